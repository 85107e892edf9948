"""Layouts (named mesh axes), placements, and the chunk arithmetic.

This module owns the pure arithmetic that maps (global shape, placement, layout, rank) to the local
chunk a rank holds. It knows nothing of files, processes or models, which is what lets a checkpoint
be resharded offline. It does not own how tensors are gathered or moved.

Conventions (DESIGN.md section 3):

* A ``Layout`` is an ordered set of named axes; rank order is row-major (the last axis varies
  fastest).
* A placement maps axis names to ``Shard(dim, parts)`` or ``Replicate()``; axes it does not name are
  replicated.  Several axes may shard one dim; the axis that comes first in the layout is the outer
  split.  Uneven splits follow ``torch.chunk`` (ceil-sized leading chunks, empty trailing ones).
* ``parts > 1`` marks a fused dim made of ``parts`` equal blocks, each split across the axes; a rank
  holds its slice of every block, block after block.  The arithmetic works in the *expanded* view in
  which a fused dim of size ``D`` becomes two dims ``(parts, D // parts)``; there every chunk is a
  plain box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from resilient.errors import LayoutError

__all__ = [
    "Layout",
    "Shard",
    "Replicate",
    "Placement",
    "Box",
    "normalize_placement",
    "placement_to_json",
    "placement_from_json",
    "fused_parts",
    "expanded_shape",
    "chunk_box",
    "local_shape",
    "chunk_range",
    "replica_ranks",
    "unique_chunks",
    "from_device_mesh",
    "placement_from_dtensor",
]


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` across an axis; ``parts > 1`` marks a fused dim (QKV, gate/up)."""

    dim: int
    parts: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise LayoutError(f"Shard(dim={self.dim!r}): dim must be a non-negative int")
        if not isinstance(self.parts, int) or self.parts < 1:
            raise LayoutError(
                f"Shard(dim={self.dim}, parts={self.parts!r}): parts must be an int >= 1"
            )


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same data."""


AxisPlacement = Union[Shard, Replicate]  # noqa: UP007 (a runtime alias on Python 3.10)
# A normalized placement: one (axis name, Shard | Replicate) per layout axis, in layout order.
Placement = tuple[tuple[str, AxisPlacement], ...]


class Layout:
    """An ordered set of named mesh axes, e.g. ``Layout(dp=2, ep=1, tp=2)``.

    Rank order is row-major: ``rank = ((dp_i * ep) + ep_i) * tp + tp_i``.
    """

    __slots__ = ("_axes", "_names")

    def __init__(
        self, axes: Mapping[str, int] | Sequence[tuple[str, int]] | None = None, **sizes: int
    ):
        items = list(axes.items() if isinstance(axes, Mapping) else (axes or [])) + list(
            sizes.items()
        )
        if not items:
            raise LayoutError("Layout needs at least one axis, e.g. Layout(dp=2, tp=2)")
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise LayoutError(f"Layout axes must be unique, got {names}")
        for name, size in items:
            if not isinstance(name, str) or not name.isidentifier():
                raise LayoutError(f"Layout axis name {name!r} must be an identifier such as 'tp'")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LayoutError(
                    f"Layout axis {name!r} has size {size!r}; every axis size must be an int >= 1 "
                    f"(layout {dict(items)})"
                )
        self._axes: tuple[tuple[str, int], ...] = tuple(items)
        self._names: tuple[str, ...] = tuple(names)

    # --- basic properties -------------------------------------------------------------------
    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        return self._axes

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self._axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        for n, s in self._axes:
            if n == axis:
                return s
        raise LayoutError(f"axis {axis!r} is not in layout {self} (axes: {list(self.names)})")

    def __contains__(self, axis: object) -> bool:
        return axis in self.names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._axes == other._axes

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return "Layout(" + ", ".join(f"{n}={s}" for n, s in self._axes) + ")"

    def describe(self) -> str:
        """``dp=2 x ep=1 x tp=2 = 4 ranks``: every factor spelled out, for error messages."""
        return " x ".join(f"{n}={s}" for n, s in self._axes) + f" = {self.world_size} ranks"

    # --- rank <-> coordinates ---------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside layout {self.describe()}")
        out: dict[str, int] = {}
        for name, size in reversed(self._axes):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in self._axes:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise LayoutError(f"coordinate {name}={c} is outside layout {self.describe()}")
            rank = rank * size + c
        return rank

    def check_world_size(self, world_size: int, *, what: str = "the process group") -> None:
        if self.world_size != world_size:
            raise LayoutError(
                f"layout {self.describe()}, but {what} has {world_size} ranks; choose axis sizes "
                f"whose product is {world_size}"
            )

    # --- JSON --------------------------------------------------------------------------------
    def to_json(self) -> list[list[Any]]:
        return [[n, s] for n, s in self._axes]

    @classmethod
    def from_json(cls, data: Any) -> Layout:
        if not isinstance(data, list) or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in data
        ):
            raise LayoutError(f"a layout must be a list of [axis, size] pairs, found {data!r}")
        return cls([(a[0], a[1]) for a in data])


# --- placements ------------------------------------------------------------------------------


def normalize_placement(
    placement: Mapping[str, AxisPlacement] | Placement | None, layout: Layout
) -> Placement:
    """One ``(axis, Shard|Replicate)`` per layout axis, in layout order; unnamed axes replicate."""
    if not placement:
        return _replicated(layout)
    given = dict(placement)
    unknown = [a for a in given if a not in layout]
    if unknown:
        raise LayoutError(
            f"placement names axes {unknown} that layout {layout} does not have (axes: "
            f"{list(layout.names)})"
        )
    out = []
    for name in layout.names:
        p = given.get(name, Replicate())
        if not isinstance(p, (Shard, Replicate)):
            raise LayoutError(f"placement for axis {name!r} must be Shard or Replicate, got {p!r}")
        out.append((name, p))
    return tuple(out)


_REPLICATED: dict[Layout, Placement] = {}


def _replicated(layout: Layout) -> Placement:
    """Every axis replicates (most tensors of a state, asked for at every save).  Kept for a few
    layouts with short names only: a layout read from an untrusted manifest is never held."""
    out = _REPLICATED.get(layout)
    if out is None:
        out = tuple((name, Replicate()) for name in layout.names)
        if len(layout.names) <= 8 and sum(map(len, layout.names)) <= 64:
            if len(_REPLICATED) >= 16:
                _REPLICATED.clear()
            _REPLICATED[layout] = out
    return out


def placement_to_json(placement: Placement) -> dict[str, Any]:
    """Only the sharded axes are written: ``{"tp": {"dim": 0, "parts": 3}}``."""
    return {n: {"dim": p.dim, "parts": p.parts} for n, p in placement if isinstance(p, Shard)}


def placement_from_json(data: Any, layout: Layout) -> Placement:
    if not isinstance(data, dict):
        raise LayoutError(f"a placement must be a JSON object, found {data!r}")
    if not data:
        return _replicated(layout)
    parsed: dict[str, AxisPlacement] = {}
    for axis, spec in data.items():
        if not isinstance(spec, dict) or set(spec) != {"dim", "parts"}:
            raise LayoutError(f"placement for axis {axis!r} must be {{dim, parts}}, found {spec!r}")
        parsed[axis] = Shard(spec["dim"], spec["parts"])
    return normalize_placement(parsed, layout)


def fused_parts(shape: Sequence[int], placement: Placement) -> dict[int, int]:
    """``{dim: parts}`` for every sharded dim; validates dims and fused sizes against ``shape``."""
    parts: dict[int, int] = {}
    for axis, p in placement:
        if not isinstance(p, Shard):
            continue
        if p.dim >= len(shape):
            raise LayoutError(
                f"axis {axis!r} shards dim {p.dim}, but the tensor has {len(shape)} dims "
                f"(shape {list(shape)})"
            )
        if parts.setdefault(p.dim, p.parts) != p.parts:
            raise LayoutError(
                f"dim {p.dim} is declared with parts={parts[p.dim]} and parts={p.parts} by different "
                f"axes; a fused dim has one number of parts"
            )
        if shape[p.dim] % p.parts:
            raise LayoutError(
                f"dim {p.dim} of size {shape[p.dim]} is declared fused with parts={p.parts}, which "
                f"does not divide it; a fused dim is made of equal blocks"
            )
    return parts


def expanded_shape(shape: Sequence[int], parts: Mapping[int, int]) -> tuple[int, ...]:
    """The view in which a fused dim ``D`` with ``P`` parts becomes two dims ``(P, D // P)``."""
    out: list[int] = []
    for d, n in enumerate(shape):
        p = parts.get(d, 1)
        if p > 1:
            out += [p, n // p]
        else:
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class Box:
    """A rectangular region: ``offsets`` and ``sizes`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        offs, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` in ``num_chunks``."""
    step = -(-size // num_chunks) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


def chunk_box(shape: Sequence[int], placement: Placement, layout: Layout, rank: int) -> Box:
    """The chunk ``rank`` holds, as a box in the *expanded* view of ``shape``.

    Per-block offsets for fused dims: the manifest records ``offsets``/``sizes`` per original dim,
    with a fused dim's values relative to each block (see :func:`chunk_range`).
    """
    offsets, sizes = _chunk_1d(shape, placement, layout, rank)
    parts = fused_parts(shape, placement)
    eo: list[int] = []
    es: list[int] = []
    for d in range(len(shape)):
        p = parts.get(d, 1)
        if p > 1:
            eo += [0, offsets[d]]
            es += [p, sizes[d]]
        else:
            eo.append(offsets[d])
            es.append(sizes[d])
    return Box(tuple(eo), tuple(es))


def _chunk_1d(
    shape: Sequence[int], placement: Placement, layout: Layout, rank: int
) -> tuple[list[int], list[int]]:
    """Per original dim: offset and size of the chunk (within one block for fused dims)."""
    parts = fused_parts(shape, placement)
    coords = layout.coords(rank)
    offsets = [0] * len(shape)
    sizes = [shape[d] // parts.get(d, 1) for d in range(len(shape))]
    for axis, p in placement:  # layout order: earlier axes split first (outer)
        if isinstance(p, Shard):
            off, length = chunk_range(sizes[p.dim], layout.size(axis), coords[axis])
            offsets[p.dim] += off
            sizes[p.dim] = length
    return offsets, sizes


def chunk_offsets_sizes(
    shape: Sequence[int], placement: Placement, layout: Layout, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes as the manifest records them (per original dim, per block when fused)."""
    o, s = _chunk_1d(shape, placement, layout, rank)
    return tuple(o), tuple(s)


def local_shape(
    shape: Sequence[int], placement: Placement, layout: Layout, rank: int
) -> tuple[int, ...]:
    """The shape of the local tensor ``rank`` holds (fused dims hold ``parts`` slices)."""
    parts = fused_parts(shape, placement)
    _, sizes = _chunk_1d(shape, placement, layout, rank)
    return tuple(s * parts.get(d, 1) for d, s in enumerate(sizes))


def replica_ranks(placement: Placement, layout: Layout, rank: int) -> list[int]:
    """The ranks that hold the same chunk as ``rank`` (they differ only along replicated axes)."""
    coords = layout.coords(rank)
    free = [a for a, p in placement if isinstance(p, Replicate)]
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        if all(c[a] == coords[a] for a in layout.names if a not in free):
            out.append(r)
    return out


def unique_chunks(
    shape: Sequence[int], placement: Placement, layout: Layout
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], list[int]]]:
    """Each distinct chunk once: ``(offsets, sizes, replica ranks)`` (empty chunks included)."""
    sharded_axes = [a for a, p in placement if isinstance(p, Shard)]
    seen: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.world_size):
        c = layout.coords(r)
        seen.setdefault(tuple(c[a] for a in sharded_axes), []).append(r)
    for ranks in seen.values():
        o, s = chunk_offsets_sizes(shape, placement, layout, ranks[0])
        yield o, s, ranks


# --- DTensor conversion -------------------------------------------------------------------------


def from_device_mesh(mesh: Any) -> Layout:
    """The layout of a ``DeviceMesh``: its named dims become axes (unnamed dims: ``mesh0``...)."""
    names = mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(mesh.ndim))
    return Layout([(n, int(s)) for n, s in zip(names, mesh.shape)])


def placement_from_dtensor(dtensor: Any, layout: Layout) -> Placement:
    """The placement of a DTensor in ``layout`` terms (its mesh axes matched by name)."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    mesh_layout = from_device_mesh(dtensor.device_mesh)
    out: dict[str, AxisPlacement] = {}
    for (name, size), p in zip(mesh_layout.axes, dtensor.placements):
        if name not in layout or layout.size(name) != size:
            raise LayoutError(
                f"DTensor mesh axis {name}={size} does not match the checkpoint layout {layout}; "
                f"name the mesh dims after the layout axes (DeviceMesh(mesh_dim_names=...))"
            )
        if type(p) is DShard:
            out[name] = Shard(p.dim)
        elif isinstance(p, DReplicate):
            out[name] = Replicate()
        else:
            raise LayoutError(
                f"DTensor placement {p} on mesh axis {name!r} is not supported; redistribute to "
                f"Shard or Replicate before saving (Partial must be reduced first)"
            )
    return normalize_placement(out, layout)
