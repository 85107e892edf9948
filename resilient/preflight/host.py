"""One rank's host: memory bandwidth (with its anchor), host-device copies, available memory.

Memory bandwidth is the rate of a large ``torch`` tensor copy (``dst.copy_(src)``, on one thread),
counted as the bytes of one buffer per second (the convention of ``nccl-tests``' buffers, not
STREAM's read + write), next to its anchor: ``numpy.copyto`` of the same bytes, the plain copy
every other tool would do.  The buffers are at least four times the last-level cache, so the
figure is the memory's, not the cache's.  Each sample repeats the copy until it lasts
``sample_s``: a sample much longer than a scheduler's time slice (or a throttle's period)
measures the rank's sustained speed.
Host-to-device and device-to-host copies use pinned host memory and the current CUDA/HIP device.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "MemorySample",
    "memory_sample",
    "copy_buffers",
    "host_device_sample",
    "available_memory_bytes",
    "last_level_cache_bytes",
]


def available_memory_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 (Linux sysfs); 32 MiB where it cannot be read."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(f"{base}/{entry}/size") as f:
                    text = f.read().strip()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text[:-1] if text[-1:] in "KMG" else text
            if digits.isdigit():
                best = max(best, int(digits) * scale)
    except OSError:
        pass
    return best or 32 << 20


@dataclass(frozen=True)
class MemorySample:
    torch_bytes_per_s: float
    numpy_bytes_per_s: float


def copy_buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 host buffers of ``nbytes``, touched (page faults are not bandwidth)."""
    n = max(nbytes // 4, 1)
    src = torch.arange(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return src, dst


def _rate(fn, nbytes: int, sample_s: float) -> float:
    """Run ``fn`` until ``sample_s`` has passed (at least once); bytes copied per second."""
    count, t0 = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= sample_s:
            return count * nbytes / elapsed


def memory_sample(src: torch.Tensor, dst: torch.Tensor, sample_s: float) -> MemorySample:
    """One sample of the torch copy and of its numpy anchor on the same bytes, both on one
    thread (numpy's copy has one; a rank's figure should not depend on its thread setting)."""
    nbytes = src.numel() * src.element_size()
    a, b = src.numpy(), dst.numpy()  # the same memory: the anchor copies the very same bytes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copied = _rate(lambda: dst.copy_(src), nbytes, sample_s)
    finally:
        torch.set_num_threads(threads)
    return MemorySample(
        torch_bytes_per_s=copied,
        numpy_bytes_per_s=_rate(lambda: np.copyto(b, a), nbytes, sample_s),
    )


def host_device_sample(
    pinned: torch.Tensor, device_buf: torch.Tensor, sample_s: float
) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes per second over one sample each."""
    nbytes = pinned.numel() * pinned.element_size()

    def h2d() -> None:
        device_buf.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device_buf.device)

    def d2h() -> None:
        pinned.copy_(device_buf, non_blocking=True)
        torch.cuda.synchronize(device_buf.device)

    h2d()
    d2h()
    return _rate(h2d, nbytes, sample_s), _rate(d2h, nbytes, sample_s)
