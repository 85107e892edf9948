"""What a scenario file may hold: names and ids used as file names, command placeholders, and
numbers (the adversarial review of the chaos harness).  tests/test_chaos.py has the rest."""

import dataclasses

import pytest

from resilient.chaos.scenario import parse_scenario
from resilient.errors import ScenarioError

TRAINER_JOB = """
[job]
nproc = 2
[job.trainer]
steps = 4
save_every = 2
"""


def _text(name: str = "t", job: str = TRAINER_JOB, faults: str = "", expect: str = "") -> str:
    return f'name = "{name}"\n{job}\n{faults}\n[expect]\n{expect}\n'


def _scenario(**kw):
    return parse_scenario(_text(**kw), "s.toml")


@pytest.mark.parametrize("name", [".", "..", "references", "suite.json", "a/b", "../x"])
def test_a_scenario_whose_name_is_not_a_run_directory_of_its_own_is_refused(name):
    with pytest.raises(ScenarioError, match=r"s\.toml:1: name: ") as e:
        _scenario(name=name)
    assert repr(name) in str(e.value)


def test_a_scenario_named_dotdot_is_refused_and_nothing_outside_out_is_deleted(
    tmp_path, monkeypatch
):
    """The runner empties out/<name> first: a scenario that got past the parser with a name
    such as '..' (built in code), or a link at out/<name>, must not have it delete elsewhere."""
    from resilient.chaos import runner

    out = tmp_path / "base" / "out"
    out.mkdir(parents=True)
    keep = tmp_path / "base" / "someone_elses_file.txt"
    keep.write_text("precious")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("precious too")
    (out / "linked").symlink_to(elsewhere)

    def launch(*a, **k):
        raise AssertionError("the run must be refused before anything is launched")

    monkeypatch.setattr(runner, "launch_job", launch)
    good = _scenario(expect='final_state = "any"')
    for name in ("..", ".", "references", "linked"):
        s = dataclasses.replace(good, name=name)
        with pytest.raises(ScenarioError, match="not a directory of its own inside the output"):
            runner.run_scenario(s, out, say=lambda *_: None)
    assert keep.read_text() == "precious" and (elsewhere / "data").exists()
    assert (out / "linked").is_symlink()


@pytest.mark.parametrize("fid", ["../../escaped", ".", "..", "a/b", ""])
@pytest.mark.parametrize(
    "fault",
    [
        'kind = "raise"\nrank = 0\nstep = 2',
        'kind = "skew"\nrank = 0\nseconds = 5.0',
        'kind = "storage"\nerror = "transient"',
    ],
)
def test_a_fault_id_that_is_not_a_plain_file_name_is_refused(fid, fault):
    """A fault's id names its marker file (faults/<id>.fired): '../../x' would claim a file
    outside the run directory."""
    with pytest.raises(ScenarioError, match=r"s\.toml:\d+: faults\[0\]\.id: .* file name"):
        _scenario(faults=f'[[faults]]\nid = "{fid}"\n{fault}\n')


def test_the_hook_claims_no_marker_outside_its_directory(tmp_path):
    """A plan written by hand (a command job) with such an id: the hook refuses, by name."""
    from resilient.chaos.faults import ChaosError, ChaosHook
    from resilient.health.events import EventLog

    run = tmp_path / "out" / "run"
    fault = {"id": "../../escaped", "kind": "raise", "rank": 0, "step": 2}
    hook = ChaosHook({"marker_dir": str(run / "faults"), "faults": [fault]}, 0, EventLog(None))
    with pytest.raises(ChaosError, match=r"fault id '\.\./\.\./escaped' is not a plain file"):
        hook.at_step(2, None)
    assert not list(tmp_path.rglob("*.fired"))


@pytest.mark.parametrize(
    "word,found",
    [
        ("print({1: 2})", "{1: 2} is not a placeholder"),
        ("{unknown}", "{unknown} is not a placeholder"),
        ("{0}", "{0} is not a placeholder"),
        ("{ckpt.x}", "{ckpt.x} is not a placeholder"),
        ("{ckpt!r}", "{ckpt!r} is not a placeholder"),
        ("{", "Single '{'"),
        ("a}", "Single '}'"),
    ],
)
def test_a_command_word_the_harness_cannot_substitute_is_refused_by_name(word, found):
    """Command words go through str.format: a literal brace or an unknown placeholder crashed
    the harness with a raw KeyError / IndexError / ValueError when the job was launched."""
    job = f'[job]\nnproc = 1\ncommand = ["python", "-c", "{word}", "{{ckpt}}"]\n'
    with pytest.raises(ScenarioError) as e:
        _scenario(job=job)
    msg = str(e.value)
    assert msg.startswith("s.toml:4: job.command: ") and repr(word) in msg and found in msg
    assert "{ckpt}, {metrics}, {events}, {run_dir}, {chaos}" in msg and "'{{' or '}}'" in msg


