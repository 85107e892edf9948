"""The chaos verifier and the harness's reading of a run's files, on files written by hand: what
a kill leaves (a cut line), a NaN loss, a damaging fault that damaged nothing, a dtype changed
(the adversarial review of the chaos harness).  tests/test_chaos.py has the rest."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.chaos import verify
from resilient.chaos.faults import ChaosHook
from resilient.chaos.harness import Launch, RunPaths
from resilient.chaos.jsonl import read_jsonl, records_of_line
from resilient.chaos.scenario import Expect, parse_scenario
from resilient.chaos.verify import Check, lineage, verify_run
from resilient.health.events import EventLog

TRAINER_JOB = """
[job]
nproc = 2
[job.trainer]
steps = 4
save_every = 2
"""


def _scenario(job: str = TRAINER_JOB, faults: str = "", expect: str = ""):
    return parse_scenario(f'name = "t"\n{job}\n{faults}\n[expect]\n{expect}\n', "t.toml")


def test_an_exact_final_state_differs_when_a_tensor_s_dtype_does(tmp_path):
    """torch.equal ignores the dtype: a float64 weight against the reference's float32, or a
    float step counter against an int64 one, was called bit-identical."""
    from resilient import Checkpointer

    ref = {"model": {"w": torch.tensor([1.0, 2.0])}, "optim": {"step": torch.tensor([3])}}
    Checkpointer(str(tmp_path / "ref" / "ckpt")).save(4, ref).wait()
    exact = Expect(final_state="exact")

    def compare(name, state):
        Checkpointer(str(tmp_path / name / "ckpt")).save(4, state).wait()
        return verify._compare_final(
            RunPaths(tmp_path / name), RunPaths(tmp_path / "ref"), 4, exact
        )

    same = compare("same", ref)
    assert same.ok, same.detail
    double = compare("double", {**ref, "model": {"w": ref["model"]["w"].double()}})
    assert double.ok is False
    assert "model.w is torch.float64 (2,), the reference's torch.float32 (2,)" in double.detail
    counter = compare("counter", {**ref, "optim": {"step": torch.tensor([3.0])}})
    assert counter.ok is False and "optim.step is torch.float32" in counter.detail
    shape = compare("shape", {**ref, "optim": {"step": torch.tensor([[3]])}})
    assert shape.ok is False and "(1, 1), the reference's torch.int64 (1,)" in shape.detail


def _write_run(root: Path, losses: list[float], first_step: int = 1) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, first_step):
            r = {"step": i, "loss": loss, "wall_time": 100.0 + i, "samples": [(i - 1) * 8, 8]}
            f.write(json.dumps(r) + "\n")


def _launch(root: Path) -> Launch:
    return Launch(run_dir=str(root), command=[], started=0.0, ended=1.0, exit_codes=[0])


def _loss_check(tmp_path, monkeypatch, run_losses, ref_losses, name):
    monkeypatch.setattr(
        verify,
        "_compare_final",
        lambda *a, **k: Check("final state matches the reference", True, ""),
    )
    ref, run = tmp_path / name / "ref", tmp_path / name / "run"
    _write_run(ref, ref_losses)
    _write_run(run, run_losses)
    out = verify_run(_scenario(), run, _launch(run), ref)
    return next(c for c in out.checks if c.name == "loss curve matches the reference")


def test_a_nan_loss_the_reference_does_not_have_fails_the_loss_curve(tmp_path, monkeypatch):
    """A NaN loss in the faulty run: its difference is NaN, 'nan > worst' is False, and the
    loss curve check said the run matched the reference."""
    nan, inf = float("nan"), float("inf")
    ref = [5.0, 4.0, 3.0, 2.0]
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, nan, 2.0], ref, "nan")
    assert bad.ok is False and "step 3: loss nan, the reference's 3.0" in bad.detail
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, 3.0, 2.0], [5.0, inf, 3.0, 2.0], "ref")
    assert bad.ok is False and "step 2: loss 4.0, the reference's inf" in bad.detail
    bad = _loss_check(tmp_path, monkeypatch, [5.0, -inf, 3.0, 2.0], [5.0, inf, 3.0, 2.0], "signs")
    assert bad.ok is False
    # the same non-finite loss on both sides (a reference that diverged too) matches
    same = _loss_check(tmp_path, monkeypatch, [5.0, nan, inf, 2.0], [5.0, nan, inf, 2.0], "same")
    assert same.ok is True, same.detail


def test_a_run_step_the_reference_never_ran_fails_the_loss_curve(tmp_path, monkeypatch):
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0], "extra")
    assert bad.ok is False and "steps [4, 5] have no reference step (it ran 1..3)" in bad.detail


class _Checkpointer:
    """What the damaging faults use of a run's checkpointer: nothing committed until told."""

    def __init__(self, url: str) -> None:
        from resilient import Checkpointer

        self.real, self.committed, self.snapshots = Checkpointer(url), False, None
        self.storage = self.real.storage

    def wait(self) -> None:
        self.real.wait()

    def latest_step(self):
        return self.real.latest_step() if self.committed else None

    def manifest(self, step):
        return self.real.manifest(step)


