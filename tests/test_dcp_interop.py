"""reshape.formats.dcp: export to and import from torch.distributed.checkpoint, both ways, checked
with torch's own dcp.load (plain tensors in one process, DTensors on a 2-rank gloo mesh)."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from reshape.execute import DestinationExistsError
from reshape.formats import dcp as dcp_format
from reshape.formats.dcp import UntrustedPickleError, export_dcp, import_dcp
from reshape.formats.reference import write_checkpoint
from resilient import Checkpointer, Layout
from resilient.checkpoint.reader import read_manifest
from resilient.checkpoint.storage import Storage
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LayoutError,
    ResilientError,
    StateMismatchError,
)
from resilient.layout import Replicate, Shard
from tests.ckpt_sim import save_world
from tests.peak import PeakGrowth

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and every byte (NaN and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def wholes() -> dict[str, torch.Tensor]:
    """Reference-trainer names (so a layout splits them, fused ones included), optimizer state,
    odd dtypes, a scalar, an empty tensor, NaN and -0.0."""
    g = torch.Generator().manual_seed(16)
    wq = torch.randn(8, 4, generator=g)
    wq[0, 0], wq[0, 1] = float("nan"), -0.0
    return {
        "model.layers.0.attn.wq.weight": wq,
        "model.layers.0.attn.wkv.weight": torch.randn(8, 4, generator=g).bfloat16(),
        "model.layers.0.moe.w_gate_up": torch.randn(2, 8, 4, generator=g),
        "model.layers.0.moe.w_down": torch.randn(2, 4, 6, generator=g).to(torch.float8_e4m3fn),
        "model.norm.weight": torch.randn(4, generator=g).half(),
        "model.mask": torch.rand(3, 5, generator=g) > 0.5,
        "optim.state.model.layers.0.attn.wq.weight.exp_avg": torch.randn(8, 4, generator=g),
        "optim.state.model.layers.0.attn.wq.weight.step": torch.tensor(3.0),
        "data.empty": torch.zeros(0, 3, dtype=torch.int64),
    }


VALUES = {
    "run": {"step": 4},
    "config": {"lr": 0.1, "name": "tiny", "nothing": None},
    "optim.param_groups.0.betas": [0.9, 0.95],
}
FLAT_VALUES = {
    "run.step": 4,
    "config.lr": 0.1,
    "config.name": "tiny",
    "config.nothing": None,
    "optim.param_groups.0.betas": [0.9, 0.95],
}


@pytest.fixture
def source(tmp_path) -> str:
    """A committed checkpoint in layout dp=1 x ep=2 x tp=2 (4 ranks' files), step 4."""
    url = str(tmp_path / "src")
    write_checkpoint(url, wholes(), {"dp": 1, "ep": 2, "tp": 2}, values=VALUES, step=4)
    m = read_manifest(Storage(url), 4)
    assert len(m.files) == 4 and dict(m.tensors["model.layers.0.attn.wq.weight"].placement)[
        "tp"
    ] == Shard(0)
    return url


def dcp_load_plain(path: str, shapes: dict[str, torch.Tensor], values=()) -> dict:
    """torch's own dcp.load, into fresh tensors filled with a marker (so nothing passes by luck)."""
    state: dict = {k: torch.full_like(w, 7) if w.numel() else w.clone() for k, w in shapes.items()}
    state.update(dict.fromkeys(values))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# --- export ---------------------------------------------------------------------------------------


def test_export_is_read_by_dcp_load_bit_exact(source, tmp_path):
    out = str(tmp_path / "dcp")
    seen: list[int] = []
    report = export_dcp(source, out, progress=seen.append)
    w = wholes()
    meta = FileSystemReader(out).read_metadata()  # our own file
    assert {k: tuple(m.size) for k, m in meta.state_dict_metadata.items() if k in w} == {
        k: tuple(t.shape) for k, t in w.items()
    }
    got = dcp_load_plain(out, w, FLAT_VALUES)
    for k, t in w.items():
        assert same(got[k], t), k
    assert {k: got[k] for k in FLAT_VALUES} == FLAT_VALUES
    total = sum(t.numel() * t.element_size() for t in w.values())
    assert (report.step, report.tensors, report.values, report.total_bytes) == (4, len(w), 5, total)
    assert sum(seen) == total and len(seen) == len(w)
    assert report.skipped == []
    # one tensor per file (torch's writer keeps a file's tensors until it closes it)
    assert report.files == len(w) + len(FLAT_VALUES)


def test_a_user_leaves_with_dcp_load_into_a_fresh_module(tmp_path):
    """A Checkpointer save of a real module and AdamW, exported, loads with plain torch: the
    module's own state dict (nested keys) and the optimizer's moments and lr (flat keys)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    with Checkpointer(str(tmp_path / "run")) as ck:
        ck.save(3, {"model": model, "optim": opt}).wait()
    export_dcp(str(tmp_path / "run"), str(tmp_path / "dcp"))

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {
        "model": fresh.state_dict(),
        "optim.state.model.0.weight.exp_avg_sq": torch.zeros(3, 4),
        "optim.param_groups.0.lr": None,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fresh.load_state_dict(state["model"])
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert same(a, b), name
    moment = opt.state[model[0].weight]["exp_avg_sq"]
    assert same(state["optim.state.model.0.weight.exp_avg_sq"], moment)
    assert state["optim.param_groups.0.lr"] == 0.01


def test_a_one_cycle_lr_scheduler_goes_out_to_dcp_load_and_back_to_a_resilient_load(tmp_path):
    """OneCycleLR's state holds a list of dicts (``_schedule_phases``), which dcp.save flattens
    into indexed keys.  Exported, it loads with plain dcp.load; imported back, the list is one
    value again, as a save would have it (it came back as flat keys such as
    ``sched._schedule_phases.0.end_step``, and the load failed: no values for
    ``sched._schedule_phases``)."""

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    model, opt, sched = fresh()
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    with Checkpointer(str(tmp_path / "run")) as ck:
        ck.save(1, {"model": model, "optim": opt, "sched": sched}).wait()
    export_dcp(str(tmp_path / "run"), str(tmp_path / "dcp"))

    _, _, plain = fresh()
    state = {"sched": plain.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    plain.load_state_dict(state["sched"])
    assert plain.state_dict() == sched.state_dict()

    back = str(tmp_path / "back")
    report = import_dcp(str(tmp_path / "dcp"), back, sizes={"tp": 1}, trust_pickle=True, step=1)
    assert report.skipped == []
    extras = read_manifest(Storage(back), 1).extras
    assert extras["sched._schedule_phases"] == sched.state_dict()["_schedule_phases"]
    model2, opt2, sched2 = fresh()
    with Checkpointer(back) as ck:
        ck.load({"model": model2, "optim": opt2, "sched": sched2}, step=1)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert same(model2.weight, model.weight)
    # the same from a DCP checkpoint that torch wrote from the nested state dicts
    save_dcp(str(tmp_path / "torch"), {"model": model.state_dict(), "sched": sched.state_dict()})
    import_dcp(str(tmp_path / "torch"), str(tmp_path / "back2"), sizes={}, trust_pickle=True)
    extras = read_manifest(Storage(str(tmp_path / "back2")), 0).extras
    assert {k[len("sched.") :]: v for k, v in extras.items()} == sched.state_dict()


def test_export_refuses_a_non_empty_out_and_overwrite_replaces_only_dcp_files(source, tmp_path):
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "__9_99.distcp").write_bytes(b"stale")
    with pytest.raises(DestinationExistsError, match="not empty.*--overwrite"):
        export_dcp(source, str(out))
    assert not (out / ".metadata").exists()
    export_dcp(source, str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and not (out / "__9_99.distcp").exists()
    assert same(dcp_load_plain(str(out), wholes())["model.mask"], wholes()["model.mask"])


def test_export_of_a_damaged_checkpoint_raises_the_readers_error(source, tmp_path):
    step_dir = pathlib.Path(source) / "step_00000004"
    rank_file = sorted(step_dir.glob("rank_*.safetensors"))[0]
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0xFF  # in the data section: a checksum mismatch
    rank_file.write_bytes(bytes(data))
    out = tmp_path / "dcp"
    with pytest.raises(CheckpointCorruptError, match="rank_0000"):
        export_dcp(source, str(out))
    assert not (out / ".metadata").exists()  # dcp.load refuses what was left


def test_export_verification_catches_bytes_that_read_back_differently(
    source, tmp_path, monkeypatch
):
    real = dcp_format._load

    def damaging(src_dir, state, raw):
        real(src_dir, state, raw)
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel():
                t.reshape(-1).view(torch.uint8)[0] ^= 1
                break

    monkeypatch.setattr(dcp_format, "_load", damaging)
    with pytest.raises(CheckpointCorruptError, match="differ from the bytes written"):
        export_dcp(source, str(tmp_path / "dcp"))


def test_export_out_must_be_local(source):
    with pytest.raises(ResilientError, match="local directory"):
        export_dcp(source, "s3://bucket/dcp")


# --- both ways across processes: DTensors on another mesh, and a 2-rank save imported -------------


def _dtensor_rank(rank: int, world: int, export_dir: str, expected: dict, save_dir: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    state: dict = {}
    for i, (k, w) in enumerate(expected.items()):
        placement = [DShard(i % w.dim())] if w.dim() else [DReplicate()]
        marker = torch.full_like(w, 7) if w.numel() else w.clone()
        state[k] = distribute_tensor(marker, mesh, placement, src_data_rank=None)
    state["run.step"] = None
    dcp.load(state, checkpoint_id=export_dir)  # collective: every rank reads only its shard
    assert state["run.step"] == 4
    for i, (k, w) in enumerate(expected.items()):
        dt = state[k]
        if w.dim():
            pieces = torch.chunk(w, world, dim=i % w.dim())
            want = pieces[rank] if rank < len(pieces) else w.narrow(i % w.dim(), 0, 0)
        else:
            want = w
        assert same(dt.to_local(), want), (rank, k)
    del state["run.step"]
    dcp.save(state, checkpoint_id=save_dir)  # DTensors, saved from 2 ranks
    return True


@pytest.mark.distributed
@pytest.mark.slow
def test_export_loads_into_dtensors_on_another_mesh_and_a_two_rank_save_imports(source, tmp_path):
    from tests.dist import run_distributed

    export_dir, saved = str(tmp_path / "dcp"), str(tmp_path / "dcp2")
    export_dcp(source, export_dir)
    expected = {k: w for k, w in wholes().items() if w.numel()}  # no empty DTensors
    assert run_distributed(_dtensor_rank, 2, export_dir, expected, saved, timeout_s=120) == [
        True,
        True,
    ]
    out = str(tmp_path / "imported")
    report = import_dcp(saved, out, sizes={"tp": 2}, trust_pickle=True, step=3)
    assert report.tensors == len(expected) and report.files == 2  # one file per rank
    state = {k: torch.full_like(w, 7) for k, w in expected.items()}
    with Checkpointer(out) as ck:
        assert ck.load(state) == 3
    for k, w in expected.items():
        assert same(state[k], w), k


# --- import ---------------------------------------------------------------------------------------


class Opaque:
    """A non-tensor entry that is not a plain value: the import skips it."""

    def __init__(self) -> None:
        self.x = 1


class Touches:
    """Unpickling this creates ``path``: a stand-in for code an untrusted pickle runs."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def save_dcp(path: str, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def dcp_state(marker: pathlib.Path) -> dict:
    w = wholes()
    return {
        "model": {k[len("model.") :]: t for k, t in w.items() if k.startswith("model.")},
        "optim": {
            "state": {k[len("optim.state.") :]: t for k, t in w.items() if k.startswith("optim.")}
        },
        "data": {"empty": w["data.empty"]},
        "weight": torch.arange(6, dtype=torch.int32),  # a key without a dot
        "step": 7,
        "config": {"lr": 0.1, "betas": (0.9, 0.95)},
        "opaque": Opaque(),
        "raw": b"\x00\x01",
        "payload": Touches(marker),
    }


@pytest.mark.parametrize("tp", [2, 1])
def test_import_writes_the_layout_and_loads_back_bit_exact(tmp_path, tp):
    marker = tmp_path / "ran"
    src, out = str(tmp_path / "dcp"), str(tmp_path / "out")
    save_dcp(src, dcp_state(marker))
    report = import_dcp(src, out, sizes={"tp": tp, "ep": 1, "dp": 1}, trust_pickle=True, step=5)
    assert not marker.exists()  # the payload entry was never unpickled with the full unpickler
    assert report.renamed == {"weight": "dcp.weight"}
    assert sorted(s.split(":")[0] for s in report.skipped) == ["opaque", "payload", "raw"]
    assert any("restricted unpickler" in s for s in report.skipped if s.startswith("payload"))
    assert "not a JSON value" in next(s for s in report.skipped if s.startswith("raw"))

    m = read_manifest(Storage(out), 5)
    assert dict(m.layout.axes) == {"dp": 1, "ep": 1, "tp": tp}
    wq = "model.layers.0.attn.wq.weight"
    assert dict(m.tensors[wq].placement)["tp"] == Shard(0)
    assert len(m.tensors[wq].chunks) == tp and len(m.files) == tp
    # optimizer state of a parameter's shape is split like its parameter; others replicate
    assert dict(m.tensors[f"optim.state.{wq}.exp_avg"].placement)["tp"] == Shard(0)
    assert dict(m.tensors["model.norm.weight"].placement)["tp"] == Replicate()
    assert m.extras == {"step": 7, "config.lr": 0.1, "config.betas": [0.9, 0.95]}

    # the reference: torch's own dcp.load of the same directory, independent of the import
    w = wholes()
    by_dcp_key = {("dcp." + k if k == "weight" else k): k for k in [*w, "weight"]}
    ref = dcp_load_plain(src, {**w, "weight": torch.zeros(6, dtype=torch.int32)})
    state: dict = {
        k: torch.full_like(ref[d], 7) if ref[d].numel() else ref[d].clone()
        for k, d in by_dcp_key.items()
    }
    state.update({"step": None, "config": {"lr": None, "betas": None}})
    with Checkpointer(out) as ck:
        assert ck.load(state) == 5
    for k, d in by_dcp_key.items():
        assert same(state[k], ref[d]), k
        if d in w:
            assert same(state[k], w[d]), k
    assert state["step"] == 7 and state["config"] == {"lr": 0.1, "betas": [0.9, 0.95]}


def test_import_verification_catches_a_checkpoint_that_differs(tmp_path, monkeypatch):
    src = str(tmp_path / "dcp")
    save_dcp(src, {"model": {"w": torch.arange(4.0)}})
    real = dcp_format.write_checkpoint

    def damaging(out, tensors, sizes, **kw):
        return real(out, {k: t + 1 for k, t in tensors.items()}, sizes, **kw)

    monkeypatch.setattr(dcp_format, "write_checkpoint", damaging)
    with pytest.raises(CheckpointCorruptError, match="'model.w'.*differ from what dcp.load gave"):
        import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    # the step it had committed is taken back: nothing that differs from its source stays
    assert not os.path.exists(tmp_path / "out" / "step_00000000")
    monkeypatch.setattr(dcp_format, "write_checkpoint", real)
    import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)  # nothing in the way


