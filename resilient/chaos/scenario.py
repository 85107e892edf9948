"""Chaos scenarios: TOML files naming a job, its faults and what must hold afterwards.

```toml
name = "kill-rank"
description = "SIGKILL rank 1 of a 4-rank tp2 x ep2 job at step 12"

[job]
nproc = 4                 # ranks per node
nodes = 1                 # torchrun agents on this machine (c10d rendezvous on localhost)
elastic = false           # --nnodes 1:NODES: continue on the nodes that are left
max_restarts = 2
# spares = 1              # launch with `resilient launch --spares 1` (in-job recovery), not torchrun
timeout_s = 300
[job.trainer]             # reference_trainer flags (or: command = ["python", "x.py", "{ckpt}"])
tp = 2
ep = 2
steps = 40
save_every = 5

[[faults]]
kind = "kill"             # kill stop raise hang pause slow corrupt truncate skew kill_node
                          # replace_node kill_job crash_job storage (replace_node: kill_node, then
                          # a new agent with empty memory takes the node's place; kill_job: SIGKILL
                          # every process of the job, then run
                          # it again; crash_job: SIGKILL the job's agents and workers, not the
                          # memory tier's persister, then run it again on nodes with empty memory)
rank = 1
step = 12                 # trigger: at a step ...
when = "step"             # ... before it ("step") or while its save is written ("save")
# when = "import"         # or a start-up phase, without a step: "import" (before the heartbeat),
                          # "init" (process-group init) or "restore" (loading the checkpoint)
# at_s = 8.0              # or at a time after the job started (kill, stop, kill_node, kill_job,
                          # crash_job)
# tier = "memory"         # corrupt/truncate: damage the newest memory snapshot, not the durable step
# after = "kill-rank-1"   # in-rank faults: arm only once the fault with this id has fired (a
                          # second fault during the first one's recovery: when = "init" fires in
                          # the next process-group init, which in-job recovery's regroup runs)

[expect]
completed = true
final_state = "exact"     # "exact" | "close" (rtol, atol, moment_rtol) | "any"
# rtol = 1e-3             # "close": each weight's difference, in norm, within rtol of its norm
# atol = 1e-5             #   plus atol per element; the optimizer's moments within moment_rtol
# moment_rtol = 1e-2      #   of theirs (they carry a tenth of the last step's gradient); integers,
                          #   step counters and NaN or inf exactly
max_steps_lost = 5        # default: the save interval
verdict = "DEAD"          # DEAD | HUNG | STRAGGLER | "none" (no DEAD/HUNG; stragglers listed); default: any
detect_within_s = 6.0     # fault to verdict (in start-up: beyond the join or start-up timeout)
recover_within_s = 45.0   # fault to the first step completed after the restart (ditto)
# restarts = 0            # exactly this many restarts of the group
# hang_rank = 1           # a HUNG verdict's record (hang_attribution) names this rank as the one
# hang_collective = "all_reduce"   # never entering a collective of this operation that others wait in
# failed_saves = 1        # exactly this many steps whose save failed (and training went on)
```

``job.env`` values may say ``{run_dir}`` (the faulty run's directory).

``job.command`` words may say ``{ckpt}`` (the checkpoint URL), ``{metrics}``, ``{events}``,
``{run_dir}`` and ``{chaos}`` (see ``COMMAND_PLACEHOLDERS``); a literal brace is written ``{{`` or
``}}``, as in ``str.format``, which the harness substitutes them with.

A command job (``job.command``) gets the chaos plan where it says ``{chaos}`` and must install the
hook itself (``resilient.chaos.faults.ChaosHook.from_file``); the reference trainer takes it as
``--chaos PLAN``.

Every problem is a ``ScenarioError`` naming the file, the line and the field.
"""

from __future__ import annotations

import math
import re
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.chaos.faults import IN_RANK_KINDS, PHASE_TRIGGERS
from resilient.errors import ScenarioError
from resilient.launch import MAX_PROCESSES_PER_NODE

__all__ = [
    "Scenario",
    "Job",
    "Fault",
    "Expect",
    "load_scenario",
    "parse_scenario",
    "KINDS",
    "COMMAND_PLACEHOLDERS",
    "command_fields",
]

