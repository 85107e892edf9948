"""``@fault_tolerant`` and ``Run``: resume is exact, SIGTERM saves and exits cleanly, ranks agree."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from resilient import Checkpointer, fault_tolerant
from resilient.loop import RNGState
from tests.dist import run_distributed


def make_train(url, total, crash_at=None, save_every=3):
    @fault_tolerant(url, save_every=save_every)
    def train(run):
        torch.manual_seed(
            0
        )  # a fresh run's seeds; a resumed run's RNG states come from the checkpoint
        random.seed(0)
        model = torch.nn.Linear(4, 2)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        run.track(model=model, optim=optim)
        for step in run.steps(total):
            x = torch.randn(8, 4)  # data from the torch RNG, noise from python's: both tracked
            noise = random.random()
            loss = ((model(x) - noise) ** 2).mean()
            loss.backward()
            if torch.distributed.is_initialized():
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
            optim.step()
            optim.zero_grad()
            if step == crash_at:
                raise RuntimeError(f"crash after step {step}")
        return model.weight.detach().clone(), run.restored_step

    return train


def test_resume_after_a_crash_is_bit_exact(tmp_path):
    straight, _ = make_train(str(tmp_path / "a"), 10)()
    with pytest.raises(RuntimeError, match="crash after step 7"):
        make_train(str(tmp_path / "b"), 10, crash_at=7)()
    assert Checkpointer(str(tmp_path / "b")).steps() == [3, 6]  # step 7 was never saved
    resumed, restored = make_train(str(tmp_path / "b"), 10)()
    assert restored == 6
    assert torch.equal(resumed, straight)


def test_corrupt_newest_step_falls_back_with_a_warning(tmp_path):
    make_train(str(tmp_path), 6)()
    f = tmp_path / "step_00000006" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="falling back to step 3"):
        _, restored = make_train(str(tmp_path), 6)()
    assert restored == 3


def test_rng_state_round_trips_through_json():
    import json

    random.seed(1)
    torch.manual_seed(1)
    sd = json.loads(json.dumps(RNGState().state_dict()))
    a = (random.random(), torch.rand(3))
    RNGState().load_state_dict(sd)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def _dist_train(rank, world, url, total, preempt_rank_at):
    from resilient import fault_tolerant

    @fault_tolerant(url, save_every=5)
    def train(run):
        model = torch.nn.Linear(4, 2)
        run.track(model=model)
        last = None
        for step in run.steps(total):
            if (rank, step) == preempt_rank_at:
                run._preempt.set()  # as the SIGTERM handler does, on one rank only
            last = step
        return last

    try:
        return ("done", train())
    except SystemExit as e:
        return ("exit", e.code)


@pytest.mark.distributed
def test_ranks_agree_on_preemption_and_stop_at_the_same_step(tmp_path):
    out = run_distributed(_dist_train, 2, str(tmp_path), 20, (1, 7))
    assert out == [("exit", 0), ("exit", 0)]
    assert Checkpointer(str(tmp_path)).steps() == [5, 7]
    out = run_distributed(_dist_train, 2, str(tmp_path), 20, None)
    assert out == [("done", 20), ("done", 20)]


SCRIPT = """
import sys, time, torch
from resilient import fault_tolerant

@fault_tolerant(sys.argv[1], save_every=100)
def train(run):
    model = torch.nn.Linear(4, 2)
    start = run.track(model=model)
    print("start", start, flush=True)
    for step in run.steps(10_000):
        time.sleep(0.02)
        print("step", step, flush=True)

train()
print("finished", flush=True)
"""


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_cleanly(tmp_path):
    url = str(tmp_path / "ck")
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, url],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    seen = 0
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("step"):
            seen = int(line.split()[1])
            if seen == 5:
                proc.send_signal(signal.SIGTERM)
        assert time.time() < deadline
    assert proc.wait(60) == 0
    steps = Checkpointer(url).steps()
    assert steps and steps[-1] >= 5 and steps[-1] == seen  # saved at the step it stopped after
    again = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("10_000", str(seen + 2)), url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and f"start {seen}" in again.stdout and "finished" in again.stdout
