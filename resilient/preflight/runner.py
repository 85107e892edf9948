"""``run_preflight``: every check, on every rank of the job, within the budget; and the command.

Call sequence (every rank calls ``run_preflight`` together, as a collective):

1. device health, each rank at once: what torch sees, a matmul with a known result, the vendor's
   error counters;
2. per-node figures in turns (one local rank of every node at a time), ``repeats`` rounds:
   memory bandwidth and its numpy anchor, matmul throughput, the store's round trip, host-device
   copies where there is a GPU; a figure that names some rank is measured again on every rank,
   and each rank's better pass counts;
3. pairwise links (world > 1), the slow-looking ones measured again, alone, before any is named;
4. the checkpoint URL, in turns (when given);
5. the collectives, in what is left of the budget;
6. rank 0 gathers every rank's figures through the store, names the outliers, and shares the
   verdict: every rank returns the same ``ok``, failures, outliers and figures per rank; the
   pairwise matrix and each rank's detail (``links["matrix_bytes_per_s"]``, ``ranks``) are in
   rank 0's report only (n^2 numbers sent to n ranks would not scale).

Budget shares: per-node figures 20%, links 20%, storage 15% (when a URL is given), collectives
the rest; the quick subset (``Run(preflight=True)``) runs one 1 MiB all-reduce instead of the sweep.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from resilient.errors import PreflightError
from resilient.preflight import collectives as coll
from resilient.preflight import device as dev
from resilient.preflight import host, links, storage
from resilient.preflight.config import PreflightConfig
from resilient.preflight.group import Group
from resilient.preflight.outliers import FIGURES, human_bytes, rank_outliers, suspect_links
from resilient.preflight.report import PreflightReport, build_report

__all__ = ["run_preflight", "preflight_main", "ENV_RESULT"]

# set by ``resilient preflight --nproc N`` for the ranks it starts: rank 0 writes the report
# there and every rank exits 0, and the launching process prints it and sets the exit code
ENV_RESULT = "RESILIENT_PREFLIGHT_RESULT"

# how long a preflight's process group waits in one collective or store read beyond the budget:
# the start-up (imports, device checks: ranks join the first collective up to ~30 s apart on a
# loaded node) and a margin; a frozen rank ended the command only after 300 s, with no report
GROUP_TIMEOUT_GRACE_S = 60.0
# after a collective timed out, how long rank 0 waits for the other live ranks to say so (they
# time out in the same collective, or in the next store read)
ANSWER_WAIT_S = 10.0


def run_preflight(config: PreflightConfig | None = None) -> PreflightReport:
    """Run the checks on every rank of the default process group (or a world of one without
    one); every rank must call it, and every rank gets the same verdict back (rank 0 the whole
    report: see step 6 above)."""
    config = config or PreflightConfig()
    t_start = time.perf_counter()
    group = Group()
    try:
        return _run(group, config, t_start)
    except RuntimeError as e:  # a collective or a store read timed out (or failed): who is gone?
        if group.store is None:
            raise
        _name_the_unanswered(group, e)
        raise


def _name_the_unanswered(group: Group, error: RuntimeError) -> None:
    """After a collective or store read failed on this rank: every rank that gets here says so
    through the store, and rank 0 raises a ``PreflightError`` naming the ranks that did not say
    so within ``ANSWER_WAIT_S`` (stopped, hung, gone); the others raise one pointing at rank 0.
    Returns (the caller re-raises ``error``) when every rank answered: not a rank that stopped."""
    missing = group.unanswered(ANSWER_WAIT_S)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    waited = group.timeout_s()
    within = f" within the group's timeout ({waited:g} s)" if waited is not None else ""
    if group.rank != 0:
        raise PreflightError(
            f"preflight: rank {group.rank} ({group.host}): a collective or store read failed "
            f"({first}); rank 0 names the ranks that did not answer"
        ) from error
    if not missing:
        return
    raise PreflightError(
        f"preflight: {_ranks_phrase(missing)} did not answer: a collective or store read "
        f"failed on rank 0{within} ({first}) and {_ranks_phrase(missing)} did not report in "
        f"{ANSWER_WAIT_S:g} s more; expected every rank to take part in every check: look for a "
        f"stopped, hung or lost process on {'its' if len(missing) == 1 else 'their'} host "
        f"(or drain the node), then run preflight again"
    ) from error


def _ranks_phrase(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _run(group: Group, config: PreflightConfig, t_start: float) -> PreflightReport:
    timings: dict[str, float] = {}
    skipped: list[str] = []
    cut: list[str] = []
    mine: dict[str, Any] = {
        "rank": group.rank,
        "host": group.host,
        "local_rank": group.local_rank,
        "pid": os.getpid(),
        "failures": [],
    }
    where = f"rank {group.rank} ({group.host})"
    budget = config.budget_s
    has_url = config.checkpoint_url is not None

    # 1. device health
    t0 = time.perf_counter()
    info = dev.device_info(group.device)
    n = (4096 if config.quick else 8192) if group.device.type == "cuda" else 256
    check = dev.matmul_check(group.device, n)
    if not check["ok"]:
        mine["failures"].append(
            f"{where}: a {n}x{n} matmul on {info['name']} got {check['mismatches']} of {n * n} "
            f"entries wrong (worst error {check['max_error']:g}) against the exact product "
            f"(expected none); this device computes wrong results: drain the node"
        )
    vendor = dev.vendor_counters(info)
    mine["failures"] += [f"{where}: {f}" for f in vendor.get("failures", [])]
    mine["device"] = {**info, "matmul_check": check, "vendor": vendor}
    timings["device"] = time.perf_counter() - t0

    # 2. per-node figures, in turns
    t0 = time.perf_counter()
    mine.update(_local_figures(group, config, budget * (0.4 if config.quick else 0.2)))
    timings["local"] = time.perf_counter() - t0
    if 0 < mine["rounds_again"] < 3:
        cut.append(
            f"per-node figures: the ones that named a rank measured again in "
            f"{mine['rounds_again']} round(s) instead of 3 (budget)"
        )
    if group.device.type != "cuda":
        skipped.append("host-device copies: no GPU on this job (CPU ranks)")
    if group.store is None:
        skipped.append("store round trip: no process group (a world of one)")

    # 3. links
    matrix: list[list[float | None]] | None = None
    link_plan: dict[str, Any] = {}
    if group.world > 1:
        t0 = time.perf_counter()
        message = min((1 << 20) if config.quick else (4 << 20), config.max_bytes)
        share = budget * (0.35 if config.quick else 0.2)
        est, sync_s, connect_s, slowest = links.probe_links(group, message, budget_s=share)
        plan = links.plan_links(
            world=group.world,
            budget_s=share,
            est_bytes_per_s=est,
            message_bytes=message,
            sync_s=sync_s,
            connect_s=connect_s,
            quick=config.quick,
            slowest_bytes_per_s=slowest,
        )
        cut += plan.cuts
        matrix, ran = links.run_links(group, plan, budget_s=share)
        # a link is named only if it is slow again when measured alone (a burst of load on a
        # busy machine can halve one pair's samples; a slow link stays slow)
        suspects = suspect_links(matrix, config.factor) if matrix is not None else None
        # what is left of the share (a slow link: one sample of each suspect at least)
        (spent,) = group.agree_max([time.perf_counter() - t0])
        matrix, again = links.confirm_links(
            group,
            matrix,
            suspects,
            message_bytes=ran["message_bytes"],
            sends=ran["sends_per_sample"],
            budget_s=max(share - spent, 0.0),
        )
        ran = {**ran, **again}
        if ran["repeats"] < plan.repeats:
            cut.append(
                f"pairwise links: {ran['repeats']} samples per pair instead of {plan.repeats} "
                f"(budget)"
            )
        concurrent = group.world > links.SEQUENTIAL_UP_TO
        if ran["message_bytes"] < plan.message_bytes:
            cut.append(
                f"pairwise links: {human_bytes(ran['message_bytes'])} messages instead of "
                f"{human_bytes(plan.message_bytes)} after the first round (a slow pair; budget)"
            )
        link_plan = {
            **ran,
            "schedule": "disjoint pairs at once" if concurrent else "one pair at a time",
            "peers_per_rank": plan.partners or group.world - 1,  # the fewest any rank met
            "barrier_s": sync_s,
            "first_contact_s": connect_s,
        }
        timings["links"] = time.perf_counter() - t0
    else:
        skipped.append("pairwise links and collectives: a world of one")

    # 4. storage
    if has_url:
        t0 = time.perf_counter()
        mine["storage"] = _storage(group, config, budget * 0.15, where)
        if "error" in mine["storage"]:
            mine["failures"].append(mine["storage"]["error"])
        timings["storage"] = time.perf_counter() - t0
    else:
        skipped.append("checkpoint storage: no --checkpoint-url given")

    # 5. collectives, in what is left
    results: list[coll.CollectiveResult] = []
    if group.world > 1:
        t0 = time.perf_counter()
        (elapsed,) = group.agree_max([time.perf_counter() - t_start])
        left = max(budget * 0.95 - elapsed, budget * 0.05)
        cap = _buffer_cap(group)
        if config.quick:
            ops, sizes = ("all_reduce",), [min(1 << 20, config.max_bytes, cap)]
        else:
            ops = config.ops
            wanted = coll.message_sizes(config.min_bytes, config.max_bytes)
            sizes = [s for s in wanted if s <= cap]
            if len(sizes) < len(wanted):
                cut.append(
                    f"collectives: sizes above {human_bytes(cap)} not run (two buffers of them "
                    f"would not fit a quarter of the memory free to each rank)"
                )
        results, coll_cuts = coll.run_collectives(group, ops=ops, sizes=sizes, budget_s=left)
        cut += coll_cuts
        timings["collectives"] = time.perf_counter() - t0
    if config.quick and group.world > 1:
        cut.append("quick subset: one 1 MiB all-reduce instead of the collective sweep")

    # 6. gather, judge, share
    (used,) = group.agree_max([time.perf_counter() - t_start])
    gathered = group.gather("ranks", mine)
    report = verdict = None
    if group.rank == 0:
        report = build_report(
            config=config,
            ranks=gathered or [mine],
            matrix=matrix,
            link_plan=link_plan,
            collectives=[r.to_dict() for r in results],
            backend=group.backend,
            device=group.device.type,
            used_s=used,
            timings_s=timings,
            skipped=skipped,
            cut=cut,
        ).to_dict()
        verdict = _verdict(report)
    # the others get the verdict and the figures per rank, not the matrix (n^2 numbers, read by
    # n ranks) nor every rank's detail: those stay with rank 0, which prints and writes them
    verdict = group.share("report", verdict)
    group.sync()  # every rank has read the verdict before its keys go
    group.cleanup(["ranks", "links", "links-suspects", "links-again", "report", "storage", "ping"])
    return PreflightReport.from_dict(report if report is not None else verdict)


def _verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The report as the ranks other than 0 get it: no pairwise matrix, no per-rank detail."""
    links = {k: v for k, v in report["links"].items() if k != "matrix_bytes_per_s"}
    return {**report, "links": links, "ranks": []}