KINDS = (*IN_RANK_KINDS, "kill_node", "replace_node", "kill_job", "crash_job", "storage")
NODE_KILLS = ("kill_node", "replace_node")  # the harness kills one agent (and its memory)
JOB_KILLS = ("kill_job", "crash_job")  # the harness kills the whole job, then runs it again
STORAGE_ERRORS = ("transient", "timeout", "permanent", "enospc")
STORAGE_OPS = ("read", "write", "list", "exists", "remove", "mkdir", "any")
VERDICTS = ("DEAD", "HUNG", "STRAGGLER", "none")
# what the runner keeps beside the scenarios' run directories in --out (a scenario's name is its
# run directory's name, which the runner empties first)
RESERVED_NAMES = ("references", "suite.json", "suite.md")
TRAINER_FLAGS = {
    "tp": int,
    "ep": int,
    "dp": (int, str),
    "zero": bool,
    "steps": int,
    "save_every": int,
    "memory_every": int,
    "memory_commit_every": int,
    "keep_last": int,
    "preset": str,
    "seed": int,
    "global_batch": int,
    "micro_batch": int,
    "lr": float,
    "warmup_steps": int,
    "heartbeat_interval_s": float,
    "hang_timeout_s": float,
    "join_timeout_s": float,
    "max_failed_saves": int,
    "no_fallback": bool,
    "data": str,
}

# what a command job's words may say, as {name}: the harness substitutes each (harness._command)
COMMAND_PLACEHOLDERS = ("ckpt", "metrics", "events", "run_dir", "chaos")

# the least value of each numeric trainer flag (reference_trainer.config.TrainConfig's checks):
# (bound, strict): x >= bound, or x > bound where strict; seed takes any integer
TRAINER_BOUNDS = {
    "tp": (1, False),
    "ep": (1, False),
    "dp": (1, False),
    "steps": (1, False),
    "global_batch": (1, False),
    "keep_last": (1, False),
    "max_failed_saves": (1, False),  # 1: the first failed save ends the run
    "micro_batch": (0, False),  # 0: the replica's whole share at once
    "save_every": (0, False),  # 0: never
    "memory_every": (0, False),  # 0: no memory tier
    "memory_commit_every": (0, False),  # 0: committed only when needed
    "warmup_steps": (0, False),
    "lr": (0, False),  # 0: frozen weights (a check that a start point loads as it was)
    "heartbeat_interval_s": (0, True),
    "hang_timeout_s": (0, True),
    "join_timeout_s": (0, True),
}

DETECTION_FLAGS = (
    "heartbeat_interval_s",
    "hang_timeout_s",
    "join_timeout_s",
    "max_failed_saves",
    "memory_every",
    "memory_commit_every",
    "save_every",
)


@dataclass(frozen=True)
class Job:
    nproc: int = 4
    nodes: int = 1
    elastic: bool = False
    max_restarts: int = 2
    timeout_s: float = 300.0
    trainer: dict[str, Any] | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    spares: int | None = None  # None: torchrun; K: `resilient launch --spares K` (in-job recovery)

    @property
    def steps(self) -> int | None:
        return None if self.trainer is None else int(self.trainer["steps"])

    @property
    def save_every(self) -> int | None:
        return None if self.trainer is None else int(self.trainer.get("save_every", 0))

    def key(self) -> dict[str, Any]:
        """What makes two jobs the same run (to share a fault-free reference).  Detector and
        save-policy flags change how a fault is handled, never what a fault-free run computes."""
        trainer = (
            None
            if self.trainer is None
            else {k: v for k, v in self.trainer.items() if k not in DETECTION_FLAGS}
        )
        return {
            "nproc": self.nproc,
            "nodes": self.nodes,
            "trainer": trainer,
            "command": self.command,
            "env": self.env,
        }


