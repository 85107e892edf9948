"""``python -m reference_trainer``: the command line (a thin layer over TrainConfig and train).

    python -m reference_trainer --nproc N --tp T --ep E --dp D [--zero] --steps S --save-every K \\
        --ckpt URL [--preset tiny|small|zaya1-mini] [--data PATH] [--seed S] [--metrics FILE.jsonl]
    torchrun --nproc-per-node N -m reference_trainer ...      (same flags, without --nproc)

With ``--nproc`` it launches N local ranks through ``resilient launch`` (torch.distributed.elastic's
agent, torchrun's flags and rendezvous), with ``--spares K`` hot spares (default 0: a failed rank
restarts the workers, as torchrun would; K >= 1: a spare takes its rank and the healthy ranks stay,
in-job recovery).  Bad flags fail here, before any process group exists, with a message naming the
flag (exit code 2).
"""

from __future__ import annotations

# ruff: noqa: E402  (collection is turned off before the other imports, on purpose)
import gc

# A rank's start-up allocates millions of objects that live as long as the process (torch, and
# through the optimizer its compiler stack).  Collecting them over and over as they are created
# frees nothing and costs about a third of the start-up's CPU, which every restart pays again.
# train() freezes them and turns collection back on once the model and optimizer exist; the
# launcher (--nproc) turns it back on before it starts the ranks.
gc.disable()

import argparse
import dataclasses
import json
import math
import os
import sys

if (
    __name__ == "__main__"
    and any(a == "--nproc" or a.startswith("--nproc=") for a in sys.argv[1:])
    and "LOCAL_RANK" not in os.environ
    and "RESILIENT_SPARE" not in os.environ
):
    # the launcher's ranks get one thread each (_launch); set before torch's import, so that this
    # process's pool is sized alike and its ranks' server may be forked from it (fork_ready)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from reference_trainer.config import ConfigError, ModelConfig, TrainConfig, preset
from resilient.checkpoint.catalog import scan
from resilient.checkpoint.reader import read_manifest
from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError
from resilient.launch import MAX_PROCESSES_PER_NODE, free_port


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reference_trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # no abbreviations: with --nproc the launcher's own flags are taken out of the ranks'
        # by their full names, and a rank given an abbreviated one refused it (every rank, 2)
        allow_abbrev=False,
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="launch this many local ranks with `resilient launch` (torch.distributed.elastic)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=0, help="with --nproc: restarts of the workers"
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with --nproc: hot spare processes; K > 0: a spare takes a failed rank over and the "
        "healthy ranks stay alive (in-job recovery); 0: a failure restarts the workers",
    )
    p.add_argument(
        "--finish-timeout",
        type=float,
        default=None,
        help="with --nproc: once a rank has finished, kill one that has done nothing for this "
        "many seconds (a rank frozen or hung after its last step; resilient launch's default "
        "300; 0: wait for it forever)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument(
        "--dp",
        default="1",
        help="data-parallel size, or 'auto': the world size / (tp x ep), so that an elastic job "
        "that lost a node continues with a smaller dp",
    )
    p.add_argument(
        "--zero", action="store_true", help="ZeRO-1: shard optimizer state over dp replicas"
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument(
        "--memory-every",
        type=int,
        default=0,
        help="snapshot into the node's host memory every N steps (the memory tier: a restart "
        "restores from there; 0: off)",
    )
    p.add_argument(
        "--memory-commit-every",
        type=int,
        default=1,
        help="commit one memory snapshot in N as it is taken; the others are sealed by their "
        "staged records and committed when a restore, a flush or a durable save needs them "
        "(0: only then, and across nodes each is sent to the peer node as it is sealed; N > 1 "
        "applies on one node; default 1: every snapshot)",
    )
    p.add_argument("--ckpt", default=None, help="checkpoint URL (any fsspec URL)")
    p.add_argument(
        "--init-from",
        default=None,
        help="start from the model weights of this checkpoint URL (its newest step, any layout; "
        "for example what `reshape import --format hf` wrote): a fresh optimizer at step 0. "
        "Ignored once --ckpt holds a step to resume from",
    )
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--preset",
        default="tiny",
        help="tiny, small, zaya1-mini, or checkpoint: the model configuration that --ckpt's "
        "newest step records, else --init-from's (for a model `reshape import` brought in)",
    )
    p.add_argument(
        "--data", default=None, help="a text file or a directory (default: Python's stdlib)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--metrics", default=None, help="append one JSON line per step (rank 0)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="sequences per forward/backward on each replica; gradients accumulate over the "
        "replica's share of the global batch (default: all at once)",
    )
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=None,
        help="declare a rank hung after this long without progress (default: calibrated)",
    )
    p.add_argument(
        "--storage-options", default=None, help="JSON options for the --ckpt filesystem (fsspec)"
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="on resume, fail if the newest checkpoint is corrupt instead of using the one before",
    )
    p.add_argument(
        "--events", default=None, help="the run's event log (default: events.jsonl in --ckpt)"
    )
    p.add_argument(
        "--join-timeout-s",
        type=float,
        default=120.0,
        help="declare a rank that never registered its heartbeat DEAD this long after the leader "
        "started (it froze in its imports or the launcher)",
    )
    p.add_argument(
        "--max-failed-saves",
        type=int,
        default=3,
        help="stop after this many consecutive failed checkpoint saves (each is logged and "
        "training goes on until then); a failed final save always stops the run",
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="before training, check every rank (store latency, a small all-reduce, pairwise "
        "links, memory bandwidth, device health: a few seconds) and refuse to train when one is "
        "slower than the others or broken; `resilient preflight` runs the full check",
    )
    p.add_argument(
        "--chaos",
        default=None,
        metavar="PLAN",
        help="install the chaos harness's fault hook with this plan (written by `resilient "
        "chaos`); nothing else turns fault injection on",
    )
    return p


