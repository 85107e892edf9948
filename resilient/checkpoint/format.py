"""Checkpoint format v2 (v1 read and upgraded): the manifest schema, strict JSON (de)serialization and validation.

This module owns what is on disk (docs/FORMAT.md is the normative prose copy): the frozen
dataclasses of MANIFEST.json, the dtype table, the file-name rules and the checks that reject a
manifest that is malformed, points outside its step directory or declares sizes that cannot be
true.  It does not read or write files; see storage.py, writer.py and reader.py.

No pickle anywhere: tensors are safetensors, everything else is JSON.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resilient.checkpoint.codec import SAFETENSORS_METADATA
from resilient.errors import CheckpointCorruptError, LayoutError
from resilient.layout import (
    Layout,
    Placement,
    Shard,
    chunk_offsets_sizes,
    fused_parts,
    placement_from_json,
    placement_to_json,
)

if TYPE_CHECKING:
    import torch

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
    "ManifestEncoder",
    "manifest_to_bytes",
    "manifest_from_bytes",
    "manifest_summary",
    "manifest_of_step",
    "ManifestSummary",
    "recorded_run",
    "recorded_uncounted",
    "recorded_parent",
    "recorded_chain",
    "chain_of",
    "parent_record",
    "PARENT_KEY",
    "ANCHOR_KEY",
    "ANCHOR_EXACT_KEY",
    "BOOKKEEPING_KEYS",
    "user_extras",
    "upgrade_v1",
    "check_json_depth",
    "check_variable_parts",
    "parse_json",
]

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1 manifests are upgraded on read (upgrade_v1)
MANIFEST_NAME = "MANIFEST.json"
DEFAULT_BLOCK_BYTES = 4 << 20
CODECS = ("none", "zstd", "zstd+bytegroup")
# The caps a reader holds a checkpoint to (docs/FORMAT.md section 5): none of them limits a real
# checkpoint, each keeps a hostile one from costing unbounded time or memory.
# A manifest over this size is not a manifest (about 250 bytes per chunk: ~4 million chunks).
MAX_MANIFEST_BYTES = 1 << 30
MAX_WORLD_SIZE = 1 << 24  # ranks in a saving layout
MAX_AXES = 16  # layout axes
MAX_NDIM = 32  # tensor dims
MAX_INT = (1 << 63) - 1  # every size, offset and byte count fits an int64
MAX_JSON_DEPTH = 64  # nesting of the free-form JSON values (extras)
# The memory tier's run that made a commit, in its manifest's extras (snapshots.py,
# number_this_run; docs/FORMAT.md section 9), and the most runs the tier counts
RUN_KEY = "_resilient_memory_run"
MAX_RUN = 1 << 29  # (run << 32, a run's first commit in memory, stays far below 2**62)
# (beside RUN_KEY, true) the run was not counted (number_this_run failed): RUN_KEY is then the
# run its commits in memory are numbered as, which it shares with an earlier run.  Such a run's
# snapshots carry it too (with no RUN_KEY), for the persister's commits of them to record it
RUN_UNCOUNTED_KEY = "_resilient_memory_run_uncounted"
# (a durable commit of a run without the tier, which records no RUN_KEY) the runs with the tier
# counted at the URL when it was made: a snapshot of one of those runs is older than the commit
# even where its anchor is "" (taken before its job knew of any durable commit), which orders
# nothing
RUNS_SEEN_KEY = "_resilient_memory_runs_seen"
# A durable commit's parent, in its manifest's extras: the commit its state descends from (what
# its job loaded, or that job's previous commit), which the line follows (docs/FORMAT.md section
# 5a): {"step": P, "commit_seq": Q, "child_commit_seq": C}, C being the commit's own commit_seq
# (a manifest copied elsewhere, where it has another, says nothing of that place's commits)
PARENT_KEY = "_resilient_parent"
# The value every memory snapshot records: the durable commit ("step:commit_seq", or "" for none)
# the snapshot's state descends from (snapshots.py)
ANCHOR_KEY = "_resilient_durable_anchor"
# (beside it, rank 0's) where no durable save was in flight when the snapshot was taken, the
# newest durable commit_seq its job knew of when it set the anchor (else False): the anchor is
# then exactly the commit the state descends from (a save in flight, once committed, would be),
# and a job restored from the snapshot, and its flush, record it as their parent (PARENT_KEY;
# snapshots.exact_anchor)
ANCHOR_EXACT_KEY = "_resilient_anchor_exact"
# The toolkit's own bookkeeping among a manifest's values: about the commit in its place, not
# the state; a copy elsewhere (reshape convert, an export) leaves them out
BOOKKEEPING_KEYS = frozenset(
    {RUN_KEY, RUN_UNCOUNTED_KEY, RUNS_SEEN_KEY, PARENT_KEY, ANCHOR_KEY, ANCHOR_EXACT_KEY}
)
_PARENT_FIELDS = frozenset({"step", "commit_seq", "child_commit_seq"})
# ... and, optionally, "older": the commits the parent descends from in turn, newest first, at
# most MAX_OLDER of them as [step, commit_seq] (the line goes on through them where the parent
# is gone: retired, or its manifest damaged)
MAX_OLDER = 15
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # as the safetensors library caps it
# A manifest's job_id and toolkit_version (the writer lease caps its strings alike): listing
# steps keeps a summary of each manifest, job_id included, for as long as the process lives
MAX_NAME_CHARS = 1024

# ASCII digits only: \d matches any Unicode digit ("step_" + Arabic-Indic digits would be a step)
_STEP_RE = re.compile(r"step_([0-9]{8,19})")
# a rank below MAX_WORLD_SIZE (2**24) has at most 8 digits; rank_file_name pads it to 5
_FILE_RE = re.compile(r"rank_([0-9]{5,9})(?:\.g([0-9]{1,18}))?\.safetensors")
_RANK_KEY_RE = re.compile(r"^(0|[1-9][0-9]{0,8})$")  # ASCII digits only (str.isdigit takes "²")


@dataclass(frozen=True)
class DtypeInfo:
    name: str  # the manifest's name, torch's spelling: "bfloat16"
    safetensors: str  # the safetensors header code: "BF16"
    itemsize: int

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: what reads and commits files needs no torch

        return getattr(torch, self.name)


DTYPES: dict[str, DtypeInfo] = {
    d.name: d
    for d in [
        DtypeInfo("float64", "F64", 8),
        DtypeInfo("float32", "F32", 4),
        DtypeInfo("float16", "F16", 2),
        DtypeInfo("bfloat16", "BF16", 2),
        DtypeInfo("int64", "I64", 8),
        DtypeInfo("int32", "I32", 4),
        DtypeInfo("int16", "I16", 2),
        DtypeInfo("int8", "I8", 1),
        DtypeInfo("uint8", "U8", 1),
        DtypeInfo("bool", "BOOL", 1),
        DtypeInfo("float8_e4m3fn", "F8_E4M3", 1),
        DtypeInfo("float8_e5m2", "F8_E5M2", 1),
    ]
}
_BY_TORCH: dict[torch.dtype, DtypeInfo] = {}  # filled at the first dtype_name


def dtype_info(name: str) -> DtypeInfo:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointCorruptError(
            f"unknown dtype {name!r}; format v{FORMAT_VERSION} knows {sorted(DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    if not _BY_TORCH:
        _BY_TORCH.update({d.torch_dtype: d for d in DTYPES.values()})
    try:
        return _BY_TORCH[dtype].name
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be checkpointed; supported: {sorted(DTYPES)}"
        ) from None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    # only the canonical spelling: step_000000001 would be a second directory for step 1
    return step if step <= MAX_INT and name == step_dir_name(step) else None


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
        _keys(d, _CHUNK_KEYS, where)
        # A manifest lists a chunk per rank per tensor, parsed at every commit and load: plain
        # values take a fast path; anything else goes through the checks that name the field.
        offsets, sizes, byte_range, checksums = (
            d["offsets"],
            d["sizes"],
            d["byte_range"],
            d["checksums"],
        )
        file, name, codec, raw_bytes = d["file"], d["name"], d["codec"], d["raw_bytes"]
        if (
            type(file) is str
            and type(name) is str
            and type(codec) is str
            and type(raw_bytes) is int
            and 0 <= raw_bytes <= MAX_INT
            and type(byte_range) is list
            and len(byte_range) == 2
            and _plain_ints(offsets)
            and _plain_ints(sizes)
            and _plain_ints(byte_range)
            and _plain_ints(checksums)
        ):
            return cls(
                offsets=tuple(offsets),
                sizes=tuple(sizes),
                file=file,
                name=name,
                byte_range=(byte_range[0], byte_range[1]),
                checksums=tuple(checksums),
                codec=codec,
                raw_bytes=raw_bytes,
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
    # v2: the commit order (the coordinator's counter: newest commit = latest, whatever the step
    # number) and the job that committed it; a v1 manifest reads as commit_seq 0, job_id ""
    commit_seq: int = 0
    job_id: str = ""

    def to_json(self, *, tensors: bool = True) -> dict[str, Any]:
        """The manifest as JSON; ``tensors=False``: the members before the tensor table only
        (``ManifestEncoder`` writes the rest)."""
        head = {
            "format_version": self.format_version,
            "step": self.step,
            "commit_seq": self.commit_seq,
            "job_id": self.job_id,
            "created_unix_s": self.created_unix_s,
            "toolkit_version": self.toolkit_version,
            "layout": self.layout.to_json(),
            "block_bytes": self.block_bytes,
            "checksum": self.checksum,
            "generation": self.generation,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }
        if not tensors:
            return head
        return {
            **head,
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
            "extras": dict(self.extras),
            "rank_extras": {str(r): dict(v) for r, v in sorted(self.rank_extras.items())},
        }

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        d = _upgraded(d)
        _keys(
            d,
            {
                "format_version",
                "step",
                "commit_seq",
                "job_id",
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
        layout = _layout(d["layout"])
        for name in ("files", "tensors", "extras", "rank_extras"):
            if not isinstance(d[name], dict):
                raise CheckpointCorruptError(
                    f"manifest.{name} must be an object, found {type(d[name]).__name__}"
                )
        if d["checksum"] != "crc32":
            raise CheckpointCorruptError(
                f"manifest.checksum is {_short(d['checksum'])}; format v{FORMAT_VERSION} knows 'crc32'"
            )
        created = d["created_unix_s"]
        try:
            if (
                isinstance(created, bool)
                or not isinstance(created, (int, float))
                or not math.isfinite(float(created))
            ):
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise CheckpointCorruptError(
                f"manifest.created_unix_s must be a finite number, found {_short(created)}"
            ) from None
        rank_extras = {}
        for r, v in d["rank_extras"].items():
            if not _RANK_KEY_RE.fullmatch(r) or not isinstance(v, dict):
                raise CheckpointCorruptError(
                    f"manifest.rank_extras[{r!r}] must map a rank (a plain decimal number such "
                    f"as '3') to an object"
                )
            if int(r) >= layout.world_size:
                raise CheckpointCorruptError(
                    f"manifest.rank_extras[{r!r}] names a rank outside {layout.describe()}"
                )
            rank_extras[int(r)] = v
        check_json_depth(d["extras"], "manifest.extras")
        check_json_depth(d["rank_extras"], "manifest.rank_extras")
        return cls(
            format_version=FORMAT_VERSION,
            step=_int(d["step"], "manifest.step"),
            commit_seq=_int(d["commit_seq"], "manifest.commit_seq"),
            job_id=_name(d["job_id"], "manifest.job_id"),
            created_unix_s=float(created),
            toolkit_version=_name(d["toolkit_version"], "manifest.toolkit_version"),
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
        global tensor is covered once and no size is absurd).  Never loops over ranks: the work is
        bounded by the number of chunks the manifest lists.  Raises CheckpointCorruptError.
        """
        if self.block_bytes < 4096 or self.block_bytes > 1 << 30:
            raise CheckpointCorruptError(
                f"manifest.block_bytes={self.block_bytes} is outside [4 KiB, 1 GiB]"
            )
        for fname, f in self.files.items():
            if not _FILE_RE.fullmatch(fname):
                raise CheckpointCorruptError(
                    f"manifest names file {_short(fname)}; files must be plain names like "
                    f"'rank_00000.safetensors' inside the step directory (no paths, no URLs)"
                )
            if not 0 <= f.rank < self.layout.world_size:
                raise CheckpointCorruptError(
                    f"file {fname!r} claims rank {f.rank}, outside {self.layout.describe()}"
                )
        for key, t in self.tensors.items():
            self._validate_tensor(key, t)

    def _validate_tensor(self, key: str, t: TensorEntry) -> None:
        if key == SAFETENSORS_METADATA or any(c.name == SAFETENSORS_METADATA for c in t.chunks):
            raise CheckpointCorruptError(
                f"tensor {key!r} (step {self.step}) is stored under the name "
                f"{SAFETENSORS_METADATA!r}, which is a safetensors header's own key: no rank file "
                "with it opens; this checkpoint was not written by resilient"
            )
        info = dtype_info(t.dtype)
        if len(t.shape) > MAX_NDIM:
            raise CheckpointCorruptError(
                f"tensor {key!r} has {len(t.shape)} dims; format v{FORMAT_VERSION} allows at most "
                f"{MAX_NDIM}"
            )
        if math.prod(t.shape) * info.itemsize > MAX_INT:
            raise CheckpointCorruptError(
                f"tensor {key!r} has shape {list(t.shape)} of {t.dtype}: more than 2**63 bytes"
            )
        try:
            expected = distinct_nonempty_chunks(
                t.shape, t.placement, self.layout, limit=len(t.chunks)
            )
        except LayoutError as e:
            raise CheckpointCorruptError(f"tensor {key!r}: {e}") from None
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for c in t.chunks:
            # (built only for a message: a manifest has a chunk per rank per tensor)
            where = _ChunkWhere(key, c, self.step)
            if c.file not in self.files:  # validate() checked the names of the listed files
                if not _FILE_RE.fullmatch(c.file):
                    raise CheckpointCorruptError(
                        f"{where}: files must be plain names like 'rank_00000.safetensors' inside "
                        f"the step directory (no paths, no URLs)"
                    )
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
            if c.checksums and max(c.checksums) > 0xFFFFFFFF:
                raise CheckpointCorruptError(f"{where}: a crc32 checksum does not fit 32 bits")
            found.add((c.offsets, c.sizes))
        if expected is None or found != expected or len(found) != len(t.chunks):
            count = "more than" if expected is None else "exactly"
            n = len(t.chunks) if expected is None else len(expected)
            raise CheckpointCorruptError(
                f"tensor {key!r} (step {self.step}): its chunks do not tile shape {list(t.shape)} "
                f"under placement {placement_to_json(t.placement)} on {self.layout.describe()}; "
                f"expected {count} {n} distinct non-empty chunks, found {len(t.chunks)}"
                + ("" if expected is None else f" ({len(found & expected)} matching)")
            )