@dataclass(frozen=True)
class Fault:
    id: str
    kind: str
    rank: int | None = None
    node: int | None = None
    step: int | None = None
    when: str = "step"
    at_s: float | None = None
    seconds: float | None = None
    factor: float | None = None
    mode: str | None = None  # slow: "compute" (default) or "throttle"
    tier: str | None = None  # corrupt/truncate: "durable" (default) or "memory"
    after: str | None = None  # in-rank: armed once the fault with this id has fired
    # storage faults (the faulty:// filesystem in front of the checkpoint URL)
    error: str | None = None
    op: str = "any"
    path: str = ""
    probability: float = 1.0
    count: int | None = None
    skip: int = 0
    latency_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Expect:
    completed: bool = True
    final_state: str = "exact"
    rtol: float = 1e-3
    atol: float = 1e-5
    moment_rtol: float = 1e-2  # "close", the optimizer's state (its tensors of more than one value)
    loss_rtol: float | None = None  # default: 0 when exact, rtol otherwise
    max_steps_lost: int | None = None
    verdict: str | None = None
    detect_within_s: float | None = None
    recover_within_s: float | None = None
    checkpoints_verify: bool = True
    samples_exactly_once: bool = True
    error_contains: str | None = None
    restarts: int | None = None
    failed_saves: int | None = None
    hang_rank: int | None = None  # the rank the hang attribution must name
    hang_collective: str | None = None  # ... as missing from a collective of this operation


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    job: Job
    faults: tuple[Fault, ...]
    expect: Expect
    source: str = ""  # the file it came from
    text: str = ""  # its TOML, kept for the report

    @property
    def storage_faults(self) -> list[Fault]:
        return [f for f in self.faults if f.kind == "storage"]


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read the scenario file ({e.strerror})") from None
    return parse_scenario(text, str(path))


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{source}: not valid TOML: {e}") from None
    v = _Validator(text, source)
    v.keys(raw, {"name", "description", "job", "faults", "expect"}, ())
    name = v.file_name(raw, "name", (), required=True, reserved=RESERVED_NAMES)
    job = _job(v, v.table(raw, "job", required=True))
    faults = tuple(_fault(v, f, i, job) for i, f in enumerate(v.array_of_tables(raw, "faults")))
    in_rank = [f for f in faults if f.kind in IN_RANK_KINDS and f.at_s is None]
    if (
        job.command is not None
        and in_rank
        and not any("chaos" in command_fields(c) for c in job.command)
    ):
        v.fail(
            ("job",),
            "command",
            f"in-rank faults ({', '.join(f.id for f in in_rank)}) need the job to install the "
            f"chaos hook: put {{chaos}} (the plan's path) in the command and pass it to "
            f"resilient.chaos.faults.ChaosHook.from_file",
        )
    ids = [f.id for f in faults]
    for i, fid in enumerate(ids):
        if fid in ids[:i]:
            v.fail(("faults", i), "id", f"{fid!r} is used by another fault; ids must be unique")
    by_id = {f.id: f for f in faults}
    for i, f in enumerate(faults):
        if f.after is None:
            continue
        first = by_id.get(f.after)
        if first is None or first is f:
            v.fail(
                ("faults", i),
                "after",
                f"{f.after!r} is not another fault's id here (ids: {', '.join(ids)})",
            )
        seen, g = {f.id}, first
        while g is not None and g.after is not None:
            if g.after in seen:
                v.fail(("faults", i), "after", f"{f.id!r} waits, through {g.id!r}, for itself")
            seen.add(g.after)
            g = by_id.get(g.after)
        if first.kind not in IN_RANK_KINDS or first.at_s is not None:
            v.fail(
                ("faults", i),
                "after",
                f"{f.after!r} is not an in-rank fault: its firing leaves no marker to wait for",
            )
    expect = _expect(v, v.table(raw, "expect"), job)
    return Scenario(
        name, v.typed(raw, "description", str, (), default=""), job, faults, expect, source, text
    )


