"""Load-time resharding: save in layout A, load into layout B, compare the global tensors bit for bit.

Every ordered pair of a set of layouts, over a zoo of tensors with uneven splits, empty chunks,
fused dims, bf16 and zero-size tensors (the DCP round-trip pattern, with more cases), and random
ones from hypothesis.
"""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.layout import Layout, Shard
from tests.ckpt_sim import distribute, load_world, local_chunk, save_world

LAYOUTS = [
    Layout(dp=1, ep=1, tp=1),
    Layout(dp=2, ep=1, tp=1),
    Layout(dp=1, ep=2, tp=2),
    Layout(dp=1, ep=1, tp=4),
    Layout(dp=3, ep=1, tp=1),
    Layout(dp=1, ep=3, tp=2),
]


def zoo():
    g = torch.Generator().manual_seed(0)
    return {
        # tensor -> (global tensor, placement)
        "emb": (torch.randn(10, 6, generator=g), {"tp": Shard(0)}),  # uneven over 3 and 4
        "qkv": (torch.randn(12, 6, generator=g).bfloat16(), {"tp": Shard(0, parts=3)}),  # fused
        "gate_up": (torch.randn(5, 8, generator=g), {"tp": Shard(1, parts=2)}),  # fused dim 1
        "experts": (torch.randn(6, 4, 3, generator=g), {"ep": Shard(0), "tp": Shard(2)}),
        "tiny": (
            torch.arange(2, dtype=torch.int64),
            {"dp": Shard(0), "tp": Shard(0)},
        ),  # empty chunks
        "empty": (torch.zeros(0, 5), {"tp": Shard(1)}),  # zero-size
        "norm": (torch.randn(6, generator=g), {}),  # replicated
        "scalar": (torch.tensor(3.5), {}),
        "zero_opt": (
            torch.randn(7, 3, generator=g),
            {"dp": Shard(0), "ep": Shard(0)},
        ),  # ZeRO-style
        "mask": (torch.rand(9, generator=g) > 0.5, {"ep": Shard(0)}),
        "half": (torch.randn(4, 5, generator=g).half(), {"tp": Shard(1), "dp": Shard(0)}),
    }


def _place(globals_, placements, lay):
    # Placements name axes; the zoo's axes all exist in every layout.
    return [distribute(globals_, placements, lay, r) for r in range(lay.world_size)]


def _zeros_like(globals_, placements, lay):
    zeros = {k: torch.zeros_like(v) for k, v in globals_.items()}
    return _place(zeros, placements, lay)


@pytest.mark.parametrize(
    "src,dst",
    list(itertools.permutations(LAYOUTS, 2)) + [(LAYOUTS[2], LAYOUTS[2])],
    ids=lambda lay: "x".join(map(str, lay.sizes)),
)
def test_every_layout_pair_round_trips_bit_for_bit(tmp_path, src, dst):
    z = zoo()
    globals_ = {k: v[0] for k, v in z.items()}
    placements = {k: v[1] for k, v in z.items()}
    save_world(str(tmp_path), 5, _place(globals_, placements, src), src)
    targets = _zeros_like(globals_, placements, dst)
    load_world(str(tmp_path), 5, targets, dst)
    for r, state in enumerate(targets):
        for k, g in globals_.items():
            expect = local_chunk(g, placements[k], dst, r)
            assert torch.equal(state[k], expect), f"{k} rank {r} {src} -> {dst}"
            assert state[k].dtype == g.dtype


def test_replicated_bytes_are_spread_across_replicas(tmp_path):
    lay = Layout(dp=4, ep=1, tp=1)
    globals_ = {f"w{i}": torch.randn(64, 64) for i in range(8)}  # all replicated
    out = save_world(str(tmp_path), 1, _place(globals_, {}, lay), lay)
    # each 16 KiB tensor written once, two per rank
    assert out["plan_load"] == (2 * 64 * 64 * 4,) * 4
    assert max(out["bytes_per_rank"]) - min(out["bytes_per_rank"]) < 1024  # headers differ slightly


def test_partial_reads_only_touch_needed_blocks(tmp_path):
    # One 4 MiB tensor saved whole (world of 1); a tp=4 rank needs a quarter of its rows.
    g = torch.randn(1024, 1024)
    one = Layout(dp=1, ep=1, tp=1)
    four = Layout(dp=1, ep=1, tp=4)
    save_world(str(tmp_path), 1, _place({"w": g}, {}, one), one)
    targets = _zeros_like({"w": g}, {"w": {"tp": Shard(0)}}, four)
    stats = load_world(str(tmp_path), 1, targets, four)
    for r, s in enumerate(stats):
        assert s.bytes_read == g.numel() * 4 // 4  # rows are contiguous: exactly a quarter
        assert s.bytes_verified == s.bytes_read
        assert torch.equal(targets[r]["w"], g.chunk(4)[r])


@st.composite
def reshard_case(draw):
    def lay():
        return Layout(
            dp=draw(st.integers(1, 3)), ep=draw(st.integers(1, 2)), tp=draw(st.integers(1, 4))
        )

    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 9)) for _ in range(ndim)]
    placement = {}
    for axis in ("dp", "ep", "tp"):
        if draw(st.booleans()):
            placement[axis] = Shard(draw(st.integers(0, ndim - 1)))
    fused_dim = draw(st.one_of(st.none(), st.integers(0, ndim - 1)))
    if fused_dim is not None and draw(st.booleans()):
        shape[fused_dim] *= 2
        placement = {
            a: (Shard(p.dim, 2) if p.dim == fused_dim else p) for a, p in placement.items()
        }
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.float16]))
    return lay(), lay(), tuple(shape), placement, dtype


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(reshard_case())
def test_random_tensors_reshard_bit_for_bit(tmp_path_factory, case):
    src, dst, shape, placement, dtype = case
    path = str(tmp_path_factory.mktemp("reshard"))
    g = (torch.arange(math.prod(shape)).reshape(shape) * 7 % 1000).to(dtype)
    save_world(path, 0, _place({"t": g}, {"t": placement}, src), src)
    targets = _zeros_like({"t": g}, {"t": placement}, dst)
    load_world(path, 0, targets, dst)
    for r, state in enumerate(targets):
        assert torch.equal(state["t"], local_chunk(g, placement, dst, r))


def test_compressed_chunks_reshard(tmp_path):
    z = zoo()
    globals_ = {k: v[0] for k, v in z.items()}
    placements = {k: v[1] for k, v in z.items()}
    src, dst = LAYOUTS[2], LAYOUTS[4]
    save_world(str(tmp_path), 5, _place(globals_, placements, src), src, compression="zstd")
    targets = _zeros_like(globals_, placements, dst)
    load_world(str(tmp_path), 5, targets, dst)
    for r, state in enumerate(targets):
        for k, g in globals_.items():
            assert torch.equal(state[k], local_chunk(g, placements[k], dst, r)), k