class _ChunkWhere:
    """Where a chunk is, for an error message; formatted only when one is raised."""

    __slots__ = ("key", "chunk", "step")

    def __init__(self, key: str, chunk: ChunkEntry, step: int) -> None:
        self.key, self.chunk, self.step = key, chunk, step

    def __str__(self) -> str:
        c = self.chunk
        return f"tensor {self.key!r} chunk {list(c.offsets)} in file {c.file!r} (step {self.step})"


# Every commit validates its manifest and every tensor in it asks the same question as at the
# last commit (a snapshot every step asks it per step): small answers are kept, a bounded number.
# The key holds numbers only (never an axis name from an untrusted manifest), and only small keys
# and answers are kept: a hostile manifest cannot make the memo hold more than about 10 MB.
_CHUNKS_MEMO: dict[tuple[Any, ...], frozenset[tuple[tuple[int, ...], tuple[int, ...]]] | None] = {}
_CHUNKS_MEMO_MAX_ENTRIES = 256
_CHUNKS_MEMO_MAX_CHUNKS = 64
_CHUNKS_MEMO_MAX_DIMS = 8


def distinct_nonempty_chunks(
    shape: tuple[int, ...], placement: Placement, layout: Layout, *, limit: int
) -> frozenset[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The distinct non-empty chunks ``(offsets, sizes)`` of a tensor split by ``placement`` on
    ``layout`` (see ``_distinct_nonempty_chunks``), remembered when the question and the answer
    are small."""
    splits = tuple(
        (p.dim, p.parts, layout.size(axis)) for axis, p in placement if isinstance(p, Shard)
    )
    if (
        limit > _CHUNKS_MEMO_MAX_CHUNKS  # (so a kept answer is None or at most that many chunks)
        or len(shape) > _CHUNKS_MEMO_MAX_DIMS
        or len(splits) > _CHUNKS_MEMO_MAX_DIMS
    ):
        return _distinct_nonempty_chunks(shape, placement, layout, limit=limit)
    key = (tuple(shape), splits, limit)
    if key in _CHUNKS_MEMO:
        return _CHUNKS_MEMO[key]
    out = _distinct_nonempty_chunks(shape, placement, layout, limit=limit)
    if len(_CHUNKS_MEMO) >= _CHUNKS_MEMO_MAX_ENTRIES:
        _CHUNKS_MEMO.clear()
    _CHUNKS_MEMO[key] = out
    return out


def _distinct_nonempty_chunks(
    shape: tuple[int, ...], placement: Placement, layout: Layout, *, limit: int
) -> frozenset[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The distinct non-empty chunks ``(offsets, sizes)`` of a tensor split by ``placement`` on
    ``layout``, as the manifest records them; None when there are more than ``limit``.

    Works per dim (each dim's nested splits, empty pieces pruned), never per rank: the cost is
    bounded by ``limit`` and the number of axes, however many ranks the layout claims.  Two ranks
    hold the same non-empty chunk exactly when they agree on every sharding axis, so the distinct
    non-empty chunks are the product of each dim's non-empty pieces.
    """
    parts = fused_parts(shape, placement)
    per_dim: list[list[tuple[int, int]]] = []
    too_many = False
    for d, n in enumerate(shape):
        pieces = [(0, n // parts.get(d, 1))] if n // parts.get(d, 1) else []
        for axis, p in placement:
            if not isinstance(p, Shard) or p.dim != d or not pieces:
                continue
            k = layout.size(axis)
            # count first (a piece of n split k ways has ceil(n / ceil(n / k)) non-empty
            # parts): the pieces are built only when there are no more than the limit
            steps = [-(-length // k) for _, length in pieces]
            count = sum(-(-length // step) for (_, length), step in zip(pieces, steps))
            if count > max(limit, 1):
                too_many = True
                break
            pieces = [
                (off + i, min(step, length - i))
                for (off, length), step in zip(pieces, steps)
                for i in range(0, length, step)
            ]
        per_dim.append(pieces)
    if any(not p for p in per_dim):
        return frozenset()  # some dim is empty everywhere: every chunk is empty
    if too_many or math.prod(len(p) for p in per_dim) > limit:
        return None
    return frozenset(
        (tuple(o for o, _ in combo), tuple(n for _, n in combo))
        for combo in itertools.product(*per_dim)
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
    # one line: json's C encoder serves only unindented output (indent=1 took 5x as long, 4 ms
    # for a 92-tensor manifest: a fixed cost of every save and every memory snapshot)
    return json.dumps(m.to_json(), allow_nan=False, sort_keys=False).encode()


class ManifestEncoder:
    """``manifest_to_bytes`` for a writer that publishes manifests of one shape again and again
    (the memory tier commits one per snapshot): the text of the tensor table is made once per
    shape, with a place for each chunk's checksums, and each commit fills those in.  The bytes are
    those of ``manifest_to_bytes``, always: anything the template cannot take (a checksum that is
    not a plain integer, a key that reads like the template's mark) goes the usual way."""

    _MARK = "\x00checksums\x00"  # a string no chunk has as its checksums

    def __init__(self) -> None:
        self._shape: Any = None
        self._parts: list[str] = []

    def encode(self, m: Manifest, shape: Any = None) -> bytes:
        """``m``'s bytes; ``shape``: what identifies every part of ``m`` but its numbers,
        checksum values and values (None: no template)."""
        tensors = sorted(m.tensors.items())
        chunks = [c for _, t in tensors for c in t.chunks]
        if shape is None or not all(_INT_TYPE.issuperset(map(type, c.checksums)) for c in chunks):
            return manifest_to_bytes(m)
        if shape != self._shape:
            self._shape, self._parts = None, []
            skeleton = {
                k: {
                    **t.to_json(),
                    "chunks": [{**c.to_json(), "checksums": self._MARK} for c in t.chunks],
                }
                for k, t in tensors
            }
            parts = json.dumps(skeleton, allow_nan=False).split(json.dumps(self._MARK))
            if len(parts) != len(chunks) + 1:  # a key or a name held the mark
                return manifest_to_bytes(m)
            self._shape, self._parts = shape, parts
        head = m.to_json(tensors=False)
        text = [json.dumps(head, allow_nan=False)[:-1], ', "tensors": ', self._parts[0]]
        for c, part in zip(chunks, self._parts[1:]):
            text += ("[", ", ".join(map(str, c.checksums)), "]", part)
        text += (
            ', "extras": ',
            json.dumps(dict(m.extras), allow_nan=False),
            ', "rank_extras": ',
            json.dumps(
                {str(r): dict(v) for r, v in sorted(m.rank_extras.items())}, allow_nan=False
            ),
            "}",
        )
        return "".join(text).encode()


def manifest_from_bytes(data: bytes, where: str) -> Manifest:
    d = parse_json(data, where, MAX_MANIFEST_BYTES)
    try:
        m = Manifest.from_json(d)
        m.validate()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {_capped(str(e))}") from None
    return m


def manifest_of_step(data: bytes, where: str, step: int) -> Manifest:
    """A manifest in full (``manifest_from_bytes``) that must be the one of ``step``: what readers
    accept as a commit, and what a writer checks the bytes it is about to publish against."""
    m = manifest_from_bytes(data, where)
    if m.step != step:
        raise CheckpointCorruptError(
            f"{where} says step {m.step}, but it is in the directory of step {step}; a step "
            f"directory copied or renamed under another number is not that step — rename it back "
            f"or delete it"
        )
    return m


def check_variable_parts(data: bytes, m: Manifest, where: str) -> None:
    """What readers check of the parts of a manifest that change from one commit of a layout to
    the next (the numbers, the checksum values, the values), for a manifest whose layout, tensor
    table, files and chunks are those of one that ``manifest_of_step`` accepted: the writer's
    check of a memory snapshot's manifest at every snapshot, in a fraction of a full parse."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"{where} is {len(data)} bytes; the limit is {MAX_MANIFEST_BYTES}"
        )
    for name in ("step", "commit_seq", "generation"):
        _int(getattr(m, name), f"manifest.{name}")
    if not math.isfinite(m.created_unix_s):
        raise CheckpointCorruptError("manifest.created_unix_s must be a finite number")
    for key, t in m.tensors.items():
        for c in t.chunks:
            cs = c.checksums
            if cs and ({*map(type, cs)} != _INT_TYPE or min(cs) < 0 or max(cs) >= 1 << 32):
                raise CheckpointCorruptError(
                    f"tensor {key!r}: a chunk's checksums must be crc32 values (integers below "
                    f"2**32)"
                )
    if not isinstance(m.extras, dict):
        raise CheckpointCorruptError("manifest.extras must be an object")
    for r, v in m.rank_extras.items():
        if type(r) is not int or not 0 <= r < m.layout.world_size or not isinstance(v, dict):
            raise CheckpointCorruptError(
                f"manifest.rank_extras[{r!r}] must map a rank of {m.layout.describe()} to an object"
            )
    check_json_depth(m.extras, "manifest.extras")
    check_json_depth({str(r): v for r, v in m.rank_extras.items()}, "manifest.rank_extras")


def parse_json(data: bytes, where: str, max_bytes: int) -> Any:
    """Strict JSON from untrusted bytes: a size cap, no NaN or Infinity, and nesting too deep for
    the parser is a CheckpointCorruptError (not a RecursionError)."""
    if len(data) > max_bytes:
        raise CheckpointCorruptError(f"{where} is {len(data)} bytes; the limit is {max_bytes}")
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise CheckpointCorruptError(
            f"{where} nests JSON deeper than the parser allows; it is damaged or hostile — load "
            f"an earlier step"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(
            f"{where} is not valid JSON ({e}); the step was not committed cleanly — load an "
            f"earlier step or delete this step directory"
        ) from None


def check_json_depth(value: Any, where: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (iteratively: no recursion to exhaust)."""
    if not isinstance(value, dict | list):
        return
    stack = [(value, 1)]  # containers only: most values are scalars, never pushed
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            raise CheckpointCorruptError(
                f"{where} nests deeper than {max_depth} levels; format v{FORMAT_VERSION} "
                f"allows at most {max_depth}"
            )
        for x in v.values() if isinstance(v, dict) else v:
            if isinstance(x, dict | list):
                stack.append((x, depth + 1))


def upgrade_v1(d: dict[str, Any]) -> dict[str, Any]:
    """A v1 manifest as v2: it has no commit order, so it reads as commit 0 (older than every v2
    commit; v1 steps among themselves go by step number) by no known job."""
    return {**d, "format_version": 2, "commit_seq": 0, "job_id": ""}


_UPGRADES = {1: upgrade_v1}


def _upgraded(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise CheckpointCorruptError(f"manifest must be a JSON object, found {type(d).__name__}")
    version = d.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"manifest has format_version {version!r}, but this toolkit reads versions "
            f"{list(READABLE_VERSIONS)}; upgrade the toolkit (or convert the checkpoint) to read it"
        )
    while d["format_version"] != FORMAT_VERSION:
        d = _UPGRADES[d["format_version"]](d)
    return d


def _layout(data: Any) -> Layout:
    if isinstance(data, list) and len(data) > MAX_AXES:
        raise CheckpointCorruptError(
            f"manifest.layout has {len(data)} axes; format v{FORMAT_VERSION} allows at most "
            f"{MAX_AXES}"
        )
    try:
        layout = Layout.from_json(data)
    except LayoutError as e:
        raise CheckpointCorruptError(f"manifest.layout: {_capped(str(e), 500)}") from None
    if layout.world_size > MAX_WORLD_SIZE:
        raise CheckpointCorruptError(
            f"manifest.layout is {layout.describe()}; format v{FORMAT_VERSION} allows at most "
            f"{MAX_WORLD_SIZE} ranks"
        )
    return layout


@dataclass(frozen=True)
class ManifestSummary:
    """What listing steps needs from a manifest: that it parses, and its place in commit order."""

    step: int
    commit_seq: int
    generation: int
    job_id: str
    files: frozenset[str]
    run: int = 0  # the memory tier's run that made the commit (RUN_KEY; 0: none recorded)
    # the commits (step, commit_seq) its state descends from, its parent first (PARENT_KEY);
    # empty: not recorded
    chain: tuple[tuple[int, int], ...] = ()
    # ``run`` is that of a run that was not counted (RUN_UNCOUNTED_KEY): shared with an earlier run
    uncounted: bool = False
    # (no ``run``) the runs with the tier counted when it was made (RUNS_SEEN_KEY); 0: none
    runs_seen: int = 0


def manifest_summary(data: bytes, where: str, step: int) -> ManifestSummary:
    """Parse and check a manifest's top level only (its JSON, version, step, commit order and file
    names): a torn or foreign manifest never counts as a commit.  The tensor table is checked in
    full when the step is read (``manifest_from_bytes``)."""
    d = _upgraded(parse_json(data, where, MAX_MANIFEST_BYTES))
    found = _int(d.get("step"), f"{where}: manifest.step")
    if found != step:
        raise CheckpointCorruptError(
            f"{where} says step {found}, but it is in the directory of step {step}; a step "
            f"directory copied or renamed under another number is not that step — rename it back "
            f"or delete it"
        )
    files = d.get("files")
    if not isinstance(files, dict):
        raise CheckpointCorruptError(f"{where}: manifest.files must be an object")
    for f in files:
        if not _FILE_RE.fullmatch(f):
            raise CheckpointCorruptError(
                f"{where}: manifest names file {f[:200]!r}; files must be plain names like "
                f"'rank_00000.safetensors' inside the step directory (no paths, no URLs)"
            )
    extras = d.get("extras")
    return _summary(
        d,
        f"{where}: manifest",
        found,
        files,
        recorded_run(extras),
        recorded_uncounted(extras),
        recorded_runs_seen(extras),
    )


def _summary(
    d: dict,
    what: str,
    step: int,
    files: Iterable[str],
    run: int,
    uncounted: bool,
    runs_seen: int,
) -> ManifestSummary:
    """(``manifest_summary``, ``summary_from_line``) The rest of the summary, checked."""
    commit_seq = _int(d.get("commit_seq"), f"{what}.commit_seq")
    return ManifestSummary(
        step=step,
        commit_seq=commit_seq,
        generation=_int(d.get("generation"), f"{what}.generation"),
        job_id=_name(d.get("job_id"), f"{what}.job_id"),
        files=frozenset(files),
        run=run,
        chain=recorded_chain(d.get("extras"), commit_seq),
        uncounted=bool(run) and uncounted,
        runs_seen=0 if run else runs_seen,
    )


def parent_record(chain: Sequence[tuple[int, int]], commit_seq: int) -> dict[str, Any]:
    """The PARENT_KEY value of a commit numbered ``commit_seq`` whose state descends from
    ``chain[0]``, which descends from ``chain[1]``, and so on (at most MAX_OLDER more kept)."""
    (step, seq), older = chain[0], chain[1 : 1 + MAX_OLDER]
    record: dict[str, Any] = {"step": step, "commit_seq": seq, "child_commit_seq": commit_seq}
    if older:
        record["older"] = [[s, q] for s, q in older]
    return record


def parent_known(next_commit_seq: int, seen: int | None) -> bool:
    """Whether a parent set when ``seen`` was the newest commit_seq may be recorded by a commit
    whose storage now numbers the next one ``next_commit_seq``: not where anything was committed
    above ``seen`` since (a save of an earlier process or lineage, or one given up on, that
    committed later: the state may descend from it), nor where ``seen`` is unknown."""
    return seen is not None and next_commit_seq <= seen + 1


def recorded_chain(extras: Any, commit_seq: int) -> tuple[tuple[int, int], ...]:
    """The PARENT_KEY value's chain (the parent, then what it descends from), empty where
    it is anything but ``parent_record``'s object of integers in [0, 2**63 - 1] made for this
    ``commit_seq`` (untrusted: read as not recorded, the line's rule without it)."""
    value = extras.get(PARENT_KEY) if isinstance(extras, Mapping) else None
    if type(value) is not dict or not _PARENT_FIELDS <= value.keys() <= _PARENT_FIELDS | {"older"}:
        return ()
    if not all(type(value[k]) is int and 0 <= value[k] <= MAX_INT for k in _PARENT_FIELDS):
        return ()
    if value["child_commit_seq"] != commit_seq:
        return ()
    older = chain_of(value.get("older", []), MAX_OLDER)
    if older is None:
        return ()
    return ((value["step"], value["commit_seq"]), *older)


def chain_of(value: Any, most: int) -> tuple[tuple[int, int], ...] | None:
    """``[[step, commit_seq], ...]`` (JSON, untrusted) as pairs; None where it is anything but a
    list of at most ``most`` pairs of integers in [0, 2**63 - 1]."""
    if type(value) is not list or len(value) > most:
        return None
    if not all(
        type(pair) is list
        and len(pair) == 2
        and all(type(v) is int and 0 <= v <= MAX_INT for v in pair)
        for pair in value
    ):
        return None
    return tuple((s, q) for s, q in value)


def recorded_parent(extras: Any, commit_seq: int) -> tuple[int, int] | None:
    """The commit (step, commit_seq) that a manifest's extras say its state descends from
    (PARENT_KEY), for a manifest numbered ``commit_seq``; None where they say nothing."""
    chain = recorded_chain(extras, commit_seq)
    return chain[0] if chain else None


def recorded_run(extras: Any) -> int:
    """The memory tier's run that a manifest's extras record (RUN_KEY); 0 where they record none
    (a save without the tier, an older version) or anything but a run number."""
    return _run(extras.get(RUN_KEY) if isinstance(extras, Mapping) else None)


def recorded_uncounted(extras: Any) -> bool:
    """Whether a manifest's extras say its run was not counted (RUN_UNCOUNTED_KEY)."""
    return isinstance(extras, Mapping) and extras.get(RUN_UNCOUNTED_KEY) is True


def recorded_runs_seen(extras: Any) -> int:
    """The runs with the memory tier counted when a commit without it was made (RUNS_SEEN_KEY);
    0 where its extras record none or anything but a run number."""
    return _run(extras.get(RUNS_SEEN_KEY) if isinstance(extras, Mapping) else None)


def _run(value: Any) -> int:
    return value if type(value) is int and 0 < value < MAX_RUN else 0


def summary_line(manifest: Manifest) -> bytes:
    """A manifest's ``ManifestSummary`` as one line of JSON (no newline in it), to travel with
    the manifest's bytes to a reader that trusts their sender's check of them and needs the
    summary only (``summary_from_line``): parsing the whole manifest for its top level took most
    of a node leader's publish."""
    return json.dumps(
        {
            "step": manifest.step,
            "commit_seq": manifest.commit_seq,
            "generation": manifest.generation,
            "job_id": manifest.job_id,
            "files": sorted(manifest.files),
            "run": recorded_run(manifest.extras),
            "uncounted": recorded_uncounted(manifest.extras),
            "runs_seen": recorded_runs_seen(manifest.extras),
        },
        separators=(",", ":"),
    ).encode()


def summary_from_line(line: bytes, where: str, step: int) -> ManifestSummary:
    """The ``ManifestSummary`` that ``summary_line`` wrote, checked as ``manifest_summary``
    checks a manifest's top level."""
    d = parse_json(line, where, MAX_MANIFEST_BYTES)
    if not isinstance(d, dict):
        raise CheckpointCorruptError(f"{where}: a manifest's summary must be a JSON object")
    found = _int(d.get("step"), f"{where}: summary.step")
    if found != step:
        raise CheckpointCorruptError(f"{where}: the summary says step {found}, not {step}")
    files = d.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, str) and _FILE_RE.fullmatch(f) for f in files
    ):
        raise CheckpointCorruptError(f"{where}: summary.files must be a list of plain file names")
    run = _run(d.get("run"))
    uncounted, seen = d.get("uncounted") is True, _run(d.get("runs_seen"))
    return _summary(d, f"{where}: summary", found, files, run, uncounted, seen)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _keys(d: Any, expected: set[str] | frozenset[str], where: str) -> None:
    if not isinstance(d, dict):
        raise CheckpointCorruptError(f"{where} must be a JSON object, found {type(d).__name__}")
    if d.keys() != expected:
        missing, extra = sorted(expected - set(d)), sorted(set(d) - expected)
        raise CheckpointCorruptError(f"{where}: missing fields {missing}, unknown fields {extra}")


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
        raise CheckpointCorruptError(
            f"{where} must be a non-negative integer below 2**63, found {_short(v)}"
        )
    return v


def _capped(message: str, limit: int = 2000) -> str:
    """An error message about untrusted input stays readable (and small) whatever the input."""
    return (
        message if len(message) <= limit else message[: limit - 40] + f" ... ({len(message)} chars)"
    )


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise CheckpointCorruptError(f"{where} must be a string, found {_short(v)}")
    return v


def _name(v: Any, where: str) -> str:
    """A short string of the manifest's top level (a job id, a toolkit version)."""
    if len(_str(v, where)) > MAX_NAME_CHARS:
        raise CheckpointCorruptError(
            f"{where} is {len(v)} characters long; format v{FORMAT_VERSION} allows at most "
            f"{MAX_NAME_CHARS} (a job id and a toolkit version are names): {_short(v)}"
        )
    return v


_CHUNK_KEYS = frozenset(
    {"offsets", "sizes", "file", "name", "byte_range", "checksums", "codec", "raw_bytes"}
)


def _plain_ints(v: Any) -> bool:
    """A JSON list of integers in [0, 2**63 - 1] (what ``_ints`` accepts), without a message."""
    return type(v) is list and (
        not v or ({*map(type, v)} == _INT_TYPE and min(v) >= 0 and max(v) <= MAX_INT)
    )


_INT_TYPE = {int}  # exactly int: a bool is not a count


def _ints(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise CheckpointCorruptError(f"{where} must be a list of integers, found {_short(v)}")
    return tuple(_int(x, where) for x in v)


def _pair(v: Any, where: str) -> tuple[int, int]:
    t = _ints(v, where)
    if len(t) != 2:
        raise CheckpointCorruptError(f"{where} must be [start, end], found {_short(v)}")
    return t[0], t[1]


def user_extras(extras: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's values without the toolkit's bookkeeping of the commit (BOOKKEEPING_KEYS)."""
    return {k: v for k, v in extras.items() if k not in BOOKKEEPING_KEYS}
