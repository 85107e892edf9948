"""The Checkpointer in one process: round trips, async semantics, retention, and bad input."""

import json
import os
import threading

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from resilient import Checkpointer, Layout, RetryPolicy, Shard, sharded
from resilient.chaos.faultfs import FaultyFileSystem
from resilient.checkpoint.format import MANIFEST_NAME
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LayoutError,
    StateMismatchError,
    StorageError,
)

FAST_RETRY = RetryPolicy(max_attempts=3, max_total_s=5, initial_backoff_s=0.001, max_backoff_s=0.01)


def make_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    sched.step()
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "emb": torch.randn(10, 6).bfloat16(),
        "extra": {"counter": 7, "names": ["a", "b"], "nested": {"x": 1.5, "none": None}},
        "pair": [torch.arange(3), {"k": 2}],
    }


def fresh_state():
    s = make_state(seed=123)
    s["emb"].zero_()
    s["extra"] = {"counter": 0, "names": [], "nested": {"x": 0.0, "none": 1}}
    s["pair"] = [torch.zeros(3, dtype=torch.int64), {"k": 0}]
    return s


def assert_same(a, b):
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    assert sa["param_groups"] == sb["param_groups"]
    assert a["sched"].state_dict() == b["sched"].state_dict()
    assert torch.equal(a["emb"], b["emb"])
    assert a["extra"] == b["extra"]
    assert torch.equal(a["pair"][0], b["pair"][0]) and a["pair"][1] == b["pair"][1]


def test_round_trip_of_model_optimizer_scheduler_and_values(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path)) as ck:
        stats = ck.save(10, src).wait()
        assert stats.committed and stats.bytes_written > 0
        assert ck.steps() == [10] and ck.latest_step() == 10
    dst = fresh_state()
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.load(dst) == 10
        assert not ck.last_load.resharded
    assert_same(src, dst)
    # an optimizer that never stepped is initialised and filled in place
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    lazy = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=5.0)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.load({**fresh_state(), **lazy})
    assert lazy["optim"].param_groups[0]["lr"] == src["optim"].param_groups[0]["lr"]
    assert torch.equal(
        lazy["optim"].state_dict()["state"][0]["exp_avg"],
        src["optim"].state_dict()["state"][0]["exp_avg"],
    )


def test_rank_files_are_valid_safetensors_with_the_right_bytes(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, src).wait()
    tensors = load_file(str(tmp_path / "step_00000001" / "rank_00000.safetensors"))
    assert torch.equal(tensors["model.0.weight"], src["model"][0].weight.detach())
    assert torch.equal(tensors["emb"], src["emb"])
    manifest = json.loads((tmp_path / "step_00000001" / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 2 and manifest["layout"] == [["dp", 1]]
    assert manifest["commit_seq"] == 1 and manifest["job_id"].startswith("process:")
    assert manifest["extras"]["extra.counter"] == 7


def test_compression_round_trips_and_shrinks(tmp_path):
    state = {"w": torch.zeros(256, 256), "b": torch.randn(300).bfloat16()}
    with Checkpointer(str(tmp_path / "z"), compression="zstd") as ck:
        ck.save(1, state).wait()
    with Checkpointer(str(tmp_path / "plain")) as ck:
        ck.save(1, state).wait()
    z = os.path.getsize(tmp_path / "z/step_00000001/rank_00000.safetensors")
    plain = os.path.getsize(tmp_path / "plain/step_00000001/rank_00000.safetensors")
    assert z < plain / 10
    out = {"w": torch.ones(256, 256), "b": torch.zeros(300).bfloat16()}
    with Checkpointer(str(tmp_path / "z")) as ck:
        ck.load(out)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


class GatedFileSystem(FaultyFileSystem):
    """Writes block until the test opens the gate: makes 'save returned before persisting' exact."""

    protocol = "gated"
    gate = threading.Event()
    writes_started = threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        return path[len("gated://") :] if path.startswith("gated://") else path

    def _open(self, path, mode="rb", **kwargs):
        if ("w" in mode or "x" in mode) and path.endswith(".safetensors"):
            GatedFileSystem.writes_started.set()
            assert GatedFileSystem.gate.wait(30)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("gated", GatedFileSystem, clobber=True)


def test_save_returns_after_staging_and_training_may_mutate(tmp_path):
    GatedFileSystem.gate.clear()
    GatedFileSystem.writes_started.clear()
    w = torch.arange(1000, dtype=torch.float32)
    state = {"w": w, "meta": {"epoch": 1}}
    ck = Checkpointer(f"gated://{tmp_path}")
    handle = ck.save(1, state)
    assert GatedFileSystem.writes_started.wait(30)
    assert not handle.done()  # persisting is blocked, yet save() has returned
    w.mul_(-1)  # training goes on and mutates the live tensors
    state["meta"]["epoch"] = 99
    # a second save waits for the first (one in flight)
    second_started = threading.Event()
    second_done = threading.Event()

    def second():
        second_started.set()
        ck.save(2, state)
        second_done.set()

    t = threading.Thread(target=second)
    t.start()
    assert second_started.wait(5)
    assert not second_done.wait(0.2)
    GatedFileSystem.gate.set()
    t.join(30)
    assert second_done.is_set()
    ck.close()
    out = {"w": torch.zeros(1000), "meta": {"epoch": 0}}
    with Checkpointer(str(tmp_path)) as ck2:
        ck2.load(out, step=1)
        assert (
            torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))
            and out["meta"]["epoch"] == 1
        )
        ck2.load(out, step=2)
        assert (
            torch.equal(out["w"], -torch.arange(1000, dtype=torch.float32))
            and out["meta"]["epoch"] == 99
        )