def test_a_corrupt_fault_before_any_commit_stays_armed_and_counts_only_once_it_damaged(
    tmp_path, monkeypatch
):
    """A corrupt fault triggered before anything was committed wrote its 'fault' event, then
    raised ChaosError without damaging anything, and the verifier's "faults fired" counted it.
    Now it claims nothing and records nothing until a commit exists, then damages the newest
    step: the 'fault' event comes with a 'fault_detail' saying what was damaged."""
    from resilient.chaos.faults import ChaosHook
    from resilient.health.events import EventLog

    monkeypatch.setattr(
        verify,
        "_compare_final",
        lambda *a, **k: Check("final state matches the reference", True, ""),
    )
    s = _scenario(faults='[[faults]]\nid = "rot"\nkind = "corrupt"\nstep = 1\n')
    run = tmp_path / "run"
    _write_run(run, [5.0, 4.0, 3.0, 2.0])
    plan = {
        "marker_dir": str(run / "faults"),
        "events": str(run / "events.jsonl"),
        "faults": [f.to_json() for f in s.faults],
    }

    class Run:
        checkpointer = _Checkpointer(str(run / "ckpt"))

    Run.checkpointer.real.save(2, {"model": {"w": torch.arange(4096.0)}}).wait()
    hook = ChaosHook(plan, 0, EventLog(plan["events"]))
    hook.at_step(1, Run())  # nothing committed yet: armed, not fired
    hook.during_save(1, Run())
    events = verify.read_jsonl(run / "events.jsonl")
    assert events == [] and not (run / "faults" / "rot.fired").exists()
    fired = next(
        c for c in verify_run(s, run, _launch(run), None).checks if c.name == "faults fired"
    )
    assert fired.ok is False and "never fired: ['rot']" in fired.detail

    ChaosHook(plan, 0, EventLog(plan["events"])).at_step(2, Run())  # the next attempt, say
    Run.checkpointer.committed = True
    hook.at_step(3, Run())  # step 2 is committed now: damaged
    hook.at_step(4, Run())  # once
    events = verify.read_jsonl(run / "events.jsonl")
    assert [(e["event"], e["id"], e.get("step")) for e in events] == [
        ("fault", "rot", 3),
        ("fault_detail", "rot", 2),
    ]
    fired = next(
        c for c in verify_run(s, run, _launch(run), None).checks if c.name == "faults fired"
    )
    assert fired.ok is True, fired.detail


