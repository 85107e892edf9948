"""resilient preflight: the arithmetic (bus bandwidth, splits, pair schedules, outliers) without
processes; the report, its JSON, table and plot; storage and device checks in one process; and the
checks on real gloo groups of 2 and 3 ranks.  Fault injection (a slow rank, a slow link) is in
tests/integration/test_preflight_chaos.py."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from resilient.errors import PreflightError, StorageError
from resilient.preflight import PreflightConfig, PreflightReport, run_preflight
from resilient.preflight import device as dev
from resilient.preflight import storage as pstorage
from resilient.preflight.collectives import bus_factor, message_sizes, uneven_splits
from resilient.preflight.group import Group
from resilient.preflight.links import (
    LinkPlan,
    confirm_links,
    matchings,
    pair_rounds,
    plan_links,
    run_links,
)
from resilient.preflight.outliers import FIGURES, link_outliers, rank_outliers, suspect_links
from resilient.preflight.report import build_report, plot, print_report
from tests.dist import run_distributed

GiB, MiB = 1 << 30, 1 << 20


# --- arithmetic ----------------------------------------------------------------------------------


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 4) == 1.0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        bus_factor("gather", 4)


def test_message_sizes_span_4_kib_to_256_mib():
    sizes = message_sizes(4 << 10, 256 << 20)
    assert sizes[0] == 4096 and sizes[-1] == 256 << 20 and len(sizes) == 17
    assert message_sizes(5000, 20000) == [8192, 16384]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_all_to_all_splits_are_uneven_and_consistent(n):
    count = 1000 * n + 7
    splits = [uneven_splits(count, n, r) for r in range(n)]
    for r, (ins, outs) in enumerate(splits):
        assert sum(ins) == count
        assert outs == [splits[p][0][r] for p in range(n)]  # what p sends r
        assert len(set(ins)) > 1  # uneven
        assert abs(sum(outs) - count) < n * n


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("concurrent", [False, True])
def test_pair_rounds_cover_every_ordered_pair_once(n, concurrent):
    rounds = pair_rounds(n, concurrent)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted((i, j) for i in range(n) for j in range(n) if i != j)
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))  # no rank twice in a round
    if concurrent:
        assert len(rounds) == 2 * (n - 1 + n % 2)  # the circle method, not n(n-1)


def test_pair_rounds_go_concurrent_past_eight_ranks():
    assert len(pair_rounds(8)) == 56 and len(pair_rounds(16)) == 30


@pytest.mark.parametrize("n", [9, 16, 17, 1023, 1024])
def test_sampled_rounds_meet_evenly_spread_peers_both_ways(n):
    every = matchings(n)
    assert len(every) == n - 1 + n % 2
    rounds = pair_rounds(n, True, partners=3)
    assert len(rounds) == 2 * (3 + n % 2)  # an odd world leaves one rank out of each matching
    met: dict[int, set[int]] = {}
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))  # no rank twice in a round
        for a, b in r:
            met.setdefault(a, set()).add(b)
    pairs = {p for r in rounds for p in r}
    assert pairs == {(b, a) for a, b in pairs}  # both directions of every pair met
    assert len(pairs) == len([p for r in rounds for p in r])  # no pair twice
    assert len(met) == n and min(len(peers) for peers in met.values()) >= 3  # every rank, 3+
    step = len(every) / (3 + n % 2)
    assert rounds[0] == every[0] and rounds[2] == every[int(step)]  # spread, not the first
    with pytest.raises(ValueError, match="partners must be >= 1"):
        pair_rounds(n, True, partners=0)


def test_link_plan_shrinks_to_the_budget():
    plan = plan_links(world=4, budget_s=1.0, est_bytes_per_s=1e9, message_bytes=4 * MiB)
    assert (plan.message_bytes, plan.repeats, plan.partners) == (4 * MiB, 5, None)
    assert plan.sends >= 1 and plan.cuts == [] and len(plan.rounds) == 12
    plan = plan_links(world=4, budget_s=0.01, est_bytes_per_s=1e8, message_bytes=4 * MiB)
    assert (plan.message_bytes, plan.sends, plan.repeats) == (64 << 10, 1, 3)
    assert plan.cuts == [
        "pairwise links: 64 KiB messages instead of 4 MiB (budget)",
        "pairwise links: 3 samples per pair instead of 5 (budget)",
    ]


def test_the_link_plan_fits_the_slowest_pairs_samples_in_the_budget():
    # one pair at 1 MiB/s, the other at 1 GB/s: 4 MiB messages took 4 s a sample on it
    slow = MiB
    kwargs = dict(world=2, budget_s=0.6, est_bytes_per_s=1e9, message_bytes=4 * MiB)
    plan = plan_links(**kwargs, slowest_bytes_per_s=slow)
    assert plan.repeats * plan.sends * plan.message_bytes / slow <= 0.6
    assert plan.repeats >= 3 and plan.message_bytes >= 64 << 10
    assert plan_links(**kwargs).message_bytes == 4 * MiB  # (the median alone fits it)


def _plan_cost(plan, world, est, sync_s, connect_s):
    matchings_run = len(plan.rounds) // 2
    per_round = plan.sends * plan.message_bytes / est + sync_s + 2e-4
    return len(plan.rounds) * plan.repeats * per_round + matchings_run * connect_s


@pytest.mark.parametrize("world", [1023, 1024])
def test_a_thousand_ranks_meet_a_few_peers_each_within_the_budget(world):
    """Every round pays a barrier: at 1,024 ranks and 2 ms a barrier, 2(n-1) rounds of 3
    samples take 12 s alone, so the plan meets fewer peers, never below three, and keeps
    messages large enough to measure bandwidth."""
    kw = dict(world=world, est_bytes_per_s=10e9, message_bytes=4 * MiB, sync_s=2e-3)
    plan = plan_links(budget_s=9.0, connect_s=0.05, **kw)
    assert 3 <= plan.partners < world - 1
    assert len(plan.rounds) == 2 * (plan.partners + world % 2)
    assert _plan_cost(plan, world, 10e9, 2e-3, 0.05) <= 9.0
    # a sample keeps a millisecond's bytes or more (4 MiB at 10 GB/s): peers went before those
    assert plan.message_bytes == 4 * MiB and plan.repeats == 5
    assert any(
        f"met {plan.partners} or more of its {world - 1} peers (budget)" in c for c in plan.cuts
    )
    tight = plan_links(budget_s=1e-3, **kw)
    assert tight.partners == 3  # the floor: over budget rather than blind
    assert (tight.message_bytes, tight.sends, tight.repeats) == (64 << 10, 1, 3)
    quick = plan_links(world=64, budget_s=60.0, est_bytes_per_s=1e9, message_bytes=MiB, quick=True)
    assert quick.partners == 4 and "(the quick subset)" in quick.cuts[-1]
    roomy = plan_links(world=16, budget_s=60.0, est_bytes_per_s=1e9, message_bytes=MiB)
    assert roomy.partners is None and len(roomy.rounds) == 30  # all of them fit
    assert roomy.cuts == [] and roomy.message_bytes == MiB


def test_the_barrier_is_paid_with_fewer_sends_not_smaller_messages():
    slow_barrier = plan_links(
        world=4, budget_s=9.0, est_bytes_per_s=1e9, message_bytes=4 * MiB, sync_s=5e-3
    )
    assert slow_barrier.message_bytes == 4 * MiB and slow_barrier.cuts == []
    assert _plan_cost(slow_barrier, 4, 1e9, 5e-3, 0.0) <= 9.0


def test_a_slow_node_is_named_alone_in_a_sampled_odd_world():
    """Three peers each in a world of 1,023: rank 341 slow; nobody else, though rank 0 and the
    others left out of a matching meet one peer more or less."""
    n = 1023
    rounds = pair_rounds(n, True, partners=3)
    matrix = [[None] * n for _ in range(n)]
    for r in rounds:
        for a, b in r:
            matrix[a][b] = 0.1 * GiB if 341 in (a, b) else 2 * GiB
    found = link_outliers(matrix, 0.7)
    assert [(o.kind, o.rank) for o in found] == [("rank", 341)]


# --- outliers --------------------------------------------------------------------------------


def test_a_slow_rank_is_named_with_its_figure_and_the_median():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    values = {0: 9.8 * GiB, 1: 10.0 * GiB, 2: 3.1 * GiB, 3: 9.6 * GiB}
    (o,) = rank_outliers(values, FIGURES["memory_bytes_per_s"], 0.7, hosts)
    assert (o.kind, o.rank, o.host) == ("rank", 2, "b")
    assert o.message == "rank 2 (b): host memory bandwidth 3.1 GiB/s, median 9.7 GiB/s (0.32x)"
    assert rank_outliers({0: 1.0, 1: 0.75}, FIGURES["memory_bytes_per_s"], 0.7) == []
    assert rank_outliers({0: 1.0}, FIGURES["memory_bytes_per_s"], 0.7) == []  # nothing to compare


def test_a_latency_is_named_when_slower_by_the_factor_and_the_slack():
    store = FIGURES["store_round_trip_s"]
    # 23x, but 2.2 ms: a healthy rank on a busy machine (seen under a loaded test run)
    assert rank_outliers({0: 1e-4, 1: 1e-4, 2: 2.3e-3}, store, 0.7) == []
    (o,) = rank_outliers({0: 1e-4, 1: 1e-4, 2: 2e-2}, store, 0.7)
    assert o.message == "rank 2: store round trip 20 ms, median 100 us (200x)"


def _matrix(n, value, slow=None, slow_rank=None):
    m = [[None if i == j else value for j in range(n)] for i in range(n)]
    if slow:
        m[slow[0]][slow[1]] = slow[2]
    if slow_rank is not None:
        for k in range(n):
            if k != slow_rank:
                m[slow_rank][k] = m[k][slow_rank] = value / 4
    return m


def test_one_slow_link_is_named_and_no_rank():
    found = link_outliers(_matrix(4, 2 * GiB, slow=(1, 3, 0.4 * GiB)), 0.7)
    assert [o.message for o in found] == ["link 1->3: 410 MiB/s, median 2 GiB/s (0.2x)"]
    assert (found[0].src, found[0].dst, found[0].kind) == (1, 3, "link")


def test_a_slow_node_is_named_once_not_as_its_links():
    found = link_outliers(_matrix(4, 2 * GiB, slow_rank=2), 0.7, {r: "h" for r in range(4)})
    assert [o.message for o in found] == [
        "rank 2 (h): pairwise send/recv bandwidth (median of its links) 512 MiB/s, median "
        "2 GiB/s (0.25x)"
    ]
    assert link_outliers(_matrix(3, 2 * GiB), 0.7) == []


def test_the_links_to_measure_again_are_the_named_ones_slowest_first():
    assert suspect_links(_matrix(4, 2 * GiB, slow=(1, 3, 0.4 * GiB)), 0.7) == [(1, 3)]
    m = _matrix(4, 2 * GiB, slow_rank=2)
    m[0][2] = 0.1 * GiB
    # a named rank: every link it has, not only the slowest
    assert suspect_links(m, 0.7) == [(0, 2), (1, 2), (2, 0), (2, 1), (2, 3), (3, 2)]
    assert suspect_links(_matrix(3, 2 * GiB), 0.7) == []


# --- the report ------------------------------------------------------------------------------


def _rank(rank, memory, failures=()):
    return {
        "rank": rank,
        "host": f"node{rank // 2}",
        "local_rank": rank % 2,
        "failures": list(failures),
        "memory_bytes_per_s": memory,
        "numpy_copy_bytes_per_s": 5 * GiB,
        "matmul_flops_per_s": 2e10,
        "store_round_trip_s": 2e-4,
        "h2d_bytes_per_s": None,
        "d2h_bytes_per_s": None,
        "measured_again": ["memory_bytes_per_s"],
        "device": {
            "kind": "cpu",
            "name": "cpu",
            "matmul_check": {"n": 256, "ok": True, "mismatches": 0, "max_error": 0.0},
            "vendor": {"tool": None, "note": "no GPU on this rank: ECC counters skipped"},
        },
    }


def _report(memory=(8, 8, 2, 8), matrix=None, failures=None):
    ranks = [_rank(r, m * GiB, (failures or {}).get(r, ())) for r, m in enumerate(memory)]
    collectives = [
        {
            "op": op,
            "size_bytes": s,
            "bytes": s,
            "iters": 5,
            "time_s": s / GiB,
            "algbw_bytes_per_s": GiB,
            "busbw_bytes_per_s": GiB * bus_factor(op, 4),
        }
        for op in ("all_reduce", "all_to_all")
        for s in (4096, 8192)
    ]
    return build_report(
        config=PreflightConfig(factor=0.7, budget_s=10),
        ranks=ranks,
        matrix=matrix or _matrix(4, GiB, slow=(0, 1, 0.1 * GiB)),
        link_plan={"message_bytes": MiB, "sends_per_sample": 4, "repeats": 5, "schedule": "x"},
        collectives=collectives,
        backend="gloo",
        device="cpu",
        used_s=3.5,
        timings_s={"local": 1.0},
        skipped=["checkpoint storage: no --checkpoint-url given"],
        cut=["all_reduce: 16 KiB..256 MiB not run (budget)"],
    )


def test_the_report_names_outliers_fails_and_round_trips_through_json(tmp_path):
    report = _report(failures={1: ["rank 1 (node0): a 256x256 matmul got 3 entries wrong"]})
    assert not report.ok
    assert report.failures == [
        "rank 1 (node0): a 256x256 matmul got 3 entries wrong",
        "rank 2 (node1): host memory bandwidth 2 GiB/s, median 8 GiB/s (0.25x)",
        "link 0->1 (node0 -> node0): 102 MiB/s, median 1 GiB/s (0.1x)",
    ]
    assert report.medians["memory_bytes_per_s"] == 8 * GiB
    assert report.figures["memory_bytes_per_s"][2] == 2 * GiB
    assert "no GPU on this rank: ECC counters skipped" in report.skipped
    path = tmp_path / "r.json"
    report.write_json(str(path))
    data = json.loads(path.read_text())
    assert data["outliers"][0]["ratio"] == pytest.approx(0.25) and data["budget_s"] == 10
    assert data["links"]["matrix_bytes_per_s"][0][0] is None
    again = PreflightReport.from_dict(data)
    assert again == report
    # a report written before a field was added reads with its default; one with a field added
    # later reads without it
    older = {k: v for k, v in data.items() if k != "measured_again"}
    read = PreflightReport.from_dict({**older, "added_later": 1})
    assert read.measured_again == [] and report.measured_again == ["memory_bytes_per_s"]
    assert dataclasses.replace(read, measured_again=report.measured_again) == report
    with pytest.raises(ValueError, match="version 9"):
        PreflightReport.from_dict({**data, "version": 9})


def test_a_clean_report_passes():
    report = _report(memory=(8, 8, 7, 8), matrix=_matrix(4, GiB))
    assert report.ok and report.failures == [] and report.outliers == []


def test_the_table_shows_every_section():
    from rich.console import Console

    console = Console(record=True, width=200)
    print_report(_report(), console)
    text = console.export_text()
    for expected in (
        "memory",
        "node1",
        "all_to_all",
        "4 KiB",
        "from\\to",
        "cut: all_reduce: 16 KiB..256 MiB",
        "FAILED rank 2 (node1): host memory bandwidth 2 GiB/s",
        "skipped: checkpoint storage",
        "per-rank figures: host memory bandwidth named a rank at first and was measured again",
    ):
        assert expected in text, expected


def test_the_plot_draws_both_panels(tmp_path):
    path = tmp_path / "p.png"
    plot(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'resilient\[plot\]'"):
        plot(_report(), str(tmp_path / "p.png"))
    from resilient.cli import app

    out = CliRunner().invoke(app, ["preflight", "--plot", str(tmp_path / "p.png")])
    assert out.exit_code == 2 and "needs matplotlib" in out.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--factor", "1.5"], "--factor 1.5: must be between 0 and 1"),
        (["--budget-s", "0"], "--budget-s 0.0: must be a finite number > 0 of seconds"),
        (["--budget-s", "inf"], "--budget-s inf: must be a finite number > 0 of seconds"),
        (["--budget-s", "1e300"], "--budget-s 1e+300: must be a finite number > 0 of seconds, "
         "at most 86400 (a day); the default is 45"),
        (["--storage-options", "{"], "--storage-options '{': not JSON (Expecting property name"),
        (["--storage-options", "[" * 100_000], "--storage-options '[[[[[[[[[[[[[[[[[[[[[[[[[[[["),
        (["--storage-options", "[1]"], "--storage-options must be a JSON object"),
        (["--nproc", "0"], "--nproc 0: expected a number of local ranks from 1 to 4096"),
        (["--nproc", "100000"], "--nproc 100000: expected a number of local ranks from 1 to 4096"),
    ],
)  # fmt: skip
def test_bad_usage_exits_2_naming_the_flag(monkeypatch, args, message):
    from resilient.cli import app

    def measured(*args, **kwargs):  # (--nproc 100000 would start its ranks here)
        raise AssertionError("measured, not refused")

    monkeypatch.setattr("resilient.preflight.preflight_main", measured)
    out = CliRunner().invoke(app, ["preflight", *args])
    assert out.exit_code == 2 and message in out.output, out.output


@pytest.mark.parametrize(
    "args,factor",
    [
        ([], 0.7),
        (["--quick"], 0.5),
        (["--quick", "--factor", "0.7"], 0.7),
        (["--factor", "0.3"], 0.3),
    ],
)
def test_the_quick_subset_judges_at_run_preflights_factor(monkeypatch, args, factor):
    """--quick passed the command's 0.7 into quick_check, over its 0.5: stricter than the
    Run(preflight=True) subset it says it runs.  Its own factor unless --factor is given."""
    from resilient import cli

    seen = {}

    def main(config, **kwargs):
        seen["config"], seen["argv"] = config, kwargs["argv"]
        return 0

    monkeypatch.setattr("resilient.preflight.preflight_main", main)
    out = CliRunner().invoke(cli.app, ["preflight", *args])
    assert out.exit_code == 0, out.output
    assert seen["config"].factor == factor
    assert seen["argv"][seen["argv"].index("--factor") + 1] == repr(factor)  # the ranks' too
    if args == ["--quick"]:
        assert seen["config"].factor == PreflightConfig.quick_check().factor


def test_bad_report_paths_exit_2_before_measuring(tmp_path, monkeypatch):
    """A --json naming a directory, a --plot format matplotlib cannot write (both failed with a
    traceback after the measurements), and --json equal to --plot (the plot overwrote the
    report): refused before any measurement."""
    pytest.importorskip("matplotlib")
    from resilient import cli

    def measured(*args, **kwargs):
        raise AssertionError("measured before refusing the paths")

    monkeypatch.setattr("resilient.preflight.preflight_main", measured)
    (tmp_path / "adir").mkdir()
    same = str(tmp_path / "same.png")
    cases = [
        (["--json", str(tmp_path / "adir")], f"--json {tmp_path / 'adir'}: is a directory"),
        (["--plot", str(tmp_path / "adir")], f"--plot {tmp_path / 'adir'}: is a directory"),
        (["--plot", str(tmp_path / "p.x")], "matplotlib cannot write .x files; expected one of"),
        (["--json", same, "--plot", same], "the same file (the plot would overwrite the report)"),
        (
            ["--json", same, "--plot", str(tmp_path / "adir" / ".." / "same.png")],
            "the same file",
        ),
    ]
    for args, message in cases:
        out = CliRunner().invoke(cli.app, ["preflight", *args])
        assert out.exit_code == 2 and message in out.output, (args, out.output)
        assert "Traceback" not in out.output


def test_the_command_lists_its_flags():
    from resilient.cli import app

    out = CliRunner().invoke(app, ["preflight", "--help"], terminal_width=200)
    for flag in ("--nproc", "--json", "--checkpoint-url", "--budget-s", "--plot", "--factor"):
        assert flag in out.output


# --- device and storage, in this process -------------------------------------------------------


def test_the_matmul_check_knows_the_exact_product():
    check = dev.matmul_check(torch.device("cpu"), 100)
    assert check == {"n": 100, "ok": True, "mismatches": 0, "max_error": 0.0}
    a, b = dev._operands(37, torch.device("cpu"))
    assert torch.equal(a @ b, dev._expected(37, torch.device("cpu")))


def test_vendor_counters_are_parsed_and_judged():
    ecc = "0, 00000000:19:00.0, 0, 12\n1, 00000000:3B:00.0, [N/A], [N/A]\n"
    assert dev.parse_nvidia_ecc(ecc) == [
        {"index": 0, "pci_bus_id": "00000000:19:00.0", "uncorrected": 0, "corrected": 12},
        {"index": 1, "pci_bus_id": "00000000:3B:00.0", "uncorrected": None, "corrected": None},
    ]
    remap = dev.parse_nvidia_remap("00000000:19:00.0, 0, 2, No, Yes\n")
    assert remap["00000000:19:00.0"] == {
        "remapped_correctable": 0,
        "remapped_uncorrectable": 2,
        "remap_pending": False,
        "remap_failure": True,
    }
    amd = {"gpu_0": {"ecc": {"total_correctable_count": 3, "total_uncorrectable_count": 1}}}
    assert dev.parse_amd_json(json.dumps([amd])) == {"uncorrected": 1, "corrected": 3}
    judged = dev._judge("nvidia-smi", {"uncorrected": 2, "remap_failure": True}, "GPU 0 (x)")
    assert judged["failures"] == [
        "GPU 0 (x): 2 uncorrected ECC errors since the driver loaded (expected 0); drain this "
        "node and have its GPU checked (reset or replace)",
        "GPU 0 (x): row remapping failed (expected none); the GPU needs replacing",
    ]
    assert dev._judge("nvidia-smi", {"uncorrected": 0, "corrected": 5}, "GPU 0")["failures"] == []
    assert "skipped" in dev.vendor_counters({"kind": "cpu"})["note"]


def test_storage_check_works_in_a_scratch_directory_and_leaves_nothing(tmp_path):
    url = tmp_path / "ckpt"
    (url / "step_00000001").mkdir(parents=True)
    (url / "step_00000001" / "MANIFEST.json").write_text("keep")
    store = pstorage.open_storage(str(url), None)
    scratch = pstorage.scratch_name()
    assert pstorage.make_scratch(store, scratch) is False
    got = pstorage.storage_sample(store, scratch, 0, 1 << 20)
    assert got["bytes"] == 1 << 20 and got["write_bytes_per_s"] > 0 and got["first_byte_s"] > 0
    pstorage.remove_scratch(store, scratch)
    assert sorted(p.name for p in url.iterdir()) == ["step_00000001"]
    assert (url / "step_00000001" / "MANIFEST.json").read_text() == "keep"
    with pytest.raises(StorageError, match="nosuchprotocol"):
        pstorage.open_storage("nosuchprotocol://bucket/x", None)


def test_the_storage_check_compares_every_block_read_back_not_the_first_only(tmp_path):
    """The file is 1 MiB blocks of the same random bytes; only the first block read back was
    compared, so a store that returns zeros past the first MiB passed."""
    store = pstorage.open_storage(str(tmp_path / "ckpt"), None)
    scratch = pstorage.scratch_name()
    pstorage.make_scratch(store, scratch)
    read_into = store.read_into

    def zeroed_tail(rel, offset, buf):
        n = read_into(rel, offset, buf)
        start = max((3 << 20) - offset, 0)  # the last of four blocks lost
        if start < len(buf):
            buf[start:] = bytes(len(buf) - start)
        return n

    store.read_into = zeroed_tail
    # (the first 4 bytes of a block stamp the rank, 0 here: zeros too)
    with pytest.raises(StorageError, match=r"at byte 3145732, in the block at byte 3145728\)"):
        pstorage.storage_sample(store, scratch, 0, 4 << 20)
    store.read_into = read_into
    assert pstorage.storage_sample(store, scratch, 0, 4 << 20)["bytes"] == 4 << 20
    pstorage.remove_scratch(store, scratch)


def test_the_storage_check_catches_repeated_parts_and_ignored_offsets(tmp_path):
    """Every block written was the same random block and the only ranged read was 1 byte at
    offset 0: a store that writes its first part again and again, or whose ranged reads ignore
    the offset, passed."""
    store = pstorage.open_storage(str(tmp_path / "ckpt"), None)
    scratch = pstorage.scratch_name()
    pstorage.make_scratch(store, scratch)
    write_file, read_range = store.write_file, store.read_range

    def first_part_only(rel, parts, **kwargs):
        parts = list(parts)
        return write_file(rel, [parts[0]] * len(parts), **kwargs)

    store.write_file = first_part_only
    with pytest.raises(StorageError, match=r"at byte 1048580, in the block at byte 1048576\)"):
        pstorage.storage_sample(store, scratch, 3, 4 << 20)  # (bytes 4-7: the block's index)
    store.write_file = write_file

    def offset_ignored(rel, start, end):
        return read_range(rel, 0, end - start)

    store.read_range = offset_ignored
    with pytest.raises(StorageError, match=r"read back 4194304 bytes that differ") as e:
        pstorage.storage_sample(store, scratch, 3, 4 << 20)
    at = int(str(e.value).split("first difference at byte ")[1].split(",")[0])
    assert 3 << 20 < at < 4 << 20  # inside the last block, where the ranged read was
    assert "do not checkpoint there" in str(e.value)
    store.read_range = read_range
    assert pstorage.storage_sample(store, scratch, 3, 4 << 20)["bytes"] == 4 << 20
    pstorage.remove_scratch(store, scratch)


def test_a_world_of_one_runs_every_local_check(tmp_path):
    """No process group: device, memory, storage; links, collectives and the store skipped."""
    url = str(tmp_path / "new")
    report = run_preflight(PreflightConfig.quick_check(budget_s=1.0, checkpoint_url=url))
    assert report.ok, report.failures
    assert report.world_size == 1 and report.figures["memory_bytes_per_s"][0] > 0
    assert report.ranks[0]["storage"]["bytes"] >= 4 << 20
    assert report.figures["numpy_copy_bytes_per_s"][0] > 0
    assert "pairwise links and collectives: a world of one" in report.skipped
    assert "store round trip: no process group (a world of one)" in report.skipped
    assert not os.path.exists(url)  # it did not exist: created for the check, and removed


def test_unwritable_storage_fails_the_check(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    report = run_preflight(
        PreflightConfig.quick_check(budget_s=0.5, checkpoint_url=str(blocker / "ckpt"))
    )
    assert not report.ok
    (failure,) = report.failures
    assert failure.startswith(f"rank 0 ({report.hosts[0]}): checkpoint URL {blocker}/ckpt")
    assert "check the URL, its credentials and free space" in failure


# --- real process groups ---------------------------------------------------------------------


def _quick(rank, world):
    report = run_preflight(PreflightConfig.quick_check(budget_s=2.0)).to_dict()
    # a sampled plan (as past eight ranks): every rank meets one peer or more
    rounds = pair_rounds(3, True, partners=1)
    matrix, _ = run_links(Group(), LinkPlan(4096, 1, 1, rounds, partners=1))
    # a burst of load made link 0->2 look a thousandth of the rest: measured again alone, it
    # gets its real figure (the better of the two) and is not named; 2->1 was not a suspect
    fast = None
    if rank == 0:
        fast = [row[:] for row in matrix]
        fast[0][2], fast[2][1] = 1.0, 2.0
    again, ran = confirm_links(
        Group(), fast, [(0, 2)] if rank == 0 else None, message_bytes=4096, sends=1
    )
    return report, matrix, rounds, again, ran


def _full(rank, world):
    config = PreflightConfig(budget_s=4.0, max_bytes=64 << 10, factor=0.1)
    return run_preflight(config).to_dict()


@pytest.mark.distributed
def test_quick_preflight_on_three_ranks():
    out = run_distributed(_quick, 3)
    reports = [r for r, *_ in out]
    r = reports[0]
    # rank 0 has the whole report; the others the verdict: the same but for the n^2 matrix and
    # each rank's detail
    verdict = {**r, "links": {k: v for k, v in r["links"].items() if "matrix" not in k}}
    assert reports[1] == reports[2] == {**verdict, "ranks": []}
    assert r["world_size"] == 3 and r["quick"] and len(r["ranks"]) == 3
    assert r["links"]["peers_per_rank"] == 2 and r["links"]["barrier_s"] > 0
    matrix = r["links"]["matrix_bytes_per_s"]
    assert [matrix[i][i] for i in range(3)] == [None] * 3
    assert all(matrix[i][j] > 0 for i in range(3) for j in range(3) if i != j)
    (_, sampled, rounds, again, ran) = out[0]
    assert ran == {"measured_again": 1} and out[1][3:] == (None, {"measured_again": 1})
    assert again[0][2] > 1e5 and again[2][1] == 2.0 and again[0][1] == sampled[0][1]
    assert r["links"]["measured_again"] >= 0  # whatever looked slow (load) was measured again
    met = {tuple(p) for rd in rounds for p in rd}
    assert len(met) == 4  # two matchings (three ranks: one sits out each), both ways
    for i in range(3):
        for j in range(3):
            assert (sampled[i][j] is not None) == ((i, j) in met), (i, j, sampled)
    (row,) = r["collectives"]
    assert row["op"] == "all_reduce" and row["size_bytes"] == 1 << 20
    assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * 4 / 3)
    assert all(v > 0 for v in r["figures"]["store_round_trip_s"])


def _rank_1_stops(rank, world):
    # rank 1 stops (SIGSTOP: a frozen process) in the middle of the checks; the group's and the
    # store's timeout are 5 s here (the command's: the budget + GROUP_TIMEOUT_GRACE_S)
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.preflight import links as links_mod
    from resilient.preflight import runner

    store = dist.distributed_c10d._get_default_store()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=5))
    store.set_timeout(timedelta(seconds=5))
    runner.ANSWER_WAIT_S = 2.0
    if rank == 1:
        store.set("test/pid-1", str(os.getpid()))

        def stop(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("continued")  # (by rank 0, once it has its answer)

        links_mod.probe_links = stop
    t0 = time.monotonic()
    try:
        run_preflight(PreflightConfig.quick_check(budget_s=1.0))
        message = None
    except PreflightError as e:
        message = str(e)
    took = time.monotonic() - t0
    store.set_timeout(timedelta(seconds=60))
    if rank == 0:
        os.kill(int(store.get("test/pid-1")), signal.SIGCONT)
        store.get("test/done-1")  # (the store lives in this process: rank 1 still needs it)
    else:
        store.set("test/done-1", "1")
    return message, took


@pytest.mark.distributed
def test_a_frozen_rank_is_named_after_the_groups_timeout_not_waited_for():
    (message, took), (other, _) = run_distributed(_rank_1_stops, 2, timeout_s=120)
    assert message is not None and message.startswith("preflight: rank 1 did not answer: ")
    assert "expected every rank to take part in every check" in message
    assert "run preflight again" in message
    assert took < 60  # 5 s of timeout and 2 s of waiting for answers (the bug: forever)
    assert other is not None and other.startswith("preflight: rank 1 (")
    assert "rank 0 names the ranks that did not answer" in other


_NEVER_JOINS = """
import os, sys, time
from resilient.preflight import PreflightConfig, preflight_main, runner
if os.environ["RANK"] == sys.argv[1]:
    time.sleep(600)  # stuck before it ever joins (an import, a shared filesystem)