# the per-rank figures judged against the median (the numpy anchor is shown, never judged)
_JUDGED = (
    "memory_bytes_per_s",
    "matmul_flops_per_s",
    "store_round_trip_s",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
)


def _local_figures(group: Group, config: PreflightConfig, share_s: float) -> dict[str, Any]:
    """Memory bandwidth, matmul throughput, store round trip (and host-device copies), measured in
    turns; medians over ``repeats`` rounds, and the samples.

    A figure that looks like an outlier on some rank is measured again, on every rank (three more
    rounds of the suspect figures alone, fewer where the share has no room left, never none), and
    each rank's better median of the two passes is judged: a burst of load on a busy machine can
    take one rank's turns in one pass (it did on a 2-core CI run: a healthy rank's matmul at 0.29x
    of the median), while a slow rank is slow in both.  Every rank decides the same (the figures
    are all-reduced), so the passes stay collective."""
    on_gpu = group.device.type == "cuda"
    llc = host.last_level_cache_bytes()
    avail = host.available_memory_bytes() or (8 << 30)
    want = max(64 << 20, 4 * llc)
    nbytes = int(min(want, avail // (8 * max(group.turns, 1))))
    (nbytes,) = group.agree_min([nbytes])
    nbytes = int(nbytes)
    repeats = 5
    per_sample = 5 if on_gpu else 3  # torch copy, numpy copy, matmul (+ h2d, d2h)
    sample_s = share_s / (repeats * max(group.turns, 1) * per_sample)
    sample_s = min(max(sample_s, 0.01), 0.2)
    bench = _Bench(group, nbytes, sample_s)
    t0 = time.perf_counter()
    first, repeats = bench.rounds(set(_JUDGED), repeats, share_s)
    (spent,) = group.agree_max([time.perf_counter() - t0])
    figures = {key: _median(first[key]) for key in _JUDGED}
    figures["numpy_copy_bytes_per_s"] = _median(first["numpy"])
    suspects = _suspects(group, figures, config.factor)
    again: dict[str, list[float]] = {}
    rounds_again = 0
    if suspects:
        # three rounds where what is left of the share holds them (a round of every figure took
        # spent / repeats: a round of the suspects takes at most that), never fewer than one
        left = max(share_s - spent, 0.0)
        rounds_again = max(1, min(3, int(left / max(spent / repeats, 1e-9))))
        again, rounds_again = bench.rounds(suspects, rounds_again, left)
        for key in suspects:
            better = max if FIGURES[key].higher_is_better else min
            values = [v for v in (figures[key], _median(again[key])) if v is not None]
            figures[key] = better(values) if values else None
        if "memory_bytes_per_s" in suspects:
            anchors = [v for v in (figures["numpy_copy_bytes_per_s"], _median(again["numpy"])) if v]
            figures["numpy_copy_bytes_per_s"] = max(anchors) if anchors else None
    return {
        "memory": {
            "bytes": nbytes,
            "sample_s": sample_s,
            "repeats": repeats,
            "torch_samples": first["memory_bytes_per_s"],
            "numpy_samples": first["numpy"],
        },
        "measured_again": sorted(suspects),
        "rounds_again": rounds_again,
        "samples_again": {k: v for k, v in again.items() if v},
        "memory_bytes_per_s": figures["memory_bytes_per_s"],
        "numpy_copy_bytes_per_s": figures["numpy_copy_bytes_per_s"],
        "matmul_flops_per_s": figures["matmul_flops_per_s"],
        "matmul_n": bench.n,
        "store_round_trip_s": figures["store_round_trip_s"],
        "h2d_bytes_per_s": figures["h2d_bytes_per_s"],
        "d2h_bytes_per_s": figures["d2h_bytes_per_s"],
    }


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


class _Bench:
    """One rank's buffers for the per-node figures, and rounds of samples taken in turns."""

    def __init__(self, group: Group, nbytes: int, sample_s: float) -> None:
        self.group, self.sample_s = group, sample_s
        self.on_gpu = group.device.type == "cuda"
        self.src, self.dst = host.copy_buffers(nbytes)
        self.pinned = self.device_buf = None
        if self.on_gpu:
            self.pinned = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
            self.device_buf = torch.empty(nbytes // 4, dtype=torch.float32, device=group.device)
        self.n = 4096 if self.on_gpu else 256

    def rounds(
        self, keys: set[str], repeats: int, share_s: float
    ) -> tuple[dict[str, list[float]], int]:
        """``repeats`` rounds of the figures ``keys`` (fewer, not below 3 or ``repeats``, when the
        first round shows that they would not fit ``share_s``): the samples per figure (and the
        numpy anchor's under ``"numpy"``), and the rounds run."""
        group = self.group
        out: dict[str, list[float]] = {key: [] for key in (*_JUDGED, "numpy")}
        t_start, rep = time.perf_counter(), 0
        while rep < repeats:
            for turn in range(group.turns):
                if group.local_rank == turn:
                    self._sample(keys, out)
                group.sync()
            rep += 1
            if rep == 1:  # a copy longer than the planned sample: fewer rounds (not below 3)
                (first,) = group.agree_max([time.perf_counter() - t_start])
                fits = 1 + int(max(share_s - first, 0.0) / max(first, 1e-9))
                repeats = min(repeats, max(3, fits))
        return out, repeats

    def _sample(self, keys: set[str], out: dict[str, list[float]]) -> None:
        sample_s = self.sample_s
        if "memory_bytes_per_s" in keys:
            s = host.memory_sample(self.src, self.dst, sample_s)
            out["memory_bytes_per_s"].append(s.torch_bytes_per_s)
            out["numpy"].append(s.numpy_bytes_per_s)
        if "matmul_flops_per_s" in keys:
            out["matmul_flops_per_s"].append(dev.matmul_sample(self.group.device, self.n, sample_s))
        if "store_round_trip_s" in keys:
            out["store_round_trip_s"] += self.group.store_round_trip(20)
        if self.on_gpu and keys & {"h2d_bytes_per_s", "d2h_bytes_per_s"}:
            up, down = host.host_device_sample(self.pinned, self.device_buf, sample_s)
            out["h2d_bytes_per_s"].append(up)
            out["d2h_bytes_per_s"].append(down)


def _suspects(group: Group, figures: dict[str, float | None], factor: float) -> set[str]:
    """The judged figures that name some rank as an outlier, decided from every rank's figures
    (all-reduced: the same set on every rank)."""
    present = [figures[key] for key in _JUDGED]
    table = group.collect_many([-1.0 if v is None else float(v) for v in present])
    (factor,) = group.agree_min([factor])  # one decision, even from ranks given other factors
    out = set()
    for i, key in enumerate(_JUDGED):
        per_rank = {r: row[i] for r, row in enumerate(table) if row[i] >= 0}
        if rank_outliers(per_rank, FIGURES[key], factor):
            out.add(key)
    return out


def _buffer_cap(group: Group) -> int:
    """The largest message size of which two buffers fit a quarter of this rank's free memory
    (the agreed minimum over ranks)."""
    if group.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(group.device)
    else:
        free = (host.available_memory_bytes() or (8 << 30)) // max(group.turns, 1)
    cap = 1 << max(int(free // 8).bit_length() - 1, 12)
    (cap,) = group.agree_min([cap])
    return int(cap)


def _storage(group: Group, config: PreflightConfig, share_s: float, where: str) -> dict[str, Any]:
    """This rank's storage figures (or ``{"error": message}``); rank 0 names the scratch
    directory and removes it at the end."""
    url = config.checkpoint_url
    assert url is not None
    scratch = group.share("storage", storage.scratch_name() if group.rank == 0 else None)
    result: dict[str, Any] = {"scratch": f"{url.rstrip('/')}/{scratch}"}
    store = None
    created_root = False
    try:
        store = storage.open_storage(url, config.storage_options)
        # every rank: a node-local path is a directory per node (shared storage: one, idempotent)
        created_root = storage.make_scratch(store, scratch)
    except Exception as e:  # every rank reaches the sync below, whatever went wrong here
        result["error"] = (
            f"{where}: checkpoint URL {url} cannot be opened or written: {e}; expected a "
            f"writable location: check the URL, its credentials and free space"
        )
        store = None
    group.sync()  # the scratch directory exists before any rank writes into it
    for turn in range(group.turns):
        if group.local_rank == turn and store is not None:
            try:
                probe = storage.storage_sample(store, scratch, group.rank, 4 << 20)
                rate = min(probe["write_bytes_per_s"], probe["read_bytes_per_s"])
                size = int(min(256 << 20, max(4 << 20, rate * share_s / group.turns / 3)))
                size = 1 << (size.bit_length() - 1)
                result.update(
                    storage.storage_sample(store, scratch, group.rank, size)
                    if size > 4 << 20
                    else probe  # fmt: skip
                )
            except Exception as e:  # (the other ranks wait in the sync below)
                result["error"] = (
                    f"{where}: checkpoint URL {url} failed the storage check: {e}; expected to "
                    f"write and read back a scratch file there: check the URL, its credentials "
                    f"and free space"
                )
        group.sync()
    # every rank has finished with it (the sync above); one rank per node removes it, so that a
    # node-local URL is cleaned on every node (on shared storage the others find it gone)
    if group.local_rank == 0 and store is not None:
        try:
            storage.remove_scratch(store, scratch, created_root=created_root)
        except FileNotFoundError:
            pass
        except Exception as e:
            result.setdefault(
                "error", f"{where}: could not remove the scratch directory {scratch}: {e}"
            )
    return result


# --- the command ---------------------------------------------------------------------------------


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def preflight_main(
    config: PreflightConfig,
    *,
    nproc: int | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    hooks: Sequence[Any] = (),
    argv: Sequence[str] = (),
    say: Any = print,
) -> int:
    """The ``resilient preflight`` command: under torchrun / ``resilient launch`` each rank runs
    the checks; with ``nproc`` it starts that many local ranks itself (``argv``: the arguments
    those ranks get); otherwise a world of one.  ``hooks``: ``resilient.hooks`` objects for
    joining the group (the chaos harness's, through ``--chaos``).  Returns the exit code: 0 every
    check passed, 1 a check failed (an outlier, a device check, the storage), 2 an error."""
    if plot_path is not None:
        from resilient.preflight.report import require_matplotlib

        require_matplotlib()
    if _under_launcher():
        return _as_rank(config, json_path, plot_path, hooks, say)
    if nproc is not None and nproc > 1:
        return _launch(nproc, argv, json_path, plot_path, say)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from resilient.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return _as_rank(config, json_path, plot_path, hooks, say)


def _as_rank(
    config: PreflightConfig,
    json_path: str | None,
    plot_path: str | None,
    hooks: Sequence[Any],
    say: Any,
) -> int:
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        _join(backend, config.budget_s + GROUP_TIMEOUT_GRACE_S, hooks)
        report = run_preflight(config)
    except PreflightError as e:  # a rank did not answer: a failed check, named by rank 0
        # (or by the rank that names who never joined: rank 0 may be one of them)
        speaks = getattr(e, "speaks", int(os.environ.get("RANK", "0")) == 0)
        if speaks and os.environ.get(ENV_RESULT):
            with open(os.environ[ENV_RESULT], "w") as f:
                json.dump({"error": str(e)}, f)
        elif speaks:
            print(f"error: {e}", file=sys.stderr)
        # (non-zero: torchrun stops the ranks still running, a stopped one included)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if os.environ.get(ENV_RESULT) or report.ok else 1
    if os.environ.get(ENV_RESULT):
        with open(os.environ[ENV_RESULT], "w") as f:
            json.dump(report.to_dict(), f)
        return 0
    return _output(report, json_path, plot_path, say)


def _join(backend: str, timeout_s: float, hooks: Sequence[Any]) -> None:
    """Form the group; where a rank never joins it within ``timeout_s``, a ``PreflightError``
    naming the ranks that never came (each rank says so in the launcher's store before it joins):
    rank 0's, or, when rank 0 is one of them, the lowest rank that came; the others point at
    that rank.  It was the store's bare timeout error, naming no rank.  The marks are kept only
    where every node names the attempt alike (under ``resilient launch``: its rendezvous round;
    or on one node): torchrun's restart count is each node's own, and a mark of another attempt
    would vouch for a rank that never came."""
    from resilient.health.attach import agent_store, attempt_key
    from resilient.health.heartbeat import ENV_ROUND
    from resilient.launch import init_process_group

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    base = f"resilient/preflight/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{attempt_key()}"
    shared = os.environ.get(ENV_ROUND) is not None or os.environ.get("LOCAL_WORLD_SIZE") == str(
        world
    )
    store = None
    if world > 1 and shared:
        try:
            store = agent_store(timeout_s=min(timeout_s, 30.0))
            if store is not None:
                store.set(f"{base}/joining/{rank}", socket.gethostname())
        except Exception:  # (then the error below names no rank)
            store = None
    try:
        init_process_group(backend, timeout_s=timeout_s, detect=False, hooks=hooks)
    except RuntimeError as e:  # the store's timeout (DistStoreError), a connection refused
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        came = None
        if store is not None:
            try:
                came = [r for r in range(world) if store.check([f"{base}/joining/{r}"])]
            except Exception:
                came = None
        namer = 0 if came is None or 0 in came else min(came, default=0)
        if rank != namer:
            raise PreflightError(
                f"preflight: rank {rank} ({socket.gethostname()}): the process group did not form "
                f"within {timeout_s:g} s ({first}); rank {namer} names the ranks that never "
                f"joined"
            ) from e
        missing = [r for r in range(world) if r not in came] if came is not None else []
        who = (
            f"{_ranks_phrase(missing)} never joined the process group"
            if missing
            else "the process group did not form (which rank is missing is not known here)"
        )
        error = PreflightError(
            f"preflight: {who} within {timeout_s:g} s (the budget and "
            f"{GROUP_TIMEOUT_GRACE_S:g} s for the start; {first}); expected all {world} ranks "
            f"to start preflight: look for a rank stuck or slow before it (imports, a shared "
            f"filesystem, a hook) or a lost process on "
            f"{'its' if len(missing) == 1 else 'their'} host, then run preflight again"
        )
        error.speaks = True  # (this rank says it, rank 0 or not: _as_rank)
        raise error from e


def _output(report: PreflightReport, json_path: str | None, plot_path: str | None, say) -> int:
    from resilient.preflight.report import plot, print_report

    print_report(report)
    if json_path:
        report.write_json(json_path)
        say(f"report: {json_path}")
    if plot_path:
        plot(report, plot_path)
        say(f"plot: {plot_path}")
    return 0 if report.ok else 1


def _launch(nproc: int, argv: Sequence[str], json_path, plot_path, say) -> int:
    """Start ``nproc`` local ranks of ``resilient preflight`` through torchrun; print their
    report here."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from resilient import forkserver
    from resilient.launch import free_port

    fd, result = tempfile.mkstemp(prefix="resilient-preflight-", suffix=".json")
    os.close(fd)
    os.environ[ENV_RESULT] = result
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    flags = [
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
    ]
    rank = ["-m", "resilient.cli", "preflight", *argv]
    server = None
    if forkserver.enabled():
        # the ranks fork from one server that imported torch and the checks once, not each its
        # own interpreter (resilient/forkserver.py; a new interpreter, not this process: a rank
        # leaving through this stack would run this function's cleanup)
        server = forkserver.start(["torch", "typer", "resilient.preflight.runner"])
        rank = [*forkserver.STAND_IN, *rank]
    try:
        failed = None
        try:
            torchrun([*flags, *rank])
        except ChildFailedError as e:
            failed = e
        with open(result) as f:
            text = f.read()
        unanswered = json.loads(text).get("error") if text.startswith('{"error"') else None
        if unanswered is not None:  # rank 0 named the ranks that stopped answering
            print(f"error: {unanswered}", file=sys.stderr)
            return 1
        if failed is not None:
            print(f"error: a preflight rank failed: {failed}", file=sys.stderr)
            return 2
        if not text:
            raise ValueError("rank 0 wrote no report")
        report = PreflightReport.from_dict(json.loads(text))
    except ValueError as e:
        print(f"error: the preflight ranks returned no report ({e})", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            forkserver.stop(server)
        os.environ.pop(ENV_RESULT, None)
        os.unlink(result)
    return _output(report, json_path, plot_path, say)
