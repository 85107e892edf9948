"""SIGKILL a saving process at random moments: the newest committed step always loads and verifies,
and no step the process saw committed is ever lost."""

import multiprocessing as mp
import os
import random
import time

import pytest
import torch

from resilient import Checkpointer

pytestmark = [pytest.mark.slow]

CTX = mp.get_context("forkserver")


def state_for(step: int) -> dict:
    # a few MB over several tensors so that a kill lands inside staging, writing, or committing
    return {f"w{i}": torch.full((64 * 1024 + i,), float(step * 10 + i)) for i in range(8)} | {
        "meta": {"step": step}
    }


def check(state: dict, step: int) -> None:
    for i in range(8):
        assert torch.equal(state[f"w{i}"], torch.full((64 * 1024 + i,), float(step * 10 + i))), (
            step,
            i,
        )
    assert state["meta"]["step"] == step


def saver(url: str, log_path: str, ready) -> None:
    torch.set_num_threads(1)
    with Checkpointer(url, keep_last=2) as ck:
        step = ck.latest_step() or 0
        while True:
            step += 1
            ck.save(step, state_for(step)).wait()
            with open(log_path, "a") as f:
                f.write(f"{step}\n")
            # every trial commits at least one step before the kill can come, however slow the
            # machine is: "progress across kills" never depends on how much fits in the window
            ready.set()
            if step % 4 == 0:  # re-save a committed step now and then (the generation path)
                ck.save(step, state_for(step)).wait()


@pytest.mark.parametrize("trials", [12])  # (12 moments: each trial is a process and a load)
def test_sigkill_at_random_moments(tmp_path, trials):
    url = str(tmp_path / "ckpt")
    log_path = str(tmp_path / "committed.log")
    rng = random.Random(1234)
    seen_committed = 0
    for trial in range(trials):
        ready = CTX.Event()
        p = CTX.Process(target=saver, args=(url, log_path, ready), daemon=True)
        p.start()
        assert ready.wait(120)
        time.sleep(rng.uniform(0.0, 0.6))  # then a kill at a random moment of the next saves
        p.kill()
        p.join()
        assert p.exitcode == -9
        if os.path.exists(log_path):
            lines = open(log_path).read().split()
            if lines:
                seen_committed = max(seen_committed, int(lines[-1]))
        with Checkpointer(url) as ck:
            steps = ck.steps()
            if seen_committed:
                assert steps and steps[-1] >= seen_committed, (trial, steps, seen_committed)
            if not steps:
                continue
            out = state_for(0)
            got = ck.load(out)
            assert got == steps[-1]
            check(out, got)
            for s in steps:
                report = ck.verify(s)
                assert report.ok, report.problems
    assert seen_committed >= trials  # the saver made progress across the kills
