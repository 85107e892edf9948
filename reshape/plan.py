"""Planning a layout change: a pure function from a source manifest and a target layout to the
chunks every target rank writes and the byte ranges each one reads.

No files, no processes: ``plan`` is arithmetic on the manifest (the same placement arithmetic the
checkpointer uses), so it is tested on manifests alone and a storage team can read the I/O it implies
before anything moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from resilient.checkpoint.format import MAX_WORLD_SIZE, Manifest, TensorEntry, rank_file_name
from resilient.checkpoint.reader import ReadItem, plan_tensor_reads
from resilient.checkpoint.writer import WriteItem, assign_writers
from resilient.errors import LayoutError
from resilient.layout import Layout, Shard, fused_parts

__all__ = ["CopyItem", "TargetChunk", "ConversionPlan", "target_layout", "check_fits", "plan"]

# Axes whose splits the trainer needs even (heads, FFN width, experts); dp splits (ZeRO-1 optimizer
# state) may be uneven.
EVEN_AXES = ("tp", "ep")


@dataclass(frozen=True)
class CopyItem:
    """One copy: a byte range of a source file into a target rank's chunk."""

    key: str
    source_file: str
    source_range: tuple[int, int]  # block-aligned, absolute in the source file
    target_rank: int
    target_file: str
    target_offsets: tuple[int, ...]  # the target chunk's offsets (manifest convention)
    overlap_offsets: tuple[int, ...]  # the copied region, expanded global coordinates
    overlap_sizes: tuple[int, ...]


@dataclass(frozen=True)
class TargetChunk:
    """A chunk a target rank writes, and the reads that fill it."""

    rank: int
    file: str
    item: WriteItem  # key, dtype, local shape, offsets, sizes, place in the data section
    reads: tuple[ReadItem, ...]

    @property
    def nbytes(self) -> int:
        return self.item.end - self.item.begin

    @property
    def read_ranges(self) -> list[tuple[str, int, int]]:
        """The coalesced (file, start, end) reads this chunk needs."""
        out: list[tuple[str, int, int]] = []
        for file, (a, b) in sorted((r.chunk.file, r.span) for r in self.reads):
            if out and out[-1][0] == file and a <= out[-1][2]:
                out[-1] = (file, out[-1][1], max(out[-1][2], b))
            else:
                out.append((file, a, b))
        return out


@dataclass(frozen=True)
class ConversionPlan:
    step: int
    source: Layout
    target: Layout
    chunks: tuple[TargetChunk, ...]  # by target rank, then in data-section order

    def for_rank(self, rank: int) -> list[TargetChunk]:
        return [c for c in self.chunks if c.rank == rank]

    @property
    def copy_items(self) -> list[CopyItem]:
        return [
            CopyItem(
                r.key,
                r.chunk.file,
                r.span,
                c.rank,
                c.file,
                c.item.offsets,
                r.overlap.offsets,
                r.overlap.sizes,
            )
            for c in self.chunks
            for r in c.reads
        ]

    def bytes_written(self, rank: int | None = None) -> int:
        return sum(c.nbytes for c in self.chunks if rank is None or c.rank == rank)

    def bytes_read(self, rank: int | None = None) -> int:
        return sum(
            b - a
            for c in self.chunks
            if rank is None or c.rank == rank
            for _, a, b in c.read_ranges
        )

    @property
    def read_amplification(self) -> float:
        written = self.bytes_written()
        return self.bytes_read() / written if written else 1.0

    @property
    def largest_chunk_bytes(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)


def target_layout(source: Layout, sizes: Mapping[str, int | None]) -> Layout:
    """The source's axes with the given sizes replaced (None keeps the source size)."""
    unknown = [a for a, v in sizes.items() if v is not None and a not in source]
    if unknown:
        raise LayoutError(
            f"the checkpoint's layout {source} has no axes {unknown}; its axes are {list(source.names)}"
        )
    bad = {a: v for a, v in sizes.items() if v is not None and (type(v) is not int or v < 1)}
    if bad:
        a, v = next(iter(bad.items()))
        raise LayoutError(
            f"--{a} {v!r}: a layout axis size is an int >= 1 (leave the flag out to keep the "
            f"source's size, {source.size(a) if a in source else '?'})"
        )
    axes = [(a, n if sizes.get(a) is None else sizes[a]) for a, n in source.axes]
    world = math.prod(n for _, n in axes)
    if world > MAX_WORLD_SIZE:  # (a reader refuses such a checkpoint; a plan listed every rank)
        raise LayoutError(
            f"{' x '.join(f'--{a} {n}' for a, n in axes)} = {world} ranks: a checkpoint's layout "
            f"has at most {MAX_WORLD_SIZE} ranks (readers refuse more); choose smaller sizes"
        )
    return Layout(axes)


def check_fits(manifest: Manifest, target: Layout) -> None:
    """Reject a target layout the tensors cannot take, naming the tensor, the dim and the numbers.

    Fused dims must split into equal blocks, and model weights that the source split evenly along
    tp or ep must split evenly in the target too (heads, FFN width and experts are per-rank sizes).
    """
    for key, t in sorted(manifest.tensors.items()):
        parts = fused_parts(t.shape, t.placement)
        if not key.startswith("model."):
            continue
        for dim in {p.dim for _, p in t.placement if isinstance(p, Shard)}:
            axes = [
                a
                for a, p in t.placement
                if isinstance(p, Shard) and p.dim == dim and a in EVEN_AXES
            ]
            if not axes:
                continue
            extent = t.shape[dim] // parts.get(dim, 1)
            src_n = math.prod(manifest.layout.size(a) for a in axes)
            dst_n = math.prod(target.size(a) for a in axes)
            if extent % src_n == 0 and extent % dst_n:
                fits = [n for n in range(1, extent + 1) if extent % n == 0]
                split = " x ".join(f"{a}={target.size(a)}" for a in axes)
                raise LayoutError(
                    f"tensor {key!r}: dim {dim} of size {extent}"
                    f"{' per block' if parts.get(dim, 1) > 1 else ''} is split by {split} = {dst_n} "
                    f"ranks, which does not divide it evenly; choose sizes whose product divides "
                    f"{extent} (one of {fits})"
                )


def plan(manifest: Manifest, target: Layout) -> ConversionPlan:
    """Every chunk of every target rank and the source byte ranges that fill it (pure)."""
    check_fits(manifest, target)
    table = {k: (t.dtype, t.shape, t.placement) for k, t in manifest.tensors.items()}
    per_rank, _ = assign_writers(table, target)
    chunks = []
    for rank in sorted(per_rank):
        for item in per_rank[rank]:
            entry: TensorEntry = manifest.tensors[item.key]
            reads = plan_tensor_reads(
                item.key, entry, entry.placement, item.offsets, item.sizes, manifest.block_bytes
            )
            chunks.append(TargetChunk(rank, rank_file_name(rank), item, tuple(reads)))
    return ConversionPlan(manifest.step, manifest.layout, target, tuple(chunks))
