"""Export to and import from ``torch.distributed.checkpoint`` (DCP) directories, through torch's own
writer and reader, so that a user can leave this toolkit, or join it, at any step.

Export: every tensor of a step, whole, under its checkpoint key, and the manifest's JSON values
(``extras``) as DCP non-tensor entries under their keys, written by ``dcp.save``.  The state given
to ``dcp.save`` holds meta tensors; the planner reads each tensor when torch's writer asks for it,
and each tensor gets its own ``.distcp`` file (torch's writer keeps a file's tensors referenced
until it closes the file), so one tensor is in memory at a time.  The result is read back with
``dcp.load``, in batches, and each tensor's CRC-32 compared with what was written.

Import: DCP's ``.metadata`` is a pickle, and unpickling an untrusted file can run arbitrary code,
so an import needs ``trust_pickle=True``; without it nothing is read.  With it, torch's reader
unpickles the metadata once, and it is checked before anything is allocated (chunks tile each
tensor exactly; data files are plain names in the directory, regular, long enough for their byte
ranges; supported dtypes; the state fits in memory).  No file is opened through a symbolic link or
as anything but a regular file, by these checks or by torch's reader (``_NoLinksFileSystem``).  ``dcp.load`` fills whole tensors, which
``reshape.formats.reference.write_checkpoint`` writes in the requested layout; every tensor is
then read back and compared bit for bit.  The import holds the whole state in memory (about twice
that while writing).

Non-tensor entries: DCP's own loader unpickles them with ``torch.load(weights_only=False)``; this
module never does.  It takes their raw bytes and decodes them with torch's restricted unpickler
(``weights_only=True``: containers, numbers, strings, tensors; never code), keeps JSON values and
skips the rest with a note in the report.  A list that ``dcp.save`` flattened into indexed entries
(one that holds a mapping: OneCycleLR's ``_schedule_phases``) is put back together from the paths
in the metadata's ``planner_data``, as one value, as a save would store it.  A DCP tensor key without a dot (``weight``) is imported
as ``dcp.<key>`` (``UNGROUPED``); value keys are kept.  The DCP side is a local directory.  DCP has
no checksums: a flipped bit in a ``.distcp`` file's tensor bytes cannot be detected; damage to its
structure is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, WriteItem, WriteItemType

from reshape.execute import ConvertReport, DestinationExistsError, allocate, resolve_step
from reshape.export import (
    byte_batches,
    check_source_files,
    read_many,
    read_whole,
    refuse_inside_source,
)
from reshape.formats.reference import (
    LAYOUT_AXES,
    open_source_file,
    reference_placement,
    write_checkpoint,
)
from resilient.checkpoint.format import (
    DTYPES,
    MAX_JSON_DEPTH,
    Manifest,
    check_json_depth,
    dtype_info,
    step_dir_name,
    user_extras,
)
from resilient.checkpoint.reader import read_manifest
from resilient.checkpoint.retention import step_dirs
from resilient.checkpoint.storage import Storage
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LayoutError,
    ResilientError,
    StateMismatchError,
    StorageError,
)

__all__ = [
    "DcpReport",
    "UntrustedPickleError",
    "export_dcp",
    "import_dcp",
    "UNGROUPED",
    "MAX_VALUE_BYTES",
]

METADATA_NAME = ".metadata"  # torch's name for the pickled Metadata of a DCP directory
VERIFY_BATCH = 128 << 20  # bytes an import reads back at once to compare
UNGROUPED = "dcp"  # the group of imported DCP tensor keys that have no dot
MAX_VALUE_BYTES = 16 << 20  # a non-tensor entry larger than this is skipped, unread
# ... and all of an import's values together, as JSON: past it, the rest are skipped (a value
# under the cap is a few KB of pickle, so many of them would expand many times over)
MAX_VALUES_BYTES = 64 << 20
MAX_METADATA_BYTES = 1 << 30  # like MANIFEST.json's cap (docs/FORMAT.md section 5)
MAX_DIMS = 32
VERIFY_BATCH_BYTES = 1 << 30  # export: how much is read back per dcp.load call
_TORCH_DTYPES = {d.torch_dtype: d.name for d in DTYPES.values()}


class UntrustedPickleError(ResilientError, PermissionError):
    """A DCP import was asked for without ``trust_pickle``: DCP's ``.metadata`` is a pickle."""


@dataclass
class DcpReport:
    step: int
    out: str
    tensors: int
    total_bytes: int  # tensor bytes written
    seconds: float
    values: int = 0  # JSON values carried over
    files: int = 0  # .distcp files written (export) or read (import)
    skipped: list[str] = field(default_factory=list)  # "key: why", for what was not carried over
    renamed: dict[str, str] = field(default_factory=dict)  # import: DCP key -> checkpoint key
    convert: ConvertReport | None = None  # import: the conversion into the requested layout


# --- the DCP side: a local directory ---------------------------------------------------------------


def _local_dir(path: str, what: str) -> str:
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path or "::" in path:
        raise StorageError(
            f"{what} {path!r}: the DCP side of an import or export is a local directory (torch's "
            f"FileSystemReader/Writer); copy it to a local disk first",
            url=path,
            operation="dcp",
        )
    return os.path.abspath(path)