runner.GROUP_TIMEOUT_GRACE_S = 3.0  # (the command's is 60 s of start-up)
sys.exit(preflight_main(PreflightConfig.quick_check(budget_s=1.0)))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("stuck", ["1", "0"])
def test_a_rank_that_never_joins_is_named(tmp_path, stuck):
    """Rank 0 waited out the group's timeout and died of the store's bare DistStoreError; where
    rank 0 was the one stuck, nobody said which rank was (the others pointed at rank 0)."""
    from resilient.launch import free_port

    script = tmp_path / "never_joins.py"
    script.write_text(_NEVER_JOINS)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", "0", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), stuck],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"error: preflight: rank {stuck} never joined the process group within 4 s (the budget "
        f"and 3 s for the start; "
    ) in proc.stderr, proc.stderr[-3000:]
    assert "expected all 2 ranks to start preflight" in proc.stderr
    assert "DistStoreError" not in proc.stderr


def test_the_commands_group_timeout_follows_the_budget(monkeypatch):
    from resilient.preflight import runner

    seen = {}

    def init(backend, *, timeout_s, **kwargs):
        seen["timeout_s"] = timeout_s
        raise SystemExit(0)  # (not joining any group)

    monkeypatch.setattr("resilient.launch.init_process_group", init)
    with pytest.raises(SystemExit):
        runner._as_rank(PreflightConfig(budget_s=3.0), None, None, (), print)
    # the start-up and some tens of seconds past the budget (it was max(300, 4 x the budget))
    assert 3.0 < seen["timeout_s"] <= 3.0 + 120


