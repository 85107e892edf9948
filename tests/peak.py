"""The peak resident memory of this process over a block of code (Linux: VmHWM, reset first).

``ru_maxrss`` is the process's high-water mark since it started, so once an earlier test has
peaked higher a check built on it can no longer fail; writing 5 to /proc/self/clear_refs resets
VmHWM to the current RSS, so the peak is measured from the start of the block.
"""

from __future__ import annotations

import resource


def _vm_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> int:
    """Reset the high-water mark where the kernel allows it; returns the baseline in KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    hwm = _vm_hwm_kib()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_kib() -> int:
    hwm = _vm_hwm_kib()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class PeakGrowth:
    """``with PeakGrowth() as p: ...`` then ``p.mib``: how far the peak rose above the start."""

    def __enter__(self) -> PeakGrowth:
        self.base = reset_peak()
        self.mib = 0.0
        return self

    def __exit__(self, *exc: object) -> bool:
        self.mib = (peak_kib() - self.base) / 1024
        return False
