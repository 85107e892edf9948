"""Export consolidated model weights as Hugging Face style safetensors shards.

Every tensor under ``model.`` is assembled whole from its chunks (ranged, verified reads), cast if
asked, and streamed into ``model-0000i-of-0000n.safetensors`` files no larger than the size limit,
with ``model.safetensors.index.json`` mapping each weight to its file.  One tensor is in memory at
a time.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from reshape.execute import DestinationExistsError, resolve_step
from resilient.checkpoint.codec import safetensors_header
from resilient.checkpoint.format import DTYPES, dtype_info
from resilient.checkpoint.reader import execute_reads, plan_tensor_reads, read_manifest
from resilient.checkpoint.storage import Storage
from resilient.errors import StateMismatchError
from resilient.layout import normalize_placement

__all__ = ["ExportReport", "export_hf", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class ExportReport:
    step: int
    out: str
    files: list[str]
    tensors: int
    total_bytes: int
    dtype: str | None
    seconds: float


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``1.5GiB``, ``1000`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(
            f"size {text!r}: expected a number with an optional unit such as 5GB or 500MiB"
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
) -> ExportReport:
    t0 = time.perf_counter()
    source, dest = Storage(src, src_options), Storage(out, out_options)
    step = resolve_step(source, step)
    manifest = read_manifest(source, step)
    keys = sorted(k for k in manifest.tensors if k.startswith("model."))
    if not keys:
        raise StateMismatchError(
            f"step {step} of {source.url} has no tensors under 'model.'; nothing to export"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {sorted(DTYPES)}")
    out_dtype = {k: dtype or manifest.tensors[k].dtype for k in keys}
    existing = [n for n in dest.listdir("") if n == INDEX_NAME or n.endswith(".safetensors")]
    if existing and not overwrite:
        raise DestinationExistsError(
            f"{dest.url} already holds {existing[:5]}; pass --overwrite to replace them, or choose an empty directory"
        )
    dest.makedirs("")
    for name in existing:
        dest.remove(name)
    # greedy split in key order: a new shard when the next tensor would pass the limit
    shards: list[list[str]] = [[]]
    size = 0
    for k in keys:
        n = (
            manifest.tensors[k].nbytes
            // dtype_info(manifest.tensors[k].dtype).itemsize
            * dtype_info(out_dtype[k]).itemsize
        )
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        entries, pos = [], 0
        for k in shard:
            t = manifest.tensors[k]
            n = t.nbytes // dtype_info(t.dtype).itemsize * dtype_info(out_dtype[k]).itemsize
            entries.append((k, dtype_info(out_dtype[k]).safetensors, t.shape, pos, pos + n))
            pos += n
            weight_map[k] = name
        total += pos
        header = safetensors_header(entries, {"format": "pt"})

        def parts(shard=shard, header=header) -> Iterator[memoryview | bytes]:
            yield header
            for k in shard:
                t = manifest.tensors[k]
                whole = torch.empty(t.shape, dtype=dtype_info(t.dtype).torch_dtype)
                reads = plan_tensor_reads(
                    k,
                    t,
                    normalize_placement(None, manifest.layout),
                    (0,) * len(t.shape),
                    tuple(t.shape),
                    manifest.block_bytes,
                )
                execute_reads(source, manifest, reads, {k: whole})
                cast = whole.to(dtype_info(out_dtype[k]).torch_dtype).contiguous()
                data = memoryview(cast.reshape(-1).view(torch.uint8).numpy())
                yield data
                if progress is not None:
                    progress(len(data))

        dest.write_file(name, parts)
    index = {
        "metadata": {"total_size": total, "step": step, "source": source.url},
        "weight_map": weight_map,
    }
    dest.write_atomic(INDEX_NAME, json.dumps(index, indent=2).encode())
    return ExportReport(step, dest.url, names, len(keys), total, dtype, time.perf_counter() - t0)
