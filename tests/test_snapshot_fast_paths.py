"""The fast paths of a snapshot at every step: a state described by checks alone reuses the plan
of the snapshot before it (no signature built, no tensor checked against its place), the staged
record reuses the text of a long string value that did not change, and an RNG state that did not
move is not encoded again.  Each must give way the moment the state changes."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.checkpoint.seal import record_name
from resilient.loop import RNGState


def _state() -> dict[str, Any]:
    return {
        "a": torch.arange(6, dtype=torch.float32),
        "b": torch.ones(3),
        "meta": {"x": 1, "names": ["u", "v"]},
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"x": 0, "names": []}
        for k, v in state.items()
    }


def _replace_a(s: dict[str, Any]) -> None:  # another object, another dtype, same shape
    # (values a float32 cannot hold: a copy through the old plan would not come back equal)
    s["a"] = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _set_b(s: dict[str, Any]) -> None:  # the same object on a new storage of another shape
    s["b"].set_(torch.arange(5.0) + 10)


def _same_shape_new_object(s: dict[str, Any]) -> None:
    s["b"] = torch.full_like(s["b"], 4.0)


def _add(s: dict[str, Any]) -> None:
    s["c"] = torch.full((2,), 7.0)


def _drop(s: dict[str, Any]) -> None:
    del s["c"]


def _reorder(s: dict[str, Any]) -> None:
    items = list(s.items())[::-1]
    s.clear()
    s.update(items)


def _meta(s: dict[str, Any]) -> None:
    s["meta"] = {"x": 2, "names": ["w"]}


CHANGES: list[Callable[[dict[str, Any]], None]] = [
    _replace_a,
    _set_b,
    _same_shape_new_object,
    _add,
    _drop,
    _reorder,
    _meta,
]


@pytest.mark.parametrize("commit_every", [1, 0], ids=["committed", "sealed"])
def test_a_state_that_changes_between_snapshots_is_snapshotted_as_it_is(tmp_path, commit_every):
    state = _state()
    with Checkpointer(
        str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=commit_every
    ) as ck:
        ck.snapshot(1, state).wait()
        ck.snapshot(2, state).wait()  # described by checks alone: the plan of step 1
        assert ck._memory._described.unchanged
        step = 2
        for change in CHANGES:
            change(state)
            for _ in range(2):  # the first snapshot after the change, then one by checks alone
                step += 1
                ck.snapshot(step, state).wait()
            assert ck._memory._described.unchanged
            target = _blank(state)
            assert ck.load(target) == step, change.__name__
            assert ck.last_load.source == "memory"
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert target[k].dtype == v.dtype and torch.equal(target[k], v), (
                        change.__name__,
                        k,
                    )
                else:
                    assert target[k] == v, (change.__name__, k)


def test_a_durable_save_after_the_state_changed_holds_the_new_state(tmp_path):
    state = _state()
    with Checkpointer(str(tmp_path / "ckpt")) as ck:
        ck.save(1, state).wait()
        ck.save(2, state).wait()
        _replace_a(state)
        _set_b(state)
        ck.save(3, state).wait()
        ck.save(4, state).wait()
        target = _blank(state)
        assert ck.load(target) == 4
        assert torch.equal(target["a"], state["a"]) and target["a"].dtype == torch.float64
        assert torch.equal(target["b"], state["b"])


def _record_values(ck: Checkpointer, step: int) -> dict[str, Any]:
    assert ck.memory is not None
    path = Path(ck.memory.dir) / "staging" / record_name(0, step)
    values = json.loads(path.read_text())["values"]
    return {k: v for k, v in values.items() if not k.startswith("_resilient")}  # (the anchor)


def test_a_sealed_record_holds_each_long_value_as_it_is_at_its_step(tmp_path):
    long_a, long_b = "a" * 4000, "b" * 4000 + '"\\\n'  # (escaped alike by the cache and json)
    state: dict[str, Any] = {"t": torch.ones(4), "k": 9, "rng": {"s": long_a, "n": 1}, "z": 0.5}
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=0) as ck:
        ck.snapshot(1, state).wait()
        ck.snapshot(2, state).wait()  # the same object: its text from the record before
        assert _record_values(ck, 2) == {"k": 9, "rng.s": long_a, "rng.n": 1, "z": 0.5}
        state["rng"] = {"s": long_b, "n": 2}
        ck.snapshot(3, state).wait()
        state["rng"] = {"s": "a" * 4000, "n": 3}  # equal to step 1's, another object
        ck.snapshot(4, state).wait()
        assert _record_values(ck, 3) == {"k": 9, "rng.s": long_b, "rng.n": 2, "z": 0.5}
        assert _record_values(ck, 4) == {"k": 9, "rng.s": long_a, "rng.n": 3, "z": 0.5}
        assert list(_record_values(ck, 4)) == ["k", "rng.s", "rng.n", "z"]  # the state's order
        target: dict[str, Any] = {
            "t": torch.zeros(4),
            "k": 0,
            "rng": {"s": "", "n": 0},
            "z": 0.0,
        }
        assert ck.load(target) == 4 and ck.last_load.sealed
        assert target["rng"] == {"s": long_a, "n": 3} and target["z"] == 0.5 and target["k"] == 9


def test_a_nan_value_is_refused_by_name(tmp_path):
    state: dict[str, Any] = {"t": torch.ones(4), "s": "a" * 4000, "bad": float("nan")}
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=0) as ck:
        with pytest.raises(TypeError, match="bad"):
            ck.snapshot(1, state)


def test_rng_state_follows_every_source_that_moves():
    rng = RNGState()
    draws: list[Callable[[], Any]] = [
        random.random,
        np.random.rand,
        lambda: torch.rand(1),
    ]
    before = rng.state_dict()
    assert rng.state_dict() == before  # nothing moved: the same texts
    for source, draw in zip(("python", "numpy", "torch"), draws):
        draw()
        now = rng.state_dict()
        assert now[source] != before[source], source
        assert now == RNGState().state_dict(), source  # what an encoding from scratch gives
        before = now

    class Mine(RNGState):  # a subclass whose __init__ does not call RNGState's
        def __init__(self) -> None:
            self.tag = "mine"

    assert Mine().state_dict() == rng.state_dict()
    # and it puts back what it read
    sd = rng.state_dict()
    want = [d() for d in draws]
    rng.load_state_dict(sd)
    got = [d() for d in draws]
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def _sealed_file(ck: Checkpointer, step: int) -> Path:
    assert ck.memory is not None
    staging = Path(ck.memory.dir) / "staging"
    return staging / json.loads((staging / record_name(0, step)).read_text())["path"]


def _pool_jobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the jobs the seal hands to the checksum threads."""
    import resilient.checkpoint.seal as seal

    jobs: list[int] = []
    pool = seal.crc_pool

    class Counted:
        def submit(self, *a: Any, **k: Any) -> Any:
            jobs.append(1)
            return pool().submit(*a, **k)

    monkeypatch.setattr(seal, "crc_pool", Counted)
    return jobs


