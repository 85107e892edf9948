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


def test_resilient_verify_shows_its_progress(tmp_path, monkeypatch):
    """Long work shows progress: `resilient verify` feeds a progress bar every byte it checks
    (it showed none; `reshape verify` did)."""
    import resilient.progress as progress_mod

    with Checkpointer(str(tmp_path)) as ck:
        ck.save(3, {"w": torch.arange(5000.0), "b": torch.ones(300)}).wait()
        want = (5000 + 300) * 4  # every tensor byte, each checksummed
    seen: list = []
    real = progress_mod.byte_progress

    def recording(total, label, **kw):
        seen.append([total, label, 0])

        class Bar:
            def __enter__(self):
                self.inner = real(total, label, **kw)
                advance = self.inner.__enter__()

                def counted(n):
                    seen[-1][2] += n
                    advance(n)

                return counted

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

        return Bar()

    monkeypatch.setattr(progress_mod, "byte_progress", recording)
    ok = runner.invoke(app, ["verify", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert seen == [[want, "verifying step 3", want]]


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