def test_each_save_describes_the_tensors_as_they_are_now(tmp_path):
    """A save reuses the previous save's description of a tensor only when it is the same object
    with the same storage, shape and strides: a parameter given new data, a tensor resized or
    pointed at other storage, or a new object under the same name, is saved as it is now."""
    model = torch.nn.Linear(4, 3)
    first = model.weight.detach().clone()
    t = torch.arange(6.0)
    state = {"model": model, "t": t}
    with Checkpointer(str(tmp_path), keep_last=4) as ck:
        ck.save(1, state)
        model.weight.data = torch.full((5, 4), 2.0)  # the same Parameter, new storage and shape
        t.resize_(2, 3)  # the same tensor and storage, another shape
        ck.save(2, state)
        model.weight = torch.nn.Parameter(torch.full((5, 4), 3.0))  # another object
        t.set_((torch.arange(6.0) * 10).view(3, 2))  # the same object, other storage
        ck.save(3, state)
        t.t_()  # the same storage and shape count, other strides
        ck.save(4, state)
        ck.wait()

    def read(step, wshape, tshape):
        out = {"model": {"weight": torch.zeros(wshape), "bias": torch.zeros(3)}}
        out["t"] = torch.zeros(tshape)
        with Checkpointer(str(tmp_path)) as r:
            r.load(out, step=step)
        return out["model"]["weight"], out["t"]

    w, got = read(1, (3, 4), (6,))
    assert torch.equal(w, first) and torch.equal(got, torch.arange(6.0))
    w, got = read(2, (5, 4), (2, 3))
    assert torch.equal(w, torch.full((5, 4), 2.0))
    assert torch.equal(got, torch.arange(6.0).view(2, 3))
    w, got = read(3, (5, 4), (3, 2))
    assert torch.equal(w, torch.full((5, 4), 3.0))
    assert torch.equal(got, (torch.arange(6.0) * 10).view(3, 2))
    w, got = read(4, (5, 4), (2, 3))
    assert torch.equal(got, (torch.arange(6.0) * 10).view(3, 2).t())


def test_a_tensor_annotated_again_is_described_again(tmp_path):
    t = torch.arange(8.0)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"t": t}).wait()
        sharded(t, {"dp": Shard(0)}, layout=Layout(dp=2))
        with pytest.raises(LayoutError, match="'t'"):
            ck.save(2, {"t": t})


def test_optimizer_state_follows_its_parameter_annotated_again(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"opt": opt}).wait()
        sharded(model.weight, {"dp": Shard(0)}, rank=3)
        with pytest.raises(LayoutError, match="exp_avg"):
            ck.save(2, {"opt": opt})


