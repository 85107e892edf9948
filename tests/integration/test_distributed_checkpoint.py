"""Real gloo process groups: save from 2 and 4 ranks, load back into the same and other layouts."""

import os

import pytest
import torch
import torch.distributed as dist

from resilient import Checkpointer, Layout, RetryPolicy, Shard, sharded
from resilient.errors import CheckpointCorruptError
from tests.ckpt_sim import distribute, local_chunk
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

GLOBALS = {
    "emb": (lambda: torch.arange(70.0).reshape(10, 7), {"tp": Shard(0)}),  # uneven over 4
    "qkv": (lambda: torch.arange(72.0).reshape(12, 6).bfloat16(), {"tp": Shard(0, parts=3)}),
    "opt": (
        lambda: torch.arange(9.0) * 3,
        {"dp": Shard(0), "tp": Shard(0)},
    ),  # ZeRO-like, empty chunks
    "norm": (lambda: torch.ones(5), {}),
    "empty": (lambda: torch.zeros(0, 3), {"tp": Shard(1)}),
}


def _state(layout: Layout, rank: int, zero: bool = False) -> dict:
    g = {k: (torch.zeros_like(f()) if zero else f()) for k, (f, _) in GLOBALS.items()}
    state = distribute(g, {k: p for k, (_, p) in GLOBALS.items()}, layout, rank)
    state["meta"] = {"rank_seen": -1 if zero else rank, "common": 0 if zero else 42}
    return state


def _check(state: dict, layout: Layout, rank: int) -> None:
    for k, (f, p) in GLOBALS.items():
        assert torch.equal(state[k], local_chunk(f(), p, layout, rank)), (k, rank)


def _save(rank, world, url, layout_sizes, steps):
    layout = Layout(list(layout_sizes))
    with Checkpointer(url, layout=layout, keep_last=2) as ck:
        for s in steps:
            ck.save(s, _state(layout, rank))
        ck.wait()
        return ck.steps(), ck.last_load


def _load(rank, world, url, layout_sizes, step):
    layout = Layout(list(layout_sizes))
    state = _state(layout, rank, zero=True)
    with Checkpointer(url, layout=layout) as ck:
        got = ck.load(state, step=step)
        _check(state, layout, rank)
        return got, state["meta"], ck.last_load.resharded, ck.last_load.bytes_read


@pytest.mark.parametrize("world,sizes", [(2, (("dp", 1), ("tp", 2))), (4, (("dp", 2), ("tp", 2)))])
def test_round_trip_same_layout(tmp_path, world, sizes):
    url = str(tmp_path)
    steps = run_distributed(_save, world, url, sizes, [1, 2, 3])
    assert all(s == [2, 3] for s, _ in steps)
    out = run_distributed(_load, world, url, sizes, None)
    for rank, (step, meta, resharded, _) in enumerate(out):
        assert step == 3 and not resharded
        assert meta == {"rank_seen": rank, "common": 42}  # per-rank values come back per rank
    files = sorted(os.listdir(tmp_path / "step_00000003"))
    assert files == ["MANIFEST.json"] + [f"rank_{r:05d}.safetensors" for r in range(world)]


def test_load_reshards_across_world_sizes(tmp_path):
    url = str(tmp_path)
    run_distributed(_save, 4, url, (("dp", 2), ("tp", 2)), [7])
    two = run_distributed(_load, 2, url, (("dp", 1), ("tp", 2)), 7)
    four = run_distributed(_load, 4, url, (("dp", 1), ("tp", 4)), 7)
    assert all(r[2] for r in two + four)  # resharded, and _load checked every byte
    # a world of one (no process group) gets the global tensors
    layout = Layout(dp=1, tp=1)
    state = _state(layout, 0, zero=True)
    with Checkpointer(url, layout=layout) as ck:
        ck.load(state)
    _check(state, layout, 0)


def _dtensor_save_load(rank, world, url):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(torch.arange(40.0).reshape(10, 4), mesh, [Replicate(), DShard(0)])
    b = distribute_tensor(torch.arange(6.0), mesh, [DShard(0), DShard(0)])
    with Checkpointer(url) as ck:  # layout comes from the mesh
        ck.save(1, {"w": w, "b": b}).wait()
        assert ck.layout == Layout(dp=2, tp=2)
    # load the DTensor checkpoint into plain annotated tensors in another layout (tp=4)
    lay = Layout(dp=1, tp=4)
    out = {
        "w": sharded(
            torch.zeros(local_chunk(torch.zeros(10, 4), {"tp": Shard(0)}, lay, rank).shape),
            {"tp": Shard(0)},
            global_shape=(10, 4),
        ),
        "b": torch.zeros(6),
    }
    with Checkpointer(url, layout=lay) as ck:
        ck.load(out)
    assert torch.equal(
        out["w"], local_chunk(torch.arange(40.0).reshape(10, 4), {"tp": Shard(0)}, lay, rank)
    )
    assert torch.equal(out["b"], torch.arange(6.0))
    # and back into DTensors with yet another placement
    w2 = distribute_tensor(torch.zeros(10, 4), mesh, [DShard(1), Replicate()])
    with Checkpointer(url) as ck:
        ck.load({"w": w2, "b": distribute_tensor(torch.zeros(6), mesh, [Replicate(), Replicate()])})
    assert torch.equal(w2.full_tensor(), torch.arange(40.0).reshape(10, 4))
    return True


