"""Checkpoint format v1: the manifest schema, strict JSON (de)serialization and validation.

This module owns what is on disk (docs/FORMAT.md is the normative prose copy): the frozen
dataclasses of MANIFEST.json, the dtype table, the file-name rules and the checks that reject a
manifest that is malformed, points outside its step directory or declares sizes that cannot be
true.  It does not read or write files; see storage.py, writer.py and reader.py.

No pickle anywhere: tensors are safetensors, everything else is JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.errors import CheckpointCorruptError, LayoutError
from resilient.layout import (
    Layout,
    Placement,
    chunk_offsets_sizes,
    placement_from_json,
    placement_to_json,
    unique_chunks,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "DTYPES",
    "DtypeInfo",
    "ChunkEntry",
    "TensorEntry",
    "FileEntry",
    "Manifest",
    "step_dir_name",
    "parse_step_dir",
    "rank_file_name",
    "dtype_info",
    "dtype_name",
    "manifest_to_bytes",
    "manifest_from_bytes",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
DEFAULT_BLOCK_BYTES = 4 << 20
CODECS = ("none", "zstd", "zstd+bytegroup")
# A manifest over this size is not a manifest (a million tensors with checksums stays well below).
MAX_MANIFEST_BYTES = 1 << 30

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_FILE_RE = re.compile(r"^rank_(\d{5,})(?:\.g(\d+))?\.safetensors$")


@dataclass(frozen=True)
class DtypeInfo:
    name: str  # the manifest's name, torch's spelling: "bfloat16"
    torch_dtype: torch.dtype
    safetensors: str  # the safetensors header code: "BF16"
    itemsize: int


DTYPES: dict[str, DtypeInfo] = {
    d.name: d
    for d in [
        DtypeInfo("float64", torch.float64, "F64", 8),
        DtypeInfo("float32", torch.float32, "F32", 4),
        DtypeInfo("float16", torch.float16, "F16", 2),
        DtypeInfo("bfloat16", torch.bfloat16, "BF16", 2),
        DtypeInfo("int64", torch.int64, "I64", 8),
        DtypeInfo("int32", torch.int32, "I32", 4),
        DtypeInfo("int16", torch.int16, "I16", 2),
        DtypeInfo("int8", torch.int8, "I8", 1),
        DtypeInfo("uint8", torch.uint8, "U8", 1),
        DtypeInfo("bool", torch.bool, "BOOL", 1),
        DtypeInfo("float8_e4m3fn", torch.float8_e4m3fn, "F8_E4M3", 1),
        DtypeInfo("float8_e5m2", torch.float8_e5m2, "F8_E5M2", 1),
    ]
}
_BY_TORCH = {d.torch_dtype: d for d in DTYPES.values()}


def dtype_info(name: str) -> DtypeInfo:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointCorruptError(
            f"unknown dtype {name!r}; format v{FORMAT_VERSION} knows {sorted(DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype].name
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be checkpointed; supported: {sorted(DTYPES)}"
        ) from None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def rank_file_name(rank: int, generation: int = 0) -> str:
    return (
        f"rank_{rank:05d}.safetensors"
        if generation == 0
        else f"rank_{rank:05d}.g{generation}.safetensors"
    )


# --- the dataclasses -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkEntry:
    """One stored chunk of a global tensor."""

    offsets: tuple[int, ...]  # per dim; relative to each block for a fused dim
    sizes: tuple[int, ...]
    file: str  # a file name inside the step directory, never a path
    name: str  # the tensor name inside that safetensors file
    byte_range: tuple[int, int]  # [start, end) in the file, absolute
    checksums: tuple[int, ...]  # crc32 of each block of the stored bytes, from byte_range[0]
    codec: str = "none"
    raw_bytes: int = 0  # uncompressed length (numel * itemsize)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "name": self.name,
            "byte_range": list(self.byte_range),
            "checksums": list(self.checksums),
            "codec": self.codec,
            "raw_bytes": self.raw_bytes,
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ChunkEntry:
        _keys(
            d,
            {"offsets", "sizes", "file", "name", "byte_range", "checksums", "codec", "raw_bytes"},
            where,
        )
        return cls(
            offsets=_ints(d["offsets"], f"{where}.offsets"),
            sizes=_ints(d["sizes"], f"{where}.sizes"),
            file=_str(d["file"], f"{where}.file"),
            name=_str(d["name"], f"{where}.name"),
            byte_range=_pair(d["byte_range"], f"{where}.byte_range"),
            checksums=_ints(d["checksums"], f"{where}.checksums"),
            codec=_str(d["codec"], f"{where}.codec"),
            raw_bytes=_int(d["raw_bytes"], f"{where}.raw_bytes"),
        )

    @property
    def stored_bytes(self) -> int:
        return self.byte_range[1] - self.byte_range[0]


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]  # global shape; never depends on the layout
    placement: Placement
    chunks: tuple[ChunkEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "placement": placement_to_json(self.placement),
            "chunks": [c.to_json() for c in self.chunks],
        }

    @classmethod
    def from_json(cls, d: Any, layout: Layout, where: str) -> TensorEntry:
        _keys(d, {"dtype", "shape", "placement", "chunks"}, where)
        try:
            placement = placement_from_json(d["placement"], layout)
        except LayoutError as e:
            raise CheckpointCorruptError(f"{where}.placement: {e}") from None
        chunks = d["chunks"]
        if not isinstance(chunks, list):
            raise CheckpointCorruptError(
                f"{where}.chunks must be a list, found {type(chunks).__name__}"
            )
        return cls(
            dtype=_str(d["dtype"], f"{where}.dtype"),
            shape=_ints(d["shape"], f"{where}.shape"),
            placement=placement,
            chunks=tuple(
                ChunkEntry.from_json(c, f"{where}.chunks[{i}]") for i, c in enumerate(chunks)
            ),
        )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_info(self.dtype).itemsize


@dataclass(frozen=True)
class FileEntry:
    rank: int
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, d: Any, where: str) -> FileEntry:
        _keys(d, {"rank", "size_bytes"}, where)
        return cls(
            rank=_int(d["rank"], f"{where}.rank"),
            size_bytes=_int(d["size_bytes"], f"{where}.size_bytes"),
        )


@dataclass(frozen=True)
class Manifest:
    step: int
    layout: Layout
    tensors: Mapping[str, TensorEntry]
    files: Mapping[str, FileEntry]
    extras: Mapping[str, Any] = field(default_factory=dict)  # JSON values (rank 0's)
    rank_extras: Mapping[int, Mapping[str, Any]] = field(
        default_factory=dict
    )  # where a rank differs
    block_bytes: int = DEFAULT_BLOCK_BYTES
    generation: int = 0
    created_unix_s: float = 0.0
    toolkit_version: str = ""
    checksum: str = "crc32"
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "created_unix_s": self.created_unix_s,
            "toolkit_version": self.toolkit_version,
            "layout": self.layout.to_json(),
            "block_bytes": self.block_bytes,
            "checksum": self.checksum,
            "generation": self.generation,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
            "extras": dict(self.extras),
            "rank_extras": {str(r): dict(v) for r, v in sorted(self.rank_extras.items())},
        }

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise CheckpointCorruptError(
                f"manifest must be a JSON object, found {type(d).__name__}"
            )
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"manifest has format_version {version!r}, but this toolkit reads version "
                f"{FORMAT_VERSION}; upgrade the toolkit (or convert the checkpoint) to read it"
            )
        _keys(
            d,
            {
                "format_version",
                "step",
                "created_unix_s",
                "toolkit_version",
                "layout",
                "block_bytes",
                "checksum",
                "generation",
                "files",
                "tensors",
                "extras",
                "rank_extras",
            },
            "manifest",
        )
        try:
            layout = Layout.from_json(d["layout"])
        except LayoutError as e:
            raise CheckpointCorruptError(f"manifest.layout: {e}") from None
        for name in ("files", "tensors", "extras", "rank_extras"):
            if not isinstance(d[name], dict):
                raise CheckpointCorruptError(
                    f"manifest.{name} must be an object, found {type(d[name]).__name__}"
                )
        if d["checksum"] != "crc32":
            raise CheckpointCorruptError(
                f"manifest.checksum is {d['checksum']!r}; format v1 knows 'crc32'"
            )
        created = d["created_unix_s"]
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise CheckpointCorruptError(
                f"manifest.created_unix_s must be a number, found {created!r}"
            )
        rank_extras = {}
        for r, v in d["rank_extras"].items():
            if not r.isdigit() or not isinstance(v, dict):
                raise CheckpointCorruptError(
                    f"manifest.rank_extras[{r!r}] must map a rank to an object"
                )
            rank_extras[int(r)] = v
        return cls(
            format_version=version,
            step=_int(d["step"], "manifest.step"),
            created_unix_s=float(created),
            toolkit_version=_str(d["toolkit_version"], "manifest.toolkit_version"),
            layout=layout,
            block_bytes=_int(d["block_bytes"], "manifest.block_bytes"),
            checksum="crc32",
            generation=_int(d["generation"], "manifest.generation"),
            files={
                k: FileEntry.from_json(v, f"manifest.files[{k!r}]") for k, v in d["files"].items()
            },
            tensors={
                k: TensorEntry.from_json(v, layout, f"tensor {k!r}")
                for k, v in d["tensors"].items()
            },
            extras=d["extras"],
            rank_extras=rank_extras,
        )

    def validate(self) -> None:
        """Reject anything that cannot be true of a checkpoint this format describes.

        Checks file names (no paths, no URLs), that every chunk lies inside its file and matches
        its dtype and sizes, that block checksums cover the stored bytes, and that each tensor's
        chunks are exactly the distinct chunks its placement gives on the saving layout (so the
        global tensor is covered once and no size is absurd).  Raises CheckpointCorruptError.
        """
        if self.block_bytes < 4096 or self.block_bytes > 1 << 30:
            raise CheckpointCorruptError(
                f"manifest.block_bytes={self.block_bytes} is outside [4 KiB, 1 GiB]"
            )
        for fname, f in self.files.items():
            if not _FILE_RE.match(fname):
                raise CheckpointCorruptError(
                    f"manifest names file {fname!r}; files must be plain names like "
                    f"'rank_00000.safetensors' inside the step directory (no paths, no URLs)"
                )
            if not 0 <= f.rank < self.layout.world_size:
                raise CheckpointCorruptError(
                    f"file {fname!r} claims rank {f.rank}, outside {self.layout.describe()}"
                )
            if f.size_bytes < 0:
                raise CheckpointCorruptError(
                    f"file {fname!r} declares a negative size {f.size_bytes}"
                )
        for key, t in self.tensors.items():
            self._validate_tensor(key, t)

    def _validate_tensor(self, key: str, t: TensorEntry) -> None:
        info = dtype_info(t.dtype)
        if any(n < 0 for n in t.shape):
            raise CheckpointCorruptError(
                f"tensor {key!r} has a negative dim in shape {list(t.shape)}"
            )
        try:
            expected = {
                (o, s)
                for o, s, _ in unique_chunks(t.shape, t.placement, self.layout)
                if math.prod(s) > 0
            }
        except LayoutError as e:
            raise CheckpointCorruptError(f"tensor {key!r}: {e}") from None
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for c in t.chunks:
            where = f"tensor {key!r} chunk {list(c.offsets)} in file {c.file!r} (step {self.step})"
            if not _FILE_RE.match(c.file):
                raise CheckpointCorruptError(
                    f"{where}: files must be plain names like 'rank_00000.safetensors' inside the "
                    f"step directory (no paths, no URLs)"
                )
            if c.file not in self.files:
                raise CheckpointCorruptError(f"{where}: the file is not listed in manifest.files")
            if c.codec not in CODECS:
                raise CheckpointCorruptError(
                    f"{where}: unknown codec {c.codec!r}; known: {list(CODECS)}"
                )
            if len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape):
                raise CheckpointCorruptError(
                    f"{where}: offsets/sizes have the wrong rank for shape {list(t.shape)}"
                )
            start, end = c.byte_range
            if not 0 <= start <= end <= self.files[c.file].size_bytes:
                raise CheckpointCorruptError(
                    f"{where}: byte range [{start}, {end}) does not fit the file's "
                    f"{self.files[c.file].size_bytes} bytes"
                )
            raw = math.prod(c.sizes) * info.itemsize * _parts_factor(t)
            if c.raw_bytes != raw or (c.codec == "none" and end - start != raw):
                raise CheckpointCorruptError(
                    f"{where}: declares {c.raw_bytes} raw bytes stored in {end - start}, but sizes "
                    f"{list(c.sizes)} of {t.dtype} need {raw}"
                )
            n_blocks = -(-(end - start) // self.block_bytes)
            if len(c.checksums) != n_blocks:
                raise CheckpointCorruptError(
                    f"{where}: has {len(c.checksums)} checksums for {n_blocks} blocks of {self.block_bytes} bytes"
                )
            found.add((c.offsets, c.sizes))
        if found != expected or len(found) != len(t.chunks):
            raise CheckpointCorruptError(
                f"tensor {key!r} (step {self.step}): its chunks do not tile shape {list(t.shape)} "
                f"under placement {placement_to_json(t.placement)} on {self.layout.describe()}; "
                f"expected {len(expected)} distinct non-empty chunks, found {len(t.chunks)}"
                f" ({len(found & expected)} matching)"
            )


def _parts_factor(t: TensorEntry) -> int:
    parts = {p.dim: p.parts for _, p in t.placement if hasattr(p, "parts")}
    return math.prod(parts.values()) if parts else 1


def expected_chunk(
    t: TensorEntry, layout: Layout, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return chunk_offsets_sizes(t.shape, t.placement, layout, rank)


# --- strict JSON helpers -------------------------------------------------------------------------


def manifest_to_bytes(m: Manifest) -> bytes:
    return json.dumps(m.to_json(), indent=1, allow_nan=False, sort_keys=False).encode()


def manifest_from_bytes(data: bytes, where: str) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where} is {len(data)} bytes; no manifest is that large")
    try:
        raw = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(
            f"{where} is not valid JSON ({e}); the step was not committed cleanly — load an "
            f"earlier step or delete this step directory"
        ) from None
    try:
        m = Manifest.from_json(raw)
        m.validate()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {e}") from None
    return m


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _keys(d: Any, expected: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise CheckpointCorruptError(f"{where} must be a JSON object, found {type(d).__name__}")
    if set(d) != expected:
        missing, extra = sorted(expected - set(d)), sorted(set(d) - expected)
        raise CheckpointCorruptError(f"{where}: missing fields {missing}, unknown fields {extra}")


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CheckpointCorruptError(f"{where} must be a non-negative integer, found {v!r}")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise CheckpointCorruptError(f"{where} must be a string, found {v!r}")
    return v


def _ints(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise CheckpointCorruptError(f"{where} must be a list of integers, found {v!r}")
    return tuple(_int(x, where) for x in v)


def _pair(v: Any, where: str) -> tuple[int, int]:
    t = _ints(v, where)
    if len(t) != 2:
        raise CheckpointCorruptError(f"{where} must be [start, end], found {v!r}")
    return t[0], t[1]
