"""The block checksum: whichever crc32 implementation is installed computes zlib's crc32, so
checkpoints written with one verify with the other."""

from __future__ import annotations

import os
import random
import signal
import zlib

import pytest

from resilient.checkpoint import codec


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 1 << 20, (1 << 20) + 13])
def test_crc32_is_zlibs_crc32(n):
    data = random.Random(n).randbytes(n)
    assert codec.crc32(data) == zlib.crc32(data)
    # a slice of a larger buffer (unaligned start), and a running value carried over
    mv = memoryview(b"x" + data)[1:]
    assert codec.crc32(mv) == zlib.crc32(data)
    assert codec.crc32(mv[n // 2 :], codec.crc32(mv[: n // 2])) == zlib.crc32(data)
    assert codec.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)


def test_block_checksums_are_zlib_crc32_of_each_block():
    data = memoryview(random.Random(0).randbytes(10 * 4096 + 100))
    want = [zlib.crc32(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    assert codec.block_checksums(data, 4096) == want
    assert codec.block_checksums(data, 4096, parallel=False) == want


def test_zlib_fallback_is_used_without_isal(monkeypatch):
    """Where ISA-L has no wheel, zlib's crc32 is the checksum (same values)."""
    monkeypatch.setattr(codec, "_fast_crc32", None)
    data = random.Random(1).randbytes(5000)
    assert codec.crc32(data, 3) == zlib.crc32(data, 3)


def test_isal_is_in_use_where_it_has_a_wheel():
    """The dependency installs on x86-64 and arm64 (pyproject's marker): the fast path is taken."""
    import platform

    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        assert codec.CRC32_IMPL == "isal"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is a POSIX call")
def test_checksums_in_parallel_work_in_a_forked_child():
    """A child made by fork after the parent used its checksum threads gets threads of its own;
    work handed to the parent's pool would never run there (the child would hang)."""
    data = memoryview(random.Random(2).randbytes(64 * 4096))
    want = codec.block_checksums(data, 4096)
    for _ in range(100):  # the parent's pool has all its threads (the case that hung)
        if len(codec.crc_pool()._threads) == codec.CRC_THREADS:
            break
        codec.block_checksums(data, 4096)
    assert len(codec.crc_pool()._threads) == codec.CRC_THREADS
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report within 30 s, or be killed by the alarm
        try:
            signal.alarm(30)
            ok = codec.block_checksums(data, 4096) == want
            os.write(w, b"ok" if ok else b"wrong")
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 16)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert got == b"ok", f"the child said {got!r}, exit status {status}"