def test_every_placeholder_and_an_escaped_brace_reach_the_command(tmp_path):
    from resilient.chaos import harness

    words = ["-c", "print({{1: 2}})", "{ckpt}", "{metrics}", "{events}", "{run_dir}", "{chaos}"]
    quoted = ", ".join(f'"{w}"' for w in words)
    s = _scenario(
        job=f"[job]\nnproc = 1\ncommand = [{quoted}]\n",
        faults='[[faults]]\nkind = "raise"\nrank = 0\nstep = 1\n',
    )
    paths = harness.RunPaths(tmp_path / "run")
    cmd = harness._command(s.job, paths, 29500, "x", [], 0, True)
    assert cmd[-7:] == [
        "-c",
        "print({1: 2})",
        str(paths.ckpt),
        str(paths.metrics),
        str(paths.events),
        str(paths.root),
        str(paths.plan(0)),
    ]
    # an escaped '{{chaos}}' is a literal, not the plan: the in-rank fault has no hook
    with pytest.raises(ScenarioError, match="need the job to install the chaos hook"):
        _scenario(
            job='[job]\nnproc = 1\ncommand = ["x.py", "{{chaos}}"]\n',
            faults='[[faults]]\nkind = "raise"\nrank = 0\nstep = 1\n',
        )


def _trainer(extra: str) -> str:
    return TRAINER_JOB.replace("save_every = 2", f"save_every = 2\n{extra}")


# (faults, job, expect) -> the message: TOML has nan and inf, and every field had no lower bound
BAD_NUMBERS = {
    "negative at_s": (
        '[[faults]]\nkind = "kill"\nrank = 0\nat_s = -5.0\n',
        TRAINER_JOB,
        "",
        "faults[0].at_s: -5.0: must be >= 0",
    ),
    "nan at_s": (
        '[[faults]]\nkind = "kill"\nrank = 0\nat_s = nan\n',
        TRAINER_JOB,
        "",
        "faults[0].at_s: expected a finite number, found nan",
    ),
    "nan pause seconds": (
        '[[faults]]\nkind = "pause"\nrank = 0\nstep = 2\nseconds = nan\n',
        TRAINER_JOB,
        "",
        "faults[0].seconds: expected a finite number, found nan",
    ),
    "inf skew seconds": (
        '[[faults]]\nkind = "skew"\nrank = 0\nseconds = inf\n',
        TRAINER_JOB,
        "",
        "faults[0].seconds: expected a finite number, found inf",
    ),
    "nan slow factor": (
        '[[faults]]\nkind = "slow"\nrank = 0\nstep = 2\nfactor = nan\n',
        TRAINER_JOB,
        "",
        "faults[0].factor: expected a finite number, found nan",
    ),
    "negative slow seconds": (
        '[[faults]]\nkind = "slow"\nrank = 0\nstep = 2\nfactor = 2.0\nmode = "throttle"\n'
        "seconds = -1.0\n",
        TRAINER_JOB,
        "",
        "faults[0].seconds: -1.0: a slow fault's duration, >= 0",
    ),
    "negative storage latency": (
        '[[faults]]\nkind = "storage"\nlatency_s = -1.0\n',
        TRAINER_JOB,
        "",
        "faults[0].latency_s: -1.0: must be >= 0",
    ),
    "negative storage count": (
        '[[faults]]\nkind = "storage"\nerror = "transient"\ncount = -1\n',
        TRAINER_JOB,
        "",
        "faults[0].count: -1: must be >= 0",
    ),
    "negative storage skip": (
        '[[faults]]\nkind = "storage"\nerror = "transient"\nskip = -1\n',
        TRAINER_JOB,
        "",
        "faults[0].skip: -1: must be >= 0",
    ),
    "nan timeout_s": (
        "",
        TRAINER_JOB.replace("nproc = 2", "nproc = 2\ntimeout_s = nan"),
        "",
        "job.timeout_s: expected a finite number, found nan",
    ),
    "too many ranks": (
        "",
        TRAINER_JOB.replace("nproc = 2", "nproc = 100000"),
        "",
        "job.nproc: 100000: expected at most 4096 ranks per node",
    ),
    "negative max_restarts": (
        "",
        TRAINER_JOB.replace("nproc = 2", "nproc = 2\nmax_restarts = -1"),
        "",
        "job.max_restarts: -1: must be >= 0",
    ),
    "negative tp and ep": (
        "",
        _trainer("tp = -1\nep = -1"),
        "",
        "job.trainer.tp: -1: must be >= 1",
    ),
    "zero dp": ("", _trainer("dp = 0"), "", "job.trainer.dp: 0: must be >= 1"),
    "negative save_every": (
        "",
        TRAINER_JOB.replace("save_every = 2", "save_every = -2"),
        "",
        "job.trainer.save_every: -2: must be >= 0",
    ),
    "zero storage latency alone": (
        '[[faults]]\nkind = "storage"\nlatency_s = 0.0\n',
        TRAINER_JOB,
        "",
        "faults[0].error: a storage fault needs error (transient, timeout, permanent, enospc) or "
        "latency_s > 0",
    ),
    "zero global_batch": ("", _trainer("global_batch = 0"), "", "global_batch: 0: must be >= 1"),
    "zero keep_last": ("", _trainer("keep_last = 0"), "", "job.trainer.keep_last: 0: must be >= 1"),
    "negative micro_batch": ("", _trainer("micro_batch = -1"), "", "micro_batch: -1: must be >= 0"),
    "negative memory_every": ("", _trainer("memory_every = -1"), "", "memory_every: -1: must be"),
    "zero max_failed_saves": (
        "",
        _trainer("max_failed_saves = 0"),
        "",
        "max_failed_saves: 0: must",
    ),
    "negative lr": ("", _trainer("lr = -0.1"), "", "job.trainer.lr: -0.1: must be >= 0"),
    "nan lr": ("", _trainer("lr = nan"), "", "job.trainer.lr: expected a finite number, found nan"),
    "zero hang_timeout_s": ("", _trainer("hang_timeout_s = 0.0"), "", "hang_timeout_s: 0.0: must"),
    "negative max_steps_lost": (
        "",
        TRAINER_JOB,
        "max_steps_lost = -1",
        "expect.max_steps_lost: -1: must be >= 0",
    ),
    "negative restarts": ("", TRAINER_JOB, "restarts = -1", "expect.restarts: -1: must be >= 0"),
    "negative failed_saves": ("", TRAINER_JOB, "failed_saves = -1", "expect.failed_saves: -1"),
    "hang_rank outside the world": (
        "",
        TRAINER_JOB,
        "hang_rank = 2",
        "expect.hang_rank: 2 is not a rank of this 2-rank job (0..1)",
    ),
    "inf detect_within_s": (
        "",
        TRAINER_JOB,
        "detect_within_s = inf",
        "expect.detect_within_s: expected a finite number, found inf",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_NUMBERS))
