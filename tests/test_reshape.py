"""reshape: the pure plan (no files), conversions between every pair of layouts, export, CLI."""

import contextlib
import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from reshape import execute
from reshape.cli import app
from reshape.execute import DestinationExistsError, convert
from reshape.export import export_hf, parse_size
from reshape.plan import plan, target_layout
from resilient import Checkpointer, Layout, Shard
from resilient.checkpoint import reader
from resilient.checkpoint.format import ChunkEntry, FileEntry, Manifest, TensorEntry, rank_file_name
from resilient.checkpoint.writer import assign_writers
from resilient.errors import CheckpointCorruptError, LayoutError, StorageError
from resilient.layout import normalize_placement
from tests.ckpt_sim import distribute, load_world, local_chunk, save_world
from tests.test_resharding import LAYOUTS, zoo

runner = CliRunner()


def fake_manifest(table: dict, layout: Layout, block: int = 4096) -> Manifest:
    """A consistent manifest with no files behind it: enough for the pure planner."""
    per_rank, _ = assign_writers(table, layout)
    tensors, files = {}, {}
    chunks = {k: [] for k in table}
    for rank, items in per_rank.items():
        name = rank_file_name(rank)
        for it in items:
            n = it.end - it.begin
            chunks[it.key].append(
                ChunkEntry(
                    it.offsets,
                    it.sizes,
                    name,
                    it.key,
                    (it.begin, it.end),
                    (0,) * -(-n // block),
                    "none",
                    n,
                )
            )
        files[name] = FileEntry(rank, items[-1].end)
    for k, (dt, shape, pl) in table.items():
        tensors[k] = TensorEntry(dt, shape, pl, tuple(sorted(chunks[k], key=lambda c: c.offsets)))
    m = Manifest(step=1, layout=layout, tensors=tensors, files=files, block_bytes=block)
    m.validate()
    return m


def table_for(layout):
    def pl(d):
        return normalize_placement(d, layout)

    return {
        "model.w": ("float32", (64, 32), pl({"tp": Shard(0)})),
        "model.qkv": ("bfloat16", (48, 16), pl({"tp": Shard(0, parts=3)})),
        "model.experts": ("float32", (4, 8, 8), pl({"ep": Shard(0), "tp": Shard(2)})),
        "optim.z": ("float32", (10, 3), pl({"dp": Shard(0), "ep": Shard(0)})),
        "norm": ("float32", (16,), pl({})),
    }


def test_plan_is_pure_and_covers_every_target_chunk_once():
    src = Layout(dp=1, ep=2, tp=2)
    m = fake_manifest(table_for(src), src)
    for sizes in (
        {"dp": 3, "ep": 1, "tp": 1},
        {"dp": 1, "ep": 4, "tp": 1},
        {"dp": 2, "ep": 2, "tp": 2},
    ):
        target = target_layout(src, sizes)
        p = plan(m, target)
        assert p == plan(m, target)  # deterministic, and frozen dataclasses compare by value
        for key, (_, shape, _placement) in table_for(target).items():
            chunks = [c for c in p.chunks if c.item.key == key]
            # every target chunk's overlaps tile it exactly once
            for c in chunks:
                assert sum(r.overlap.numel for r in c.reads) == c.reads[0].dst_box.numel
            assert sum(math.prod(c.item.local_shape) for c in chunks) == math.prod(shape)
        assert p.bytes_written() == sum(t.nbytes for t in m.tensors.values())
        assert all(
            ci.source_file.startswith("rank_") and ci.target_file == rank_file_name(ci.target_rank)
            for ci in p.copy_items
        )


def test_same_layout_plan_reads_each_chunk_once():
    lay = Layout(dp=2, ep=1, tp=2)
    m = fake_manifest(table_for(lay), lay)
    p = plan(m, lay)
    assert p.read_amplification == 1.0
    assert all(len(c.reads) == 1 and c.reads[0].chunk.offsets == c.item.offsets for c in p.chunks)


def test_layouts_that_do_not_fit_are_refused_with_the_numbers():
    src = Layout(dp=1, ep=2, tp=2)
    m = fake_manifest(table_for(src), src)
    with pytest.raises(
        LayoutError,
        match=r"tensor 'model.experts': dim 0 of size 4 is split by ep=3 = 3 ranks.*one of \[1, 2, 4\]",
    ):
        plan(m, target_layout(src, {"ep": 3}))
    with pytest.raises(
        LayoutError, match=r"tensor 'model.experts': dim 2 of size 8 is split by tp=3"
    ):
        plan(m, target_layout(src, {"tp": 3, "ep": 1}))
    qkv_only = fake_manifest({"model.qkv": table_for(src)["model.qkv"]}, src)
    with pytest.raises(
        LayoutError, match=r"tensor 'model.qkv': dim 0 of size 16 per block is split by tp=3"
    ):
        plan(qkv_only, target_layout(src, {"tp": 3, "ep": 1}))
    with pytest.raises(LayoutError, match=r"has no axes \['pp'\]"):
        target_layout(src, {"pp": 2})


@pytest.mark.parametrize(
    "src,dst",
    list(itertools.permutations(LAYOUTS[1:], 2)),
    ids=lambda lay: "x".join(map(str, lay.sizes)),
)
def test_convert_every_pair_bit_for_bit(tmp_path, src, dst):
    z = zoo()
    globals_ = {k: v[0] for k, v in z.items()}
    placements = {k: v[1] for k, v in z.items()}
    save_world(
        str(tmp_path / "src"),
        7,
        [distribute(globals_, placements, src, r) for r in range(src.world_size)],
        src,
        block_bytes=4096,
    )
    sizes = dict(zip(dst.names, dst.sizes))
    report = convert(str(tmp_path / "src"), str(tmp_path / "dst"), sizes)
    assert report.target_layout == dst.to_json()
    with Checkpointer(str(tmp_path / "dst")) as ck:
        assert ck.steps() == [7] and ck.verify(7).ok and ck.manifest().layout == dst
    # the target loads in its own layout like any checkpoint, and holds the same global tensors
    assert_loads_as(str(tmp_path / "dst"), 7, globals_, placements, dst)


def assert_loads_as(url, step, globals_, placements, layout, storage_options=None):
    """Every rank of ``layout`` loads exactly its chunk of each global tensor from ``url``."""
    targets = [
        distribute({k: torch.zeros_like(v) for k, v in globals_.items()}, placements, layout, r)
        for r in range(layout.world_size)
    ]
    load_world(url, step, targets, layout, storage_options)
    for r, state in enumerate(targets):
        for k, g in globals_.items():
            assert torch.equal(state[k], local_chunk(g, placements[k], layout, r)), (k, r)


def _saved(tmp_path, layout=Layout(dp=1, ep=2, tp=2)):
    g = {
        "model.w": torch.arange(4096.0).reshape(64, 64),
        "model.e": torch.randn(4, 8, 16).bfloat16(),
        "optim.m": torch.arange(30.0),
    }
    pl = {
        "model.w": {"tp": Shard(0)},
        "model.e": {"ep": Shard(0)},
        "optim.m": {"dp": Shard(0), "ep": Shard(0)},
    }
    save_world(
        str(tmp_path / "src"),
        5,
        [distribute(g, pl, layout, r) for r in range(layout.world_size)],
        layout,
    )
    return g


def test_export_hf_loads_with_safetensors_and_equals_the_weights(tmp_path):
    g = _saved(tmp_path)
    report = export_hf(str(tmp_path / "src"), str(tmp_path / "hf"), max_shard_bytes=10_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model.w", "model.e"} and len(report.files) == 2
    loaded = {}
    for f in report.files:
        loaded.update(load_file(str(tmp_path / "hf" / f)))
    assert torch.equal(loaded["model.w"], g["model.w"]) and torch.equal(
        loaded["model.e"], g["model.e"]
    )
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in loaded.values()
    )
    cast = export_hf(str(tmp_path / "src"), str(tmp_path / "hf16"), dtype="bfloat16")
    t = load_file(str(tmp_path / "hf16" / cast.files[0]))
    assert t["model.w"].dtype == torch.bfloat16 and torch.equal(
        t["model.w"], g["model.w"].bfloat16()
    )
    with pytest.raises(DestinationExistsError, match="pass --overwrite"):
        export_hf(str(tmp_path / "src"), str(tmp_path / "hf"))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20


def test_corrupt_source_names_file_and_tensor(tmp_path):
    _saved(tmp_path)
    f = tmp_path / "src" / "step_00000005" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointCorruptError,
        match=r"checksum mismatch in .*rank_00000.safetensors, tensor '.*', step 5",
    ):
        convert(str(tmp_path / "src"), str(tmp_path / "dst"), {"dp": 1, "ep": 1, "tp": 1})
    assert Checkpointer(str(tmp_path / "dst")).steps() == []  # nothing committed
    result = runner.invoke(app, ["verify", str(tmp_path / "src")])
    assert result.exit_code == 1 and "FAILED" in result.output