def _two_large_sealed(ck: Checkpointer) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """Sealed snapshots of steps 1 and 2 of a 24 MB state (six 4 MB blocks): the state, and each
    step's tensor."""
    state = {"w": torch.randn(6 << 20, generator=torch.Generator().manual_seed(0))}
    want = {}
    for step in (1, 2):
        state["w"].add_(1.0)
        ck.snapshot(step, state).wait()
        want[step] = state["w"].clone()
    return state, want


def test_a_large_sealed_snapshot_is_checked_on_the_checksum_threads(tmp_path, monkeypatch):
    # the six blocks checked on the checksum threads by the seal (seal._in_parallel); a byte
    # flipped in the fifth block of the newest snapshot makes the restore take the one before
    jobs = _pool_jobs(monkeypatch)
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=0) as ck:
        state, want = _two_large_sealed(ck)
        path = _sealed_file(ck, 2)
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - (5 << 20))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        target = {"w": torch.zeros_like(state["w"])}
        assert ck.load(target) == 1
        assert ck.last_load.source == "memory" and ck.last_load.sealed
        assert torch.equal(target["w"], want[1])
        assert jobs  # (both steps' files were checked on the threads)


def test_a_short_read_on_the_checksum_threads_leaves_the_step_unsealed(tmp_path, monkeypatch):
    import resilient.checkpoint.seal as seal

    jobs = _pool_jobs(monkeypatch)
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=0) as ck:
        state, want = _two_large_sealed(ck)
        ino = _sealed_file(ck, 2).stat().st_ino

        class Short:  # the os module, but one block of step 2's file reads a byte short
            def __getattr__(self, name: str) -> Any:
                return getattr(os, name)

            def pread(self, fd: int, n: int, at: int) -> bytes:
                data = os.pread(fd, n, at)
                short = os.fstat(fd).st_ino == ino and at > (12 << 20)
                return data[:-1] if short else data

        monkeypatch.setattr(seal, "os", Short())
        target = {"w": torch.zeros_like(state["w"])}
        assert ck.load(target) == 1 and ck.last_load.sealed
        assert torch.equal(target["w"], want[1])
        assert jobs


