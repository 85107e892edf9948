import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.errors import LayoutError
from resilient.layout import (
    Layout,
    Shard,
    chunk_box,
    chunk_offsets_sizes,
    chunk_range,
    expanded_shape,
    fused_parts,
    local_shape,
    normalize_placement,
    placement_from_json,
    placement_to_json,
    replica_ranks,
    unique_chunks,
)


def test_rank_order_is_row_major():
    lay = Layout(dp=2, ep=3, tp=2)
    assert lay.world_size == 12
    for r in range(12):
        c = lay.coords(r)
        assert r == ((c["dp"] * 3) + c["ep"]) * 2 + c["tp"]
        assert lay.rank(c) == r
    assert lay.coords(5) == {"dp": 0, "ep": 2, "tp": 1}


def test_layout_errors_spell_out_every_factor():
    lay = Layout(dp=2, ep=1, tp=2)
    with pytest.raises(
        LayoutError, match=r"layout dp=2 x ep=1 x tp=2 = 4 ranks, but the process group has 8 ranks"
    ):
        lay.check_world_size(8)
    with pytest.raises(LayoutError, match="axis 'tp' has size 0"):
        Layout(dp=2, tp=0)
    with pytest.raises(LayoutError, match="unique"):
        Layout([("dp", 2), ("dp", 2)])
    with pytest.raises(LayoutError, match="rank 4 is outside layout dp=2 x tp=2 = 4 ranks"):
        Layout(dp=2, tp=2).coords(4)
    with pytest.raises(LayoutError, match=r"placement names axes \['pp'\]"):
        normalize_placement({"pp": Shard(0)}, lay)


def test_layout_json_round_trip():
    lay = Layout(dp=2, ep=1, tp=4)
    assert Layout.from_json(lay.to_json()) == lay
    with pytest.raises(LayoutError, match="list of"):
        Layout.from_json({"dp": 2})


@pytest.mark.parametrize("size,n", [(10, 4), (5, 4), (3, 4), (0, 3), (8, 2), (1, 5), (7, 3)])
def test_chunk_range_matches_torch_chunk(size, n):
    t = torch.arange(size)
    pieces = list(torch.chunk(t, n)) if size else []
    pieces += [t[:0]] * (n - len(pieces))
    for i in range(n):
        off, length = chunk_range(size, n, i)
        assert length == len(pieces[i])
        if length:
            assert pieces[i][0].item() == off


def test_two_axes_on_one_dim_outer_first():
    lay = Layout(dp=2, tp=2)
    pl = normalize_placement({"dp": Shard(0), "tp": Shard(0)}, lay)
    # dp splits 8 rows into [0,4) [4,8); tp splits each half again.
    got = [chunk_offsets_sizes((8, 3), pl, lay, r) for r in range(4)]
    assert got == [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (2, 3))]


def test_fused_dim_holds_a_slice_of_every_block():
    lay = Layout(tp=2)
    pl = normalize_placement({"tp": Shard(0, parts=3)}, lay)  # fused QKV: 3 blocks of 4 rows
    assert fused_parts((12, 5), pl) == {0: 3}
    assert expanded_shape((12, 5), {0: 3}) == (3, 4, 5)
    assert local_shape((12, 5), pl, lay, 1) == (6, 5)
    box = chunk_box((12, 5), pl, lay, 1)
    assert box.offsets == (0, 2, 0) and box.sizes == (3, 2, 5)
    # and the local tensor is exactly q[2:4], k[2:4], v[2:4]
    g = torch.arange(60).reshape(12, 5)
    local = torch.cat([blk[2:4] for blk in g.chunk(3)])
    ev = g.view(3, 4, 5)[:, 2:4, :].reshape(6, 5)
    assert torch.equal(local, ev)


def test_fused_errors():
    lay = Layout(tp=2)
    with pytest.raises(LayoutError, match="dim 0 of size 10 is declared fused with parts=3"):
        fused_parts((10, 4), normalize_placement({"tp": Shard(0, 3)}, lay))
    with pytest.raises(LayoutError, match="shards dim 2, but the tensor has 2 dims"):
        fused_parts((10, 4), normalize_placement({"tp": Shard(2)}, lay))