def _dp(args: argparse.Namespace, world_size: int | None) -> int:
    if args.dp != "auto":
        try:
            return int(args.dp)
        except ValueError:
            raise ConfigError(f"--dp {args.dp!r}: an integer or 'auto'") from None
    inner = args.tp * args.ep
    if not world_size or inner < 1 or world_size % inner:
        raise ConfigError(
            f"--dp auto: the world size {world_size} is not a multiple of --tp {args.tp} x "
            f"--ep {args.ep} = {inner}"
        )
    return world_size // inner


def _storage_options(raw: str | None) -> dict | None:
    if raw is None:
        return None
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--storage-options is not valid JSON ({e}); give a JSON object"
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


def _model(args: argparse.Namespace) -> ModelConfig:
    """--preset NAME, or --preset checkpoint: the model configuration recorded by --ckpt's newest
    step, else by --init-from's (say, a model `reshape import --format hf` brought in)."""
    if args.preset != "checkpoint":
        return preset(args.preset)
    from reshape.formats.hf import MoEConfig, recorded_model_config  # (35 ms of imports)

    options = _storage_options(args.storage_options)
    for flag, url in (("--ckpt", args.ckpt), ("--init-from", args.init_from)):
        if not url:
            continue
        try:
            storage = Storage(url, options)
            steps = scan(storage).steps()
            if not steps:
                continue
            extras = read_manifest(storage, steps[-1]).extras
        except ResilientError as e:
            raise ConfigError(f"--preset checkpoint: cannot read {flag} {url}: {e}") from None
        fields = recorded_model_config(extras)
        if not fields:
            raise ConfigError(
                f"--preset checkpoint: step {steps[-1]} of {flag} {url} records no model "
                f"configuration (config.model.*); pass the --preset it was trained with"
            )
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        try:
            MoEConfig.from_mapping(fields, f"{flag} {url}")  # types and ranges of what matters
            return ModelConfig(**{k: v for k, v in fields.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"--preset checkpoint: the model configuration of {flag} {url} is not one the "
                f"trainer builds: {e}"
            ) from None
    raise ConfigError(
        "--preset checkpoint: neither --ckpt nor --init-from holds a committed step to take the "
        "model configuration from"
    )


def config_from(args: argparse.Namespace, world_size: int | None) -> TrainConfig:
    return TrainConfig(
        preset=args.preset,
        model=_model(args),
        dp=_dp(args, world_size),
        ep=args.ep,
        tp=args.tp,
        zero=args.zero,
        steps=args.steps,
        save_every=args.save_every,
        memory_every=args.memory_every,
        memory_commit_every=args.memory_commit_every,
        ckpt=args.ckpt,
        init_from=args.init_from,
        keep_last=args.keep_last,
        data=args.data,
        seed=args.seed,
        global_batch=args.global_batch,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        device=args.device,
        metrics=args.metrics,
        micro_batch=args.micro_batch,
        heartbeat_interval_s=args.heartbeat_interval_s,
        hang_timeout_s=args.hang_timeout_s,
        join_timeout_s=args.join_timeout_s,
        max_failed_saves=args.max_failed_saves,
        storage_options=_storage_options(args.storage_options),
        fallback=not args.no_fallback,
        events=args.events,
        world_size=world_size,
        preflight=args.preflight,
    )


def main(argv: list[str] | None = None, *, program: bool = False) -> int:
    """``program``: called as the program (``python -m reference_trainer``), with nothing above
    it that catches an exception: the launcher of ``--nproc`` may fork the ranks' server from
    this process (``resilient.launch.agent.launch_main``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    # a worker of torchrun / resilient launch, or a spare of resilient launch (no rank yet)
    under_launcher = (
        "LOCAL_RANK" in os.environ or "RESILIENT_SPARE" in os.environ
    ) and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else (args.nproc or 1)
    try:
        most = MAX_PROCESSES_PER_NODE
        if args.nproc is not None and not 1 <= args.nproc <= most:
            raise ConfigError(
                f"--nproc {args.nproc}: expected a number of local ranks from 1 to {most} (this "
                f"machine's processes); for more ranks, run on several nodes with torchrun or "
                f"`resilient launch --nnodes`"
            )
        if not 0 <= args.spares <= most:
            raise ConfigError(f"--spares {args.spares}: expected 0 to {most} spare processes")
        if args.spares and args.nproc is None:
            raise ConfigError(
                f"--spares {args.spares}: spares come with --nproc (or run under "
                f"`resilient launch --spares K`)"
            )
        if args.finish_timeout is not None:
            if not (math.isfinite(args.finish_timeout) and args.finish_timeout >= 0):
                raise ConfigError(
                    f"--finish-timeout {args.finish_timeout}: expected a number of seconds >= 0"
                )
            if args.nproc is None:
                raise ConfigError(
                    f"--finish-timeout {args.finish_timeout:g}: it comes with --nproc (or run "
                    "under `resilient launch --finish-timeout S`)"
                )
        cfg = config_from(args, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nproc is not None and not under_launcher:
        rest = _without_launcher_flags(argv)
        return _launch(
            args.nproc,
            args.max_restarts,
            rest,
            args.spares,
            program=program,
            finish_timeout=args.finish_timeout,
        )
    if not under_launcher:  # a world of one, in this process
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    hooks: list = []
    if args.chaos is not None:  # the chaos harness asked for its hook, by flag, explicitly
        from resilient.chaos.faults import ChaosHook
        from resilient.hooks import call

        hooks.append(ChaosHook.from_file(args.chaos))
        call(hooks, "at_phase", "import", None)  # before the heavy imports and the heartbeat
    import torch.distributed as dist

    from reference_trainer.train import train
    from resilient.errors import PreflightError

    try:
        train(cfg, hooks=hooks)
    except PreflightError as e:  # every rank refuses alike; one says why
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    except SystemExit:
        # a clean stop (preemption saved the current step): leave the process group before the
        # interpreter tears down, as a completed run does; its threads alive at exit made a rank
        # abort now and then ("terminate called without an active exception", exit -6)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


_LAUNCHER_FLAGS = ("--nproc", "--max-restarts", "--spares", "--finish-timeout")


def _without_launcher_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _LAUNCHER_FLAGS:
            skip = True
            continue
        if a.startswith(tuple(f"{f}=" for f in _LAUNCHER_FLAGS)):
            continue
        out.append(a)
    return out


def _launch(
    nproc: int,
    max_restarts: int,
    rest: list[str],
    spares: int = 0,
    *,
    program: bool = False,
    finish_timeout: float | None = None,
) -> int:
    import signal

    from reference_trainer import PRELOAD
    from resilient.launch.agent import launch_main

    gc.enable()  # a long-lived launcher collects as usual
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    flags = [
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--spares",
        str(spares),
    ]
    if finish_timeout is not None:
        flags += ["--finish-timeout", repr(finish_timeout)]
    # the ranks fork from a server that has imported torch and the trainer once (not every rank
    # at every restart): resilient/forkserver.py
    flags += ["--preload", ",".join(PRELOAD)]
    code = launch_main([*flags, "-m", "reference_trainer", *rest], program=program)
    if code == 128 + signal.SIGTERM:
        # Preemption: the launcher forwarded SIGTERM and waited for the ranks, which saved the
        # current step and exited cleanly (resilient.Run); the job stops successfully.
        print(
            "preempted (SIGTERM): the ranks saved the current step; rerun to resume",
            file=sys.stderr,
        )
        return 0
    if code:
        print("error: training failed (the launcher's report is above)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(program=True))