def test_a_number_a_scenario_may_not_hold_is_refused_with_its_line(case):
    faults, job, expect, message = BAD_NUMBERS[case]
    text = _text(job=job, faults=faults, expect=expect)
    with pytest.raises(ScenarioError) as e:
        parse_scenario(text, "s.toml")
    field = message.split(":")[0].split(".")[-1].split("[")[0]
    lines = text.splitlines()
    # the line that sets the field, else (a field that is missing) its table's header
    line = next((n for n, x in enumerate(lines, 1) if x.startswith(field + " =")), None)
    line = line or lines.index("[[faults]]") + 1
    assert f"s.toml:{line}: " in str(e.value) and message in str(e.value)


def test_the_least_values_the_reference_trainer_takes_still_parse():
    s = _scenario(
        job=_trainer(
            "micro_batch = 0\nmemory_every = 0\nmemory_commit_every = 0\nwarmup_steps = 0\n"
            "max_failed_saves = 1\nkeep_last = 1\nseed = -3\nlr = 1e-6"
        ).replace("save_every = 2", "save_every = 0"),
        faults='[[faults]]\nkind = "kill"\nrank = 0\nat_s = 0\n'
        '[[faults]]\nkind = "storage"\nerror = "transient"\nlatency_s = 0.0\ncount = 0\n'
        "skip = 0\n",
        expect="max_steps_lost = 0\nrestarts = 0\nfailed_saves = 0\nhang_rank = 1",
    )
    assert s.job.trainer["seed"] == -3 and s.faults[0].at_s == 0.0 and s.expect.hang_rank == 1


