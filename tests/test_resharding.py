"""Load-time resharding: save in layout A, load into layout B, compare the global tensors bit for bit.

Every ordered pair of a set of layouts, over a zoo of tensors with uneven splits, empty chunks,
fused dims, bf16 and zero-size tensors (the DCP round-trip pattern, with more cases), and random
ones from hypothesis.
"""

import itertools
import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.checkpoint import reader
from resilient.checkpoint.format import ChunkEntry, step_dir_name
from resilient.checkpoint.reader import ReadItem, ReadRing, execute_reads, plan_reads, read_manifest
from resilient.checkpoint.state import flatten_state
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError
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


def _saved_step5(tmp_path, z, lay):
    """Save the tensors ``z`` (name -> (global, placement)) as step 5 in ``lay`` with 4 KiB blocks:
    (globals, placements, storage, manifest)."""
    globals_ = {k: v[0] for k, v in z.items()}
    placements = {k: v[1] for k, v in z.items()}
    save_world(str(tmp_path), 5, _place(globals_, placements, lay), lay, block_bytes=4096)
    storage = Storage(str(tmp_path))
    return globals_, placements, storage, read_manifest(storage, 5)


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
        assert s.bytes_direct == s.bytes_read  # a band of rows: read straight into the tensor
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


def test_read_ring_hands_out_regions_in_fifo_order_and_wraps():
    ring = ReadRing(100)
    a, b = ring.take(40), ring.take(40)
    assert len(a) == 40 and len(b) == 40
    assert ring.take(30) is None  # 20 bytes left at the end, and the front is still in use
    ring.release()  # a is done: the next region wraps to the front
    c = ring.take(30)
    assert c is not None and c.obj is a.obj and _offset(c) == 0
    assert ring.take(15) is None  # between c's end (30) and b's start (40) only 10 bytes are free
    d = ring.take(10)
    assert _offset(d) == 30
    ring.release()  # b
    ring.release()  # c
    e = ring.take(60)  # after d's end (40), not wrapped again
    assert _offset(e) == 40
    ring.release()
    ring.release()
    assert _offset(ring.take(100)) == 0  # empty again: the whole ring
    assert ring.take(1) is None
    ring.clear()
    ring.reserve(500)
    assert ring.capacity == 500
    empty, after = ring.take(0), ring.take(10)  # an empty region never shares a start with the next
    assert len(empty) == 0 and _offset(after) == 1


def _offset(view: memoryview) -> int:
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(view.obj))
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) - base


def test_pieces_cut_only_at_block_boundaries_of_their_chunk(monkeypatch):
    monkeypatch.setattr(reader, "PIECE_BYTES", 10_000)
    # two chunks that touch, neither starting on a multiple of the block size
    c1 = ChunkEntry((0,), (1,), "f", "a", (100, 30_100), (), "none", 30_000)
    c2 = ChunkEntry((0,), (1,), "f", "b", (30_100, 47_000), (), "none", 16_900)
    group = [
        ReadItem("a", c1, None, None, None, (100, 30_100)),
        ReadItem("b", c2, None, None, None, (30_100, 47_000)),
    ]
    pieces = reader._pieces(100, 47_000, group, 4096)
    assert pieces[0][0] == 100 and pieces[-1][1] == 47_000
    assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))  # contiguous, no gaps
    assert len(pieces) >= 4 and all(b - a <= 10_000 + 4096 for a, b in pieces)
    for cut, _ in pieces[1:]:
        start = c1.byte_range[0] if cut < c2.byte_range[0] else c2.byte_range[0]
        assert (cut - start) % 4096 == 0, cut
    # blocks larger than a piece: cuts round up to the next block boundary
    assert reader._pieces(100, 30_100, group[:1], 16_384) == [(100, 16_484), (16_484, 30_100)]


def test_reads_split_into_pieces_through_a_tight_ring_are_exact_and_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "PIECE_BYTES", 5000)  # every multi-block read is split
    z = zoo()
    g = torch.Generator().manual_seed(1)
    z["cols"] = (torch.randn(96, 256, generator=g), {"tp": Shard(1)})  # 96 KiB, strided overlaps
    z["rows"] = (torch.randn(64, 130, generator=g).bfloat16(), {"tp": Shard(0), "ep": Shard(0)})
    src, dst = LAYOUTS[2], LAYOUTS[4]
    globals_, placements, storage, m = _saved_step5(tmp_path, z, src)
    ring = ReadRing()  # one ring for every rank's reads, as the resharder shares it
    targets = _zeros_like(globals_, placements, dst)
    direct = staged = 0
    for r, state in enumerate(targets):
        flat = flatten_state(state, dst, r, for_load=True)
        items = plan_reads(m, flat.tensors, dst, r)
        dests = {k: v.local for k, v in flat.tensors.items()}
        stats = execute_reads(storage, m, items, dests, max_inflight_bytes=1, ring=ring)
        direct += stats.bytes_direct
        staged += stats.bytes_read - stats.bytes_direct
        for k, g in globals_.items():
            assert torch.equal(state[k], local_chunk(g, placements[k], dst, r)), (k, r)
    assert direct > 0 and staged > 0  # both paths ran
    # a flipped byte deep inside a large chunk is caught by the piece that holds its block
    key, chunk = "cols", m.tensors["cols"].chunks[0]
    assert chunk.raw_bytes > 4 * 4096
    path = tmp_path / step_dir_name(5) / chunk.file
    data = bytearray(path.read_bytes())
    at = chunk.byte_range[0] + 3 * 4096 + 17
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    flat = flatten_state(_zeros_like(globals_, placements, src)[0], src, 0, for_load=True)
    items = [it for it in plan_reads(m, flat.tensors, src, 0) if it.chunk == chunk]
    with pytest.raises(CheckpointCorruptError, match=rf"tensor '{key}', step 5, block 3 "):
        execute_reads(storage, m, items, {k: v.local for k, v in flat.tensors.items()}, ring=ring)
    # and through the staged path: the new layout takes column bands, placed from the ring
    caught = []
    for r, state in enumerate(_zeros_like(globals_, placements, dst)):
        flat = flatten_state(state, dst, r, for_load=True)
        items = [it for it in plan_reads(m, flat.tensors, dst, r) if it.chunk == chunk]
        assert all(
            reader._direct_target(it, m.tensors[key], flat.tensors[key].local) is None
            for it in items
        )
        try:
            execute_reads(
                storage, m, items, {k: v.local for k, v in flat.tensors.items()}, ring=ring
            )
        except CheckpointCorruptError as e:
            caught.append(str(e))
    assert caught and all(f"tensor '{key}', step 5, block 3 " in e for e in caught)


