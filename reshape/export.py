"""Export consolidated model weights as Hugging Face style safetensors shards.

Every tensor under ``model.`` is assembled whole from its chunks (ranged, verified reads), cast if
asked, and streamed into ``model-0000i-of-0000n.safetensors`` files no larger than the size limit,
with ``model.safetensors.index.json`` mapping each weight to its file.  One tensor is in memory at
a time.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from reshape.execute import DestinationExistsError, allocate, resolve_step
from resilient.checkpoint.codec import SAFETENSORS_METADATA, safetensors_header
from resilient.checkpoint.format import DTYPES, Manifest, dtype_info, parse_step_dir
from resilient.checkpoint.reader import (
    check_file_sizes,
    execute_reads,
    plan_tensor_reads,
    read_manifest,
)
from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError, StateMismatchError
from resilient.layout import normalize_placement

__all__ = [
    "ExportOptionError",
    "ExportReport",
    "byte_batches",
    "check_export_dtype",
    "check_name_map",
    "check_source_files",
    "clear_destination",
    "export_bytes",
    "export_hf",
    "parse_size",
    "read_many",
    "read_whole",
    "write_shards",
]

INDEX_NAME = "model.safetensors.index.json"
T = TypeVar("T")


class ExportOptionError(ResilientError, ValueError):
    """An export was asked for something it cannot write: an option's value (``--dtype``,
    ``--max-shard-size``, ``--name-map``) or an output name."""


@dataclass
class ExportReport:
    step: int
    out: str
    files: list[str]
    tensors: int
    total_bytes: int
    dtype: str | None
    seconds: float
    architecture: str | None = None  # the transformers architecture, or None: our own names


def parse_size(text: str, what: str = "size") -> int:
    """``5GB``, ``500MB``, ``1.5GiB``, ``1000`` -> bytes; ``what`` names the option in errors."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ExportOptionError(
            f"{what} {text!r}: expected a number with an optional unit such as 5GB or 500MiB"
        )
    value, unit = float(m.group(1)), m.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return int(value * base**power)


def export_hf(
    src: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    src_options: dict | None = None,
    out_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    name_map: Mapping[str, str] | None = None,
) -> ExportReport:
    """Every tensor under ``model.``, whole, under its checkpoint name (or the name
    ``name_map`` gives it), as safetensors shards and an index."""
    t0 = time.perf_counter()
    source, dest = Storage(src, src_options), Storage(out, out_options)
    step = resolve_step(source, step)
    manifest = read_manifest(source, step)
    keys = sorted(k for k in manifest.tensors if k.startswith("model."))
    if not keys:
        raise StateMismatchError(
            f"step {step} of {source.url} has no tensors under 'model.'; nothing to export"
        )
    check_export_dtype(dtype)
    out_dtype = {k: dtype or manifest.tensors[k].dtype for k in keys}
    rename = check_name_map(name_map or {}, keys, source.url, step)
    refuse_inside_source(source, dest)
    check_source_files(source, manifest, keys)
    clear_destination(dest, overwrite)
    items = [(rename.get(k, k), out_dtype[k], manifest.tensors[k].shape) for k in keys]
    back = {rename.get(k, k): k for k in keys}

    def produce(name: str) -> torch.Tensor:
        k = back[name]
        return read_whole(source, manifest, k).to(dtype_info(out_dtype[k]).torch_dtype)

    names, weight_map, total = write_shards(dest, items, produce, max_shard_bytes, progress)
    index = {
        "metadata": {"total_size": total, "step": step, "source": source.url},
        "weight_map": weight_map,
    }
    dest.write_atomic(INDEX_NAME, json.dumps(index, indent=2).encode())
    return ExportReport(step, dest.url, names, len(keys), total, dtype, time.perf_counter() - t0)


# what --dtype may cast weights to: the floating dtypes of the format (an integer or bool cast
# truncates every weight to a few values, silently)
EXPORT_DTYPES = tuple(sorted(n for n, d in DTYPES.items() if d.torch_dtype.is_floating_point))


