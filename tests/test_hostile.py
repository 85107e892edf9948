"""Checkpoints someone else controls: every reader fails fast, in bounded memory, with a named
ResilientError; writers never follow a link planted in a step directory."""

import json
import os
import time

import pytest
import torch
import zstandard

from resilient import Checkpointer
from resilient.checkpoint.format import MANIFEST_NAME
from resilient.checkpoint.reader import read_manifest, verify_step
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError, CheckpointNotFoundError, StorageError
from tests.peak import PeakGrowth


def saved(tmp_path, steps=(1, 2), **kw):
    with Checkpointer(str(tmp_path), **kw) as ck:
        for s in steps:
            ck.save(s, {"w": torch.arange(3000.0) * s, "v": {"s": s}}).wait()
    return tmp_path


def blank():
    return {"w": torch.zeros(3000), "v": {"s": 0}}


def manifest_path(tmp_path, step=2):
    return tmp_path / f"step_{step:08d}" / MANIFEST_NAME


def edit(tmp_path, fn, step=2):
    p = manifest_path(tmp_path, step)
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def load_step(tmp_path, step=2):
    with Checkpointer(str(tmp_path)) as ck:
        return ck.load(blank(), step=step)


class Bounded:
    """Fails if the block hangs (a generous bound: the work takes milliseconds, the defects took
    minutes) or raises the peak RSS by much: what "fast, in bounded memory" means here."""

    def __init__(self, seconds=30.0, mib=200):
        self.seconds, self.mib = seconds, mib

    def __enter__(self):
        self.t0 = time.monotonic()
        self.peak = PeakGrowth().__enter__()
        return self

    def __exit__(self, *exc):
        self.peak.__exit__()
        took = time.monotonic() - self.t0
        assert took < self.seconds, f"took {took:.1f}s"
        assert self.peak.mib < self.mib, f"peak memory grew by {self.peak.mib:.0f} MiB"
        return False


# --- manifests that never end ------------------------------------------------------------------


def test_a_manifest_linked_to_dev_zero_is_refused_without_reading_it(tmp_path):
    saved(tmp_path)
    p = manifest_path(tmp_path)
    p.unlink()
    p.symlink_to("/dev/zero")
    with Bounded():
        with pytest.raises(StorageError, match=r"MANIFEST.json: it is a symbolic link"):
            read_manifest(Storage(str(tmp_path)), 2)
        with Checkpointer(str(tmp_path)) as ck:
            assert ck.steps() == [1]  # not a commit
            with pytest.raises(CheckpointCorruptError, match="step 2 .* is not a usable commit"):
                ck.load(blank(), step=2)
            assert ck.load(blank()) == 1


def test_a_huge_manifest_is_refused_by_its_size(tmp_path):
    saved(tmp_path)
    p = manifest_path(tmp_path)
    with open(p, "r+b") as f:
        f.truncate(100 << 30)  # 100 GiB, sparse
    with Bounded():
        with pytest.raises(StorageError, match=r"it is 107374182400 bytes, over the limit of"):
            read_manifest(Storage(str(tmp_path)), 2)
        assert Checkpointer(str(tmp_path)).steps() == [1]


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    saved(tmp_path)
    p = manifest_path(tmp_path)
    p.unlink()
    os.mkfifo(p)
    with Bounded():
        with pytest.raises(StorageError, match=r"it is a FIFO, not a regular file"):
            read_manifest(Storage(str(tmp_path)), 2)


# --- sizes that cannot be true ------------------------------------------------------------------


def test_a_layout_of_a_billion_ranks_is_refused_fast(tmp_path):
    saved(tmp_path)
    edit(tmp_path, lambda m: m.update(layout=[["dp", 1_000_000_000]]))
    with Bounded():
        with pytest.raises(CheckpointCorruptError, match=r"allows at most 16777216 ranks"):
            load_step(tmp_path)


def test_a_large_layout_validates_without_looping_over_ranks(tmp_path):
    # 2**24 ranks, within the cap: the replicated tensor is one chunk; checking it must not
    # enumerate ranks (which took minutes and gigabytes before)
    saved(tmp_path)
    edit(
        tmp_path,
        lambda m: (
            m.update(layout=[["dp", 1 << 24]]),
            m["files"]["rank_00000.safetensors"].update(rank=0),
        ),
    )
    with Bounded(mib=100):
        m = read_manifest(Storage(str(tmp_path)), 2)
    assert m.layout.world_size == 1 << 24