def test_coalesce_merges_shared_blocks_always_and_touching_reads_up_to_the_cap():
    c = ChunkEntry((0,), (1,), "f", "a", (0, 100_000), (), "none", 100_000)

    def item(a, b):
        return ReadItem("a", c, None, None, None, (a, b))

    items = [item(0, 4096), item(4096, 8192), item(8192, 12288), item(12000, 20000)]
    assert [r for r, _ in reader._coalesce(items)] == [(0, 20000)]  # no cap: one read
    merged = reader._coalesce(items, cap=8192)
    assert [r for r, _ in merged] == [(0, 8192), (8192, 20000)]  # overlap merged past the cap
    assert [len(g) for _, g in merged] == [2, 2]
    assert [r for r, _ in reader._coalesce([item(0, 10), item(20, 30)], cap=None)] == [
        (0, 10),
        (20, 30),
    ]


@pytest.mark.timeout(120)
def test_stream_reads_keeps_reads_in_flight_across_batches_that_wait_for_buffers(tmp_path):
    # The resharder's pattern: each batch takes one of two buffers, which only its done() gives
    # back.  The next batch is taken while the previous one's reads are still in flight, and no
    # more than two are ever open, or the source would wait forever for a buffer.
    src, dst = LAYOUTS[2], LAYOUTS[3]
    globals_, placements, storage, m = _saved_step5(tmp_path, zoo(), src)
    buffers = threading.Semaphore(2)
    events, results = [], []

    def source():
        for r, state in enumerate(_zeros_like(globals_, placements, dst)):
            flat = flatten_state(state, dst, r, for_load=True)
            for key in sorted(flat.tensors):
                assert buffers.acquire(timeout=30), "a batch waited for a buffer that never came"
                n = len(results)
                events.append(("take", n))
                dests = {key: flat.tensors[key].local}
                items = plan_reads(m, {key: flat.tensors[key]}, dst, r)

                def done(stats, n=n):
                    events.append(("done", n))
                    buffers.release()

                results.append((r, key, dests[key]))
                yield reader.ReadBatch(items, dests, done)

    reader.stream_reads(storage, m, source(), ring=ReadRing())
    assert [n for e, n in events if e == "done"] == list(range(len(results)))  # in order, all
    for r, key, got in results:
        assert torch.equal(got, local_chunk(globals_[key], placements[key], dst, r)), (r, key)
    # every batch after the first was taken before the one ahead of it was done
    assert all(
        events.index(("take", n + 1)) < events.index(("done", n)) for n in range(len(results) - 1)
    )


def test_verify_step_checks_every_block_concurrently_and_reports_in_file_order(
    tmp_path, monkeypatch
):
    # Reads of one block each, verified by several threads into reused buffers: every byte is
    # counted once, and every damaged block of every file is reported, in file and block order.
    monkeypatch.setattr(reader, "VERIFY_READ_BYTES", 4096)
    g = torch.Generator().manual_seed(3)
    z = {
        "w": (torch.randn(64, 256, generator=g), {"tp": Shard(0)}),
        "e": (torch.randn(8, 40, 33, generator=g), {"ep": Shard(0), "tp": Shard(2)}),
    }
    globals_, placements, storage, m = _saved_step5(tmp_path, z, LAYOUTS[2])
    total = sum(f.size_bytes for f in m.files.values())
    seen = []
    ok = reader.verify_step(storage, 5, progress=seen.append)
    assert ok.ok and ok.bytes_checked == total and ok.files_checked == 4
    data_bytes = sum(
        c.byte_range[1] - c.byte_range[0] for t in m.tensors.values() for c in t.chunks
    )
    assert sum(seen) == data_bytes and len(seen) > 4 * reader.READ_THREADS  # many reads in flight
    damaged = []  # (file, tensor, block) in the order verify reports them
    for file in sorted(m.files)[1:3]:
        for key in sorted(m.tensors, reverse=True):  # flip blocks out of order within a file
            c = next((c for c in m.tensors[key].chunks if c.file == file), None)
            if c is not None and len(c.checksums) > 1:
                block = len(c.checksums) - 1
                path = tmp_path / step_dir_name(5) / file
                raw = bytearray(path.read_bytes())
                raw[c.byte_range[0] + block * 4096] ^= 0x01
                path.write_bytes(bytes(raw))
                damaged.append((file, c.byte_range[0], key, block))
    assert len(damaged) >= 3 and len({d[0] for d in damaged}) == 2
    bad = reader.verify_step(storage, 5)
    expected = [(f, k, b) for f, _, k, b in sorted(damaged)]
    assert len(bad.problems) == len(expected) and bad.bytes_checked == total
    for problem, (file, key, block) in zip(bad.problems, expected):
        assert file in problem and f"tensor {key!r} (step 5) block {block} " in problem, problem