def test_import_refuses_keys_with_empty_parts_and_skips_values_nested_too_deep(tmp_path):
    src = str(tmp_path / "dcp")
    save_dcp(src, {"model.": torch.ones(2), ".x": torch.zeros(1)})
    with pytest.raises(StateMismatchError, match="empty part between dots"):
        import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    assert not os.path.exists(tmp_path / "out")
    deep: list = []
    for _ in range(100):  # deeper than a checkpoint value may nest (64)
        deep = [deep]
    src2 = str(tmp_path / "dcp2")
    save_dcp(src2, {"model": {"w": torch.ones(2)}, "deep": deep})
    report = import_dcp(src2, str(tmp_path / "out2"), sizes={"tp": 1}, trust_pickle=True)
    assert [s.split(":")[0] for s in report.skipped] == ["deep"], report.skipped
    assert "nested too deeply" in report.skipped[0]


def test_a_value_that_repeats_a_shared_list_is_skipped_before_it_is_expanded(tmp_path):
    """A pickle keeps shared references: [[[0] * n] * n] * n is a few kilobytes stored (far under
    the 16 MiB cap) and n**3 elements in JSON; json.dumps expanded it (n = 200: 8 million
    elements, hundreds of MiB and seconds).  Now it is sized, each shared list once, and
    skipped, naming the key and the cap."""
    n = 200
    a = [0] * n
    bomb = ((a,) * n,) * n  # (tuples: dcp.save's flatten would walk n**3 list elements itself)
    src = str(tmp_path / "dcp")
    save_dcp(src, {"model": {"w": torch.ones(2)}, "x.bomb": bomb, "x.ok": [a] * 4})
    with PeakGrowth() as peak:
        report = import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    assert peak.mib < 100, peak.mib
    assert report.skipped == [
        f"x.bomb: its JSON would take more than {dcp_format.MAX_VALUE_BYTES} bytes (the cap on a "
        f"value; a pickle can hold one list many times over)"
    ]
    assert read_manifest(Storage(str(tmp_path / "out")), 0).extras == {"x.ok": [a] * 4}