def test_a_recorded_corrupt_fault_without_its_damage_is_not_counted_as_fired(tmp_path, monkeypatch):
    """The verifier's side, for a run an older hook recorded: a 'fault' event alone."""
    monkeypatch.setattr(
        verify,
        "_compare_final",
        lambda *a, **k: Check("final state matches the reference", True, ""),
    )
    s = _scenario(faults='[[faults]]\nid = "rot"\nkind = "truncate"\nstep = 1\n')
    run = tmp_path / "run"
    _write_run(run, [5.0, 4.0, 3.0, 2.0])
    (run / "events.jsonl").write_text(
        json.dumps({"event": "fault", "id": "rot", "kind": "truncate", "step": 1, "time": 1.0})
        + "\n"
    )
    fired = next(
        c for c in verify_run(s, run, _launch(run), None).checks if c.name == "faults fired"
    )
    assert fired.ok is False
    assert "never fired: ['rot'] (['rot']: recorded, but no fault_detail" in fired.detail


def _rec(i: int) -> str:
    return json.dumps({"step": i, "loss": 1.0, "wall_time": 100.0 + i, "samples": [(i - 1) * 8, 8]})


def test_a_line_a_kill_cut_gives_up_the_record_the_restart_appended_to_it():
    from resilient.chaos.jsonl import records_of_line

    nested = json.dumps({"step": 5, "layout": {"dp": 2, "tp": 1}, "loss": 1.0})
    assert records_of_line(_rec(7)[:10] + nested) == [json.loads(nested)]  # not its inner {"dp"
    assert records_of_line(_rec(4) + _rec(5)) == [json.loads(_rec(4)), json.loads(_rec(5))]
    assert records_of_line('{"step": 3, "lo') == []
    assert records_of_line("  ") == [] and records_of_line("[1, 2]") == []


def test_the_harness_tails_metrics_past_a_line_a_kill_cut(tmp_path):
    """The supervisor's _MetricsTail json.loads'ed every line: a cut record followed by the
    restart's next one raised a raw JSONDecodeError out of the harness, killing the job."""
    from resilient.chaos.harness import _MetricsTail

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # killed mid-record
    tail = _MetricsTail(p)
    assert tail.last_step() == 2
    with open(p, "a") as f:
        f.write('{"step": 3, "loss": 1.0}\n{"no_step": 1}\nnot json\n')  # the restart appends
    assert tail.last_step() == 3
    with open(p, "a") as f:
        f.write('{"step": 4}\n')
    assert tail.last_step() == 4


def test_a_rollback_whose_first_record_shares_the_cut_line_is_still_counted(tmp_path, monkeypatch):
    """The cut line swallowed the replay's first record: lineage saw the rollback one step
    shorter (keeping the pre-crash record of that step), so a rollback that lost more than
    max_steps_lost passed "steps lost within bound"."""
    monkeypatch.setattr(
        verify,
        "_compare_final",
        lambda *a, **k: Check("final state matches the reference", True, ""),
    )
    run = tmp_path / "run"
    run.mkdir()
    # steps 1..6, step 7 cut by the kill, resumed from step 4: 5, 6, 7, 8 replayed
    text = "\n".join(_rec(i) for i in range(1, 7)) + "\n" + _rec(7)[:10] + _rec(5) + "\n"
    text += "\n".join(_rec(i) for i in range(6, 9)) + "\n"
    (run / "metrics.jsonl").write_text(text)
    s = _scenario(
        job=TRAINER_JOB.replace("steps = 4", "steps = 8"),
        expect='max_steps_lost = 1\nfinal_state = "any"',
    )
    out = verify_run(s, run, _launch(run), None)
    lost = next(c for c in out.checks if c.name == "steps lost within bound")
    assert lost.ok is False, f"2 steps (5, 6) were lost, the bound is 1: {lost.detail}"
    assert out.measurements["rollbacks"][0]["lost"] == 2


# --- jsonl: a cut line whose text ends at a nested object's close -----------------------------

# the reference trainer's metrics record (train._train_step): "layout" is a nested object
_RECORD = {
    "step": 7,
    "loss": 2.5,
    "aux_loss": 0.01,
    "lr": 0.001,
    "grad_norm": 1.0,
    "tokens_per_s": 1000.0,
    "wall_time": 1.0,
    "step_s": 0.1,
    "optimizer_s": 0.01,
    "compute_s": 0.05,
    "layout": {"dp": 2, "ep": 1, "tp": 2, "zero": True},
    "data_step": 7,
    "samples": [48, 8],
    "micro_batches": 1,
}


