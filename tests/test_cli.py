import json

import pytest
import torch
from typer.testing import CliRunner

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


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_runs_end_to_end(tmp_path):
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["ok"] and all(not r["mismatches"] for r in summary["loads"])
    assert "all checks passed" in result.output
