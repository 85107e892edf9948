import json

import pytest
import torch
from typer.testing import CliRunner

from reshape.cli import app as reshape_app
from resilient import Checkpointer
from resilient.cli import app

runner = CliRunner()


def test_verify_exit_codes(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(3, {"w": torch.arange(10.0)}).wait()
    ok = runner.invoke(app, ["verify", str(tmp_path)])
    assert ok.exit_code == 0 and "step 3: 1 files" in ok.output and "ok" in ok.output
    f = tmp_path / "step_00000003" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x40
    f.write_bytes(bytes(data))
    bad = runner.invoke(app, ["verify", str(tmp_path), "--step", "3"])
    assert bad.exit_code == 1 and "crc32 expected" in bad.output and "FAILED" in bad.output
    missing = runner.invoke(app, ["verify", str(tmp_path), "--step", "9"])
    assert missing.exit_code == 2 and "committed steps: 3" in missing.output


@pytest.mark.parametrize(
    "damage,code",
    [
        ("none", 0),
        ("bit flip", 1),
        ("truncated", 1),
        ("unreadable", 1),
        ("no storage backend", 1),  # a StorageError: 2 from resilient verify before, 1 from reshape
        ("manifest", 1),  # a damaged step named with --step: corrupt, not missing
        ("missing step", 2),
        ("not a checkpoint", 2),
    ],
)
def test_resilient_and_reshape_verify_share_exit_codes(tmp_path, damage, code):
    """The README's contract: 0 every byte checks, 1 failed verification or a corrupt source,
    2 bad usage; the same for `resilient verify` and `reshape verify`."""
    url = str(tmp_path / "ck")
    with Checkpointer(url) as ck:
        ck.save(3, {"w": torch.arange(10.0)}).wait()
    args = [url]
    if damage == "bit flip":
        f = tmp_path / "ck" / "step_00000003" / "rank_00000.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x40
        f.write_bytes(bytes(data))
    elif damage == "truncated":
        f = tmp_path / "ck" / "step_00000003" / "rank_00000.safetensors"
        f.write_bytes(f.read_bytes()[:-8])
    elif damage == "unreadable":  # a storage error, not a checksum mismatch
        f = tmp_path / "ck" / "step_00000003" / "rank_00000.safetensors"
        f.unlink()
        f.mkdir()
    elif damage == "manifest":
        (tmp_path / "ck" / "step_00000003" / "MANIFEST.json").write_text('{"format_version": 1')
        args += ["--step", "3"]
    elif damage == "missing step":
        args += ["--step", "9"]
    elif damage == "no storage backend":
        args = ["nosuchprotocol://bucket/ck"]
    elif damage == "not a checkpoint":
        args = [str(tmp_path / "nothing-here")]
    ours = runner.invoke(app, ["verify", *args])
    theirs = runner.invoke(reshape_app, ["verify", *args])
    assert (ours.exit_code, theirs.exit_code) == (code, code), (ours.output, theirs.output)


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = runner.invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["passed"], report["checks"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["final state matches the reference"]["ok"]
    assert checks["DEAD verdict on the faulty rank"]["ok"]
    assert report["measurements"]["restarts"] >= 2  # the kill and the freeze
    assert report["reshard"]["ok"] and report["reshard"]["target_layout"] == {
        "dp": 2,
        "ep": 2,
        "tp": 1,
    }
    for name in ("report.md", "events.jsonl", "timeline.png"):
        assert (out / name).exists(), name
    assert "detector: DEAD rank 2" in result.output and "all checks passed" in result.output
    # the memory tier: both restarts restored a snapshot newer than the newest durable step
    assert report["measurements"]["restore_sources"] == ["memory", "memory"]
    assert max(report["measurements"]["steps_lost"], default=0) <= 1
    assert "newest snapshot in the node's memory" in result.output
    # a second run may replace its own output, never a directory it did not write
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    refused = runner.invoke(app, ["demo", "--out", str(other)])
    assert refused.exit_code == 2 and (other / "precious.txt").exists()