def test_many_values_under_the_cap_share_one_budget(tmp_path, monkeypatch):
    """(a review) The cap was per value: six values each just under it, a few KB of pickle
    apiece, expanded six times over (a 16 KB directory: 1.2 GB and a 90 MB manifest).  All the
    values of one import share MAX_VALUES_BYTES now; past it the rest are skipped, named."""
    monkeypatch.setattr(dcp_format, "MAX_VALUES_BYTES", 4 << 20)
    a = [0] * 1000
    value = [a] * 500  # about 1.5 MB of JSON, a few KB stored
    src = str(tmp_path / "dcp")
    save_dcp(src, {"model": {"w": torch.ones(2)}, **{f"v{i}": value for i in range(5)}})
    report = import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    assert sorted(read_manifest(Storage(str(tmp_path / "out")), 0).extras) == ["v0", "v1"]
    assert len(report.skipped) == 3
    assert all(
        "bytes left of the 4194304 that all values of an import may take together" in why
        for why in report.skipped
    ), report.skipped


def test_import_without_trust_reads_and_writes_nothing(tmp_path):
    """The trust flag is real: a .metadata that runs code when unpickled stays unread without it,
    and runs with it (which is why the flag exists), then fails as not DCP metadata."""
    src, out, marker = tmp_path / "dcp", tmp_path / "out", tmp_path / "ran"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(Touches(marker)))
    with pytest.raises(UntrustedPickleError) as e:
        import_dcp(str(src), str(out), sizes={"tp": 1}, trust_pickle=False)
    msg = str(e.value)
    assert str(src) in msg and ".metadata is a Python pickle" in msg
    assert "can run arbitrary code" in msg and "--trust-pickle" in msg and "trust" in msg
    assert isinstance(e.value, ResilientError)
    assert not marker.exists() and not out.exists()
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: cannot read DCP metadata"):
        import_dcp(str(src), str(out), sizes={"tp": 1}, trust_pickle=True)
    assert marker.exists() and not out.exists()