def _is_dcp_file(name: str) -> bool:
    return name == METADATA_NAME or name.endswith(".distcp")


def _prepare_out(out_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty ``out_dir`` unless ``overwrite``; then remove the DCP files there (the
    old ``.metadata`` first, so an interrupted export never leaves it naming new files)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise DestinationExistsError(f"{out_dir} exists and is not a directory; choose another OUT")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if names and not overwrite:
        raise DestinationExistsError(
            f"{out_dir} is not empty (it holds {names[:5]}); pass --overwrite to replace the DCP "
            f"checkpoint there, or choose an empty directory"
        )
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(names, key=lambda n: n != METADATA_NAME):
        if _is_dcp_file(name) and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """``dcp.save``/``dcp.load`` with ``no_dist=True`` warn that they assume one process: we mean
    that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _underlying(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (a BaseException), or ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return inner[0]
    return e


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so that NaNs and -0.0 compare by their bits)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(_bits(t).numpy()))


# --- export ---------------------------------------------------------------------------------------


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a state of meta tensors: each tensor is read from the
    checkpoint when torch's writer resolves it (SavePlanner.resolve_data is where the docs want
    memory allocated), its CRC-32 noted for the read-back.  A failure is kept, to be raised as
    itself rather than inside DCP's CheckpointException."""

    def __init__(
        self, storage: Storage, manifest: Manifest, progress: Callable[[int], None] | None
    ) -> None:
        super().__init__()
        self.storage, self.manifest, self.progress = storage, manifest, progress
        self.crcs: dict[str, int] = {}
        self.error: BaseException | None = None

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        key = write_item.index.fqn
        try:
            whole = read_whole(self.storage, self.manifest, key)
        except BaseException as e:
            self.error = self.error or e
            raise
        self.crcs[key] = _crc(whole)
        if self.progress is not None:
            self.progress(whole.numel() * whole.element_size())
        return whole


def export_dcp(
    src: str,
    out: str,
    *,
    step: int | None = None,
    overwrite: bool = False,
    src_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    verify: bool = True,
) -> DcpReport:
    """Write step ``step`` (default: the newest commit) of the checkpoint at ``src`` as a DCP
    checkpoint in the local directory ``out``.

    Every tensor is written whole under its checkpoint key, and every value of the manifest's
    ``extras`` as a DCP non-tensor entry under its key (``optim.param_groups.0.lr``, ``run.step``);
    values that differ per rank (``rank_extras``) have no place in DCP's one namespace and are
    listed in ``skipped``.  One tensor is in memory at a time.  ``progress(nbytes)`` is called per
    tensor.  With ``verify`` the written directory is read back with ``dcp.load`` and each
    tensor's CRC-32 compared.  A non-empty ``out`` is refused unless ``overwrite`` (which replaces
    the DCP files there).  DCP writes ``.metadata`` last: an interrupted export leaves a directory
    ``dcp.load`` refuses.
    """
    t0 = time.perf_counter()
    source = Storage(src, src_options)
    step = resolve_step(source, step)
    manifest = read_manifest(source, step)
    out_dir = _local_dir(out, "OUT")
    skipped: list[str] = []
    state: dict[str, Any] = {
        k: torch.empty(t.shape, dtype=dtype_info(t.dtype).torch_dtype, device="meta")
        for k, t in manifest.tensors.items()
    }
    values = 0
    written: dict[str, Any] = {}  # DCP key -> JSON value, as dcp.save flattens the extras
    taken = set(state)  # the DCP keys so far: the tensors', and the values' flattened
    for key, value in user_extras(manifest.extras).items():  # (not the commit's bookkeeping)
        if key in manifest.tensors:
            skipped.append(f"{key}: a value with the key of a tensor")
            continue
        leaves = _dcp_leaves(key, value)
        keys = [k for k, _ in leaves]
        # (a key twice within the value: {"a.b": 1, "a": {"b": 2}} flattens to a.b twice)
        twice = [k for k, n in Counter(keys).items() if n > 1]
        if twice:
            skipped.append(f"{key}: DCP flattens it to the key {twice[0]!r} twice")
            continue
        if leaves and _holds_an_empty_mapping(value):
            skipped.append(
                f"{key}: it holds an empty mapping, which DCP stores nothing for (it would come "
                f"back without it)"
            )
            continue
        clash = [k for k in keys if k in taken]
        if clash:
            skipped.append(
                f"{key}: DCP flattens it to the key {clash[0]!r}, which a tensor or another value "
                f"already has"
            )
            continue
        if not leaves:
            skipped.append(f"{key}: an empty mapping, which DCP stores nothing for")
            continue
        written.update(leaves)
        taken.update(keys)
        # the value itself, not its leaves: dcp.save flattens it alike, and keeps each leaf's
        # path in the metadata's planner_data, from which an import puts the value back together
        state[key] = value
        values += 1
    for rank, per_rank in sorted(manifest.rank_extras.items()):
        skipped.append(
            f"rank_extras of rank {rank} ({len(per_rank)} values, such as {sorted(per_rank)[:3]}): "
            f"values that differ per rank have no place in DCP's one namespace"
        )
    refuse_inside_source(source, Storage(out_dir))
    check_source_files(source, manifest, manifest.tensors)
    _prepare_out(out_dir, overwrite)
    planner = _StreamingSavePlanner(source, manifest, progress)
    writer = FileSystemWriter(out_dir, single_file_per_rank=False, thread_count=1)
    try:
        with _single_process():
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if planner.error is not None:
            raise planner.error from None  # the source's own error (corrupt, missing, ...)
        inner = _underlying(e)
        if isinstance(inner, ResilientError):
            raise inner from None
        raise StorageError(
            f"writing the DCP checkpoint {out_dir} failed: {type(inner).__name__}: {inner}; check "
            f"the directory (space, permissions) and run the export again",
            url=out_dir,
            operation="dcp.save",
        ) from inner
    if verify:
        _verify_export(out_dir, manifest, planner.crcs, written)
    total = sum(t.nbytes for t in manifest.tensors.values())
    files = sum(1 for n in os.listdir(out_dir) if n.endswith(".distcp"))
    return DcpReport(
        step,
        out_dir,
        len(manifest.tensors),
        total,
        time.perf_counter() - t0,
        values=values,
        files=files,
        skipped=skipped,
    )


def _holds_an_empty_mapping(value: Any) -> bool:
    """Whether an empty mapping is anywhere in a JSON value (dcp.save's flatten drops it)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            if not v:
                return True
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return False


def _dcp_leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """A JSON value under ``key`` as ``dcp.save`` flattens it (torch's ``flatten_state_dict``):
    (dotted key, leaf) for every leaf.  A mapping is walked; a list is walked only where it holds
    a mapping somewhere inside, else it is a leaf; anything else is a leaf."""

    def terminal(v: Any) -> bool:
        if isinstance(v, Mapping):
            return False
        return not isinstance(v, list) or all(terminal(x) for x in v)

    out: list[tuple[str, Any]] = []

    def walk(path: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{path}.{k}", x)
        elif terminal(v):
            out.append((path, v))
        else:
            for i, x in enumerate(v):
                walk(f"{path}.{i}", x)

    walk(key, value)
    return out


def _verify_export(
    out_dir: str, manifest: Manifest, crcs: Mapping[str, int], values: Mapping[str, Any]
) -> None:
    """Read the export back with ``dcp.load``, in batches of about VERIFY_BATCH_BYTES, and compare
    each tensor's CRC-32 with the bytes that were written, and each value (``values``: DCP key ->
    the JSON value written there)."""
    keys = sorted(manifest.tensors, key=lambda k: manifest.tensors[k].nbytes)
    batches: list[list[str]] = [[]]
    size = 0
    for k in keys:
        if batches[-1] and size + manifest.tensors[k].nbytes > VERIFY_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(k)
        size += manifest.tensors[k].nbytes
    for batch in batches:
        state: dict[str, Any] = {
            k: allocate(
                manifest.tensors[k].shape,
                dtype_info(manifest.tensors[k].dtype).torch_dtype,
                f"reading tensor {k!r} back from {out_dir}",
            )
            for k in batch
        }
        _load(out_dir, state, {})
        for k in batch:
            if _crc(state[k]) != crcs.get(k):
                raise CheckpointCorruptError(
                    f"tensor {k!r}: the bytes dcp.load reads back from {out_dir} differ from the "
                    f"bytes written; the disk or filesystem is damaging writes: check it and run "
                    f"the export again"
                )
    if values:
        raw: dict[str, bytes] = {}
        _load(out_dir, dict.fromkeys(values), raw)
        for k, want in values.items():
            # (the values are the manifest's, whatever their size: the cap is for a value read in)
            cap = max(MAX_VALUE_BYTES, 2 * len(json.dumps(want)))
            got, why = _decode_value(raw.get(k, b""), cap)
            if why is not None or got != want:
                raise CheckpointCorruptError(
                    f"value {k!r}: dcp.load reads back {got!r} from {out_dir}, expected "
                    f"{want!r} ({why or 'different'}); run the export again"
                )


# --- reading a DCP directory ----------------------------------------------------------------------


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor entry's bytes are kept raw (in
    ``raw``) instead of being unpickled with ``torch.load(weights_only=False)``."""

    def __init__(self, raw: dict[str, bytes]) -> None:
        super().__init__()
        self.raw = raw

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.getvalue()


class _NoLinksFileSystem(FileSystem):
    """torch's local FileSystem, whose reads open only regular files, never through a symbolic
    link (``open_source_file``): what torch's reader opens (``.metadata``, every ``.distcp``) is
    the file checked, not whatever a link or a FIFO planted under its name gives."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise AssertionError(f"a DCP import only reads; asked to open {path} with {mode!r}")
        with open_source_file(str(path), "DCP file", CheckpointCorruptError) as f:
            yield f  # type: ignore[misc]


class _NamingReader(FileSystemReader):
    """torch's FileSystemReader, reading file by file so that a failure names its file, and
    unpickling ``.metadata`` once: dcp.load gets the metadata that was checked."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _NoLinksFileSystem()
        self.path = self.fs.init_path(path)
        self.failure: tuple[str, BaseException] | None = None
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        fut = None
        for name, items in per_file.items():
            try:
                fut = super().read_data(dataclasses.replace(plan, items=items), planner)
                fut.wait()
            except BaseException as e:
                self.failure = (name, e)
                raise
        return fut if fut is not None else super().read_data(plan, planner)


def _load(
    src_dir: str,
    state: dict[str, Any],
    raw: dict[str, bytes],
    reader: _NamingReader | None = None,
) -> None:
    """``dcp.load`` into ``state`` (tensors allocated whole; ``None`` for non-tensor entries, whose
    raw bytes land in ``raw``); any failure becomes a CheckpointCorruptError naming the file."""
    reader = reader if reader is not None else _NamingReader(src_dir)
    try:
        with _single_process():
            dcp.load(state, storage_reader=reader, planner=_RawBytesLoadPlanner(raw), no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if reader.failure is not None:
            name, inner = reader.failure
            where = os.path.join(src_dir, name)
        else:
            inner, where = _underlying(e), src_dir
        raise CheckpointCorruptError(
            f"{where}: dcp.load failed ({type(inner).__name__}: {str(inner)[:300]}); the DCP "
            f"checkpoint is damaged (a truncated or overwritten .distcp file) or was not written "
            f"by torch.distributed.checkpoint.save: copy or save it again"
        ) from inner


class _Budget:
    """What the values of one import may still take, as JSON (MAX_VALUES_BYTES)."""

    def __init__(self, total: int | None = None) -> None:
        self.total = self.left = MAX_VALUES_BYTES if total is None else total


def _decode_value(
    data: bytes, max_json_bytes: int = MAX_VALUE_BYTES, budget: _Budget | None = None
) -> tuple[Any, str | None]:
    """(value, None) for a non-tensor entry that holds a JSON value, else (None, why).

    torch's restricted unpickler (``weights_only=True``) builds plain containers, numbers,
    strings and tensors only; it refuses any other class or callable, so no code runs.  Its value
    is sized before it is encoded: one whose JSON would pass ``max_json_bytes``, or what is left
    of ``budget`` (the import's values together), is not a value; an accepted one spends it."""
    try:
        # audited (tests/test_imports.py): the restricted unpickler, never the full one
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        return None, f"not a plain value (torch's restricted unpickler refused it: {str(e)[:120]})"
    limit = max_json_bytes if budget is None else min(max_json_bytes, budget.left)
    try:
        size = _json_size(value, limit)
    except _TooLarge as e:
        if budget is None or budget.left >= max_json_bytes:
            return None, str(e)
        return None, (
            f"its JSON would take more than the {budget.left} bytes left of the {budget.total} "
            f"that all values of an import may take together"
        )
    except _NotAValue as e:
        return None, str(e)
    if budget is not None:
        budget.left -= size
    try:
        decoded = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        return None, f"not a JSON value ({type(value).__name__}: {str(e)[:120]})"
    try:
        check_json_depth(decoded, "value")
    except ResilientError as e:
        return None, f"nested too deeply for a checkpoint value ({e})"
    return decoded, None


class _NotAValue(Exception):
    pass


class _TooLarge(_NotAValue):
    pass


def _json_size(value: Any, limit: int) -> int:
    """About the bytes of ``value``'s JSON, at least them; _NotAValue past ``limit``.

    A pickle keeps shared references, and so does the restricted unpickler: ``[[[0] * n] * n] * n``
    is 3n objects in a few kilobytes of pickle, and n**3 elements once ``json.dumps`` writes each
    reference out (n = 300: 27 million, a gigabyte and half a minute).  So each distinct container
    is sized once (by id) and counted at every reference to it, and the walk stops as soon as a
    sum passes ``limit``: it costs about what the pickle holds, not what its JSON would.  Sizes are
    at least the JSON's (a float as 3 bytes, an int by its bits), so a value within the limit is
    counted as within it."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(v: Any, depth: int) -> int:
        if isinstance(v, str):
            return len(v) + 2
        if isinstance(v, bool) or v is None:
            return 4
        if isinstance(v, int):
            return int(v.bit_length() * 0.30103) + 1
        if isinstance(v, float):
            return 3
        if not isinstance(v, (list, tuple, dict)):
            return 0  # not JSON: json.dumps says so
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in active:
            raise _NotAValue("not a JSON value (it contains itself)")
        if depth > MAX_JSON_DEPTH:
            raise _NotAValue(f"nested too deeply for a checkpoint value (over {MAX_JSON_DEPTH})")
        active.add(id(v))
        n = 2
        items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
        for k, x in items:
            n += 2 + size(x, depth + 1) + (0 if k is None else size(str(k), depth + 1) + 2)
            if n > limit:
                raise _TooLarge(
                    f"its JSON would take more than {limit} bytes (the cap on a value; a pickle "
                    f"can hold one list many times over)"
                )
        active.discard(id(v))
        sizes[id(v)] = n
        return n

    return size(value, 1)


def _check_tiling(fqn: str, md: TensorStorageMetadata) -> None:
    """The chunks of a DCP tensor lie inside it and cover every element exactly once."""
    shape = [int(n) for n in md.size]
    if len(shape) > MAX_DIMS or any(n < 0 for n in shape):
        raise CheckpointCorruptError(f"tensor {fqn!r}: shape {shape} is not a tensor's shape")
    boxes: list[tuple[list[int], list[int]]] = []
    volume = 0
    for c in md.chunks:
        off, size = [int(x) for x in c.offsets], [int(x) for x in c.sizes]
        if (
            len(off) != len(shape)
            or len(size) != len(shape)
            or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(off, size, shape))
        ):
            raise CheckpointCorruptError(
                f"tensor {fqn!r}: chunk at {off} of sizes {size} is outside its shape {shape}"
            )
        if all(s > 0 for s in size):
            boxes.append((off, [o + s for o, s in zip(off, size)]))
            volume += math.prod(size)
    if volume != math.prod(shape):
        raise CheckpointCorruptError(
            f"tensor {fqn!r}: its chunks hold {volume} elements, its shape {shape} has "
            f"{math.prod(shape)}; the metadata is damaged"
        )
    if len(boxes) < 2:
        return
    # sweep along the dim with the most distinct offsets: few chunks are open at a time there
    d = max(range(len(shape)), key=lambda i: len({b[0][i] for b in boxes}))
    boxes.sort(key=lambda b: b[0][d])
    open_: list[tuple[list[int], list[int]]] = []
    for lo, hi in boxes:
        open_ = [b for b in open_ if b[1][d] > lo[d]]
        for plo, phi in open_:
            if all(max(a, b) < min(x, y) for a, b, x, y in zip(plo, lo, phi, hi)):
                raise CheckpointCorruptError(
                    f"tensor {fqn!r}: chunks at {plo} and {lo} overlap; the metadata is damaged"
                )
        open_.append((lo, hi))


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


@dataclass
class _DcpContents:
    tensors: dict[str, TensorStorageMetadata]
    values: list[str]  # non-tensor entries small enough to read
    skipped: list[str]
    files: int


def _read_metadata(src_dir: str) -> tuple[_NamingReader, Metadata]:
    path = os.path.join(src_dir, METADATA_NAME)
    if not os.path.isdir(src_dir):
        raise CheckpointNotFoundError(f"{src_dir}: no such directory; check DCP_DIR")
    try:
        with open_source_file(path, "DCP metadata", CheckpointCorruptError) as f:
            st = os.fstat(f.fileno())
    except FileNotFoundError:
        ranks = [n for n in os.listdir(src_dir) if n.endswith(METADATA_NAME) and n != METADATA_NAME]
        hint = (
            f" (it holds per-rank {ranks[:3]}: a save without collectives, which is not supported)"
            if ranks
            else ""
        )
        raise CheckpointNotFoundError(
            f"{path}: no such file{hint}; DCP_DIR must be a directory written by "
            f"torch.distributed.checkpoint.save (an interrupted save has no .metadata)"
        ) from None
    if st.st_size > MAX_METADATA_BYTES:
        raise CheckpointCorruptError(
            f"{path}: {st.st_size} bytes, DCP metadata of at most {MAX_METADATA_BYTES} bytes was "
            f"expected; it is not DCP metadata"
        )
    reader = _NamingReader(src_dir)
    try:
        metadata = reader.read_metadata()  # pickle.load (in torch), behind trust_pickle
    except Exception as e:
        raise CheckpointCorruptError(
            f"{path}: cannot read DCP metadata ({type(e).__name__}: {str(e)[:200]}); the file is "
            f"damaged or was not written by torch.distributed.checkpoint.save"
        ) from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointCorruptError(
            f"{path}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint's "
            f"Metadata; it is not a DCP checkpoint"
        )
    return reader, metadata


def _check_contents(src_dir: str, metadata: Metadata) -> _DcpContents:
    """Everything about a DCP directory that can be checked before allocating or reading data."""
    tensors: dict[str, TensorStorageMetadata] = {}
    values: list[str] = []
    skipped: list[str] = []
    lengths: dict[tuple[str, str], list[tuple[int, int, bool]]] = {}  # (fqn, file) -> spans
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name, fqn = getattr(info, "relative_path", None), getattr(index, "fqn", None)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name:
            raise CheckpointCorruptError(
                f"{os.path.join(src_dir, METADATA_NAME)}: entry {fqn!r} names the file {name!r}; "
                f"DCP data files are plain names inside the directory"
            )
        if not (isinstance(start, int) and isinstance(length, int) and start >= 0 and length >= 0):
            raise CheckpointCorruptError(f"entry {fqn!r} in {name!r}: byte range is not valid")
        if name not in sizes:
            path = os.path.join(src_dir, name)
            try:
                with open_source_file(path, "DCP data file", CheckpointCorruptError) as f:
                    sizes[name] = os.fstat(f.fileno()).st_size
            except FileNotFoundError:
                raise CheckpointCorruptError(
                    f"{path}: missing (the metadata names it for {fqn!r}); the DCP checkpoint is "
                    f"incomplete: copy the whole directory again"
                ) from None
        if start + length > sizes[name]:
            raise CheckpointCorruptError(
                f"{os.path.join(src_dir, name)}: {sizes[name]} bytes, but the metadata puts "
                f"{fqn!r} at bytes [{start}, {start + length}): the file is truncated; copy or "
                f"save the DCP checkpoint again"
            )
        transformed = bool(getattr(info, "transform_descriptors", None))
        lengths.setdefault((str(fqn), name), []).append((start, length, transformed))
    stored: dict[str, int] = {}
    untransformed: set[str] = set()
    for (fqn, _), spans in lengths.items():
        stored[fqn] = stored.get(fqn, 0) + sum(n for _, n, _ in spans)
        if not any(t for _, _, t in spans):
            untransformed.add(fqn)
    total = 0
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(fqn, str):
            raise CheckpointCorruptError(f"the metadata has a key {fqn!r} that is not a string")
        if isinstance(md, BytesStorageMetadata):
            if stored.get(fqn, 0) > MAX_VALUE_BYTES:
                skipped.append(f"{fqn}: a non-tensor entry of {stored[fqn]} bytes (not read)")
            else:
                values.append(fqn)
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointCorruptError(
                f"entry {fqn!r} is a {type(md).__name__}, neither a tensor nor a non-tensor "
                f"entry; it is not a DCP checkpoint this torch can read"
            )
        dtype = getattr(md.properties, "dtype", None)
        if dtype not in _TORCH_DTYPES:
            raise StateMismatchError(
                f"tensor {fqn!r} has dtype {dtype}; checkpoints hold {sorted(DTYPES)}: convert "
                f"it before saving the DCP checkpoint"
            )
        _check_tiling(fqn, md)
        nbytes = math.prod(int(n) for n in md.size) * dtype_info(_TORCH_DTYPES[dtype]).itemsize
        # torch.save writes at least the chunk's bytes: the files bound what the metadata claims
        if fqn in untransformed and nbytes > stored.get(fqn, 0):
            raise CheckpointCorruptError(
                f"tensor {fqn!r}: the metadata gives it {nbytes} bytes, its files hold "
                f"{stored.get(fqn, 0)}; the metadata or the data files are damaged"
            )
        tensors[fqn] = md
        total += nbytes
    memory = _physical_memory_bytes()
    if total > memory:
        raise StateMismatchError(
            f"{src_dir}: its tensors hold {total} bytes; an import holds all of them in memory "
            f"(and about twice that while writing), and this machine has {memory}: import on a "
            f"machine with more memory"
        )
    return _DcpContents(tensors, values, skipped, len(sizes))


# --- import ---------------------------------------------------------------------------------------


def _check_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(sizes) - set(LAYOUT_AXES))
    bad = {a: n for a, n in sizes.items() if not isinstance(n, int) or n < 1}
    if unknown or bad:
        raise LayoutError(
            f"layout {dict(sizes)}: the axes are {list(LAYOUT_AXES)}, each a size of at least 1 "
            f"(found {'unknown axes ' + str(unknown) if unknown else 'sizes ' + str(bad)})"
        )
    return {a: int(sizes.get(a, 1)) for a in LAYOUT_AXES}


def _check_destination(out: str, options: dict | None, step: int, overwrite: bool) -> None:
    """Fail before reading a large DCP checkpoint when write_checkpoint would refuse ``out``."""
    dest = Storage(out, options)
    existing = sorted(step_dirs(dest))  # {} when there is no directory yet
    if existing and not overwrite:
        raise DestinationExistsError(
            f"the destination {dest.url} already holds checkpoint steps {existing[-10:]}; pass "
            f"--overwrite to replace step {step} there, or choose an empty destination"
        )


def _checkpoint_key(fqn: str) -> str:
    head, dot, rest = fqn.partition(".")
    return fqn if head and dot and rest else f"{UNGROUPED}.{fqn}"


def _placement_of(shapes: Mapping[str, tuple[int, ...]]) -> Callable[[str], dict]:
    """The reference trainer's placements, and for optimizer state
    (``optim.state.<parameter key>.<name>``) of a parameter's shape, the parameter's (as the
    trainer's optimizer state inherits its parameter's placement)."""

    def placement(key: str) -> dict:
        if key.startswith("optim.state."):
            param, _, _ = key[len("optim.state.") :].rpartition(".")
            if param in shapes and shapes[param] == shapes[key] and len(shapes[key]) > 0:
                return reference_placement(param)
        return reference_placement(key)

    return placement


def import_dcp(
    src: str,
    out: str,
    *,
    sizes: Mapping[str, int],
    trust_pickle: bool,
    step: int = 0,
    overwrite: bool = False,
    out_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> DcpReport:
    """Write the DCP checkpoint in the local directory ``src`` as step ``step`` of a checkpoint at
    ``out`` in the layout ``sizes`` (``{"tp": 2, "ep": 1, "dp": 1}``), split the reference
    trainer's way (its names; other tensors replicated), verified bit for bit against
    ``dcp.load``.

    ``trust_pickle`` must be True: DCP's ``.metadata`` is a pickle (UntrustedPickleError
    otherwise, before anything is read).  Tensor keys without a dot get the group ``dcp.``
    (``report.renamed``); non-tensor entries that hold JSON values become the checkpoint's values,
    others are skipped (``report.skipped``).  Holds the whole state in memory (about twice while
    writing).  ``progress(nbytes)`` reports the bytes written.  Every failure is a
    ResilientError naming the file.
    """
    t0 = time.perf_counter()
    src_dir = _local_dir(src, "DCP_DIR")
    if not trust_pickle:
        raise UntrustedPickleError(
            f"{src_dir}: a torch.distributed.checkpoint directory's .metadata is a Python pickle, "
            f"and unpickling a file from an untrusted source can run arbitrary code on this "
            f"machine. Pass --trust-pickle (trust_pickle=True) only for a directory that you, or "
            f"someone you trust, wrote; nothing was read"
        )
    layout = _check_sizes(sizes)
    _check_destination(out, out_options, step, overwrite)
    reader, metadata = _read_metadata(src_dir)
    try:
        contents = _check_contents(src_dir, metadata)
    except ResilientError:
        raise
    except Exception as e:  # a Metadata whose fields are not what torch writes
        raise CheckpointCorruptError(
            f"{os.path.join(src_dir, METADATA_NAME)}: malformed DCP metadata "
            f"({type(e).__name__}: {str(e)[:200]}); it was not written by "
            f"torch.distributed.checkpoint.save"
        ) from e

    empty = sorted(f for f in contents.tensors if "" in f.split("."))
    if empty:
        raise StateMismatchError(
            f"{src_dir}: DCP keys {empty[:3]} have an empty part between dots (a checkpoint key "
            f"is <group>.<name> with no empty parts); rename them in the DCP checkpoint"
        )
    renamed = {f: _checkpoint_key(f) for f in contents.tensors if _checkpoint_key(f) != f}
    keys = {f: _checkpoint_key(f) for f in contents.tensors}
    clash = sorted(f for f, k in keys.items() if k in contents.tensors and k != f)
    if clash:
        raise StateMismatchError(
            f"{src_dir}: DCP keys {clash[:3]} would be imported as {[keys[f] for f in clash[:3]]}, "
            f"which the checkpoint already holds; rename them in the DCP checkpoint"
        )
    state: dict[str, Any] = {
        f: torch.empty(tuple(int(n) for n in md.size), dtype=md.properties.dtype)
        for f, md in contents.tensors.items()
    }
    state.update(dict.fromkeys(contents.values))
    raw: dict[str, bytes] = {}
    _load(src_dir, state, raw, reader)

    skipped = list(contents.skipped)
    groups = {k.partition(".")[0] for k in keys.values()}
    taken = set(keys.values())
    values: dict[str, Any] = {}
    budget = _Budget()
    for key, value, why in _nested_values(contents.values, raw, metadata.planner_data, budget):
        if why is None:
            leaves = dict(_json_leaves(key, value))
            bad = [k for k in leaves if k in groups or k in taken or k in values]
            if bad:
                why = f"its key {bad[0]!r} is taken by a group of tensors, a tensor or a value"
            elif not leaves:
                why = "an empty mapping: nothing to store"
            else:
                values.update(leaves)
        if why is not None:
            skipped.append(f"{key}: {why}")
    tensors = {keys[f]: state[f] for f in contents.tensors}
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    report = write_checkpoint(
        out,
        tensors,
        layout,
        values=values,
        step=step,
        placement=_placement_of(shapes),
        overwrite=overwrite,
        out_options=out_options,
        progress=progress,
    )
    try:
        _verify_import(out, out_options, step, tensors, values)
    except BaseException:
        # the step is committed by now: a step that does not equal its source must not stay
        with contextlib.suppress(Exception):
            Storage(out, out_options).remove_tree(step_dir_name(step))
        raise
    return DcpReport(
        step,
        report.target,
        len(tensors),
        sum(t.numel() * t.element_size() for t in tensors.values()),
        time.perf_counter() - t0,
        values=len(values),
        files=contents.files,
        skipped=skipped,
        renamed=renamed,
        convert=report,
    )


def _value_path(fqn: str, planner_data: Any) -> tuple[str, tuple[str | int, ...]]:
    """(checkpoint key, path inside its value) of the DCP value entry ``fqn``.

    ``dcp.save`` flattens a list that holds a mapping into indexed keys
    (``sched._schedule_phases.0.end_step``) and keeps each original path in the metadata's
    ``planner_data`` (``('sched', '_schedule_phases', 0, 'end_step')``).  A checkpoint keeps such
    a list whole as one value, as a save of the same state would: the key is the path up to its
    first index, the rest is where the entry sits inside the value.  A path that is missing, or
    does not spell ``fqn``, leaves the entry under its own key."""
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if (
        not isinstance(path, (tuple, list))
        or not path
        or not all(type(p) in (str, int) for p in path)
        or ".".join(map(str, path)) != fqn
    ):
        return fqn, ()
    first = next((i for i, p in enumerate(path) if type(p) is int), len(path))
    if first == 0:
        return fqn, ()
    return ".".join(map(str, path[:first])), tuple(path[first:])


class _Leaf:
    def __init__(self, value: Any) -> None:
        self.value = value


def _nest(entries: list[tuple[tuple[str | int, ...], Any]]) -> Any:
    """The value whose entries are (path inside it, leaf): indices make lists, names mappings;
    ValueError where the paths do not describe one value."""
    tree: dict = {}
    for path, value in entries:
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"a leaf and a container at {list(path)}")
        if path[-1] in node:
            raise ValueError(f"two entries at {list(path)}")
        node[path[-1]] = _Leaf(value)

    def build(node: Any) -> Any:
        if isinstance(node, _Leaf):
            return node.value
        if all(type(k) is int for k in node):
            if sorted(node) != list(range(len(node))):
                raise ValueError(f"list indices {sorted(node)[:8]} are not 0..{len(node) - 1}")
            return [build(node[i]) for i in range(len(node))]
        if any(type(k) is int for k in node):
            raise ValueError(f"list indices and names at one level ({sorted(map(str, node))[:8]})")
        return {k: build(v) for k, v in node.items()}

    return build(tree)


def _nested_values(
    fqns: list[str], raw: Mapping[str, bytes], planner_data: Any, budget: _Budget
) -> Iterator[tuple[str, Any, str | None]]:
    """(checkpoint key, value, None), or (key, None, why) for what is skipped, for the DCP value
    entries ``fqns``: each decoded, and the entries of one list that ``dcp.save`` flattened put
    back together (``_value_path``), so the checkpoint holds the value a save would have."""
    grouped: dict[str, list[tuple[str, tuple[str | int, ...]]]] = {}
    for fqn in fqns:
        key, path = _value_path(fqn, planner_data)
        grouped.setdefault(key, []).append((fqn, path))
    for key, members in grouped.items():
        if len(members) == 1 and not members[0][1]:
            value, why = _decode_value(raw.get(members[0][0], b""), budget=budget)
            yield key, value, why
            continue
        entries: list[tuple[tuple[str | int, ...], Any]] = []
        why = None
        for fqn, path in members:
            if not path:
                why = f"DCP stores it both whole ({fqn!r}) and as indexed entries"
            elif len(path) > MAX_JSON_DEPTH:
                why = f"nested too deeply for a checkpoint value ({fqn!r})"
            else:
                value, bad = _decode_value(raw.get(fqn, b""), budget=budget)
                why = why or (f"its entry {fqn!r} is {bad}" if bad is not None else None)
                entries.append((path, value))
            if why is not None:
                break
        if why is None:
            try:
                value = _nest(entries)
                check_json_depth(value, f"value {key!r}")
            except ValueError as e:
                why = f"its DCP entries do not form one value: {e}"
            except ResilientError as e:
                why = f"nested too deeply for a checkpoint value ({e})"
        yield (key, None, why) if why is not None else (key, value, None)


def _json_leaves(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """A JSON value as the checkpoint stores values: nested mappings flattened into dotted keys
    (a checkpoint never stores a mapping as one value), everything else whole."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_leaves(f"{key}.{k}", v)
    else:
        yield key, value


def _verify_import(
    out: str,
    out_options: dict | None,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    values: Mapping[str, Any],
) -> None:
    """Every tensor of the written step, read back whole, has the bits ``dcp.load`` gave, and its
    values are ``values``; read in batches of about ``VERIFY_BATCH`` bytes."""
    storage = Storage(out, out_options)
    manifest = read_manifest(storage, step)
    if set(manifest.tensors) != set(tensors):
        raise CheckpointCorruptError(
            f"step {step} of {storage.url} holds tensors "
            f"{sorted(set(manifest.tensors) ^ set(tensors))[:5]} differently from the DCP "
            f"checkpoint; the import failed: run it again"
        )
    for batch in byte_batches(list(tensors), lambda k: manifest.tensors[k].nbytes, VERIFY_BATCH):
        read = read_many(storage, manifest, batch)
        for key in batch:
            got, expected = read.pop(key), tensors[key]
            if got.dtype != expected.dtype or got.shape != expected.shape:
                raise CheckpointCorruptError(
                    f"tensor {key!r} at step {step} of {storage.url}: {got.dtype} "
                    f"{list(got.shape)}, dcp.load gave {expected.dtype} {list(expected.shape)}; "
                    f"run the import again"
                )
            if not torch.equal(_bits(got), _bits(expected)):
                raise CheckpointCorruptError(
                    f"tensor {key!r} at step {step} of {storage.url}: its bytes differ from what "
                    f"dcp.load gave; the destination is damaging writes: check it and run again"
                )
    if dict(manifest.extras) != dict(values):
        diff = sorted(set(manifest.extras) ^ set(values)) or sorted(
            k for k in values if manifest.extras.get(k) != values[k]
        )
        raise CheckpointCorruptError(
            f"step {step} of {storage.url}: values {diff[:5]} differ from the DCP checkpoint's; "
            f"run the import again"
        )