def test_placement_json_round_trip():
    lay = Layout(dp=2, ep=2, tp=2)
    pl = normalize_placement({"ep": Shard(0), "tp": Shard(1, parts=2)}, lay)
    js = placement_to_json(pl)
    assert js == {"ep": {"dim": 0, "parts": 1}, "tp": {"dim": 1, "parts": 2}}
    assert placement_from_json(js, lay) == pl


def test_replica_ranks():
    lay = Layout(dp=2, tp=2)
    pl = normalize_placement({"tp": Shard(0)}, lay)
    assert replica_ranks(pl, lay, 1) == [1, 3]
    assert replica_ranks(normalize_placement(None, lay), lay, 0) == [0, 1, 2, 3]


# --- property tests: every layout's chunks tile the global tensor once per replica group ---------

AXES = ["dp", "ep", "tp"]


@st.composite
def layouts_and_placements(draw):
    sizes = [draw(st.integers(1, 3)) for _ in AXES]
    lay = Layout(list(zip(AXES, sizes)))
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 7)) for _ in range(ndim)]
    placement = {}
    parts: dict[int, int] = {}
    for axis in AXES:
        if ndim and draw(st.booleans()):
            dim = draw(st.integers(0, ndim - 1))
            p = parts.setdefault(dim, draw(st.sampled_from([1, 1, 2, 3])))
            shape[dim] = shape[dim] * p if p > 1 else shape[dim]
            placement[axis] = Shard(dim, p)
    return lay, tuple(shape), normalize_placement(placement, lay)


@settings(max_examples=300, deadline=None)
@given(layouts_and_placements())
def test_chunks_tile_the_global_tensor_once_per_replica_group(case):
    lay, shape, pl = case
    parts = fused_parts(shape, pl)
    eshape = expanded_shape(shape, parts)
    sharded_axes = [a for a, p in pl if isinstance(p, Shard)]
    groups: dict[tuple, list[int]] = {}
    for r in range(lay.world_size):
        c = lay.coords(r)
        groups.setdefault(tuple(c[a] for a, p in pl if not isinstance(p, Shard)), []).append(r)
    for ranks in groups.values():  # one replica group: one rank per sharded coordinate
        assert len(ranks) == math.prod(lay.size(a) for a in sharded_axes)
        cover = torch.zeros(eshape, dtype=torch.int32)
        for r in ranks:
            box = chunk_box(shape, pl, lay, r)
            assert math.prod(local_shape(shape, pl, lay, r)) == box.numel
            view = cover
            for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
                view = view.narrow(d, o, s)
            view += 1
        assert bool((cover == 1).all()), (lay, shape, pl)
    # unique_chunks lists each distinct chunk with all its replicas
    listed = list(unique_chunks(shape, pl, lay))
    assert sorted(r for _, _, rs in listed for r in rs) == list(range(lay.world_size))


@settings(max_examples=100, deadline=None)
@given(layouts_and_placements())
def test_chunk_box_matches_torch_chunk_on_a_real_tensor(case):
    lay, shape, pl = case
    g = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(7)
    parts = fused_parts(shape, pl)
    for r in range(lay.world_size):
        # the reference: split the real tensor with torch.chunk, axis by axis, block by block
        coords = lay.coords(r)

        def split(t):
            for axis, p in pl:
                if isinstance(p, Shard):
                    n = lay.size(axis)
                    if p.parts > 1:
                        blocks = t.chunk(p.parts, p.dim) if t.shape[p.dim] else [t] * p.parts
                        pieces = []
                        for b in blocks:
                            cs = list(b.chunk(n, p.dim)) if b.shape[p.dim] else []
                            cs += [b.narrow(p.dim, 0, 0)] * (n - len(cs))
                            pieces.append(cs[coords[axis]])
                        t = torch.cat(pieces, p.dim)
                    else:
                        cs = list(t.chunk(n, p.dim)) if t.shape[p.dim] else []
                        cs += [t.narrow(p.dim, 0, 0)] * (n - len(cs))
                        t = cs[coords[axis]]
            return t

        ref = split(g)
        assert tuple(ref.shape) == local_shape(shape, pl, lay, r)
        box = chunk_box(shape, pl, lay, r)
        got = g.reshape(expanded_shape(shape, parts)) if shape else g
        for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
            got = got.narrow(d, o, s)
        assert torch.equal(got.reshape(ref.shape), ref)