def test_a_sharded_tensor_over_huge_axes_is_checked_per_chunk_not_per_rank(tmp_path):
    saved(tmp_path)

    def shard(m):
        m["layout"] = [["dp", 1 << 20], ["tp", 1 << 4]]
        m["tensors"]["w"]["placement"] = {"dp": {"dim": 0, "parts": 1}}

    edit(tmp_path, shard)
    with Bounded(mib=100):
        with pytest.raises(
            CheckpointCorruptError,
            match=r"expected more than 1 distinct non-empty chunks, found 1",
        ):
            load_step(tmp_path)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda m: m["tensors"]["w"].update(shape=[2**64]),
            r"must be a non-negative integer below 2\*\*63",
        ),
        (
            lambda m: m["tensors"]["w"].update(shape=[2**40, 2**40]),
            r"more than 2\*\*63 bytes",
        ),
        (
            lambda m: m["tensors"]["w"].update(shape=[1] * 40),
            r"has 40 dims; format v2 allows at most 32",
        ),
        (lambda m: m.update(layout=[[f"a{i}", 1] for i in range(20)]), "has 20 axes"),
        (lambda m: m.update(step=10**30), "below 2\\*\\*63"),
    ],
)
def test_sizes_past_int64_are_refused(tmp_path, change, message):
    saved(tmp_path)
    edit(tmp_path, change)
    with Bounded():
        with pytest.raises(CheckpointCorruptError, match=message):
            read_manifest(Storage(str(tmp_path)), 2)


def _rename_w(m, key: bool, chunk: bool) -> None:
    t = m["tensors"].pop("w")
    for c in t["chunks"]:
        c["name"] = "__metadata__" if chunk else c["name"]
    m["tensors"]["__metadata__" if key else "w"] = t


@pytest.mark.parametrize("key,chunk", [(True, False), (False, True), (True, True)])
def test_a_tensor_named_like_the_safetensors_metadata_is_refused(tmp_path, key, chunk):
    """(a review) A tensor "__metadata__" replaced the header's metadata: the rank file did not
    open in safetensors, and verify and convert passed it on."""
    saved(tmp_path)
    edit(tmp_path, lambda m: _rename_w(m, key, chunk))
    with pytest.raises(CheckpointCorruptError, match="a safetensors header's own key"):
        read_manifest(Storage(str(tmp_path)), 2)


def test_a_tensor_named_like_the_safetensors_metadata_is_never_saved(tmp_path):
    from resilient.checkpoint.codec import safetensors_header

    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(ValueError, match="state key '__metadata__' is a safetensors header"):
            ck.save(1, {"__metadata__": torch.ones(3), "w": torch.ones(2)})
        assert ck.steps() == []
    with pytest.raises(ValueError, match="the header's metadata key"):
        safetensors_header([("__metadata__", "F32", [1], 0, 4)], {})


# --- JSON that is deep, or the wrong shape -------------------------------------------------------


def test_json_nested_100000_deep_is_a_corrupt_error_not_a_recursion_error(tmp_path):
    saved(tmp_path)
    p = manifest_path(tmp_path)
    text = p.read_text()
    deep = "[" * 100_000 + "]" * 100_000
    p.write_text(text.replace('"extras": {', f'"extras": {{"deep": {deep}, ', 1))
    with Bounded():
        with pytest.raises(CheckpointCorruptError, match="nests JSON deeper than the parser"):
            read_manifest(Storage(str(tmp_path)), 2)
        assert Checkpointer(str(tmp_path)).steps() == [1]


def test_json_nested_past_the_format_cap_is_refused(tmp_path):
    saved(tmp_path)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    edit(tmp_path, lambda m: m["extras"].update(deep=deep))
    with pytest.raises(CheckpointCorruptError, match="manifest.extras nests deeper than 64 levels"):
        load_step(tmp_path)


