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