def _cut_after_layout(record: dict[str, Any]) -> str:
    line = json.dumps(record)
    end = line.index("}", line.index('"layout"')) + 1
    return line[:end]  # a kill (or ENOSPC) cut the write right after the nested object


def test_a_record_cut_after_a_nested_object_yields_no_invented_record() -> None:
    cut = _cut_after_layout(_RECORD)
    # the cut record is lost; nothing else was ever written on this line
    assert records_of_line(cut, "step") == [], (
        f"invented a record from the cut line's nested object: {records_of_line(cut, 'step')}"
    )


def test_the_verifiers_lineage_survives_a_metrics_line_cut_after_a_nested_object(
    tmp_path: Path,
) -> None:
    """The trainer starts the next attempt on a fresh line, so a cut record is a line of its
    own: its nested 'layout' was returned as a record and lineage() died on it (KeyError)."""
    path = tmp_path / "metrics.jsonl"
    rec = lambda s: {**_RECORD, "step": s}  # noqa: E731
    text = "".join(json.dumps(rec(s)) + "\n" for s in (1, 2, 3))
    text += _cut_after_layout(rec(4)) + "\n"  # the kill; open_metrics adds the newline
    text += "".join(json.dumps(rec(s)) + "\n" for s in (3, 4, 5))  # the restart replays
    path.write_text(text)
    history, _ = lineage(read_jsonl(path, "step"))
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]


def test_an_event_line_cut_after_its_nested_stacks_yields_no_record(tmp_path: Path) -> None:
    """Same for the event log: a 'stacks' event cut after its nested stacks dict (its last
    field) became {thread: text}, and verify_run's e["event"] raised KeyError on it."""
    line = json.dumps({"event": "stacks", "time": 1.0, "rank": 1, "stacks": {"MainThread": "x"}})
    path = tmp_path / "events.jsonl"
    path.write_text(line[:-1] + "\n")  # cut before the outer '}'
    assert read_jsonl(path, "event") == []


# --- a corrupt/truncate fault keeps waiting on (and listing) the checkpointer every step --------


class _FailedSaveCheckpointer:
    """A checkpointer whose pending asynchronous save failed (a storage fault the Run counts
    under max_failed_saves) and whose catalog listing fails (a storage 'list' fault)."""

    snapshots = None

    def __init__(self) -> None:
        self.waits = 0
        self.lists = 0

    def wait(self) -> None:
        self.waits += 1
        raise OSError("injected: the pending save of step 10 failed")

    def latest_step(self) -> int | None:
        self.lists += 1
        raise OSError("injected: list failed")


class _Run:
    def __init__(self) -> None:
        self.checkpointer = _FailedSaveCheckpointer()


def test_a_fired_corrupt_fault_leaves_later_steps_alone(tmp_path: Path) -> None:
    """Once a corrupt fault has fired (its marker exists), later steps do not touch the
    checkpointer: it joined the pending save and listed the catalog at every step to the end of
    the run (every async save synchronous on that rank; a failed save's error, or a listing
    fault, raised out of the chaos hook into the loop)."""
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "events": str(tmp_path / "events.jsonl"),
        "faults": [{"id": "bit-rot", "kind": "corrupt", "rank": 0, "step": 3, "when": "step"}],
    }
    hook = ChaosHook(plan, 0, EventLog(plan["events"]))
    (tmp_path / "faults" / "bit-rot.fired").touch()  # it fired (this attempt or an earlier one)
    run = _Run()
    try:
        hook.at_step(12, run)
    except OSError as e:
        pytest.fail(f"a fired corrupt fault raised out of the hook at a later step: {e!r}")
    assert run.checkpointer.waits == 0 and run.checkpointer.lists == 0, (
        f"fired fault still joined the save {run.checkpointer.waits}x and listed "
        f"{run.checkpointer.lists}x"
    )