@pytest.mark.distributed
def test_full_preflight_times_every_collective_over_sizes():
    r = run_distributed(_full, 2)[0]
    ops = {c["op"] for c in r["collectives"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    for c in r["collectives"]:
        assert c["algbw_bytes_per_s"] == pytest.approx(c["bytes"] / c["time_s"])
        assert c["busbw_bytes_per_s"] == pytest.approx(
            c["algbw_bytes_per_s"] * bus_factor(c["op"], 2)
        )
    sizes = sorted({c["size_bytes"] for c in r["collectives"] if c["op"] == "all_reduce"})
    assert sizes[0] == 4096 and sizes[-1] <= 64 << 10
    assert set(r["timings_s"]) >= {"device", "local", "links", "collectives"}
    assert r["used_s"] > 0 and r["budget_s"] == 4.0


def _slowed_in_the_first_pass(rank, world):
    """Rank 1's torch figures in the first pass of per-node figures come out a thousandth of what
    it measured (a burst of load that took its turns, made certain: on a busy machine a healthy
    rank's own figures move 10x), the second pass's as measured."""
    from resilient.preflight import runner

    passes = []
    first_pass, sample = runner._Bench.rounds, runner._Bench._sample

    def rounds(self, keys, repeats, share_s):
        passes.append(sorted(keys))
        return first_pass(self, keys, repeats, share_s)

    def burst(self, keys, out):
        sample(self, keys, out)
        if rank == 1 and len(passes) == 1:
            for key in ("memory_bytes_per_s", "matmul_flops_per_s"):
                out[key][-1] /= 1000

    runner._Bench.rounds, runner._Bench._sample = rounds, burst
    report = run_preflight(PreflightConfig.quick_check(budget_s=2.0, factor=0.05)).to_dict()
    return report, passes


@pytest.mark.distributed
def test_a_rank_slow_for_one_pass_is_measured_again_and_not_named():
    """A CI run named a healthy rank (matmul at 0.29x of the median: other jobs took its turns);
    a figure that names a rank is now measured again on every rank, and the better pass counts."""
    out = run_distributed(_slowed_in_the_first_pass, 3, timeout_s=300)
    report, passes = out[0]
    assert report["ok"], report["failures"]
    assert {"memory_bytes_per_s", "matmul_flops_per_s"} <= set(report["measured_again"])
    # every rank ran the same passes: all figures, then the suspects
    assert all(p == passes for _, p in out) and passes[1] == report["measured_again"]
    assert len(passes) == 2 and set(passes[0]) > set(passes[1])
    slowed_pass = report["ranks"][1]["memory"]["torch_samples"]
    again_pass = report["ranks"][1]["samples_again"]["memory_bytes_per_s"]
    assert statistics.median(again_pass) > 50 * statistics.median(slowed_pass)


def _run_with_preflight(rank, world):
    from resilient import Run

    with Run(None, preflight=PreflightConfig.quick_check(budget_s=2.0, factor=0.2)) as run:
        run.track(w=torch.zeros(2))
        return [s for s in run.steps(2)]


@pytest.mark.distributed
def test_run_with_preflight_trains_when_every_rank_passes():
    assert run_distributed(_run_with_preflight, 2) == [[1, 2], [1, 2]]


def test_run_rejects_a_bad_preflight_setting():
    from resilient import Run

    with pytest.raises(ValueError, match="preflight must be True, False or a"):
        Run(None, preflight="yes")


def test_the_trainer_takes_preflight():
    from reference_trainer.__main__ import config_from, parser

    assert config_from(parser().parse_args(["--preflight"]), 1).preflight is True
    assert config_from(parser().parse_args([]), 1).preflight is False