def test_a_negative_storage_latency_no_longer_reaches_the_faulty_filesystem(tmp_path):
    """What latency_s = -1 did once accepted: the faulty filesystem's first call raised a raw
    ValueError (time.sleep(-1)) inside a rank."""
    from resilient.chaos import harness
    from resilient.chaos.faultfs import FaultyFileSystem

    with pytest.raises(ScenarioError, match=r"faults\[0\]\.latency_s: -1\.0: must be >= 0"):
        _scenario(faults='[[faults]]\nkind = "storage"\nlatency_s = -1.0\n')
    s = _scenario(faults='[[faults]]\nkind = "storage"\nlatency_s = 0.001\n')
    fs = FaultyFileSystem(faults=[harness._storage_rule(f) for f in s.storage_faults])
    assert fs.exists(str(tmp_path))


# --- fields that another kind reads, or that the rest of the scenario makes meaningless -------

JOB_30 = TRAINER_JOB.replace("steps = 4\nsave_every = 2", "steps = 30\nsave_every = 5")


@pytest.mark.parametrize(
    "fault, field, kind",
    [
        ('kind = "storage"\nerror = "transient"\nstep = 12', "step", "storage"),
        ('kind = "storage"\nerror = "permanent"\nat_s = 8.0', "at_s", "storage"),
        ('kind = "storage"\nerror = "permanent"\nrank = 1', "rank", "storage"),
        ('kind = "kill"\nrank = 1\nstep = 12\nerror = "enospc"', "error", "kill"),
        ('kind = "kill"\nrank = 1\nstep = 12\nprobability = 0.1', "probability", "kill"),
        ('kind = "kill"\nrank = 1\nstep = 12\ncount = 3', "count", "kill"),
        ('kind = "kill"\nrank = 1\nstep = 12\nseconds = 9.0', "seconds", "kill"),
        ('kind = "kill"\nrank = 1\nstep = 12\nfactor = 3.0', "factor", "kill"),
        ('kind = "kill_job"\nstep = 12\nseconds = 2.0', "seconds", "kill_job"),
    ],
)
def test_a_fault_field_its_kind_does_not_read_is_refused_naming_field_and_kind(fault, field, kind):
    """A storage fault with step = 12 fired from the start; a kill fault with probability = 0.1
    killed every time: the parser accepted fields that the fault's kind never reads."""
    with pytest.raises(ScenarioError) as e:
        _scenario(job=JOB_30, faults=f"[[faults]]\n{fault}\n")
    assert f"faults[0].{field}: a {kind} fault has no {field}; its fields are " in str(e.value)


def test_when_save_at_a_step_without_a_save_is_refused():
    """The hook fires at the first save at or after the step: step 12 with save_every 5 fired
    during step 15's save, silently."""
    with pytest.raises(ScenarioError) as e:
        _scenario(
            job=JOB_30, faults='[[faults]]\nkind = "kill"\nrank = 1\nstep = 12\nwhen = "save"\n'
        )
    assert (
        "faults[0].step: 12 is not a save step of this job (save_every 5, steps 30: saves at "
        "5, 10, 15, 20, 25, 30); use one of them, e.g. [10, 15]"
    ) in str(e.value)
    for step in (10, 30):  # a save step, and the final step's save
        _scenario(
            job=JOB_30,
            faults=f'[[faults]]\nkind = "stop"\nrank = 1\nstep = {step}\nwhen = "save"\n',
        )
    # a harness-side fault never sees a save
    two = JOB_30.replace("nproc = 2", "nproc = 1\nnodes = 2")
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.when: 'save': a kill_node fault fires"):
        _scenario(
            job=two, faults='[[faults]]\nkind = "kill_node"\nnode = 1\nstep = 10\nwhen = "save"\n'
        )


@pytest.mark.parametrize(
    "expect, message",
    [
        ('final_state = "exact"\nrtol = 0.5', "expect.rtol: a tolerance of final_state 'close'"),
        ('final_state = "any"\natol = 0.5', "expect.atol: a tolerance of final_state 'close'"),
        ("moment_rtol = 0.5", "expect.moment_rtol: a tolerance of final_state 'close'"),
        ('error_contains = "Boom"', "expect.error_contains: the error a failing job must log"),
        ('final_state = "any"\nloss_rtol = 100.0', "expect.loss_rtol: final_state 'any' runs no"),
    ],
)
def test_expectations_that_contradict_each_other_are_refused(expect, message):
    with pytest.raises(ScenarioError) as e:
        _scenario(expect=expect)
    assert message in str(e.value)
    # and what they belong with is accepted
    _scenario(expect='final_state = "close"\nrtol = 0.5\natol = 0.1\nmoment_rtol = 0.5')
    _scenario(expect='completed = false\nerror_contains = "Boom"\nfinal_state = "any"')