def _history(samples: list[Any]) -> list[dict[str, Any]]:
    return [{"step": i, "loss": 1.0, "samples": s} for i, s in enumerate(samples, 1)]


def test_samples_are_accounted_per_data_replica_as_each_one_served_them() -> None:
    """Rank 0's loader position implied the whole global batch: a replica restored to another
    step than rank 0's went unseen. Each replica's range is checked now."""
    good = _history([[[0, 4], [4, 4]], [[8, 4], [12, 4]], [[16, 4], [20, 4]]])
    ok = verify._samples_once(good, 3)
    assert ok.ok, ok.detail
    assert ok.detail == "samples 0..23 each once over 3 steps"
    # replica 1 resumed one step behind replica 0: its step-2 samples read again, step 3's never
    behind = _history([[[0, 4], [4, 4]], [[8, 4], [12, 4]], [[16, 4], [12, 4]]])
    bad = verify._samples_once(behind, 3)
    assert bad.ok is False
    assert "repeated [((12, 16), (12, 16))]" in bad.detail and "skipped [(20, 24)]" in bad.detail
    # the one-pair form (one replica, or a job that records the global batch) still reads
    assert verify._samples_once(_history([[0, 8], [8, 8]]), 2).ok


@pytest.mark.parametrize("samples", [[1], "0,8", [[0, 4], [4]], [[0, -4]], [], [[0, True]], None])
def test_a_malformed_samples_record_fails_the_check_naming_the_step(samples: Any) -> None:
    out = verify._samples_once(_history([[0, 8], samples]), 2)
    assert out.ok is False
    assert f"step 2 records samples {samples!r}: expected [first id, count]" in out.detail


# --- the second review: wrong runs the verifier called PASSED ---------------------------------


def _save(root: Path, steps: tuple[int, ...], extras: dict[str, Any] | None = None) -> None:
    """A real checkpoint of a tiny state at each step (extras: its non-tensor values)."""
    from resilient import Checkpointer

    with Checkpointer(str(root / "ckpt")) as ck:
        for step in steps:
            state = {"model": {"w": torch.arange(4.0)}, "optim": {"m": torch.ones(4)}}
            ck.save(step, {**state, **(extras or {})}).wait()


def _check(outcome, name: str) -> Check:
    return next(c for c in outcome.checks if c.name == name)


def test_samples_missing_after_the_last_range_fail_the_check() -> None:
    """The total was counted from the ranges seen, so ids never served after the last range
    (a replica that served nothing at the last step, or never recorded) went unnoticed."""
    for last in ([[4, 2], [6, 0]], [[4, 2]]):
        out = verify._samples_once(_history([[[0, 2], [2, 2]], last]), 2, even=True)
        assert out.ok is False, last
        assert "skipped [(6, 8)]" in out.detail
        assert "steps served other than the global batch of 4: step 2: 2" in out.detail
    # the scenario's global batch says how many each step serves, even if every step fell short
    out = verify._samples_once(_history([[0, 2], [2, 2]]), 2, global_batch=4, even=True)
    assert out.ok is False and "4 samples in 2 steps (expected 8)" in out.detail
    # and a step that served other ids than the reference's step fails, however they tile
    ref = _history([[[0, 2], [2, 2]], [[4, 2], [6, 2]]])
    swapped = _history([[[4, 4]], [[0, 4]]])
    out = verify._samples_once(swapped, 2, reference=ref, even=True)
    assert out.ok is False
    assert (
        "steps [1, 2] served other samples than the reference's, e.g. step 1: [(4, 8)], "
        "the reference's [(0, 4)]"
    ) in out.detail
    # the same ids split otherwise (a run in another layout) match
    other_split = _history([[[0, 4]], [[4, 1], [5, 3]]])
    assert verify._samples_once(other_split, 2, reference=ref, even=True).ok