def test_a_value_json_cannot_write_is_refused_by_name_at_the_save(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(TypeError, match="state key 'big'"):
            ck.save(1, {"big": 10**5000})


def test_a_tensor_whose_memory_was_freed_is_refused_by_name_not_a_crash(tmp_path):
    """A tensor whose storage was freed or shrunk (FSDP frees the unsharded parameters it is not
    using) is refused by name, at a save (the first, or one after a save that took it) and at a
    load into it: copying it would read or write memory that is not the tensor's."""
    freed = torch.randn(1 << 16)
    freed.untyped_storage().resize_(0)
    kept = torch.randn(1 << 16)
    view = kept[100:]
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(ValueError, match=r"tensor 'a\.w' .* storage, which holds 0"):
            ck.save(1, {"a": {"w": freed}})
        ck.save(2, {"v": view}).wait()
        kept.untyped_storage().resize_(4 * 1000)  # shrunk under the view the last save took
        with pytest.raises(ValueError, match="tensor 'v' .*freed or shrunk"):
            ck.save(3, {"v": view})
        with pytest.raises(ValueError, match="tensor 'v' .*freed or shrunk"):
            ck.load({"v": view}, step=2)


def test_sparse_and_meta_tensors_are_refused_by_name(tmp_path):
    sparse = torch.eye(4).to_sparse()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"s": torch.eye(4)}).wait()  # (its description is then cached, under "s")
        with pytest.raises(TypeError, match="tensor 's' is a torch.sparse_coo tensor"):
            ck.save(2, {"s": sparse})
        with pytest.raises(ValueError, match="tensor 'm' is on the meta device"):
            ck.save(2, {"m": torch.empty(3, device="meta")})


def test_a_save_of_unchanged_tensors_does_not_describe_them_again(tmp_path, monkeypatch):
    from resilient.checkpoint import state as state_module

    calls = []
    describe = state_module.describe_tensor

    def counted(key, *a, **k):
        calls.append(key)
        return describe(key, *a, **k)

    monkeypatch.setattr(state_module, "describe_tensor", counted)
    state = make_state()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state)
        first = len(calls)
        state["emb"] = state["emb"].clone()  # one new object
        ck.save(2, state)
        ck.wait()
    assert first == len(ck.manifest(1).tensors) and calls[first:] == ["emb"]


def test_staging_buffer_is_reused_across_saves(tmp_path):
    state = {"w": torch.randn(100, 100)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state)
        buf = ck._stager._buffer
        ck.save(2, state)
        assert ck._stager._buffer is buf
        ck.wait()


def faulty(tmp_path, faults, **kw):
    return Checkpointer(
        f"faulty://{tmp_path}", storage_options={"faults": faults}, retry=FAST_RETRY, **kw
    )


def test_transient_storage_errors_are_retried(tmp_path):
    ck = faulty(
        tmp_path,
        [
            {"op": "write", "error": "transient", "count": 2, "path": "rank_"},
            {"op": "read", "error": "timeout", "count": 1},
        ],
    )
    ck.save(3, {"w": torch.arange(5.0)}).wait()
    out = {"w": torch.zeros(5)}
    assert ck.load(out) == 3 and torch.equal(out["w"], torch.arange(5.0))
    fired = ck.storage.fs.fired
    assert [f[2] for f in fired].count("transient") == 2 and [f[2] for f in fired].count(
        "timeout"
    ) == 1
    assert ck.storage.retries_done == 3
    ck.close()


def test_permanent_storage_error_surfaces_at_the_next_call_and_nothing_is_committed(tmp_path):
    ck = faulty(
        tmp_path, [{"op": "write", "error": "enospc", "path": "rank_", "skip": 2}]
    )  # header + body of step 1
    ck.save(1, {"w": torch.arange(5.0)}).wait()
    ck.save(2, {"w": torch.arange(5.0) + 1})  # the background write fails
    with pytest.raises(
        StorageError,
        match=r"storage write of faulty://.*step_00000002/rank_00000.safetensors failed .*No space left on device.*free space",
    ):
        ck.wait()
    assert ck.steps() == [1]
    ck.close()  # the failure was reported once; close does not raise it again
    ck = faulty(tmp_path, [{"op": "write", "error": "permanent", "path": "rank_"}])
    ck.save(3, {"w": torch.zeros(5)})
    with pytest.raises(StorageError, match="step_00000003"):
        ck.save(4, {"w": torch.zeros(5)})  # the next save raises the previous failure...
    ck.close()  # ...and did not start, so nothing is left to fail
    ck = faulty(tmp_path, [{"op": "write", "error": "permanent", "path": "rank_"}])
    ck.save(5, {"w": torch.zeros(5)})
    with pytest.raises(StorageError, match="step_00000005"):
        ck.close()  # close raises a failure nobody has seen yet
    assert Checkpointer(str(tmp_path)).steps() == [1]