def test_interrupted_conversion_leaves_no_committed_target(tmp_path):
    _saved(tmp_path)
    dst = f"faulty://{tmp_path / 'dst'}"
    opts = {"faults": [{"op": "write", "error": "permanent", "path": "rank_00001"}]}
    with pytest.raises(StorageError, match="rank_00001"):
        convert(str(tmp_path / "src"), dst, {"dp": 2, "ep": 1, "tp": 1}, dst_options=opts)
    assert Checkpointer(str(tmp_path / "dst")).steps() == []
    report = convert(
        str(tmp_path / "src"), str(tmp_path / "dst"), {"dp": 2, "ep": 1, "tp": 1}, overwrite=True
    )
    assert report.files == 2 and Checkpointer(str(tmp_path / "dst")).verify(5).ok


def test_cli_commands_and_exit_codes(tmp_path):
    _saved(tmp_path)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    r = runner.invoke(app, ["inspect", src, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["layout"] == [["dp", 1], ["ep", 2], ["tp", 2]]
    r = runner.invoke(app, ["inspect", src])
    assert r.exit_code == 0 and "model.w" in r.output and "tp:0" in r.output
    r = runner.invoke(app, ["plan", src, "--tp", "1", "--ep", "1", "--dp", "2", "--json"])
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["read_amplification"] >= 1.0 and set(out["ranks"]) == {"0", "1"}
    assert runner.invoke(app, ["convert", src, dst, "--tp", "4", "--ep", "1"]).exit_code == 0
    r = runner.invoke(app, ["convert", src, dst, "--tp", "4", "--ep", "1"])
    assert r.exit_code == 2 and "already holds checkpoint steps [5]" in r.output
    assert (
        runner.invoke(app, ["convert", src, dst, "--tp", "4", "--ep", "1", "--overwrite"]).exit_code
        == 0
    )
    r = runner.invoke(app, ["verify", dst, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"]
    r = runner.invoke(app, ["convert", src, str(tmp_path / "x"), "--ep", "3"])
    assert r.exit_code == 2 and "does not divide it evenly" in r.output
    r = runner.invoke(app, ["inspect", src, "--step", "9"])
    assert r.exit_code == 2 and "committed steps: 5" in r.output
    r = runner.invoke(app, ["export", src, str(tmp_path / "hf"), "--format", "onnx"])
    assert r.exit_code == 2 and "one of 'hf', 'dcp'" in r.output
    r = runner.invoke(
        app, ["export", src, str(tmp_path / "hf"), "--format", "hf", "--dtype", "bfloat16"]
    )
    assert r.exit_code == 0 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert runner.invoke(app, ["convert", src]).exit_code == 2  # typer: missing argument


def _in_small_batches(monkeypatch, seed):
    """Batches of one chunk and 4 KiB read pieces, and a small state sharded over every axis
    (column bands, experts over ep and tp, ZeRO-style dp x ep): (globals, placements)."""
    monkeypatch.setattr(execute, "MIN_BATCH_BYTES", 1)
    monkeypatch.setattr(reader, "PIECE_BYTES", 4096)
    g = torch.Generator().manual_seed(seed)
    globals_ = {
        "model.a": torch.randn(64, 96, generator=g),
        "model.b": torch.randn(8, 32, 24, generator=g).bfloat16(),
        "model.c": torch.randn(40, 40, generator=g),
        "optim.m": torch.randn(301, generator=g),
    }
    placements = {
        "model.a": {"tp": Shard(1)},
        "model.b": {"ep": Shard(0), "tp": Shard(2)},
        "model.c": {"tp": Shard(0)},
        "optim.m": {"dp": Shard(0), "ep": Shard(0)},
    }
    return globals_, placements


def test_convert_in_many_small_batches_survives_a_write_retried_mid_stream(tmp_path, monkeypatch):
    # one batch per chunk and many read pieces, with the two batch buffers and the read ring
    # shared by every target file; the first write of rank 0's file fails on its first batch,
    # after its header, so the retry streams that file again on its own while the shared stream,
    # which has read ahead, drops the rest of it and goes on with the next file
    globals_, placements = _in_small_batches(monkeypatch, seed=3)
    src, dst = Layout(dp=1, ep=2, tp=2), Layout(dp=3, ep=1, tp=2)
    save_world(
        str(tmp_path / "src"),
        9,
        [distribute(globals_, placements, src, r) for r in range(src.world_size)],
        src,
    )
    fault = {"op": "write", "error": "transient", "path": "rank_00000", "skip": 1, "count": 1}
    report = convert(
        str(tmp_path / "src"),
        f"faulty://{tmp_path / 'dst'}",
        dict(zip(dst.names, dst.sizes)),
        dst_options={"faults": [fault], "record": str(tmp_path / "fired.jsonl")},
    )
    assert report.batch_bytes == report.largest_chunk_bytes  # batches of one chunk
    fired = (tmp_path / "fired.jsonl").read_text().splitlines()
    assert len(fired) == 1 and "rank_00000" in fired[0]
    with Checkpointer(str(tmp_path / "dst")) as ck:
        assert ck.verify(9).ok and ck.manifest().layout == dst
    assert_loads_as(str(tmp_path / "dst"), 9, globals_, placements, dst)


@pytest.mark.s3
def test_convert_between_object_store_buckets_in_small_batches(s3, monkeypatch):
    # S3 to S3 through the local server: ranged GETs in, multipart-style streamed writes out, with
    # batches of one chunk so the stream reuses its buffers many times over.
    globals_, placements = _in_small_batches(monkeypatch, seed=5)
    src, dst = Layout(dp=1, ep=2, tp=2), Layout(dp=3, ep=1, tp=2)
    src_url, dst_url = f"s3://{s3.new_bucket()}/run", f"s3://{s3.new_bucket()}/run-dp3"
    save_world(
        src_url,
        4,
        [distribute(globals_, placements, src, r) for r in range(src.world_size)],
        src,
        storage_options=s3.options,
    )
    report = convert(
        src_url,
        dst_url,
        dict(zip(dst.names, dst.sizes)),
        src_options=s3.options,
        dst_options=s3.options,
    )
    assert report.batch_bytes == report.largest_chunk_bytes and report.bytes_written > 0
    with Checkpointer(dst_url, storage_options=s3.options) as ck:
        assert ck.steps() == [4] and ck.verify(4).ok and ck.manifest().layout == dst
    assert_loads_as(dst_url, 4, globals_, placements, dst, s3.options)


def test_chunk_stream_reads_ahead_across_files_and_drops_what_an_abandoned_file_left(
    tmp_path, monkeypatch
):
    # One producer streams every target file in order; a file the writer gives up on part-way is
    # dropped (its buffers come back), the next file still streams exactly its own bytes, and an
    # abandoned file cannot be streamed again from the same stream.
    monkeypatch.setattr(execute, "MIN_BATCH_BYTES", 1)
    g = _saved(tmp_path)
    dst = Layout(dp=2, ep=1, tp=1)
    storage = execute.Storage(str(tmp_path / "src"))
    m = reader.read_manifest(storage, 5)
    conversion = plan(m, dst)
    per_target = {}
    for c in conversion.chunks:
        per_target.setdefault(c.rank, []).append(c)
    files = [per_target[r] for r in sorted(per_target)]
    budget = conversion.largest_chunk_bytes
    assert len(files) == 2 and len(list(execute._batches(files[0], budget))) >= 2  # leaves some
    seen = []
    buffers = execute.StreamBuffers(budget)
    stream = execute.ChunkStream(storage, m, files, buffers, on_bytes=seen.append)
    try:
        first = stream.file(0)
        next(first)  # one batch of file 0, then the writer gives up on it
        first.close()
        with pytest.raises(RuntimeError, match="target file 0 was already streamed"):
            next(stream.file(0))
        data = b"".join(bytes(mv) for mv in stream.file(1))
    finally:
        stream.close()
    c0, c1 = files[1][0].item, files[1][-1].item
    assert len(data) == c1.end - c0.begin == sum(seen)  # the abandoned batch is not counted
    for c in files[1]:  # file 1's bytes are its chunks' global slices, and its checksums match
        got = torch.frombuffer(bytearray(data[c.item.begin : c.item.end]), dtype=torch.uint8)
        want = local_chunk(g[c.item.key], {}, Layout(dp=1), 0)
        dims = [slice(o, o + n) for o, n in zip(c.item.offsets, c.item.sizes)]
        expect = want[tuple(dims)].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got, expect), c.item.key
        assert stream.checksums[1][c.item.key] == execute.block_checksums(
            memoryview(data)[c.item.begin : c.item.end], m.block_bytes
        )
    assert buffers.ring.idle and stream.read_bytes[1] > 0


# --- the destination against the source, and sizes that are not sizes ----------------------------
def test_an_export_into_the_sources_step_directory_is_refused(tmp_path):
    """Making an export's destination ready removes the *.safetensors there: in one of the
    source's step directories those are its rank files (the step was gone for good)."""
    _saved(tmp_path)
    src = str(tmp_path / "src")
    for out in (tmp_path / "src" / "step_00000005", tmp_path / "src"):
        r = runner.invoke(app, ["export", src, str(out), "--format", "hf", "--overwrite"])
        assert r.exit_code == 2 and "source checkpoint" in r.output, r.output
    assert Checkpointer(src).verify(5).ok
    r = runner.invoke(app, ["export", src, str(tmp_path / "src" / "hf"), "--format", "hf"])
    assert r.exit_code == 0, r.output  # (a directory of its own under the root is fine)
    assert Checkpointer(src).verify(5).ok and Checkpointer(src).steps() == [5]


@pytest.mark.parametrize("command", ["convert", "plan"])
def test_a_zero_axis_size_is_refused_not_taken_as_the_sources(tmp_path, command):
    _saved(tmp_path)
    args = [command, str(tmp_path / "src")] + (
        [str(tmp_path / "dst")] if command == "convert" else []
    )
    r = runner.invoke(app, [*args, "--tp", "0"])
    assert r.exit_code == 2 and "--tp 0" in r.output, r.output
    assert not (tmp_path / "dst").exists()


def test_convert_over_later_steps_of_the_destination_is_refused(tmp_path):
    """The converted step is committed as the destination's newest: over its later steps it
    would abandon them (the destination's line went back to the converted step)."""
    _saved(tmp_path)
    dst = tmp_path / "dst"
    save_world(str(dst), 10, [{"optim.m": torch.arange(30.0)}], Layout(dp=1))
    with pytest.raises(DestinationExistsError, match=r"later steps \[10\]"):
        convert(str(tmp_path / "src"), str(dst), {"tp": 1, "ep": 1}, step=5, overwrite=True)
    assert Checkpointer(str(dst)).latest_step() == 10 and Checkpointer(str(dst)).steps() == [10]


# --- a manifest that declares more than its files hold -------------------------------------------
def _declare_huge_chunk(tmp_path) -> tuple[str, int]:
    """A one-tensor checkpoint whose manifest, consistent in itself, declares a 4 TiB chunk in a
    file of a few hundred bytes: (its URL, the file's real size)."""
    src = tmp_path / "src"
    save_world(str(src), 5, [{"model.w": torch.arange(16.0)}], Layout(dp=1))
    n = 1 << 40
    path = src / "step_00000005" / "MANIFEST.json"
    d = json.loads(path.read_text())
    d["block_bytes"] = 1 << 30
    d["files"]["rank_00000.safetensors"]["size_bytes"] = 128 + 4 * n
    t = d["tensors"]["model.w"]
    t["shape"], c = [n], t["chunks"][0]
    c["sizes"], c["byte_range"], c["raw_bytes"] = [n], [128, 128 + 4 * n], 4 * n
    c["checksums"] = [0] * (4 * n >> 30)
    path.write_text(json.dumps(d))
    return str(src), (src / "step_00000005" / "rank_00000.safetensors").stat().st_size


@pytest.mark.parametrize(
    "args", [["convert", "--dp", "1"], ["export", "--format", "hf"], ["export", "--format", "dcp"]]
)
def test_a_manifest_declaring_more_than_its_file_holds_is_corrupt_before_allocating(tmp_path, args):
    """Buffers and whole tensors are sized from the manifest: its files are checked against it
    first (the allocator's raw error for 4 TiB before)."""
    src, size = _declare_huge_chunk(tmp_path)
    r = runner.invoke(app, [args[0], src, str(tmp_path / "out"), *args[1:]])
    assert r.exit_code == 1, r.output
    assert f"rank_00000.safetensors (step 5) is {size} bytes, but the manifest declares " in (
        " ".join(r.output.split())
    ), r.output


def test_an_allocation_the_allocator_refuses_is_a_named_error():
    with pytest.raises(execute.AllocationError, match=r"tensor 'x': needs 4503599627370496 bytes"):
        execute.allocate((1 << 50,), torch.float32, "tensor 'x'")


def test_a_name_map_to_the_safetensors_metadata_key_is_refused(tmp_path):
    """`__metadata__` is the safetensors header's key for the file's metadata: a tensor of that
    name was overwritten by it and the file written did not open."""
    _saved(tmp_path)
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"model.w": "__metadata__"}))
    out = tmp_path / "hf"
    r = runner.invoke(
        app,
        ["export", str(tmp_path / "src"), str(out), "--format", "hf", "--name-map", str(mapping)],
    )
    assert r.exit_code == 2, r.output
    assert "--name-map gives 'model.w' the name '__metadata__', the key safetensors reserves" in (
        " ".join(r.output.split())
    ), r.output
    assert not out.exists() or not list(out.glob("*.safetensors"))  # refused before writing


