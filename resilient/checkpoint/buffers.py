"""Fresh CPU memory for the checkpointer: the load's scratch tensors and the save's staging
buffer, on transparent huge pages where the kernel offers them by ``madvise``."""

from __future__ import annotations

import torch

__all__ = ["huge_pages", "scratch_like", "scratch_for"]

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def huge_pages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages over ``t``'s memory (where the kernel leaves it to
    ``madvise``): faulting in fresh memory 2 MiB at a time instead of 4 KiB is several times
    cheaper, and a load's scratch memory is all fresh.  Advisory; a no-op where unsupported."""
    global _LIBC
    nbytes = t.numel() * t.element_size()
    if nbytes < 2 * _HUGE or t.device.type != "cpu":
        return
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL(None, use_errno=True).madvise
            _LIBC.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            _LIBC(start, end - start, _MADV_HUGEPAGE)


_LIBC = None


def scratch_like(t: torch.Tensor) -> torch.Tensor:
    """Fresh, unzeroed CPU memory of ``t``'s shape and dtype, on huge pages where possible."""
    out = torch.empty(t.shape, dtype=t.dtype)
    huge_pages(out)
    return out


def scratch_for(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh CPU tensors shaped like ``tensors``, carved from one allocation (64-byte aligned
    each) so that all of it, small tensors too, sits on huge pages."""
    spans, total = {}, 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        spans[key] = (total, n)
        total += -(-n // 64) * 64
    flat = torch.empty(max(total, 1), dtype=torch.uint8)  # torch aligns CPU memory to 64 bytes
    huge_pages(flat)
    out = {}
    for key, t in tensors.items():
        at, n = spans[key]
        out[key] = flat[at : at + n].view(t.dtype).view(t.shape)
    return out