def test_retries_are_bounded(tmp_path):
    ck = faulty(tmp_path, [{"op": "write", "error": "transient", "path": "rank_"}])
    ck.save(1, {"w": torch.zeros(3)})
    with pytest.raises(StorageError, match=r"kept failing after 3 attempt\(s\)"):
        ck.wait()
    ck.close()


def test_retention_keeps_last_and_every_and_collects_garbage(tmp_path):
    os.makedirs(tmp_path / "step_00000003")
    (tmp_path / "step_00000003" / "rank_00000.safetensors").write_bytes(b"half-written")
    with Checkpointer(str(tmp_path), keep_last=2, keep_every=4) as ck:
        for step in range(1, 10):
            ck.save(step, {"w": torch.full((4,), float(step))})
        ck.wait()
        assert ck.steps() == [4, 8, 9]
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000008", "step_00000009"]


def test_resaving_a_committed_step_replaces_it_safely(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(5, {"w": torch.ones(4)}).wait()
        ck.save(5, {"w": torch.full((4,), 2.0)}).wait()
        out = {"w": torch.zeros(4)}
        ck.load(out)
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    assert sorted(os.listdir(tmp_path / "step_00000005")) == [
        MANIFEST_NAME,
        "rank_00000.g1.safetensors",
    ]


# --- bad input -----------------------------------------------------------------------------------


def saved(tmp_path, steps=(1, 2)):
    with Checkpointer(str(tmp_path)) as ck:
        for s in steps:
            ck.save(s, {"w": torch.arange(3000.0) * s, "v": {"s": s}}).wait()
    return tmp_path


def test_missing_step_lists_the_steps_that_exist(tmp_path):
    saved(tmp_path)
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"step 7 is not a committed checkpoint under .*; committed steps: 1, 2",
        ):
            ck.load({"w": torch.zeros(3000), "v": {"s": 0}}, step=7)
    with Checkpointer(str(tmp_path / "empty")) as ck:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint under"):
            ck.load({"w": torch.zeros(3)})


def test_shape_dtype_and_key_mismatches_name_the_key(tmp_path):
    saved(tmp_path)
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            StateMismatchError,
            match=r"tensor 'w': step 2 holds global shape \[3000\], but the state being loaded has global shape \[30, 100\]",
        ):
            ck.load({"w": torch.zeros(30, 100), "v": {"s": 0}})
        with pytest.raises(
            StateMismatchError,
            match=r"tensor 'w': step 2 holds float32, but the state being loaded has bfloat16",
        ):
            ck.load({"w": torch.zeros(3000).bfloat16(), "v": {"s": 0}})
        with pytest.raises(StateMismatchError, match=r"step 2 has no tensors 'other'"):
            ck.load({"w": torch.zeros(3000), "other": torch.zeros(2), "v": {"s": 0}})


def flip_byte(path, offset_from_end=10):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bit_flip_is_caught_and_fallback_only_when_asked(tmp_path):
    saved(tmp_path)
    flip_byte(tmp_path / "step_00000002" / "rank_00000.safetensors")
    out = {"w": torch.zeros(3000), "v": {"s": 0}}
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            CheckpointCorruptError,
            match=r"checksum mismatch in .*step_00000002/rank_00000.safetensors, tensor 'w', step 2",
        ):
            ck.load(out)
        with pytest.warns(UserWarning, match="falling back to step 1"):
            assert ck.load(out, fallback=True) == 1
        assert ck.last_load.skipped_steps == [2]
        report = ck.verify(2)
        assert not report.ok and "crc32 expected" in report.problems[0]
        assert ck.verify(1).ok
    assert torch.equal(out["w"], torch.arange(3000.0)) and out["v"]["s"] == 1


