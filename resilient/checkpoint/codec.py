"""Block checksums, optional chunk compression, and the safetensors header.

Owns the byte-level encodings of the format (unchanged from v1 to v2): crc32 per fixed-size block, zstd with byte grouping
(the k bytes of each k-byte element are gathered into k planes, which is what makes float data
compressible), and the safetensors header that makes every rank file a valid safetensors file.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = [
    "CRC32_IMPL",
    "CRC_THREADS",
    "crc_pool",
    "block_checksums",
    "crc32",
    "compress",
    "decompress",
    "safetensors_header",
    "parse_safetensors_header",
]

try:  # Intel ISA-L's crc32: the same polynomial, initial value and result as zlib's, ~3.5x faster
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # no wheel for this platform: zlib's is the same function, slower
    _fast_crc32 = None

#: The implementation in use: "isal" or "zlib" (benchmarks print it).
CRC32_IMPL = "zlib" if _fast_crc32 is None else "isal"


#: crc32(data) itself, for a loop over many small pieces (no call in between).
crc32_of: Callable[[Any], int] = zlib.crc32 if _fast_crc32 is None else _fast_crc32


def crc32(data: memoryview | bytes, value: int = 0) -> int:
    """zlib's crc32 of ``data``, continuing from ``value`` (what every checksum in the format is),
    computed by ISA-L where it is installed: on a 2-core EPYC zlib 1.2.13 checks 2 GB/s, ISA-L 7,
    and checksums were the largest CPU cost of a load.  Both release the GIL."""
    if _fast_crc32 is None:
        return zlib.crc32(data, value)
    return _fast_crc32(data, value)


# crc32 releases the GIL for large buffers, so blocks checksum in parallel threads.
CRC_THREADS = 4


def _new_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=CRC_THREADS, thread_name_prefix="resilient-crc")


_CRC_POOL = _new_pool()


def crc_pool() -> ThreadPoolExecutor:
    """The checksum threads of this process.  A child made by ``fork`` gets a pool of its own: the
    parent's threads are not in it, and work handed to the parent's pool would never run."""
    return _CRC_POOL


def _after_fork_in_child() -> None:
    global _CRC_POOL
    _CRC_POOL = _new_pool()


os.register_at_fork(after_in_child=_after_fork_in_child)


def block_checksums(data: memoryview, block_bytes: int, *, parallel: bool = True) -> list[int]:
    """crc32 of each ``block_bytes`` block of ``data`` (the last block may be short)."""
    n = len(data)
    spans = [(i, min(i + block_bytes, n)) for i in range(0, n, block_bytes)]
    if not parallel or len(spans) < 4:
        return [crc32(data[a:b]) for a, b in spans]
    return list(crc_pool().map(lambda s: crc32(data[s[0] : s[1]]), spans))


def _zstd():
    import zstandard

    return zstandard


def compress(data: memoryview, itemsize: int, bytegroup: bool, level: int = 3) -> bytes:
    if bytegroup and itemsize > 1 and len(data) % itemsize == 0:
        import numpy as np  # (here: a persister that writes no compressed file never imports it)

        arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
        data = memoryview(np.ascontiguousarray(arr.T).reshape(-1))
    return _zstd().ZstdCompressor(level=level, write_content_size=True).compress(data)


def decompress(data: bytes, raw_bytes: int, itemsize: int, bytegroup: bool) -> bytes:
    """Inverse of :func:`compress`; refuses output of any size but ``raw_bytes``."""
    zstd = _zstd()
    params = zstd.get_frame_parameters(data)
    if params.content_size != raw_bytes:
        raise ValueError(
            f"compressed frame declares {params.content_size} bytes, expected {raw_bytes}"
        )
    out = zstd.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
    if len(out) != raw_bytes:
        raise ValueError(f"decompressed to {len(out)} bytes, expected {raw_bytes}")
    if bytegroup and itemsize > 1 and raw_bytes % itemsize == 0:
        import numpy as np

        arr = np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1)
        out = np.ascontiguousarray(arr.T).tobytes()
    return out


# A safetensors header's key for the file's string metadata: never a tensor's name (a tensor of
# that name would replace the metadata, and no reader would open the file).
SAFETENSORS_METADATA = "__metadata__"


def safetensors_header(
    entries: Sequence[tuple[str, str, Sequence[int], int, int]], metadata: dict[str, str]
) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file.

    ``entries``: (name, safetensors dtype code, shape, begin, end) with offsets relative to the data
    section.  The header is padded with spaces to a multiple of 8 bytes so that the data section
    stays aligned.
    """
    header: dict[str, object] = {SAFETENSORS_METADATA: metadata}
    for name, code, shape, begin, end in entries:
        if name == SAFETENSORS_METADATA:
            raise ValueError(
                "a tensor named '__metadata__' cannot be stored in a safetensors file: the name is "
                "the header's metadata key; rename it"
            )
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def parse_safetensors_header(prefix: bytes) -> tuple[int, dict]:
    """``(data_start, header)`` from the first bytes of a safetensors file (at least 8).

    Untrusted input: anything but a JSON object of ``{name: {"dtype", "shape", "data_offsets":
    [begin, end]}}`` (plus ``__metadata__``) is a ValueError that says what is wrong.
    """
    (n,) = struct.unpack("<Q", prefix[:8])
    if len(prefix) < 8 + n:
        raise ValueError(f"header declares {n} bytes but only {len(prefix) - 8} are present")
    try:
        header = json.loads(prefix[8 : 8 + n])
    except RecursionError:
        raise ValueError("the header nests JSON deeper than the parser allows") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(
                f"tensor {name[:80]!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                f"found {str(offsets)[:80]}"
            )
    return 8 + n, header
