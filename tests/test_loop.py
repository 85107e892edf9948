"""``@fault_tolerant`` and ``Run``: resume is exact, SIGTERM saves and exits cleanly, ranks agree."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from resilient import Checkpointer, Run, SaveFailedWarning, fault_tolerant
from resilient.errors import LeaseError, StateMismatchError, StorageError
from resilient.health import DetectorConfig, EventLog
from resilient.health.detector import Finding, Verdict
from resilient.health.heartbeat import Monitor, decode_progress
from resilient.loop import RNGState
from tests.dist import run_distributed
from tests.monitor_fakes import DictStore, fake_time, quiet_monitors


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


def _edit_value(url, step, key, value):
    """Write ``value`` as the JSON value ``key`` of committed step ``step`` (a hostile or stale
    checkpoint; the manifest holds no checksum over its values)."""
    path = os.path.join(url, f"step_{step:08d}", "MANIFEST.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["extras"][key] = value
    with open(path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize(
    "value, found",
    [
        (True, "is True \\(bool\\)"),
        (5.0, "is 5.0 \\(float\\)"),
        ("6", "is '6' \\(str\\)"),
        (None, "is None \\(NoneType\\)"),
        (-1, "is -1 \\(int\\)"),
        (2**70, f"is {2**70} \\(int\\)"),
    ],
)
def test_a_restored_loop_step_that_is_no_step_number_is_refused(tmp_path, value, found):
    """``run.step`` went through int(): True resumed after step 1 of a step-6 checkpoint, 5.0 and
    '6' were taken, -1 failed later in a save with a bare ValueError, None with a TypeError, and
    2**70 ended the loop at once with nothing trained or saved."""
    url = str(tmp_path)
    make_train(url, 6)()
    _edit_value(url, 6, "run.step", value)
    with pytest.raises(StateMismatchError, match=f"the value 'run.step' of step 6 under .* {found}, "
                       "expected the int step number"):  # fmt: skip
        make_train(url, 9)()


def test_a_restored_loop_step_below_the_committed_one_is_refused(tmp_path):
    """A step-6 checkpoint whose loop says step 2 resumed at step 3: steps 3-6 trained again
    (their samples seen twice) and saved over the committed steps 3 and 6."""
    url = str(tmp_path)
    make_train(url, 6)()
    _edit_value(url, 6, "run.step", 2)
    with pytest.raises(StateMismatchError, match="'run.step' of step 6 .* is 2, expected 6 .* "
                       "would train steps 3..6 again"):  # fmt: skip
        make_train(url, 9)()
    assert Checkpointer(url).steps() == [3, 6]  # nothing committed was touched


def test_a_state_stored_under_a_lower_step_number_resumes_after_its_own_step(tmp_path):
    """(an import writes step 0 of a state whose loop was at step 6) said, and not refused"""
    url = str(tmp_path)
    make_train(url, 6)()
    _edit_value(url, 6, "run.step", 7)
    with pytest.warns(UserWarning, match="'run.step' of step 6 .* is 7: .* resuming after step 7"):
        _, restored = make_train(url, 9)()
    assert restored == 6 and Checkpointer(url).latest_step() == 9


def test_rng_state_round_trips_through_json():
    import json

    random.seed(1)
    torch.manual_seed(1)
    sd = json.loads(json.dumps(RNGState().state_dict()))
    a = (random.random(), torch.rand(3))
    RNGState().load_state_dict(sd)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_rng_states_saved_as_lists_of_integers_still_load():
    """Before the compact form, the Mersenne Twister states were saved as lists of integers."""
    import numpy as np

    random.seed(2)
    np.random.seed(3)
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    sd = RNGState().state_dict()
    assert isinstance(sd["python"][1], str) and isinstance(sd["numpy"][1], str)
    old = {
        **sd,
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    a = (random.random(), np.random.rand())
    RNGState().load_state_dict(json.loads(json.dumps(old)))
    assert (random.random(), np.random.rand()) == a
    RNGState().load_state_dict(json.loads(json.dumps(sd)))
    assert (random.random(), np.random.rand()) == a


def _damaged_rng(source, value):
    return {**json.loads(json.dumps(RNGState().state_dict())), source: value}


@pytest.mark.parametrize(
    "source, value, why",
    [
        ("python", None, "TypeError: cannot unpack"),
        ("python", [3, "@@@", None], "Only base64 data is allowed"),
        ("python", [3, "AAAA", None], "ValueError"),
        ("python", "gauss", "the cached gauss value must be None or a float, not 'x'"),
        ("numpy", "x", "ValueError: not enough values to unpack"),
        ("numpy", ["MT19937", "AAAA", 0, 0, 0.0], "ValueError"),
        ("torch", "AAAA", "RuntimeError: .* size"),
        ("torch", 5, "TypeError"),
        ("cuda", "zz", "Invalid base64"),
        ("cuda", None, "TypeError"),
    ],
)
def test_a_damaged_rng_state_is_refused_by_its_key_before_any_generator_is_set(source, value, why):
    """Each was a bare TypeError, ValueError, binascii.Error or RuntimeError from inside
    random, numpy, base64 or torch, after the generators before it had been set; a python
    state whose cached gauss value was a string was taken."""
    if value == "gauss":  # a good state but for its cached gauss value
        value = [*RNGState().state_dict()["python"][:2], "x"]
    sd = _damaged_rng(source, value)
    random.seed(5)
    before = random.getstate()
    with pytest.raises(StateMismatchError, match=f"the saved RNG state 'rng.{source}' is .*, "
                       f"which does not set a {source} generator \\(.*{why}"):  # fmt: skip
        RNGState().load_state_dict(sd)
    assert random.getstate() == before  # nothing was set
    with pytest.raises(StateMismatchError, match="the saved RNG states have no 'rng.numpy'"):
        RNGState().load_state_dict(
            {k: v for k, v in _damaged_rng("cuda", []).items() if k != "numpy"}
        )


def test_a_damaged_rng_state_in_a_checkpoint_stops_the_restore_by_name(tmp_path):
    url = str(tmp_path)
    make_train(url, 6)()
    _edit_value(url, 6, "rng.torch", "AAAA")
    with pytest.raises(StateMismatchError, match="'rng.torch' is 'AAAA', which does not set"):
        make_train(url, 9)()


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


def _restore_with_one_ranks_listing(rank, world, url, listing):
    """Run's restore where rank 1's durable listing ``listing``: "fails" (a storage error on
    that rank only) or "empty" (it sees no commit while rank 0 sees one)."""
    from resilient import Run
    from resilient.checkpoint import checkpointer

    if rank == 1:

        def latest_step(self):
            if listing == "fails":
                raise StorageError(f"listing {self.url} failed on rank 1 (injected)")
            return None

        checkpointer.Checkpointer.latest_step = latest_step
    model = torch.nn.Linear(4, 2)
    with Run(url, save_every=0) as run:
        run.track(model=model)
        restored = run.restored_step
        # a collective right after the restore: a rank that skipped the load would meet here
        # the other ranks' load broadcasts instead
        dist.barrier()
    return restored, model.weight.sum().item()


def test_runs_own_collectives_put_their_tensors_where_the_backend_takes_them(tmp_path, monkeypatch):
    """Under NCCL (fault_tolerant's backend on a GPU machine) a collective's tensor must be on
    the GPU, as the Checkpointer's are (collective_device): Run's agreement on what to restore
    and on preemption ask the same function.  (A two-rank NCCL group needs two GPUs; this
    checks the wiring on a one-process group of gloo.)"""
    import resilient.loop as loop

    asked = []

    def device():
        asked.append(1)
        return torch.device("cpu")

    monkeypatch.setattr(loop, "collective_device", device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Run(str(tmp_path / "ckpt"), save_every=0) as run:
            run.world_size = 2  # (as a group of two would: the agreements run)
            run.track(model=torch.nn.Linear(2, 2))
            assert len(asked) == 1  # what to restore
            assert run._agree_preempted() is False and len(asked) == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("listing", ["fails", "empty"])
def test_a_rank_that_lists_durable_storage_differently_still_restores(tmp_path, listing):
    run_distributed(_dist_train, 2, str(tmp_path), 5, None)  # a durable step 5
    out = run_distributed(_restore_with_one_ranks_listing, 2, str(tmp_path), listing, timeout_s=90)
    assert [r[0] for r in out] == [5, 5], out
    assert out[0][1] == out[1][1], out


@pytest.mark.distributed
def test_ranks_agree_on_preemption_and_stop_at_the_same_step(tmp_path):
    out = run_distributed(_dist_train, 2, str(tmp_path), 20, (1, 7))
    assert out == [("exit", 0), ("exit", 0)]
    assert Checkpointer(str(tmp_path)).steps() == [5, 7]
    out = run_distributed(_dist_train, 2, str(tmp_path), 20, None)
    assert out == [("done", 20), ("done", 20)]


def _preempted_before_the_first_step(url, total, preempt=True):
    """A run of steps up to ``total`` that gets SIGTERM (a real signal, to this process) after
    its restore, before its loop's first step; returns the steps it trained and how it ended."""
    taken = []
    try:
        with Run(url, save_every=2, detect=False) as run:
            run.track(model=torch.nn.Linear(2, 1))
            if preempt:
                os.kill(os.getpid(), signal.SIGTERM)
            for step in run.steps(total):
                taken.append(step)
    except SystemExit as e:
        return taken, e.code
    return taken, "completed"


def test_sigterm_before_the_first_step_stops_there_with_the_newest_state_committed(tmp_path):
    """A SIGTERM in the restore or the model's build was only looked at after the first step:
    a step trained (and saved) inside the grace period, however long a first step takes."""
    url = str(tmp_path)
    assert _preempted_before_the_first_step(url, 6) == ([], 0)
    assert Checkpointer(url).steps() == [0]  # a fresh run: its initial state
    assert _preempted_before_the_first_step(url, 3, preempt=False) == ([1, 2, 3], "completed")
    assert _preempted_before_the_first_step(url, 6) == ([], 0)
    assert Checkpointer(url).steps() == [0, 2, 3]  # nothing trained, nothing lost
    assert _preempted_before_the_first_step(url, 4, preempt=False) == ([4], "completed")


class _SigtermInTheFinalSave:
    """(a hook) SIGTERM to this process while the save of step ``at`` is written."""

    def __init__(self, at: int) -> None:
        self.at = at

    def during_save(self, step: int, run: Run) -> None:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_in_the_final_commit_stops_the_run_after_it(tmp_path):
    """A SIGTERM after the last step's check (in the final commit) was never looked at again:
    the code after the loop ran on into the grace period's SIGKILL."""
    url = str(tmp_path)
    after = []
    with pytest.raises(SystemExit) as e:
        with Run(url, save_every=2, detect=False, hooks=[_SigtermInTheFinalSave(4)]) as run:
            run.track(model=torch.nn.Linear(2, 1))
            for _ in run.steps(4):
                pass
            after.append("after the loop")
    assert e.value.code == 0 and after == []
    assert Checkpointer(url).steps() == [2, 4]  # the final step committed
    # the next run resumes at the final step, and what follows the loop runs there
    with Run(url, save_every=2, detect=False) as run:
        run.track(model=torch.nn.Linear(2, 1))
        assert list(run.steps(4)) == []
        after.append("after the loop")
    assert after == ["after the loop"]


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


def simple_run(url, total, *, save_every=3, events=None, storage_options=None, **kw):
    """A one-process run of ``total`` steps on a tiny model; returns the Run."""
    run = Run(url, save_every=save_every, event_log=events, storage_options=storage_options, **kw)
    with run:
        run.track(model=torch.nn.Linear(2, 2))
        for _ in run.steps(total):
            pass
    return run


def test_a_completed_run_commits_its_final_step(tmp_path):
    """10 steps, a save every 3: the final step is committed too, before steps() returns."""
    simple_run(str(tmp_path), 10, keep_last=5)
    assert Checkpointer(str(tmp_path)).steps() == [3, 6, 9, 10]
    again = simple_run(str(tmp_path), 10)  # nothing to recompute
    assert again.restored_step == 10 and again.step == 10


def faulty(tmp_path, rule):
    return f"faulty://{tmp_path / 'ck'}", {"target_protocol": "file", "faults": [rule]}


def test_a_failed_save_is_logged_and_training_goes_on(tmp_path):
    url, options = faulty(
        tmp_path, {"op": "write", "error": "permanent", "path": "step_00000004", "count": 1}
    )
    events = str(tmp_path / "events.jsonl")
    with pytest.warns(SaveFailedWarning, match=r"checkpoint save of step 4 failed: .*injected"):
        run = simple_run(url, 8, save_every=2, events=events, storage_options=options)
    assert run.step == 8
    # step 4 never committed; step 2 stayed the newest until step 6 committed
    assert Checkpointer(str(tmp_path / "ck")).steps() == [2, 6, 8]
    saves = [e for e in EventLog(events).read() if e["event"] == "save"]
    failed = [e for e in saves if not e["ok"]]
    assert [(e["step"], e["consecutive_failures"]) for e in failed] == [(4, 1)]
    assert "injected permanent fault on write" in failed[0]["error"]
    assert {e["step"] for e in saves if e["ok"]} == {2, 6, 8}


@pytest.mark.parametrize("skip", range(1, 9))
def test_a_lease_file_read_that_fails_once_costs_one_save_at_most(tmp_path, skip):
    """A read of the writer lease that fails (here the 2nd to 9th read of LEASE.json: the first
    lease's settle, a check before or after some save's publish) is a storage failure: the run
    counts it as a failed save and goes on, or (after the publish) keeps the committed step;
    never a lost lease, and never a save reported failed that committed."""
    rule = {"id": "r", "op": "read", "error": "permanent", "path": "LEASE.json", "count": 1}
    url, options = faulty(tmp_path, {**rule, "skip": skip})
    options["record"] = record = str(tmp_path / "fired.jsonl")
    events = str(tmp_path / "events.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SaveFailedWarning)
        run = simple_run(
            url,
            6,
            save_every=1,
            events=events,
            storage_options=options,
            max_failed_saves=2,
            keep_last=10,
        )
    assert run.step == 6
    steps = Checkpointer(str(tmp_path / "ck")).steps()
    saves = [e for e in EventLog(events).read() if e["event"] == "save"]
    failed = [e for e in saves if not e["ok"]]
    assert len(failed) <= 1 and all("could not be read back" in e["error"] for e in failed)
    assert steps == sorted(set(range(1, 7)) - {e["step"] for e in failed})
    assert {e["step"] for e in saves if e["ok"]} | {e["step"] for e in failed} == set(range(1, 7))
    assert len(open(record).readlines()) == 1  # the fault fired


def test_too_many_consecutive_failed_saves_end_the_run(tmp_path):
    url, options = faulty(tmp_path, {"op": "write", "error": "permanent", "path": "step_"})
    with pytest.warns(SaveFailedWarning, match="1 consecutive failed save"):
        with pytest.raises(StorageError) as e:
            simple_run(url, 20, save_every=1, storage_options=options, max_failed_saves=2)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "2 consecutive saves failed (max_failed_saves=2)" in notes
    assert "the newest committed step is no step yet" in notes


def test_a_failed_final_save_fails_the_run(tmp_path):
    url, options = faulty(
        tmp_path, {"op": "write", "error": "permanent", "path": "step_00000005", "count": 1}
    )
    with pytest.raises(StorageError) as e:
        simple_run(url, 5, save_every=2, storage_options=options)
    assert "the final save failed; the newest committed step is step 4" in "\n".join(
        e.value.__notes__
    )


def test_ctrl_c_while_a_save_runs_is_not_swallowed_nor_the_save_called_committed(
    tmp_path, monkeypatch
):
    """Ctrl-C while the loop waits for a background save (here step 2's save joining step 1's)
    ends the run; the save still running is not recorded as committed then, and close() settles
    it truthfully once it is over.  (The wait swallowed the interrupt: the run trained to the
    end and logged step 1 as saved, ``committed_at`` None, before it was.)"""
    from resilient.chaos.faultfs import FaultyFileSystem
    from resilient.checkpoint.checkpointer import SaveHandle

    gate = threading.Event()
    maybe_fail = FaultyFileSystem._maybe_fail

    def gated(fs, op, path):  # step 1's files are written once the gate opens
        if op == "write" and "step_00000001" in path:
            assert gate.wait(10), "the test never opened the gate"
        return maybe_fail(fs, op, path)

    wait = SaveHandle.wait

    def interrupted(handle, timeout=None):  # Ctrl-C arrives while the loop waits for a save
        if not handle.done() and not gate.is_set():
            raise KeyboardInterrupt
        return wait(handle, timeout)

    monkeypatch.setattr(FaultyFileSystem, "_maybe_fail", gated)
    monkeypatch.setattr(SaveHandle, "wait", interrupted)
    url, options = f"faulty://{tmp_path / 'ck'}", {"target_protocol": "file", "faults": []}
    events = str(tmp_path / "events.jsonl")
    run = Run(url, save_every=1, event_log=events, storage_options=options, detect=False)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with run:
            run.track(model=torch.nn.Linear(2, 2))
            try:
                for step in run.steps(5):
                    seen.append(step)
            finally:  # the interrupt reached the loop: nothing is committed yet
                at_interrupt = (run._committed_step, run._handle and run._handle.step)
                saves_then = [e for e in EventLog(events).read() if e["event"] == "save"]
                gate.set()  # the save may finish now; close() waits for it
    assert seen == [1, 2]
    assert at_interrupt == (None, 1) and saves_then == []
    saves = [e for e in EventLog(events).read() if e["event"] == "save"]
    assert [(e["step"], e["ok"], e["committed_at"] is not None) for e in saves] == [(1, True, True)]
    assert Checkpointer(str(tmp_path / "ck")).steps() == [1] and run._committed_step == 1


class _Handle:
    def __init__(self, error):
        self.step, self.error = 3, error
        self.started_at = self.finished_at = 0.0
        self.stats = type("S", (), {"stage_s": 0, "write_s": 0, "commit_s": 0, "bytes_written": 0})

    def done(self):
        return True

    def wait(self):
        raise self.error


def test_another_jobs_lease_is_not_a_transient_save_failure():
    run = Run(None)
    with pytest.raises(LeaseError, match="owned by job B"):
        run._settle(_Handle(LeaseError("the URL's writer lease is owned by job B")), final=False)
    with pytest.warns(SaveFailedWarning):
        run._settle(_Handle(StorageError("the disk is full")), final=False)  # counted, not raised
    assert run._failed_saves == 2


class Recorder:
    def __init__(self):
        self.calls = []

    def at_phase(self, phase, run):
        self.calls.append(("phase", phase))

    def at_step(self, step, run):
        self.calls.append(("step", step))

    def during_save(self, step, run):
        self.calls.append(("save", step))


def test_hooks_are_called_at_their_points(tmp_path):
    hook = Recorder()
    simple_run(str(tmp_path), 4, save_every=2, hooks=[hook])
    assert hook.calls == [
        ("phase", "restore"),
        ("step", 1),
        ("step", 2),
        ("save", 2),
        ("step", 3),
        ("step", 4),
        ("save", 4),  # the final save is a save too
    ]


def test_the_chaos_environment_variable_does_nothing(tmp_path, monkeypatch):
    """Production code never reads the chaos harness's plan: only an installed hook can fire."""
    import json

    plan = tmp_path / "plan.json"
    fault = {"id": "x", "kind": "raise", "rank": 0, "step": 2, "when": "step"}
    plan.write_text(json.dumps({"marker_dir": str(tmp_path / "m"), "faults": [fault]}))
    monkeypatch.setenv("RESILIENT_CHAOS", str(plan))
    assert simple_run(str(tmp_path / "ck"), 3).step == 3


class PhaseLog:
    """A stand-in monitor that records the loop's progress announcements."""

    def __init__(self):
        from resilient.health import DetectorConfig

        self.config = DetectorConfig()
        self.seen = []

    def progress(self, step, phase, busy_s=None):
        self.seen.append((step, phase))

    def verdict(self):
        return None

    def close(self, announce=True):
        self.seen.append((None, "closed"))


def test_the_loop_announces_restore_checkpoint_and_commit_phases(tmp_path):
    simple_run(str(tmp_path), 2, save_every=1)  # something to restore
    mon = PhaseLog()
    simple_run(str(tmp_path), 4, save_every=3, monitor=mon)
    assert mon.seen == [
        (None, "restore"),
        (None, "setup"),
        (3, "first_step"),
        (3, "checkpoint"),
        (3, "train"),
        (4, "train"),
        (4, "checkpoint"),  # the final save: synchronous, its commit watched
        (4, "commit"),
        (None, "closed"),
    ]


def test_fault_tolerant_rejects_unknown_options_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launched job: the wrapper would create a group
    with pytest.raises(TypeError, match=r"'save_evry' \(did you mean 'save_every'\?\)"):
        fault_tolerant("/tmp/x", save_evry=3)
    with pytest.raises(ValueError, match="max_failed_saves must be an int >= 1"):
        fault_tolerant("/tmp/x", max_failed_saves=0)
    with pytest.raises(ValueError, match="join_timeout_s must be positive"):
        fault_tolerant("/tmp/x", join_timeout_s=0)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "option, value",
    [
        (name, bad)
        for name in ("heartbeat_interval_s", "join_timeout_s", "hang_timeout_s")
        for bad in ("1", float("nan"), float("inf"), True, -1.0)
    ]
    + [("keep_every", True)],
)
def test_bad_option_values_are_refused_naming_the_option(option, value):
    """A timeout read as text ('1') compared with a number deep in the detector, naming nothing;
    NaN, infinity and a bool (for a count, True as 1) were taken."""
    with pytest.raises(ValueError, match=rf"^{option} must be .*, got {re.escape(repr(value))}"):
        fault_tolerant("/tmp/x", **{option: value})
    with pytest.raises(ValueError, match=rf"^{option} must be "):
        Run(None, detect=False, **{option: value})


@pytest.mark.parametrize(
    "budgets, says",
    [
        ({"evaluation": 5.0}, r"names phases the loop does not go through: \['evaluation'\]"),
        ({"eval": True}, r"phase_budgets_s\['eval'\] must be positive seconds"),
        ({"eval": "5"}, r"phase_budgets_s\['eval'\] must be positive seconds"),
        ([("eval", 5.0)], r"phase_budgets_s must map phase names to seconds"),
    ],
)
def test_phase_budgets_are_checked_like_every_other_timeout(budgets, says):
    """A misspelt phase was a budget nothing used, True a budget of 1 s, "5" a bare TypeError."""
    with pytest.raises(ValueError, match=says):
        fault_tolerant("/tmp/x", phase_budgets_s=budgets)
    with pytest.raises(ValueError, match=says):
        Run(None, detect=False, phase_budgets_s=budgets)
    Run(None, detect=False, phase_budgets_s={"eval": 5, "checkpoint": 30.0, "train": 60})


@pytest.mark.parametrize("total", [10.0, "10", True, -1, None])
def test_steps_refuses_a_total_that_is_not_a_step_number(total):
    run = Run(None, detect=False)
    with run:
        run.track(counter=0)
        with pytest.raises(
            ValueError, match=rf"total must be an int >= 0 .*got {re.escape(repr(total))}"
        ):
            next(run.steps(total))


def test_errors_are_importable_from_the_package_and_track_says_it_restores():
    import resilient
    import resilient.errors

    for name in resilient.errors.__all__:
        assert getattr(resilient, name) is getattr(resilient.errors, name)
    assert "restore it in place from the newest committed" in " ".join(Run.track.__doc__.split())


def test_a_heartbeat_store_failure_does_not_crash_the_training_loop(monkeypatch, tmp_path):
    """The loop announces progress at every step: a store error there (the agent's store gone, one
    request timing out) killed the run.  The loop goes on; the error is logged once; the newest
    announcement is published with the next beat once the store answers."""
    fake_time(monkeypatch)
    store, log = DictStore(), str(tmp_path / "events.jsonl")
    cfg = DetectorConfig(interval_s=1.0, dead_after_intervals=2)
    m = quiet_monitors(store, 2, cfg, ranks=[0], events=EventLog(log))[0]
    run = Run(None, monitor=m, event_log=log)
    run.track(counter=0)
    done = []
    try:
        for step in run.steps(5):
            if step == 2:
                store.fail = True
            done.append(step)
        assert done == [1, 2, 3, 4, 5]
        errors = [e for e in EventLog(log).read() if e["event"] == "monitor_error"]
        assert [(e["where"], "store down" in e["error"]) for e in errors] == [("progress", True)]
        store.fail = False
        m._beat()
        step, phase, seq, _, _ = decode_progress(store.d["run/0/progress/0"])
        assert (step, phase, seq) == (5, "train", m._seq)
    finally:
        run.close()


def test_a_verdict_read_after_the_loop_took_a_peers_failure_over_exits_no_one(
    monkeypatch, tmp_path
):
    """In-job recovery: the loop takes a peer's failure over (its collective failed) and its
    checkpointer goes on to the next generation; a verdict about that peer which the monitor's
    thread reads only now (a loaded machine) must not exit the survivor (Run.close hands the
    failure over to the monitor)."""
    monkeypatch.setenv("RESILIENT_INJOB", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    store, exits = DictStore(), []
    m = quiet_monitors(store, 2, DetectorConfig(interval_s=30.0), ranks=[1])[1]
    m.on_failure = exits.append
    run = Run(str(tmp_path / "ck"), monitor=m)
    with pytest.raises(RuntimeError, match="Connection closed"):
        with run:
            run.track(counter=0)
            for step in run.steps(5):
                if step == 2:  # what a collective raises when a peer died
                    raise RuntimeError("gloo: Connection closed by peer")
    assert run._carry  # (the checkpointer goes on)
    run.checkpointer.close()
    store.set(
        "run/0/verdict",
        json.dumps(Finding(Verdict.DEAD, 0, "h", 1, 2, "train", 1.0, 9.0, "x").to_json()),
    )
    m._watch()
    assert exits == [] and m.verdict() is not None


def test_a_kill_a_missed_verdict_names_this_rank_for_is_done_with_no_checkpointer_to_carry(
    monkeypatch, tmp_path
):
    """In-job recovery where the loop failed before ``track`` (a model's first collective, DDP's
    broadcast) or without a checkpoint URL: no checkpointer goes on (``_carry`` is False), and
    Run.close did not hand the failure over, so the closing monitor left a verdict its thread had
    not read unanswered: a kill it named this rank for was never done (a frozen rank its agent
    never sees fail; the next generation never forms)."""
    monkeypatch.setenv("RESILIENT_INJOB", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    store, exits = DictStore(), []
    try:
        m = Monitor(
            store,
            "run/0",
            1,
            3,
            DetectorConfig(interval_s=30.0),  # (no beat reads the verdict before the close)
            ring=None,
            on_failure=exits.append,
        )
        run = Run(str(tmp_path / "ck"), monitor=m)
        host = socket.gethostname()
        finding = Finding(Verdict.DEAD, 2, host, victim.pid, 5, "train", 9.0, 9.0, "x", kill_by=1)
        with pytest.raises(RuntimeError, match="Connection closed"):
            with run:
                store.set("run/0/verdict", json.dumps(finding.to_json()))
                raise RuntimeError("gloo: Connection closed by peer")  # before track
        assert not run._carry and m.closed
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert exits == []
    finally:
        victim.kill()
        victim.wait()


def test_fault_tolerant_refuses_bad_optional_values_before_any_process_group(monkeypatch):
    """optional_values="config.corpus" (one str, taken letter by letter) was let through by the
    decorator and refused only by Run, inside the wrapped call, after the process group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TypeError, match="optional must be value names"):
        fault_tolerant("/tmp/x", optional_values="config.corpus")
    fault_tolerant("/tmp/x", optional_values=("config.corpus",))
    assert not dist.is_initialized()