def test_truncated_shard(tmp_path):
    saved(tmp_path)
    f = tmp_path / "step_00000002" / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            CheckpointCorruptError,
            match=r"rank_00000.safetensors \(step 2\) is \d+ bytes, but the manifest declares \d+; the file is truncated",
        ):
            ck.load({"w": torch.zeros(3000), "v": {"s": 0}})


def edit_manifest(tmp_path, fn, step=2):
    p = tmp_path / f"step_{step:08d}" / MANIFEST_NAME
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def load_latest(tmp_path):
    """Load step 2 by name: a damaged step 2 must say what is wrong with it."""
    with Checkpointer(str(tmp_path)) as ck:
        ck.load({"w": torch.zeros(3000), "v": {"s": 0}}, step=2)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda m: m.update(format_version=9),
            r"format_version 9, but this toolkit reads versions \[1, 2\]",
        ),
        (
            lambda m: m["tensors"]["w"]["chunks"][0].update(
                file="../step_00000001/rank_00000.safetensors"
            ),
            "files must be plain names",
        ),
        (
            lambda m: m["files"].update({"/etc/passwd": {"rank": 0, "size_bytes": 1}}),
            r"names file '/etc/passwd'",
        ),
        (
            lambda m: m["files"].update(
                {"s3://bucket/x.safetensors": {"rank": 0, "size_bytes": 1}}
            ),
            "no paths, no URLs",
        ),
        (
            lambda m: m["tensors"]["w"]["chunks"][0].update(byte_range=[0, 10**12]),
            r"does not fit the file's",
        ),
        (lambda m: m["tensors"]["w"].update(shape=[3000000]), "do not tile shape"),
        (lambda m: m["tensors"]["w"]["chunks"][0].update(sizes=[10**9]), "need 4000000000"),
        (lambda m: m.pop("layout"), r"missing fields \['layout'\]"),
        (
            lambda m: m["tensors"]["w"]["chunks"][0].update(checksums=[]),
            "has 0 checksums for 1 blocks",
        ),
        (lambda m: m["tensors"]["w"].update(dtype="complex64"), "unknown dtype 'complex64'"),
    ],
)
def test_bad_manifests_are_rejected_with_a_named_reason(tmp_path, edit, message):
    saved(tmp_path)
    edit_manifest(tmp_path, edit)
    with pytest.raises(CheckpointCorruptError, match=message):
        load_latest(tmp_path)


def test_manifest_that_is_not_json(tmp_path):
    saved(tmp_path)
    (tmp_path / "step_00000002" / MANIFEST_NAME).write_text('{"format_version": 1, "step": ')
    with pytest.raises(
        CheckpointCorruptError, match=r"MANIFEST.json is not valid JSON .*load an earlier step"
    ):
        load_latest(tmp_path)


def test_declared_sizes_are_checked_against_the_real_file_before_reading(tmp_path):
    saved(tmp_path)
    # a consistent manifest whose file claims to be a petabyte: rejected before any read
    edit_manifest(
        tmp_path, lambda m: m["files"]["rank_00000.safetensors"].update(size_bytes=10**15)
    )
    with pytest.raises(
        CheckpointCorruptError, match=r"is \d+ bytes, but the manifest declares 1000000000000000"
    ):
        load_latest(tmp_path)


def test_layout_that_does_not_fit_the_world(tmp_path):
    with pytest.raises(
        LayoutError, match=r"layout dp=2 x tp=2 = 4 ranks, but the process group has 1 ranks"
    ):
        Checkpointer(str(tmp_path), layout=Layout(dp=2, tp=2))


def test_sharded_annotation_must_match_the_local_shape(tmp_path):
    t = sharded(torch.zeros(5, 3), {"dp": Shard(0)}, global_shape=(12, 3))
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            LayoutError,
            match=r"tensor 'w': rank 0 holds a local shape \[5, 3\], but global shape \[12, 3\] split by \{dp:Shard\(0\)\} on dp=1 = 1 ranks gives \[12, 3\]",
        ):
            ck.save(1, {"w": t})