def test_dtensors_save_and_reshard(tmp_path):
    assert run_distributed(_dtensor_save_load, 4, str(tmp_path)) == [True] * 4


def _failing_rank(rank, world, url):
    from resilient.errors import ResilientError

    opts = (
        {"faults": [{"op": "write", "error": "permanent", "path": "step_00000002/rank_"}]}
        if rank == 1
        else None
    )
    u = f"faulty://{url}" if rank == 1 else url
    fast = RetryPolicy(max_attempts=2, max_total_s=5, initial_backoff_s=0.001, max_backoff_s=0.01)
    with Checkpointer(u, storage_options=opts, retry=fast, commit_timeout_s=60) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()
        ck.save(2, {"w": torch.ones(4)})
        try:
            ck.wait()
        except ResilientError as e:
            return str(e), ck.steps()
    return None, None


def test_a_rank_failing_to_write_fails_the_commit_everywhere(tmp_path):
    out = run_distributed(_failing_rank, 2, str(tmp_path))
    for _, steps in out:
        assert steps == [1]
    # the coordinator names the rank that failed and why; the other rank says its own failure
    assert "rank 1 failed to write: StorageError" in out[0][0]
    assert "injected permanent fault" in out[0][0]
    assert "storage write of" in out[1][0] and "injected permanent fault" in out[1][0]


def _mismatched(rank, world, url):
    state = {"w": torch.ones(4)}
    if rank == 1:
        state["extra"] = torch.ones(2)
    with Checkpointer(url) as ck:
        ck.save(1, state)
        try:
            ck.wait()
        except Exception as e:
            return str(e)
    return None


def test_ranks_saving_different_states_are_refused(tmp_path):
    out = run_distributed(_mismatched, 2, str(tmp_path))
    assert "rank 1 saved a different state than rank 0 (2 tensors vs 1" in out[0]
    assert "step 1 was not committed" in out[1]
    assert not (tmp_path / "step_00000001" / "MANIFEST.json").exists()


def _fallback(rank, world, url, fallback):
    lay = Layout(tp=2)
    state = {"w": sharded(torch.zeros(2048), {"tp": Shard(0)})}
    with Checkpointer(url, layout=lay) as ck:
        try:
            return ck.load(state, fallback=fallback), float(state["w"][0])
        except CheckpointCorruptError as e:
            return "corrupt", str(e)


def _save_two(rank, world, url):
    lay = Layout(tp=2)
    with Checkpointer(url, layout=lay, block_bytes=4096) as ck:
        for s in (1, 2):
            ck.save(s, {"w": sharded(torch.full((2048,), float(s * 10 + rank)), {"tp": Shard(0)})})
        ck.wait()


def test_fallback_is_agreed_by_all_ranks(tmp_path):
    run_distributed(_save_two, 2, str(tmp_path))
    # corrupt only rank 1's file of step 2: rank 0 reads clean bytes, rank 1 does not
    f = tmp_path / "step_00000002" / "rank_00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 1
    f.write_bytes(bytes(data))
    out = run_distributed(_fallback, 2, str(tmp_path), False)
    assert out[1][0] == "corrupt" and "rank_00001.safetensors, tensor 'w', step 2" in out[1][1]
    # rank 0 read clean bytes, and raises what rank 1 found, naming rank 1
    assert out[0][0] == "corrupt"
    assert "step 2 failed to load on rank 1: checksum mismatch in" in out[0][1]
    out = run_distributed(_fallback, 2, str(tmp_path), True)
    assert out == [(1, 10.0), (1, 11.0)]


def _bytes_balance(rank, world, url):
    with Checkpointer(url) as ck:  # Layout(dp=4): everything replicated
        stats = ck.save(1, {f"w{i}": torch.full((256,), float(i)) for i in range(8)}).wait()
    return stats.bytes_written


def test_replicated_tensors_are_written_once_and_balanced(tmp_path):
    sizes = run_distributed(_bytes_balance, 4, str(tmp_path))
    assert max(sizes) - min(sizes) < 256  # two 1 KiB tensors per rank; headers differ slightly
    assert sum(sizes) < 8 * 1024 + 4 * 512
    _ = dist  # the module is what the children use