def _distcp(src: pathlib.Path) -> pathlib.Path:
    return max(src.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _link_outside(path: pathlib.Path) -> None:
    """Move ``path`` out of its directory and leave a symbolic link to it in its place."""
    outside = path.parent.parent / f"outside{path.name}"
    path.rename(outside)
    path.symlink_to(outside)


def _fifo(path: pathlib.Path) -> None:
    path.unlink()
    os.mkfifo(path)


LINKED = "is a symbolic link; an import does not follow links"
DAMAGE = {
    "no directory": (
        lambda src: __import__("shutil").rmtree(src),
        CheckpointNotFoundError,
        "no such directory",
    ),
    "no metadata": (
        lambda src: (src / ".metadata").unlink(),
        CheckpointNotFoundError,
        r"\.metadata: no such file",
    ),
    "garbage metadata": (
        lambda src: (src / ".metadata").write_bytes(b"not a pickle"),
        CheckpointCorruptError,
        "cannot read DCP metadata",
    ),
    "truncated data file": (
        lambda src: os.truncate(_distcp(src), _distcp(src).stat().st_size // 2),
        CheckpointCorruptError,
        r"__0_\d+\.distcp: \d+ bytes, but .* truncated",
    ),
    "overwritten data file": (
        lambda src: _distcp(src).write_bytes(b"\0" * _distcp(src).stat().st_size),
        CheckpointCorruptError,
        r"__0_\d+\.distcp: dcp.load failed",
    ),
    "missing data file": (
        lambda src: _distcp(src).unlink(),
        CheckpointCorruptError,
        r"__0_\d+\.distcp: missing",
    ),
    "linked data file": (
        lambda src: _link_outside(_distcp(src)),
        CheckpointCorruptError,
        r"__0_\d+\.distcp " + LINKED,
    ),
    "linked metadata": (
        lambda src: _link_outside(src / ".metadata"),
        CheckpointCorruptError,
        r"\.metadata " + LINKED,
    ),
    "data file is a FIFO": (
        lambda src: _fifo(_distcp(src)),
        CheckpointCorruptError,
        r"__0_\d+\.distcp is a FIFO, not a regular file",
    ),
    "metadata is a FIFO": (
        lambda src: _fifo(src / ".metadata"),
        CheckpointCorruptError,
        r"\.metadata is a FIFO, not a regular file",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_dcp_directory_raises_a_named_error(tmp_path, damage):
    src, out = tmp_path / "dcp", tmp_path / "out"
    save_dcp(str(src), {"model": {"w": torch.arange(4096.0), "b": torch.ones(3)}, "step": 1})
    do, error, pattern = DAMAGE[damage]
    do(src)
    with pytest.raises(error, match=pattern):
        import_dcp(str(src), str(out), sizes={"tp": 1}, trust_pickle=True)
    assert not out.exists()


def test_torchs_reader_opens_no_link_put_there_after_the_checks(tmp_path, monkeypatch):
    """The checks before dcp.load refuse links, and so do the opens of torch's reader itself: a
    data file swapped for a link after the checks is not read through it."""
    src = tmp_path / "dcp"
    save_dcp(str(src), {"model": {"w": torch.arange(4096.0)}})
    checked = dcp_format._check_contents

    def check_then_swap(src_dir, metadata):
        contents = checked(src_dir, metadata)
        _link_outside(_distcp(src))
        return contents

    monkeypatch.setattr(dcp_format, "_check_contents", check_then_swap)
    with pytest.raises(
        CheckpointCorruptError, match=r"__0_\d+\.distcp: dcp.load failed.*" + LINKED
    ):
        import_dcp(str(src), str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)


HUGE = torch.Size([1 << 40])
FORGED = {
    "more than its files": (
        TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            HUGE,
            [ChunkStorageMetadata(torch.Size([0]), HUGE)],
        ),
        r"'model.w'.*4398046511104 bytes, its files hold",
    ),
    "malformed chunks": (
        TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([8]),
            [ChunkStorageMetadata("ab", None)],
        ),
        r"malformed DCP metadata \(ValueError",
    ),
    "unsupported dtype": (
        TensorStorageMetadata(
            TensorProperties(dtype=torch.complex64),
            torch.Size([8]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([8]))],
        ),
        r"'model.w' has dtype torch.complex64; checkpoints hold",
    ),
    "not a tensor entry": (["what"], r"'model.w' is a list, neither a tensor"),
}


@pytest.mark.parametrize("forged", sorted(FORGED))
def test_a_forged_metadata_is_refused_before_allocating(tmp_path, forged):
    src = tmp_path / "dcp"
    save_dcp(str(src), {"model": {"w": torch.arange(8.0)}})
    meta = FileSystemReader(str(src)).read_metadata()  # our own file
    entry, pattern = FORGED[forged]
    meta.state_dict_metadata["model.w"] = entry
    (src / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(ResilientError, match=pattern):
        import_dcp(str(src), str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    assert not (tmp_path / "out").exists()


def _tensor_md(shape, chunks) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


@pytest.mark.parametrize(
    "shape,chunks,problem",
    [
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))], None),
        ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))], None),
        ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))], None),
        ((5,), [((0,), (3,)), ((3,), (2,)), ((5,), (0,))], None),  # uneven, an empty chunk
        ((), [((), ())], None),
        ((4, 6), [((0, 0), (2, 6))], "hold 12 elements"),  # a gap
        ((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))], "hold 30 elements"),  # too many
        # as many elements as the tensor, but row 2 twice and row 3 never
        ((4, 6), [((0, 0), (3, 6)), ((2, 0), (1, 6)), ((0, 0), (0, 6))], "overlap"),
        ((4, 6), [((0, 0), (4, 4)), ((0, 3), (4, 2))], "overlap"),  # column 3 twice
        ((4, 6), [((0, 0), (4, 7))], "outside"),
        ((4, 6), [((0,), (4,))], "outside"),
    ],
)
def test_chunks_must_tile_their_tensor(shape, chunks, problem):
    md = _tensor_md(shape, chunks)
    if problem is None:
        dcp_format._check_tiling("model.t", md)
    else:
        with pytest.raises(CheckpointCorruptError, match=problem):
            dcp_format._check_tiling("model.t", md)