def check_export_dtype(dtype: str | None) -> None:
    """``--dtype``: None (keep each tensor's) or one of ``EXPORT_DTYPES``."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        what = "is not floating point" if dtype in DTYPES else "is not a dtype of the format"
        raise ExportOptionError(
            f"--dtype {dtype!r} {what}: weights are cast to one of {list(EXPORT_DTYPES)}; pass "
            f"one of those, or no --dtype to keep each tensor's own"
        )


def export_bytes(manifest: Manifest, dtype: str | None = None) -> int:
    """The tensor bytes ``export_hf`` writes for ``manifest``: every tensor under ``model.``, at
    the itemsize of ``dtype`` (or its own)."""
    return sum(
        math.prod(t.shape) * dtype_info(dtype or t.dtype).itemsize
        for k, t in manifest.tensors.items()
        if k.startswith("model.")
    )


def check_name_map(
    name_map: Mapping[str, str], keys: list[str], url: str, step: int
) -> dict[str, str]:
    """A user's renaming ({"checkpoint name": "output name"}), checked: every name it renames
    exists, no two tensors end up with the same output name, and none is named `__metadata__`."""
    if not isinstance(name_map, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in name_map.items()
    ):
        raise ExportOptionError(
            "--name-map: expected a JSON object of tensor name -> new name (strings)"
        )
    missing = sorted(set(name_map) - set(keys))
    if missing:
        raise StateMismatchError(
            f"--name-map renames {missing[:5]}, which step {step} of {url} does not have; its "
            f"tensors are named like {keys[:3]}"
        )
    seen: dict[str, str] = {}
    for k in keys:
        out = name_map.get(k, k)
        if out == SAFETENSORS_METADATA:
            given = f"--name-map gives {k!r} the name" if k in name_map else f"tensor {k!r} has"
            raise ExportOptionError(
                f"{given} {SAFETENSORS_METADATA!r}, the key safetensors reserves for a file's metadata "
                f"(the file written would not open); map it to another name"
            )
        if out in seen:
            raise ExportOptionError(
                f"--name-map gives {seen[out]!r} and {k!r} the same name {out!r}; every output "
                f"name must be unique"
            )
        seen[out] = k
    return dict(name_map)


def refuse_inside_source(source: Storage, dest: Storage) -> None:
    """Refuse an export into the source checkpoint's root or into one of its step directories:
    making the destination ready removes the ``*.safetensors`` there, which in a step directory
    are the checkpoint's own rank files.  (A directory of its own under the root, such as
    ``ckpt/hf``, is no step of the checkpoint and is fine.)"""
    src, out = source.location(), dest.location()
    if src[:-1] != out[:-1]:
        return
    base, path = src[-1].rstrip("/"), out[-1].rstrip("/")
    if path == base:
        inside = "is the source checkpoint's root"
    elif (
        path.startswith(base + "/")
        and parse_step_dir(path[len(base) + 1 :].split("/")[0]) is not None
    ):
        inside = "is inside one of the source checkpoint's step directories"
    else:
        return
    raise DestinationExistsError(
        f"the destination {dest.url} {inside} ({source.url}); its files there would be replaced: "
        f"export into a directory of its own"
    )


def clear_destination(dest: Storage, overwrite: bool, also: tuple[str, ...] = ()) -> None:
    """Make ``dest`` ready for an export: refuse one that holds weights unless ``overwrite``,
    then remove them (and the files named in ``also``)."""
    existing = [
        n for n in dest.listdir("") if n == INDEX_NAME or n.endswith(".safetensors") or n in also
    ]
    if existing and not overwrite:
        raise DestinationExistsError(
            f"{dest.url} already holds {existing[:5]}; pass --overwrite to replace them, or "
            f"choose an empty directory"
        )
    dest.makedirs("")
    for name in existing:
        dest.remove(name)


def check_source_files(source: Storage, manifest: Manifest, keys: Iterable[str]) -> None:
    """The files that hold tensors ``keys`` against the sizes the manifest declares, before any
    tensor is allocated by the shape the manifest gives it (a damaged manifest's shape would be
    the allocator's error, not the file's)."""
    check_file_sizes(source, manifest, {c.file for k in keys for c in manifest.tensors[k].chunks})


def read_whole(source: Storage, manifest: Manifest, key: str) -> torch.Tensor:
    """Tensor ``key`` of ``manifest``, assembled whole from its chunks (every block verified)."""
    return read_many(source, manifest, [key])[key]


def read_many(source: Storage, manifest: Manifest, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of ``manifest``, each assembled whole, in one batch of reads (one pool of
    reader threads for all of them; every block verified)."""
    whole, reads = {}, []
    for key in keys:
        t = manifest.tensors[key]
        whole[key] = allocate(
            t.shape, dtype_info(t.dtype).torch_dtype, f"tensor {key!r} of step {manifest.step}"
        )
        reads += plan_tensor_reads(
            key,
            t,
            normalize_placement(None, manifest.layout),
            (0,) * len(t.shape),
            tuple(t.shape),
            manifest.block_bytes,
        )
    execute_reads(source, manifest, reads, whole)
    return whole


def byte_batches(items: list[T], size: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` in order, cut greedily into batches of at most ``budget`` bytes (an item larger
    than that is a batch of its own)."""
    out: list[list[T]] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if out[-1] and total + n > budget:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def write_shards(
    dest: Storage,
    items: list[tuple[str, str, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    max_shard_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[str], dict[str, str], int]:
    """Write ``items`` (name, dtype, shape), in order, into ``model-0000i-of-0000n.safetensors``
    files of at most ``max_shard_bytes`` each (a tensor larger than that gets a file of its own);
    ``produce(name)`` gives each tensor, one at a time.  Returns (file names, the weight map,
    total bytes)."""
    shards = byte_batches(
        items, lambda it: math.prod(it[2]) * dtype_info(it[1]).itemsize, max_shard_bytes
    )
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        entries, pos = [], 0
        for k, dtype, shape in shard:
            n = math.prod(shape) * dtype_info(dtype).itemsize
            entries.append((k, dtype_info(dtype).safetensors, shape, pos, pos + n))
            pos += n
            weight_map[k] = name
        total += pos
        header = safetensors_header(entries, {"format": "pt"})

        def parts(shard=shard, header=header) -> Iterator[memoryview | bytes]:
            yield header
            for k, dtype, shape in shard:
                t = produce(k)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype_info(dtype).torch_dtype:
                    raise AssertionError(f"{k}: produced {t.dtype} {tuple(t.shape)}")
                data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                yield data
                if progress is not None:
                    progress(len(data))

        dest.write_file(name, parts)
    return names, weight_map, total
