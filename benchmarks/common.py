"""Shared helpers for the benchmarks: timing, machine description, table output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    try:
        from resilient.checkpoint.codec import CRC32_IMPL
    except ImportError:  # a tree from before the choice of crc32 implementation
        CRC32_IMPL = "zlib"
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB RAM, torch {torch.__version__}, "
        f"Python {platform.python_version()}, crc32 by {CRC32_IMPL}"
    )


def drop_caches() -> bool:
    """Drop the page cache (root only), so the next read comes from the disk; whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def scratch(prefix: str, disk: str | None, shm: str | None) -> tuple[str, str]:
    """A directory for durable storage under ``disk`` and a memory-tier root under ``shm`` (set
    as ``RESILIENT_MEMORY_ROOT`` for this process and what it starts) for one benchmark."""
    d = tempfile.mkdtemp(prefix=prefix, dir=disk)
    m = tempfile.mkdtemp(prefix=prefix, dir=shm)
    os.environ["RESILIENT_MEMORY_ROOT"] = m
    return d, m


class Samples(dict):
    """Seconds measured, by name, in the order taken."""

    def add(self, name: str, seconds: float) -> None:
        self.setdefault(name, []).append(seconds)


def snapshot_times(
    ck, step: int, state, before: Callable[[], object] = lambda: None
) -> tuple[float, float, float, int]:
    """A memory snapshot's times: its stall with the previous one written, its background part
    (from the call's return to ``wait()``), and the stall of a snapshot taken right after another
    (back to back: it waits for the other's background part); ``before`` runs before the first
    (a device sync).  Returns them with the last step number taken."""
    ck.wait_snapshot()
    step += 1
    before()
    t0 = time.perf_counter()
    h = ck.snapshot(step, state)
    stall = time.perf_counter() - t0
    h.wait()
    write = time.perf_counter() - t0 - stall
    step += 1
    ck.snapshot(step, state)
    step += 1
    t0 = time.perf_counter()
    ck.snapshot(step, state)
    b2b = time.perf_counter() - t0
    ck.wait_snapshot()
    return stall, write, b2b, step


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def write_results(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=1))


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def fsync_dir_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def read_tree(root: str) -> int:
    """Read every file under ``root`` sequentially into one reused buffer; the bytes read.

    A fresh buffer per read would time page faults, not the disk.
    """
    buf = bytearray(64 << 20)
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            with open(os.path.join(dirpath, f), "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total