def test_values_that_are_not_json_are_refused_by_name(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(
            TypeError,
            match=r"state key 'cfg.when': value of type set is neither a tensor nor JSON-able",
        ):
            ck.save(1, {"cfg": {"when": {1, 2}}})
        with pytest.raises(TypeError, match="state key 'x'"):
            ck.save(1, {"x": float("nan")})
        with pytest.raises(TypeError, match="state key 'y'"):
            ck.save(1, {"y": -float("inf")})


def test_lists_are_values_unless_they_hold_tensors(tmp_path):
    """A plain list is one JSON value (an RNG state, a sampler's indices); a list that holds a
    tensor is walked item by item; anything else in a list is refused by name, as elsewhere."""
    state = {
        "rng": list(range(625)),
        "mixed": [torch.arange(4.0), {"n": 3}, [1, "a"]],
        "t": (1.5, None, True),
    }
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state).wait()
        m = ck.manifest(1)
        assert m.extras["rng"] == list(range(625)) and m.extras["t"] == [1.5, None, True]
        assert "mixed.0" in m.tensors and m.extras["mixed.1.n"] == 3
        assert m.extras["mixed.2"] == [1, "a"]
        got = {"rng": [0] * 625, "mixed": [torch.zeros(4), {"n": 0}, []], "t": ()}
        ck.load(got)
        assert got["rng"] == list(range(625)) and torch.equal(got["mixed"][0], torch.arange(4.0))
        assert got["mixed"][1] == {"n": 3} and got["mixed"][2] == [1, "a"]
        with pytest.raises(TypeError, match=r"state key 'l': value of type list is neither"):
            ck.save(2, {"l": [1, {2, 3}]})
        with pytest.raises(TypeError, match=r"state key 'l.1'"):
            ck.save(2, {"l": [torch.zeros(1), float("nan")]})


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        Checkpointer("memory://x", keep_last=0)
    with pytest.raises(ValueError, match="compression must be None or 'zstd'"):
        Checkpointer("memory://x", compression="lz4")
    with pytest.raises(
        StorageError, match=r"cannot open checkpoint URL 'nosuchproto://x'.*install the fsspec"
    ):
        Checkpointer("nosuchproto://x")
    bad = {"target_protocol": "file", "faults": [{"op": "read", "latency_s": 0}]}
    with pytest.raises(StorageError, match=r"bad fault rule .*; check the storage options"):
        Checkpointer("faulty:///tmp/x", storage_options=bad)


@pytest.mark.parametrize(
    "step,found",
    [("12", "'12' (str)"), (12.0, "12.0 (float)"), (True, "True (bool)"), (-1, "-1 (int)")],
)
def test_a_step_that_is_not_an_int_is_refused_by_every_call_that_takes_one(tmp_path, step, found):
    """load, verify and manifest check the step as save does: '12' is no step (it was "not a
    committed checkpoint ... committed steps: 12"), 12.0 failed in string formatting, and True
    loaded step 1."""
    with Checkpointer(str(tmp_path)) as ck:
        for s in (1, 12):
            ck.save(s, {"w": torch.full((4,), float(s))}).wait()
        state = {"w": torch.zeros(4)}
        calls = {
            "save": lambda: ck.save(step, state),
            "load": lambda: ck.load(state, step=step),
            "verify": lambda: ck.verify(step),
            "manifest": lambda: ck.manifest(step),
        }
        for call, fn in calls.items():
            optional = "None (the newest commit) or " if call != "save" else ""
            with pytest.raises(ValueError) as e:
                fn()
            assert str(e.value).startswith(
                f"{call}(step=...) must be {optional}an int in [0, 2**63 - 1], got {found}; "
            ), str(e.value)
        assert torch.equal(state["w"], torch.zeros(4))  # nothing loaded
        assert ck.load(state, step=12) == 12 and ck.verify(1).ok and ck.manifest(None).step == 12


def test_a_job_id_longer_than_readers_accept_is_refused_at_the_start():
    with pytest.raises(ValueError, match=r"job_id must be a str of at most 1024 characters"):
        Checkpointer("memory://x", job_id="j" * 1025)
    with pytest.raises(ValueError, match=r"job_id must be a str .*got 7"):
        Checkpointer("memory://x", job_id=7)
    Checkpointer("memory://x", job_id="j" * 1024).close()