def test_import_refuses_a_remote_dcp_dir_and_needs_trust_before_anything(tmp_path):
    with pytest.raises(ResilientError, match="local directory"):
        import_dcp("s3://b/dcp", str(tmp_path / "o"), sizes={"tp": 1}, trust_pickle=True)
    with pytest.raises(UntrustedPickleError):  # even for a directory that does not exist
        import_dcp(str(tmp_path / "nothing"), str(tmp_path / "o"), sizes={}, trust_pickle=False)


def test_import_checks_the_layout_and_destination_before_reading(tmp_path):
    src, out = tmp_path / "dcp", str(tmp_path / "out")
    src.mkdir()
    (src / ".metadata").write_bytes(b"would fail as damaged if it were read")
    with pytest.raises(LayoutError, match=r"the axes are \['dp', 'ep', 'tp'\].*'pp'"):
        import_dcp(str(src), out, sizes={"pp": 2}, trust_pickle=True)
    write_checkpoint(out, {"model.w": torch.zeros(2)}, {"tp": 1}, step=1)
    with pytest.raises(DestinationExistsError, match=r"already holds checkpoint steps \[1\]"):
        import_dcp(str(src), out, sizes={"tp": 1}, trust_pickle=True)


def test_import_unpickles_the_metadata_once(tmp_path, monkeypatch):
    """dcp.load gets the metadata that was checked, not a second unpickling of the file."""
    src = str(tmp_path / "dcp")
    save_dcp(src, {"model": {"w": torch.arange(6.0)}, "step": 2})
    calls = []
    real = FileSystemReader.read_metadata

    def counting(self, *a, **kw):
        calls.append(self.path)
        return real(self, *a, **kw)

    monkeypatch.setattr(FileSystemReader, "read_metadata", counting)
    report = import_dcp(src, str(tmp_path / "out"), sizes={"tp": 1}, trust_pickle=True)
    assert len(calls) == 1 and (report.tensors, report.values) == (1, 1)