def test_steps_that_record_no_samples_fail_the_check_the_scenario_asks_for(tmp_path) -> None:
    """Only history[0] was looked at, and a job that recorded no samples made the check n/a."""
    out = verify._samples_once([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}], 2)
    assert out.ok is False
    assert "steps [1, 2] (of 2) record no samples: the scenario expects every sample" in out.detail
    partly = _history([[0, 8]]) + [{"step": 2, "loss": 1.0}]
    assert verify._samples_once(partly, 2).ok is False
    assert verify._samples_once([], 2).ok is False


def test_a_damaged_manifest_of_a_committed_step_fails_checkpoints_verify(tmp_path) -> None:
    """ck.steps() hides a step whose MANIFEST.json was torn after its commit: the check saw
    the other steps verify and passed."""
    run = tmp_path / "run"
    _save(run, (1, 2))
    manifest = run / "ckpt" / "step_00000001" / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    out = verify._verify_checkpoints(RunPaths(run), [])
    assert out.ok is False
    assert "steps [2] verify; steps [1] fail; unexpected: [1] (step 1: " in out.detail
    # the scenario's own durable damage of that step is excused; a memory snapshot's is not
    damage = {"event": "fault_detail", "id": "rot", "step": 1, "file": "MANIFEST.json"}
    assert verify._verify_checkpoints(RunPaths(run), [{**damage, "tier": "durable"}]).ok
    assert verify._verify_checkpoints(RunPaths(run), [{**damage, "tier": "memory"}]).ok is False
    # nothing left that verifies: a failure, not "does not apply", for a run that is to
    # complete; a scenario that damages every step it saves, to make the job fail, passes
    manifest = run / "ckpt" / "step_00000002" / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    every = [{**damage, "tier": "durable", "step": s} for s in (1, 2)]
    out = verify._verify_checkpoints(RunPaths(run), every)
    assert out.ok is False and "no step verifies" in out.detail
    out = verify._verify_checkpoints(RunPaths(run), every, completed=False)
    assert out.ok and "steps [1, 2] fail (damaged by the scenario itself)" in out.detail
    assert verify._verify_checkpoints(RunPaths(run), every[:1], completed=False).ok is False


def test_the_final_state_compares_the_non_tensor_values_too(tmp_path) -> None:
    """Only model.* and optim.* tensors were compared: a final checkpoint whose loader position
    and token counter were wrong was called bit-identical."""
    good = {"data": {"next_step": 5}, "train": {"tokens": 2048}, "rng": {"python": "a"}}
    _save(tmp_path / "ref", (4,), good)
    exact = Expect(final_state="exact")

    def compare(name: str, extras: dict[str, Any]) -> Check:
        _save(tmp_path / name, (4,), extras)
        return verify._compare_final(
            RunPaths(tmp_path / name), RunPaths(tmp_path / "ref"), 4, exact
        )

    # the processes' own RNG states differ between honest runs, and so does the memory tier's
    # run counter after a restart: not compared
    same = compare("same", {**good, "rng": {"python": "b"}, "_resilient_memory_run": 2})
    assert same.ok, same.detail
    # nor the commit each descends from (a run with a save more, after a restart, than its
    # reference: its step 4 records step 3 as its parent, the reference's none)
    _save(tmp_path / "more", (3, 4), good)
    more = verify._compare_final(RunPaths(tmp_path / "more"), RunPaths(tmp_path / "ref"), 4, exact)
    assert more.ok, more.detail
    bad = compare("bad", {**good, "data": {"next_step": 1}, "train": {"tokens": 999}})
    assert bad.ok is False
    assert "step 4: tensors match, but 2 non-tensor values differ" in bad.detail
    assert "data.next_step: 1, the reference's 5; train.tokens: 999, the reference's 2048" in (
        bad.detail
    )
    gone = compare("gone", {"data": {"next_step": 5}, "rng": {"python": "a"}})
    assert gone.ok is False and "train.tokens: '(absent)', the reference's 2048" in gone.detail