@pytest.mark.parametrize("key", ["²", "٣", "-1", "01", "1e3", " 1", "1\n", "99999999999999"])
def test_rank_extras_keys_must_be_plain_decimal_ranks(tmp_path, key):
    saved(tmp_path)
    edit(tmp_path, lambda m: m["rank_extras"].update({key: {"x": 1}}))
    with pytest.raises(
        CheckpointCorruptError, match=r"rank_extras\[.*\] must map a rank|names a rank outside"
    ):
        load_step(tmp_path)


def test_a_step_directory_copied_under_another_number_is_not_that_step(tmp_path):
    import shutil

    saved(tmp_path)
    shutil.copytree(tmp_path / "step_00000001", tmp_path / "step_00000009")
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1, 2] and ck.latest_step() == 2
        with pytest.raises(
            CheckpointCorruptError, match=r"says step 1, but it is in the directory of step 9"
        ):
            ck.load(blank(), step=9)


def _safetensors_header(path, new_header: bytes):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    body = data[8 + n :]
    assert len(new_header) <= n
    path.write_bytes(data[:8] + new_header.ljust(n) + body)


@pytest.mark.parametrize(
    "header,problem",
    [
        (b"[1, 2, 3]", "the header is a JSON list, not an object"),
        (b'{"w": {"dtype": "F32", "shape": [3000], "data_offsets": [0]}}', "data_offsets must be"),
        (b'{"w": [1]}', "data_offsets must be"),
    ],
)
def test_a_bad_safetensors_header_is_a_verify_problem_not_a_crash(tmp_path, header, problem):
    saved(tmp_path)
    _safetensors_header(tmp_path / "step_00000002" / "rank_00000.safetensors", header)
    report = verify_step(Storage(str(tmp_path)), 2)
    assert not report.ok and problem in report.problems[0]


def test_a_safetensors_header_nested_too_deep_is_a_value_error():
    from resilient.checkpoint.codec import parse_safetensors_header

    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nests JSON deeper"):
        parse_safetensors_header(len(deep).to_bytes(8, "little") + deep)


def test_a_huge_safetensors_header_length_is_not_read(tmp_path):
    saved(tmp_path)
    f = tmp_path / "step_00000002" / "rank_00000.safetensors"
    data = f.read_bytes()
    f.write_bytes((2**62).to_bytes(8, "little") + data[8:])
    with Bounded():
        report = verify_step(Storage(str(tmp_path)), 2)
    assert "not a valid safetensors file (header length 4611686018427387904" in report.problems[0]


def test_a_zstd_frame_declaring_a_huge_size_allocates_nothing(tmp_path):
    import zlib

    saved(tmp_path, compression="zstd")
    m = json.loads(manifest_path(tmp_path).read_text())
    c = m["tensors"]["w"]["chunks"][0]
    f = tmp_path / "step_00000002" / c["file"]
    start, end = c["byte_range"]
    # a frame whose header says it holds 64 GiB (decompressing it would allocate that much)
    # (magic, a header with an 8-byte content size and one segment, then an empty last block)
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (64 << 30).to_bytes(8, "little") + b"\x01\0\0"
    payload = frame.ljust(end - start, b"\0")
    assert zstandard.get_frame_parameters(payload).content_size == 64 << 30
    data = bytearray(f.read_bytes())
    data[start:end] = payload
    f.write_bytes(bytes(data))
    # with checksums that match, so that only the frame itself can stop it
    block = m["block_bytes"]
    c["checksums"] = [zlib.crc32(payload[i : i + block]) for i in range(0, len(payload), block)]
    manifest_path(tmp_path).write_text(json.dumps(m))
    with Bounded(mib=200):
        with pytest.raises(
            CheckpointCorruptError, match=r"does not decompress .*declares 68719476736 bytes"
        ):
            load_step(tmp_path)


# --- links planted in a step directory -----------------------------------------------------------


def test_reads_refuse_a_rank_file_that_is_a_link(tmp_path):
    saved(tmp_path)
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_bytes(b"x" * 100)
    f = tmp_path / "step_00000002" / "rank_00000.safetensors"
    f.unlink()
    f.symlink_to(secret)
    with pytest.raises(StorageError, match="rank_00000.safetensors: it is a symbolic link"):
        with Checkpointer(str(tmp_path)) as ck:
            ck.load(blank(), step=2)
    report = verify_step(Storage(str(tmp_path)), 2)
    assert not report.ok and "symbolic link" in report.problems[0]