def test_export_flattens_values_as_dcp_does_and_skips_those_that_clash_with_a_tensor(tmp_path):
    """dcp.save flattens nested values into dotted keys: {"model": {"w": 7}} next to tensor model.w
    failed as a StorageError ('duplicated flatten key model.w ... check the directory'), and a
    nested value that did not clash failed the read-back."""
    url = str(tmp_path / "src")
    save_world(url, 5, [{"model.w": torch.arange(6.0)}], Layout(dp=1))
    path = tmp_path / "src" / "step_00000005" / "MANIFEST.json"
    d = json.loads(path.read_text())
    d["extras"] = {
        "model": {"w": 7},
        "model.w": 1,
        "cfg": {"a": [1, {"b": 2}], "c": [3]},
        "x": 4,
        "y": {"z": 5},
        "y.z": 6,  # (a value's key that an earlier value flattens to)
        "twice": {"a.b": 1, "a": {"b": 2}},  # (one value flattening to one key twice)
        "hollow": [{"a": 1}, {}],  # (an empty mapping inside: dcp.save stores nothing for it)
    }
    path.write_text(json.dumps(d))
    report = export_dcp(url, str(tmp_path / "dcp"))
    assert report.skipped == [
        "model: DCP flattens it to the key 'model.w', which a tensor or another value already has",
        "model.w: a value with the key of a tensor",
        "y.z: DCP flattens it to the key 'y.z', which a tensor or another value already has",
        "twice: DCP flattens it to the key 'twice.a.b' twice",
        "hollow: it holds an empty mapping, which DCP stores nothing for (it would come back "
        "without it)",
    ]
    flat = {"cfg.a.0": 1, "cfg.a.1.b": 2, "cfg.c": [3], "x": 4, "y.z": 5}
    got = dcp_load_plain(str(tmp_path / "dcp"), {"model.w": torch.arange(6.0)}, flat)
    assert report.values == 3 and {k: got[k] for k in flat} == flat
    assert torch.equal(got["model.w"], torch.arange(6.0))