@pytest.mark.parametrize("dtype", ["int8", "bool", "int64", "complex64"])
def test_export_dtype_other_than_floating_point_is_refused(tmp_path, dtype):
    """A cast of float weights to an integer or bool dtype wrecked them silently."""
    _saved(tmp_path)
    r = runner.invoke(
        app,
        ["export", str(tmp_path / "src"), str(tmp_path / "hf"), "--format", "hf", "--dtype", dtype],
    )
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"--dtype '{dtype}' is not" in text and "'bfloat16', 'float16'" in text, r.output
    assert not (tmp_path / "hf").exists()


def test_export_casts_to_float8(tmp_path):
    g = _saved(tmp_path)
    report = export_hf(str(tmp_path / "src"), str(tmp_path / "hf"), dtype="float8_e4m3fn")
    t = load_file(str(tmp_path / "hf" / report.files[0]))["model.w"]
    assert t.dtype == torch.float8_e4m3fn and torch.equal(t, g["model.w"].to(torch.float8_e4m3fn))


@pytest.mark.parametrize("size", ["1.2.3GB", ".", "1..5MB", "5XB"])
def test_a_max_shard_size_that_is_not_a_size_names_the_option(tmp_path, size):
    """`[0-9.]+` took '1.2.3', and float() failed with its own message."""
    _saved(tmp_path)
    r = runner.invoke(
        app,
        ["export", str(tmp_path / "src"), str(tmp_path / "hf"), "--format", "hf"]
        + ["--max-shard-size", size],
    )
    assert r.exit_code == 2, r.output
    assert f"--max-shard-size '{size}': expected a number with an optional unit such as 5GB" in (
        " ".join(r.output.split())
    ), r.output
    assert parse_size("1.5GiB") == 3 << 29 and parse_size(".5KB") == 500
    assert parse_size("2.MB") == 2 * 10**6