def test_the_steps_a_seal_retires_are_deleted(tmp_path):
    state = {"w": torch.ones(1000)}
    # every second snapshot committed: 2 and 4 are committed, 5 is sealed
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=2) as ck:
        for step in range(1, 6):
            state["w"].add_(1.0)
            ck.snapshot(step, state).wait()
        assert ck.memory_steps() == [4, 2]
        target = {"w": torch.zeros(1000)}
        assert ck.load(target) == 5 and ck.last_load.sealed
        assert torch.equal(target["w"], state["w"])
        assert ck.memory is not None
        left = sorted(p.name for p in Path(ck.memory.steps).glob("step_*"))
        assert left == ["step_00000004", "step_00000005"]
        assert ck.memory_steps() == [5, 4]


@pytest.mark.parametrize("commit_every", [1, 0], ids=["committed", "sealed"])
def test_an_unchanged_state_takes_the_plan_before_it_and_a_changed_one_does_not(
    tmp_path, monkeypatch, commit_every
):
    import resilient.checkpoint.checkpointer as checkpointer
    import resilient.checkpoint.slots as slots

    calls = {"plan": 0, "fit": 0}
    plan_writes, check_fit = checkpointer.plan_writes, slots._check_fit

    def counted_plan(*a: Any, **k: Any) -> Any:
        calls["plan"] += 1
        return plan_writes(*a, **k)

    def counted_fit(*a: Any, **k: Any) -> Any:
        calls["fit"] += 1
        return check_fit(*a, **k)

    monkeypatch.setattr(checkpointer, "plan_writes", counted_plan)
    monkeypatch.setattr(slots, "_check_fit", counted_fit)
    state = _state()
    with Checkpointer(
        str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=commit_every
    ) as ck:
        ck.snapshot(1, state).wait()
        assert calls == {"plan": 1, "fit": 1}
        for step in (2, 3):  # described by checks alone: the plan of step 1, nothing checked
            ck.snapshot(step, state).wait()
        assert calls == {"plan": 1, "fit": 1}
        _replace_a(state)
        ck.snapshot(4, state).wait()
        assert calls == {"plan": 2, "fit": 2}


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_plan_that_failed_is_never_stood_in_for_by_the_one_before(tmp_path):
    # the flatten of step 3 describes every tensor (the cache moves on to it), then its plan
    # fails (a dtype the format does not have): step 4's flatten is "unchanged" against step
    # 3's, but the newest plan is step 1's, of a float32 tensor, and must not be taken
    state = {"a": torch.ones(4)}
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_commit_every=0) as ck:
        ck.snapshot(1, state).wait()
        ck.snapshot(2, state).wait()
        state["a"] = torch.ones(4, dtype=torch.complex32)
        for step in (3, 4):
            with pytest.raises(Exception, match="complex32|dtype"):
                ck.snapshot(step, state)