def test_a_step_directory_that_is_a_link_is_not_followed(tmp_path):
    saved(tmp_path / "other")
    saved(tmp_path / "ckpt", steps=(1,))
    (tmp_path / "ckpt" / "step_00000002").symlink_to(tmp_path / "other" / "step_00000002")
    with Checkpointer(str(tmp_path / "ckpt")) as ck:
        assert ck.steps() == [1]
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            ck.load(blank(), step=2)
        ck.save(3, {"w": torch.ones(3000), "v": {"s": 3}}).wait()  # retention runs: no harm
    assert (tmp_path / "other" / "step_00000002" / MANIFEST_NAME).exists()


def test_writes_never_follow_a_planted_link_or_truncate_a_planted_hard_link(tmp_path):
    saved(tmp_path, steps=(1,))
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(b"precious")
    hard = tmp_path.parent / f"{tmp_path.name}-hard"
    hard.write_bytes(b"also precious")
    step = tmp_path / "step_00000002"
    step.mkdir()
    for g in range(0, 3):  # every name a save of step 2 might pick, as links out of the tree
        name = "rank_00000.safetensors" if g == 0 else f"rank_00000.g{g}.safetensors"
        if g % 2:
            os.link(hard, step / name)
        else:
            (step / name).symlink_to(victim)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(2, {"w": torch.arange(3000.0) * 2, "v": {"s": 2}}).wait()
        out = blank()
        assert ck.load(out) == 2 and torch.equal(out["w"], torch.arange(3000.0) * 2)
    assert victim.read_bytes() == b"precious"
    assert hard.read_bytes() == b"also precious"


def test_a_missing_step_is_not_found_and_a_damaged_one_says_why(tmp_path):
    saved(tmp_path)
    manifest_path(tmp_path).write_text('{"format_version": 2, "step": ')  # torn
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1]
        with pytest.raises(CheckpointNotFoundError, match="step 7 is not a committed checkpoint"):
            ck.load(blank(), step=7)
        with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
            ck.load(blank(), step=2)


def test_the_memory_bound_used_here_can_fail():
    """The peak-memory check measures the block itself (VmHWM reset), whatever ran before."""
    big = torch.ones(1 << 26)  # 256 MiB, touched
    del big
    with pytest.raises(AssertionError, match="peak memory grew by"):
        with Bounded(mib=100):
            x = torch.ones(1 << 26)
            del x


def test_verify_with_huge_blocks_reads_through_a_bounded_buffer(tmp_path, monkeypatch):
    """A manifest may declare blocks of up to 1 GiB: verify checksums them in slices, so its
    buffers never grow with the block size (here a 64 KiB block through 16 KiB slices)."""
    from resilient.checkpoint import reader as reader_mod

    monkeypatch.setattr(reader_mod, "VERIFY_READ_BYTES", 16 << 10)
    with Checkpointer(str(tmp_path), block_bytes=64 << 10) as ck:
        ck.save(1, {"w": torch.arange(100_000.0)}).wait()
    sizes = []
    real = reader_mod._uninitialized
    monkeypatch.setattr(reader_mod, "_uninitialized", lambda n: sizes.append(n) or real(n))
    assert verify_step(Storage(str(tmp_path)), 1).ok
    assert sizes and max(sizes) <= 16 << 10
    f = tmp_path / "step_00000001" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1000] ^= 1
    f.write_bytes(bytes(data))
    report = verify_step(Storage(str(tmp_path)), 1)
    assert not report.ok and "crc32 expected" in report.problems[0]