def _recording_progress(monkeypatch) -> dict:
    import reshape.cli as cli

    seen: dict = {}

    @contextlib.contextmanager
    def fake(total, label, enabled=True, console=None):
        seen.update(total=total, done=0)

        def advance(n):
            seen["done"] += n

        yield advance

    monkeypatch.setattr(cli, "byte_progress", fake)
    return seen


def test_export_progress_counts_the_bytes_of_the_dtype_written(tmp_path, monkeypatch):
    """The total knew 4 float dtypes (any other counted 4 bytes an element): the bar ended at a
    quarter for float8."""
    _saved(tmp_path)
    seen = _recording_progress(monkeypatch)
    out = tmp_path / "hf"
    args = ["export", str(tmp_path / "src"), str(out), "--format", "hf", "--dtype", "float8_e5m2"]
    assert runner.invoke(app, args).exit_code == 0
    written = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
    assert seen["total"] == seen["done"] == written["total_size"] == 64 * 64 + 4 * 8 * 16


def test_a_converted_or_exported_checkpoint_leaves_the_sources_bookkeeping_out(tmp_path):
    """A manifest's parent record (as the memory tier's run) says where that commit stands in
    its own URL's history: convert copied it into another URL's manifest, and the DCP export
    wrote it as a value of the state."""
    from reshape.formats.dcp import export_dcp
    from resilient.checkpoint.format import BOOKKEEPING_KEYS, PARENT_KEY

    src = str(tmp_path / "src")
    with Checkpointer(src, layout=Layout(dp=1)) as ck:
        ck.save(1, {"w": torch.ones(4), "lr": 0.5}).wait()
        ck.save(2, {"w": torch.full((4,), 2.0), "lr": 0.25}).wait()
    assert PARENT_KEY in Checkpointer(src).manifest(2).extras  # (its parent: step 1)
    convert(src, str(tmp_path / "dst"), {"dp": 1})
    out = Checkpointer(str(tmp_path / "dst")).manifest(2).extras
    assert out == {"lr": 0.25} and not BOOKKEEPING_KEYS & set(out)
    report = export_dcp(src, str(tmp_path / "dcp"))
    written = (tmp_path / "dcp" / ".metadata").read_bytes()
    assert b"_resilient_" not in written and report is not None