def test_local_loads_share_the_cores_among_the_ranks_of_a_node(monkeypatch):
    """A local load's reader threads: the process's cores over torchrun's LOCAL_WORLD_SIZE,
    between 1 and READ_THREADS (copying and checksumming are CPU work); a rank pinned to a
    subset of the cores keeps that subset."""
    import os

    from resilient.checkpoint import checkpointer as ckpt_mod

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    for local, want in (("8", 2), ("16", 1), ("64", 1), ("1", 4), ("0", 4), ("-3", 4), ("x", 4)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert ckpt_mod._local_read_threads() == want, local
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6})  # pinned: its own 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ckpt_mod._local_read_threads() == 3


def test_a_checkpointer_dropped_unclosed_releases_its_writer_lease(tmp_path):
    """Once collected, as close() would (on a thread of its own): a new checkpointer of the URL in this process saves at
    once (the dropped one's renewal thread kept the lease alive: another job's, to the new one)."""
    import gc
    import time

    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"model": torch.nn.Linear(4, 4)}).wait()
    del ck
    gc.collect()
    deadline = time.monotonic() + 30  # (let go of by a thread of its own: not at once)
    while (tmp_path / "LEASE.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (tmp_path / "LEASE.json").exists()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(2, {"model": torch.nn.Linear(4, 4)}).wait()
        assert ck.steps() == [1, 2]


def test_values_named_optional_that_a_step_lacks_keep_their_own(tmp_path):
    """A training script that records a new value (its corpus, a counter) cannot load the steps
    its older version saved unless the value is named optional: it keeps its current value
    there; restored where the step has it; any other missing value is still a mismatch."""
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"w": torch.ones(4), "config": {"seed": 3}}).wait()
        ck.save(2, {"w": torch.ones(4), "config": {"seed": 3, "corpus": "c2"}}).wait()
        state = {"w": torch.zeros(4), "config": {"seed": 0, "corpus": None}}
        with pytest.raises(StateMismatchError, match=r"config\.corpus"):
            ck.load(state, 1)
        assert ck.load(state, 1, optional=["config.corpus"]) == 1
        assert state["config"] == {"seed": 3, "corpus": None} and torch.equal(
            state["w"], torch.ones(4)
        )
        assert ck.load(state, optional=("config.corpus",)) == 2
        assert state["config"] == {"seed": 3, "corpus": "c2"}
        state["config"]["new"] = 1
        with pytest.raises(StateMismatchError, match=r"config\.new"):
            ck.load(state, 2, optional=("config.corpus",))
        for bad in ("config.corpus", 5, [b"config.corpus"]):
            with pytest.raises(TypeError, match="optional must be value names"):
                ck.load(state, 2, optional=bad)


def test_a_fork_does_not_let_go_of_its_parents_dropped_checkpointer(tmp_path):
    """A checkpointer queued to be let go of (dropped, collected) when the process forks is in
    the child's copy of the queue too: the child's reaper must leave it to the parent (it
    released the parent's writer lease, which the parent still held)."""
    import threading

    from resilient.checkpoint import checkpointer as ckpt_mod

    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"model": torch.nn.Linear(4, 4)}).wait()
    pid = os.fork()
    if pid == 0:  # the child: the parent's checkpointer in the queue, then a marker after it
        code = 1
        try:
            done = threading.Event()

            class Marker:
                _owner_pid, url = os.getpid(), "marker"

                def _let_go(self):
                    done.set()

            ckpt_mod._DROPPED.put(ck)
            ckpt_mod._DROPPED.put(Marker())
            ckpt_mod._start_reaper()  # (a fork's child has no threads: started anew)
            code = 0 if done.wait(30) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "LEASE.json").exists()  # still the parent's
    ck.save(2, {"model": torch.nn.Linear(4, 4)}).wait()
    ck.close()
    assert Checkpointer(str(tmp_path)).steps() == [1, 2]


def test_a_checkpointer_does_not_keep_the_tensors_it_saved_alive(tmp_path):
    import gc
    import weakref

    model = torch.nn.Linear(64, 64)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"model": model}).wait()
        ref = weakref.ref(model.weight)
        del model
        gc.collect()
        assert ref() is None