def test_reading_a_manifest_keeps_nothing_of_it_once_the_read_returns(tmp_path):
    """The manifest checks remember small answers between commits (a snapshot every step asks the
    same questions); nothing they keep may come from an untrusted manifest's text: a directory
    whose layouts have megabyte axis names must not leave them in this process's memory."""
    from resilient import Layout
    from resilient.checkpoint import format as fmt
    from resilient.layout import _REPLICATED

    name = "a" * 1_000_000
    with Checkpointer(str(tmp_path), layout=Layout({name: 1})) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()
        fmt._CHUNKS_MEMO.clear()
        _REPLICATED.clear()
        assert read_manifest(ck.storage, 1).layout.names == (name,)
        assert ck.steps() == [1]

    def leaves(x):
        if isinstance(x, (tuple, frozenset)):
            for v in x:
                yield from leaves(v)
        else:
            yield x

    kept = [v for k, v in fmt._CHUNKS_MEMO.items() for v in leaves((k, v))]
    assert all(isinstance(v, int) or v is None for v in kept), "an untrusted value is kept"
    assert all(len(n) < 1000 for layout in _REPLICATED for n in layout.names)


def _kept_of(root) -> list:
    """What the listing cache holds of the manifests under ``root``."""
    from resilient.checkpoint import catalog

    where = Storage(str(root)).location()
    return [v for k, v in catalog._CACHE.items() if k[0] == where]


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("job_id", "J" * 1_000_000, "manifest.job_id is 1000000 characters long"),
        ("toolkit_version", "9" * 1_000_000, "manifest.toolkit_version is 1000000 characters"),
        ("job_id", "J" * 1025, "at most 1024"),
    ],
)
def test_listing_a_hostile_directory_keeps_none_of_its_long_strings(tmp_path, field, value, named):
    """The listing cache lives as long as the process: a manifest's strings are capped (a job id,
    a toolkit version: 1024 characters, as in the writer lease), and the message kept for a step
    that is not a commit is short."""
    saved(tmp_path, steps=(1, 2, 3))
    for s in (2, 3):
        edit(tmp_path, lambda m: m.update({field: value}), step=s)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1] and ck.latest_step() == 1
        damaged = ck.catalog().damaged()
        assert [i.step for i in damaged] == [2, 3]
        assert named in damaged[0].problem and "format v2 allows at most 1024" in damaged[0].problem
        assert len(damaged[0].problem) <= 2000
        with pytest.raises(CheckpointCorruptError, match="step 2 .* is not a usable commit"):
            ck.load(blank(), step=2)
    kept = _kept_of(tmp_path)
    assert kept and all(
        len(v) <= 2000 if isinstance(v, str) else len(v.job_id) <= 1024 for v in kept
    )
    edit(tmp_path, lambda m: m.update({field: "j" * 1024}), step=2)  # at the cap: a commit
    assert Checkpointer(str(tmp_path)).steps() == [1, 2]


@pytest.mark.parametrize("digits", [10, 1_000_000])
def test_a_rank_file_name_with_more_digits_than_a_rank_has_is_refused(tmp_path, digits):
    saved(tmp_path)
    name = "rank_" + "0" * digits + ".safetensors"

    def rename(m):
        m["files"][name] = m["files"].pop("rank_00000.safetensors")
        for t in m["tensors"].values():
            for c in t["chunks"]:
                c["file"] = name

    edit(tmp_path, rename)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1]
        (problem,) = [i.problem for i in ck.catalog().damaged()]
        assert "files must be plain names like 'rank_00000.safetensors'" in problem
        assert len(problem) <= 2000
    assert all(len(v) <= 2000 for v in _kept_of(tmp_path) if isinstance(v, str))


def test_a_manifest_naming_more_files_than_a_job_writes_is_listed_but_not_cached(tmp_path):
    """A summary is kept only up to 65,536 file names (a rank file per rank of a large job); a
    manifest naming more (a layout of up to 2**24 ranks may) is read again at every listing."""
    saved(tmp_path)
    ranks = (1 << 16) + 1

    def widen(m):
        m["layout"] = [["dp", ranks]]
        first = m["files"]["rank_00000.safetensors"]
        m["files"] = {
            f"rank_{r:05d}.safetensors": {"rank": r, "size_bytes": 0} for r in range(ranks)
        }
        m["files"]["rank_00000.safetensors"] = first
        m["rank_extras"] = {}

    edit(tmp_path, widen)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1, 2]
        assert ck.catalog().get(2).files.__len__() == ranks
    # (the summaries kept of step 2 are of its manifest as saved, before the edit)
    assert all(len(v.files) == 1 for v in _kept_of(tmp_path))