def test_a_command_job_compares_final_states_of_the_same_step_only(tmp_path) -> None:
    """A command job (no steps) compared each run's newest step, whatever they were: a run that
    stopped at step 2 matched a reference at step 4 whose state happened to be the same."""
    _save(tmp_path / "ref", (2, 4))
    _save(tmp_path / "run", (2,))
    out = verify._compare_final(
        RunPaths(tmp_path / "run"), RunPaths(tmp_path / "ref"), None, Expect(final_state="exact")
    )
    assert out.ok is False
    assert "the run's newest committed step is 2, the reference's 4" in out.detail
    _save(tmp_path / "run", (4,))
    same = verify._compare_final(
        RunPaths(tmp_path / "run"), RunPaths(tmp_path / "ref"), None, Expect(final_state="exact")
    )
    assert same.ok, same.detail


def test_an_exact_final_state_without_a_reference_fails(tmp_path) -> None:
    """With no reference recorded, final_state = "exact" was 'not compared' and the run passed."""
    run = tmp_path / "run"
    _write_run(run, [5.0, 4.0, 3.0, 2.0])
    _save(run, (4,))
    out = verify_run(_scenario(), run, _launch(run), None)
    final = _check(out, "final state matches the reference")
    assert final.ok is False and "no fault-free reference run is recorded" in final.detail
    assert not out.passed
    # "any" asks for no reference
    anyway = verify_run(_scenario(expect='final_state = "any"'), run, _launch(run), None)
    assert _check(anyway, "final state matches the reference").ok is None


def test_a_reference_without_step_records_fails_the_loss_curve(tmp_path) -> None:
    """The loss curve check vanished when the reference had no metrics: a run whose loss was 9x
    the reference's passed."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    _save(ref, (4,))
    _save(run, (4,))
    _write_run(run, [9.0, 9.0, 9.0, 9.0])
    out = verify_run(_scenario(), run, _launch(run), ref)
    loss = _check(out, "loss curve matches the reference")
    assert loss.ok is False
    assert f"the reference run {ref} recorded no step ({ref / 'metrics.jsonl'} is missing" in (
        loss.detail
    )
    # a run without records against a reference with them fails too
    _write_run(ref, [5.0, 4.0, 3.0, 2.0])
    (run / "metrics.jsonl").unlink()
    loss = _check(
        verify_run(_scenario(), run, _launch(run), ref), "loss curve matches the reference"
    )
    assert loss.ok is False and "this run recorded no step" in loss.detail


def test_a_reference_whose_files_are_gone_is_not_reused(tmp_path) -> None:
    """run_reference reused any reference whose run.json said it succeeded, even with its
    metrics or checkpoints removed since."""
    from resilient.chaos.harness import reference_complete

    job = _scenario().job  # steps = 4
    ref = tmp_path / "ref"
    _write_run(ref, [5.0, 4.0, 3.0, 2.0])
    _save(ref, (4,))
    assert reference_complete(job, RunPaths(ref))
    _write_run(ref, [5.0, 4.0])  # cut short
    assert not reference_complete(job, RunPaths(ref))
    (ref / "metrics.jsonl").unlink()
    assert not reference_complete(job, RunPaths(ref))
    _write_run(ref, [5.0, 4.0, 3.0, 2.0])
    import shutil

    shutil.rmtree(ref / "ckpt")
    assert not reference_complete(job, RunPaths(ref))


def test_an_unexpected_restart_says_why_the_launcher_did_not_recover_in_the_job():
    from resilient.chaos.verify import _fallback_reason

    log = (
        "rank 3 (pid 9) exited with 1: spare pid 10 takes its rank, generation 1\n"
        "W1205 agent.py:1] in-job recovery not possible (0 spare(s) left for 1 failed worker(s)):"
        " restarting the workers\n"
    )
    assert _fallback_reason(log) == (
        "; the launcher: W1205 agent.py:1] in-job recovery not possible (0 spare(s) left for 1 "
        "failed worker(s)): restarting the workers"
    )
    assert _fallback_reason("rank 3 (pid 9) exited with 1\n") == ""
