"""A failure to read the newest step on one rank is seen by every rank: all fall back together, or
all raise the same error; never a hang, and never a half-loaded state."""

import pytest
import torch

from resilient import Checkpointer, Layout, Shard, sharded
from resilient.errors import CheckpointCorruptError, StateMismatchError, StorageError
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed


def _save_two(rank, world, url):
    lay = Layout(tp=2)
    with Checkpointer(url, layout=lay, block_bytes=4096) as ck:
        for s in (1, 2):
            ck.save(s, {"w": sharded(torch.full((2048,), float(s * 10 + rank)), {"tp": Shard(0)})})
        ck.wait()


def _load(rank, world, url, fallback, bad_rank_options, shape):
    from resilient import RetryPolicy

    lay = Layout(tp=2)
    opts = bad_rank_options if rank == 1 else None
    u = f"faulty://{url}" if (rank == 1 and opts) else url
    n = shape if rank == 1 else 4096
    state = {"w": sharded(torch.full((n // 2,), -1.0), {"tp": Shard(0)}, global_shape=(n,))}
    fast = RetryPolicy(max_attempts=2, max_total_s=5, initial_backoff_s=0.001, max_backoff_s=0.01)
    with Checkpointer(u, layout=lay, storage_options=opts, retry=fast) as ck:
        try:
            step = ck.load(state, fallback=fallback)
            return "ok", step, float(state["w"][0]), None
        except (CheckpointCorruptError, StateMismatchError, StorageError) as e:
            return type(e).__name__, None, float(state["w"][0]), str(e)


def test_a_file_missing_for_one_rank_makes_every_rank_fall_back(tmp_path):
    run_distributed(_save_two, 2, str(tmp_path))
    (tmp_path / "step_00000002" / "rank_00001.safetensors").unlink()  # only rank 1 reads it
    out = run_distributed(_load, 2, str(tmp_path), True, None, 4096, timeout_s=120)
    assert out == [("ok", 1, 10.0, None), ("ok", 1, 11.0, None)]


def test_a_storage_error_on_one_rank_makes_every_rank_fall_back(tmp_path):
    run_distributed(_save_two, 2, str(tmp_path))
    faults = {"faults": [{"op": "read", "error": "permanent", "path": "step_00000002/rank_"}]}
    out = run_distributed(_load, 2, str(tmp_path), True, faults, 4096, timeout_s=120)
    assert out == [("ok", 1, 10.0, None), ("ok", 1, 11.0, None)]
    # without fallback every rank raises, naming the rank and the failure; nothing changed
    out = run_distributed(_load, 2, str(tmp_path), False, faults, 4096, timeout_s=120)
    assert out[1][0] == "StorageError" and "injected permanent fault" in out[1][3]
    assert out[0][0] == "StorageError"  # the same error class on every rank
    assert "step 2 failed to load on rank 1: storage" in out[0][3]
    assert "injected permanent fault" in out[0][3]
    assert out[0][2] == -1.0 and out[1][2] == -1.0  # all or nothing: rank 0 read fine, kept none


def test_a_state_mismatch_on_one_rank_is_raised_by_every_rank(tmp_path):
    run_distributed(_save_two, 2, str(tmp_path))
    out = run_distributed(_load, 2, str(tmp_path), True, None, 8192, timeout_s=120)
    assert out[1][0] == "StateMismatchError" and "global shape [8192]" in out[1][3]
    assert out[0][0] == "StateMismatchError"
    assert "step 2 failed to load on rank 1: tensor 'w'" in out[0][3]
    assert out[0][2] == -1.0  # rank 0 could read its part, and kept none of it