def _job(v: _Validator, t: dict[str, Any]) -> Job:
    at = ("job",)
    v.keys(
        t,
        {
            "nproc",
            "nodes",
            "elastic",
            "max_restarts",
            "spares",
            "timeout_s",
            "trainer",
            "command",
            "env",
        },
        at,
    )
    nproc = v.positive(t, "nproc", at, default=4)
    if nproc > MAX_PROCESSES_PER_NODE:
        v.fail(at, "nproc", f"{nproc}: expected at most {MAX_PROCESSES_PER_NODE} ranks per node")
    nodes = v.positive(t, "nodes", at, default=1)
    if nodes > 2:
        v.fail(at, "nodes", f"{nodes}: localhost jobs take 1 or 2 torchrun agents")
    trainer, command = t.get("trainer"), t.get("command")
    if (trainer is None) == (command is None):
        v.fail(at, "trainer", "give exactly one of [job.trainer] (trainer flags) or job.command")
    if trainer is not None:
        trainer = v.table(t, "trainer", at)
        tat = (*at, "trainer")
        v.keys(trainer, set(TRAINER_FLAGS), tat)
        for k, kind in TRAINER_FLAGS.items():
            if k in trainer:
                v.typed(trainer, k, kind, tat)
        v.positive(trainer, "steps", tat, required=True)
        if isinstance(trainer.get("dp"), str) and trainer["dp"] != "auto":
            v.fail(tat, "dp", f"{trainer['dp']!r}: an integer or 'auto'")
        for k, (bound, strict) in TRAINER_BOUNDS.items():
            if not isinstance(trainer.get(k), str):  # (dp = 'auto')
                v.at_least(trainer, k, tat, bound, kind=TRAINER_FLAGS[k], strict=strict)
        world = nproc * nodes
        inner = trainer.get("tp", 1) * trainer.get("ep", 1)
        dp = trainer.get("dp", world // max(inner, 1))
        if dp != "auto" and dp * inner != world:
            v.fail(
                tat,
                "dp",
                f"dp {dp} x ep {trainer.get('ep', 1)} x tp {trainer.get('tp', 1)} = {dp * inner}, "
                f"but the job has {world} ranks (nproc {nproc} x nodes {nodes}); "
                f"use dp = {world // max(inner, 1)} or 'auto'",
            )
        trainer = {"dp": dp, **trainer}
    else:
        command = v.typed(t, "command", list, at)
        if not command or not all(isinstance(c, str) for c in command):
            v.fail(at, "command", "must be a non-empty list of strings")
        for word in command:
            try:
                command_fields(word)
            except ValueError as e:
                v.fail(
                    at,
                    "command",
                    f"{word!r}: {e}; a word may say "
                    f"{', '.join('{' + p + '}' for p in COMMAND_PLACEHOLDERS)}, and a literal "
                    f"brace is written '{{{{' or '}}}}'",
                )
    env = v.typed(t, "env", dict, at, default={})
    if not all(isinstance(x, str) for x in env.values()):
        v.fail(at, "env", "values must be strings")
    spares = t.get("spares")
    if spares is not None:
        v.at_least(t, "spares", at, 0)
    return Job(
        nproc=nproc,
        nodes=nodes,
        elastic=v.typed(t, "elastic", bool, at, default=False),
        max_restarts=v.at_least(t, "max_restarts", at, 0, default=2),
        timeout_s=float(v.positive(t, "timeout_s", at, default=300, kind=(int, float))),
        trainer=trainer,
        command=command,
        env=env,
        spares=spares,
    )


def command_fields(word: str) -> set[str]:
    """The placeholders a command word says (``{ckpt}``: ``{"ckpt"}``); ``ValueError`` where
    ``str.format`` would not substitute it with ``COMMAND_PLACEHOLDERS`` alone (an unknown
    name, a positional, an index or attribute, a format spec, a lone brace)."""
    fields = set()
    for _literal, name, spec, conversion in string.Formatter().parse(word):
        if name is None:
            continue
        if name not in COMMAND_PLACEHOLDERS or spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(f"{{{shown}}} is not a placeholder")
        fields.add(name)
    return fields


def _fault(v: _Validator, t: Any, i: int, job: Job) -> Fault:
    at = ("faults", i)
    if not isinstance(t, dict):
        v.fail(at, "", "each [[faults]] entry must be a table")
    allowed = set(Fault.__dataclass_fields__)
    v.keys(t, allowed, at)
    kind = v.typed(t, "kind", str, at, required=True)
    if kind not in KINDS:
        v.fail(at, "kind", f"{kind!r} is not a fault kind; one of {', '.join(KINDS)}")
    # a field another kind reads would be ignored here, and change what the scenario means
    for k in t:
        if k not in FAULT_FIELDS[kind]:
            v.fail(
                at,
                k,
                f"a {kind} fault has no {k}; its fields are "
                f"{', '.join(sorted(FAULT_FIELDS[kind]))} (remove {k}, or use the kind it "
                f"belongs to)",
            )
    world = job.nproc * job.nodes
    rank = v.typed(t, "rank", int, at, default=None)
    if rank is not None and not 0 <= rank < world:
        v.fail(at, "rank", f"{rank} is not a rank of this {world}-rank job (0..{world - 1})")
    step = v.typed(t, "step", int, at, default=None)
    at_s = v.at_least(t, "at_s", at, 0, kind=(int, float))
    when = v.typed(t, "when", str, at, default="step")
    after = v.typed(t, "after", str, at, default=None)
    if after is not None and (kind not in IN_RANK_KINDS or kind == "skew" or at_s is not None):
        v.fail(
            at,
            "after",
            "only an in-rank fault with a step or phase trigger waits (not skew, not at_s)",
        )
    if when not in ("step", "save", *PHASE_TRIGGERS):
        v.fail(
            at,
            "when",
            f"{when!r}: 'step' (before the step), 'save' (during its save), or a start-up phase: "
            f"{', '.join(repr(p) for p in PHASE_TRIGGERS)}",
        )
    steps = job.steps
    if step is not None and (step < 1 or (steps is not None and step > steps)):
        v.fail(at, "step", f"{step} is outside the job's steps 1..{steps}")
    if when == "save" and (kind not in IN_RANK_KINDS or at_s is not None):
        v.fail(
            at,
            "when",
            f"'save': a {kind} fault "
            + ("with at_s fires at a time" if at_s is not None else "fires from the harness")
            + ", not inside a rank's save; give when = 'step' (or leave it out)",
        )
    if when == "save" and step is not None and steps is not None:
        # the loop's hook runs at durable saves only (not the memory tier's snapshots), and a
        # step without one would fire at the next save instead
        every = job.save_every or 0
        saved = [s for s in range(1, steps + 1) if (every and s % every == 0) or s == steps]
        if step not in saved:
            near = [s for s in saved if s > step][:1] + [s for s in saved if s < step][-1:]
            v.fail(
                at,
                "step",
                f"{step} is not a save step of this job (save_every {every}, steps {steps}: "
                f"saves at {_shown(saved)}); use one of them, e.g. {sorted(near)}",
            )
    if kind == "storage":
        error = v.typed(t, "error", str, at, default=None)
        latency = v.at_least(t, "latency_s", at, 0, kind=(int, float))
        if error is None and not latency:  # (latency_s = 0 alone would do nothing)
            v.fail(
                at,
                "error",
                f"a storage fault needs error ({', '.join(STORAGE_ERRORS)}) or latency_s > 0",
            )
        if error is not None and error not in STORAGE_ERRORS:
            v.fail(at, "error", f"{error!r}: one of {', '.join(STORAGE_ERRORS)}")
        op = v.typed(t, "op", str, at, default="any")
        if op not in STORAGE_OPS:
            v.fail(at, "op", f"{op!r}: one of {', '.join(STORAGE_OPS)}")
        prob = float(v.typed(t, "probability", (int, float), at, default=1.0))
        if not 0 < prob <= 1:
            v.fail(at, "probability", f"{prob}: must be in (0, 1]")
        return Fault(
            id=v.file_name(t, "id", at, default=f"{kind}-{i}"),
            kind=kind,
            error=error,
            op=op,
            path=v.typed(t, "path", str, at, default=""),
            probability=prob,
            count=v.at_least(t, "count", at, 0),
            skip=v.at_least(t, "skip", at, 0, default=0),
            latency_s=None if latency is None else float(latency),
        )
    node = v.typed(t, "node", int, at, default=None)
    seconds = v.typed(t, "seconds", (int, float), at, default=None)
    if kind == "skew":
        for k in ("step", "at_s", "when"):
            if k in t:
                v.fail(at, k, "a skew fault holds from the start of every attempt: no trigger")
        if seconds is None or seconds == 0:
            v.fail(at, "seconds", "a skew fault needs seconds != 0 (negative: the clock is behind)")
        if node is not None and not 0 <= node < job.nodes:
            v.fail(at, "node", f"{node}: which agent's workers, 0..{job.nodes - 1}")
        if (rank is None) == (node is None):
            v.fail(at, "rank", "a skew fault targets one rank = R or one node = N")
        return Fault(
            id=v.file_name(t, "id", at, default=f"{kind}-{i}"),
            kind=kind,
            rank=rank,
            node=node,
            when="import",
            seconds=float(seconds),
        )
    if when in PHASE_TRIGGERS:
        if step is not None or at_s is not None:
            v.fail(at, "when", f"{when!r} is the trigger: give no step or at_s with it")
        if kind not in ("kill", "stop", "raise", "hang", "pause"):
            v.fail(at, "kind", f"a {kind} fault cannot fire in the {when!r} phase")
    elif (step is None) == (at_s is None):
        v.fail(at, "step", f"a {kind} fault needs exactly one trigger: step = N or at_s = SECONDS")
    if at_s is not None and kind not in ("kill", "stop", *NODE_KILLS, *JOB_KILLS):
        v.fail(at, "at_s", f"a {kind} fault fires inside a rank: trigger it with step = N")
    if kind in NODE_KILLS:
        if job.nodes < 2:
            v.fail(at, "kind", f"{kind} needs a job with nodes = 2")
        if node is None or not 0 <= node < job.nodes:
            v.fail(at, "node", f"which agent to kill: 0..{job.nodes - 1}")
        if node == 0:
            v.fail(at, "node", "node 0 hosts the rendezvous store; kill node 1")
    elif kind in JOB_KILLS:
        if rank is not None or node is not None:
            v.fail(at, "rank", f"a {kind} fault kills every process of the job: no rank or node")
    elif kind not in ("corrupt", "truncate") and rank is None:
        v.fail(at, "rank", f"a {kind} fault needs the rank it hits")
    factor = v.typed(t, "factor", (int, float), at, default=None)
    if kind == "slow" and (factor is None or factor <= 1):
        v.fail(at, "factor", "a slow fault needs factor > 1 (2: half speed)")
    mode = v.typed(t, "mode", str, at, default=None)
    if mode is not None and (kind != "slow" or mode not in ("compute", "throttle")):
        v.fail(at, "mode", f"{mode!r}: a slow fault's mode is 'compute' or 'throttle'")
    if kind == "pause" and (seconds is None or seconds <= 0):
        v.fail(at, "seconds", "a pause fault needs seconds > 0")
    if kind == "slow" and seconds is not None and seconds < 0:
        v.fail(at, "seconds", f"{seconds}: a slow fault's duration, >= 0 (0: to the end)")
    tier = v.typed(t, "tier", str, at, default=None)
    if tier is not None and (kind not in ("corrupt", "truncate") or tier not in TIERS):
        v.fail(at, "tier", f"{tier!r}: a corrupt or truncate fault's tier is 'durable' or 'memory'")
    return Fault(
        id=v.file_name(t, "id", at, default=f"{kind}-{i}"),
        kind=kind,
        rank=0 if kind in ("corrupt", "truncate") and rank is None else rank,
        node=node,
        step=step,
        when=when,
        at_s=None if at_s is None else float(at_s),
        seconds=None if seconds is None else float(seconds),
        factor=None if factor is None else float(factor),
        mode=mode,
        tier=tier,
        after=after,
    )


TIERS = ("durable", "memory")

# the fields each kind of fault reads (every other field is refused: it would be ignored).
# A rank fault takes no node: its rank is global ("rank = 1, node = 1" on two nodes of two
# ranks would read as node 1's rank 1 and hit rank 1, on node 0).
_TRIGGER = frozenset({"id", "kind", "step", "when", "after"})
_EXTERNAL = frozenset({"id", "kind", "step", "at_s", "when"})
FAULT_FIELDS: dict[str, frozenset[str]] = {
    "kill": _TRIGGER | {"rank", "at_s"},
    "stop": _TRIGGER | {"rank", "at_s"},
    "raise": _TRIGGER | {"rank"},
    "hang": _TRIGGER | {"rank"},
    "pause": _TRIGGER | {"rank", "seconds"},
    "slow": _TRIGGER | {"rank", "seconds", "factor", "mode"},
    "corrupt": _TRIGGER | {"rank", "tier"},
    "truncate": _TRIGGER | {"rank", "tier"},
    # (a trigger or after on a skew fault is refused below, with why)
    "skew": frozenset({"id", "kind", "rank", "node", "seconds", "step", "at_s", "when", "after"}),
    "kill_node": _EXTERNAL | {"node"},
    "replace_node": _EXTERNAL | {"node"},
    "kill_job": _EXTERNAL,
    "crash_job": _EXTERNAL,
    "storage": frozenset(
        {"id", "kind", "error", "op", "path", "probability", "count", "skip", "latency_s"}
    ),
}
assert set(FAULT_FIELDS) == set(KINDS)


def _shown(steps: list[int]) -> str:
    return (
        ", ".join(map(str, steps))
        if len(steps) <= 8
        else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
    )


def _expect(v: _Validator, t: dict[str, Any], job: Job) -> Expect:
    at = ("expect",)
    v.keys(t, set(Expect.__dataclass_fields__), at)
    final = v.typed(t, "final_state", str, at, default="exact")
    if final not in ("exact", "close", "any"):
        v.fail(at, "final_state", f"{final!r}: 'exact', 'close' or 'any'")
    verdict = v.typed(t, "verdict", str, at, default=None)
    if verdict is not None and verdict not in VERDICTS:
        v.fail(at, "verdict", f"{verdict!r}: one of {', '.join(VERDICTS)}")
    world = job.nproc * job.nodes
    hang_rank = v.typed(t, "hang_rank", int, at, default=None)
    if hang_rank is not None and not 0 <= hang_rank < world:
        v.fail(
            at, "hang_rank", f"{hang_rank} is not a rank of this {world}-rank job (0..{world - 1})"
        )
    if final != "close":
        for k in ("rtol", "atol", "moment_rtol"):
            if k in t:
                v.fail(
                    at,
                    k,
                    f"a tolerance of final_state 'close', found with final_state {final!r}, "
                    f"which ignores it; remove {k} or say final_state = 'close'",
                )
    if final == "any" and "loss_rtol" in t:
        v.fail(
            at,
            "loss_rtol",
            "final_state 'any' runs no reference, so no loss curve is compared; remove "
            "loss_rtol or say final_state = 'exact' or 'close'",
        )
    completed = v.typed(t, "completed", bool, at, default=True)
    if completed and "error_contains" in t:
        v.fail(
            at,
            "error_contains",
            "the error a failing job must log, found with completed = true (a job that "
            "completes is not searched for it); say completed = false or remove error_contains",
        )
    floats = {}
    for k in ("rtol", "atol", "moment_rtol", "loss_rtol", "detect_within_s", "recover_within_s"):
        x = v.at_least(t, k, at, 0, kind=(int, float))
        if x is not None:
            floats[k] = float(x)
    return Expect(
        completed=completed,
        final_state=final,
        max_steps_lost=v.at_least(t, "max_steps_lost", at, 0),
        verdict=verdict,
        checkpoints_verify=v.typed(t, "checkpoints_verify", bool, at, default=True),
        samples_exactly_once=v.typed(
            t, "samples_exactly_once", bool, at, default=job.trainer is not None
        ),
        error_contains=v.typed(t, "error_contains", str, at, default=None),
        restarts=v.at_least(t, "restarts", at, 0),
        failed_saves=v.at_least(t, "failed_saves", at, 0),
        hang_rank=hang_rank,
        hang_collective=v.typed(t, "hang_collective", str, at, default=None),
        **floats,
    )


class _Validator:
    """Type checks that name the file, the line and the field."""

    def __init__(self, text: str, source: str) -> None:
        self.lines, self.source = text.splitlines(), source

    def fail(self, at: tuple, key: str, message: str) -> None:
        where = ".".join(str(a) if isinstance(a, str) else f"[{a}]" for a in at).replace(".[", "[")
        name = f"{where}.{key}" if where and key else (where or key)
        line = self.line_of(at, key)
        raise ScenarioError(
            f"{self.source}:{line}: {name}: {message}"
            if line
            else f"{self.source}: {name}: {message}"
        )

    def line_of(self, at: tuple, key: str) -> int | None:
        """The line that sets ``key`` in the table ``at`` (its header's line if the key is absent)."""
        names = [a for a in at if isinstance(a, str)]
        table = ".".join(names)
        index = next((a for a in at if isinstance(a, int)), 0)
        start = 0
        if table:
            header = re.compile(rf"^\s*\[\[?\s*{re.escape(table)}\s*\]\]?\s*(#.*)?$")
            inline = (
                re.compile(rf"^\s*{re.escape(names[-1])}\s*=\s*\{{")
                if isinstance(at[-1], str)
                else None
            )
            seen = -1
            for n, line in enumerate(self.lines):
                if header.match(line) or (inline is not None and inline.match(line)):
                    seen += 1
                    if seen == index:
                        start = n
                        break
            else:
                return None
        if not key:
            return start + 1
        pattern = re.compile(rf"(^|[{{,]\s*){re.escape(key)}\s*=")
        for n in range(start, len(self.lines)):
            stripped = self.lines[n].strip()
            if stripped.startswith("[") and (n > start or not table):
                break  # the next table
            if pattern.search(stripped):
                return n + 1
        return start + 1 if table else None

    def keys(self, t: dict[str, Any], allowed: set[str], at: tuple) -> None:
        for k in t:
            if k not in allowed:
                self.fail(at, k, f"unknown field; expected one of {', '.join(sorted(allowed))}")

    def table(self, t: dict[str, Any], key: str, at: tuple = (), *, required: bool = False) -> dict:
        if key not in t:
            if required:
                self.fail(at, key, "missing (a table is required)")
            return {}
        if not isinstance(t[key], dict):
            self.fail(at, key, f"must be a table, got {type(t[key]).__name__}")
        return t[key]

    def array_of_tables(self, t: dict[str, Any], key: str) -> list:
        x = t.get(key, [])
        if not isinstance(x, list):
            self.fail((), key, "must be an array of tables ([[faults]])")
        return x

    def typed(
        self,
        t: dict[str, Any],
        key: str,
        kind: Any,
        at: tuple,
        *,
        required: bool = False,
        default: Any = None,
    ) -> Any:
        if key not in t:
            if required:
                self.fail(at, key, "missing")
            return default
        x = t[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(x, bool) and bool not in kinds) or not isinstance(x, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(at, key, f"expected {names}, found {type(x).__name__} {x!r}")
        if isinstance(x, float) and not math.isfinite(x):  # TOML allows nan and inf
            self.fail(at, key, f"expected a finite number, found {x}")
        return x

    def at_least(
        self,
        t: dict[str, Any],
        key: str,
        at: tuple,
        bound: float,
        *,
        kind: Any = int,
        strict: bool = False,
        default: Any = None,
        required: bool = False,
    ) -> Any:
        """A number ``>= bound`` (``> bound`` where ``strict``)."""
        x = self.typed(t, key, kind, at, required=required, default=default)
        if x is not None and (x <= bound if strict else x < bound):
            self.fail(at, key, f"{x}: must be {'>' if strict else '>='} {bound}")
        return x

    def file_name(
        self,
        t: dict[str, Any],
        key: str,
        at: tuple,
        *,
        required: bool = False,
        default: str | None = None,
        reserved: tuple[str, ...] = (),
    ) -> Any:
        """A string used as a file name (a run directory, a marker file): one path component."""
        x = self.typed(t, key, str, at, required=required, default=default)
        if x is None:
            return x
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", x) or x in (".", ".."):
            self.fail(
                at,
                key,
                f"{x!r} is used as a file name: use only letters, digits, '-', '_' and '.' "
                f"(and not '.' or '..')",
            )
        if x in reserved:
            self.fail(at, key, f"{x!r} is taken by the runner's own files; choose another")
        return x

    def positive(
        self,
        t: dict[str, Any],
        key: str,
        at: tuple,
        *,
        default: Any = None,
        required: bool = False,
        kind: Any = int,
    ) -> Any:
        return self.at_least(t, key, at, 1, kind=kind, default=default, required=required)
