"""``resilient preflight`` on this machine, 2 and 4 ranks (gloo), with the anchor of each figure.

Runs the real command (``resilient preflight --nproc N --json FILE``, the default 45 s budget) and
prints a markdown table of its key figures next to what they should be compared with:

* host memory bandwidth (torch tensor copy, median over ranks) against a plain ``numpy.copyto`` of
  the same bytes, measured by preflight itself in the same turn;
* pairwise send/recv (median link) and each collective's bus bandwidth (at the largest size the
  budget ran) against the loopback TCP throughput: two processes copying the same message size over
  a 127.0.0.1 socket, which is the transport gloo itself uses here;
* the store's round trip, the matmul throughput, the budget used and what the budget cut.

    python benchmarks/preflight.py [--budget-s 45] [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from resilient.preflight.outliers import human_bytes  # noqa: E402 (this checkout's)

GiB, MiB = 1 << 30, 1 << 20


# --- the anchor: loopback TCP between two processes ------------------------------------------


def _receiver(port_q, nbytes: int, count: int, rounds: int) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(nbytes)
            view = memoryview(buf)
            for _ in range(rounds):
                for _ in range(count):
                    got = 0
                    while got < nbytes:
                        got += conn.recv_into(view[got:], nbytes - got)
                conn.sendall(b"k")  # the acknowledgement, as preflight's link samples have


def loopback_bytes_per_s(nbytes: int, count: int = 8, rounds: int = 5) -> float:
    """Median over ``rounds`` of ``count`` messages of ``nbytes`` sent over a 127.0.0.1 TCP socket
    to another process and acknowledged (bytes per second)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(q, nbytes, count, rounds + 1))
    p.start()
    port = q.get(timeout=60)
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) or 1))[:nbytes]
    rates = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            for _ in range(count):
                s.sendall(data)
            s.recv(1)
            if r:  # the first round is the warm-up
                rates.append(count * nbytes / (time.perf_counter() - t0))
    p.join(timeout=30)
    return statistics.median(rates)


# --- preflight itself ----------------------------------------------------------------------------


def run_preflight(nproc: int, budget_s: float) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "resilient.cli", "preflight", "--nproc", str(nproc)]
        cmd += ["--budget-s", str(budget_s), "--json", out]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if not os.path.exists(out):
            raise SystemExit(f"preflight --nproc {nproc} wrote no report:\n{done.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f), wall


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB/s"


def largest(report: dict, op: str) -> dict | None:
    rows = [c for c in report["collectives"] if c["op"] == op]
    return max(rows, key=lambda c: c["size_bytes"]) if rows else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=45.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()

    reports = {}
    for n in args.ranks:
        reports[n] = run_preflight(n, args.budget_s)
        print(f"preflight --nproc {n}: done", file=sys.stderr)
    link_bytes = reports[args.ranks[0]][0]["links"]["message_bytes"]
    loop_link = loopback_bytes_per_s(link_bytes)
    big = max(c["size_bytes"] for r, _ in reports.values() for c in r["collectives"])
    loop_big = loopback_bytes_per_s(big, count=4)

    cols = " | ".join(f"{n} ranks" for n in args.ranks)
    print(f"| figure | {cols} | anchor |")
    print("|---|" + "---|" * len(args.ranks) + "---|")

    def row(label: str, values: list[str], anchor: str) -> None:
        print(f"| {label} | " + " | ".join(values) + f" | {anchor} |")

    rs = [reports[n][0] for n in args.ranks]
    mem = [r["medians"]["memory_bytes_per_s"] for r in rs]
    npy = [r["medians"]["numpy_copy_bytes_per_s"] for r in rs]
    row(
        "host memory bandwidth (torch copy, median rank)",
        [f"{gib(m)} ({m / a:.2f}x numpy)" for m, a in zip(mem, npy)],
        "numpy.copyto of the same bytes: " + ", ".join(gib(a) for a in npy),
    )
    row(
        "matmul (256x256 fp32, median rank)",
        [f"{r['medians']['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s" for r in rs],
        "-",
    )
    row(
        "store round trip (median rank)",
        [f"{r['medians']['store_round_trip_s'] * 1e6:.0f} us" for r in rs],
        "-",
    )
    row(
        f"pairwise send/recv, median link ({link_bytes >> 20} MiB messages)",
        [
            f"{gib(r['links']['median_bytes_per_s'])} "
            f"({r['links']['median_bytes_per_s'] / loop_link:.2f}x)"
            for r in rs
        ],
        f"loopback TCP, {link_bytes >> 20} MiB messages: {gib(loop_link)}",
    )
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        cells = []
        for r in rs:
            c = largest(r, op)
            cells.append(
                "-"
                if c is None
                else f"{gib(c['busbw_bytes_per_s'])} at {human_bytes(c['size_bytes'])} "
                f"({c['busbw_bytes_per_s'] / loop_big:.2f}x)"
            )
        row(f"{op} bus bandwidth, largest size run", cells, f"loopback TCP: {gib(loop_big)}")
    row(
        "budget used / wall time of the command",
        [
            f"{r['used_s']:.1f} s of {r['budget_s']:g} s / {reports[n][1]:.0f} s"
            for n, r in zip(args.ranks, rs)
        ],  # fmt: skip
        "-",
    )
    row(
        "verdict", ["PASSED" if r["ok"] else "FAILED: " + "; ".join(r["failures"]) for r in rs], "-"
    )
    print()
    for n, r in zip(args.ranks, rs):
        print(f"{n} ranks, cut: " + ("; ".join(r["cut"]) or "nothing"))
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
