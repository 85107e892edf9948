"""One storage contract, run against every backend: local disk, memory://, S3 (moto over HTTP)."""

import errno
import functools
import time
import uuid

import pytest
import torch

from resilient import Checkpointer, Layout, Shard, sharded
from resilient.checkpoint.storage import RetryPolicy, Storage, WriteConflict, is_transient
from resilient.errors import CheckpointCorruptError, StorageError


def test_an_exclusive_write_never_replaces_a_file(storage_url):
    """Rank files are written where nothing is: what is there stays, and a named error says so."""
    url, opts = storage_url
    st = Storage(url, opts, retry=RetryPolicy(max_attempts=1))
    st.makedirs("step_00000001")
    assert st.write_file("step_00000001/r.bin", [b"committed"], exclusive=True) == 9
    with pytest.raises(WriteConflict, match=r"r\.bin: a file is there already.*one job"):
        st.write_file("step_00000001/r.bin", [b"a stale writer's"], exclusive=True)
    assert st.read("step_00000001/r.bin") == b"committed"
    st.write_file("step_00000001/r.bin", [b"replaced"])  # (a plain write still replaces)
    assert st.read("step_00000001/r.bin") == b"replaced"


def test_a_write_that_fails_part_way_publishes_nothing(storage_url):
    """Bytes a failed write produced are never published under its name (an object store's
    upload, published at its close, is aborted; a file its exclusive open created is removed),
    so the retry of an exclusive write is not taken for another writer's, and a write that failed
    for good leaves nothing."""
    url, opts = storage_url
    st = Storage(url, opts, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.001))
    st.makedirs("s")
    data = bytes(range(256)) * 100

    def flaky(attempts: list):
        def parts():
            attempts.append(1)
            yield data[:1000]
            if len(attempts) == 1:
                raise ConnectionError("the connection dropped part-way (injected)")
            yield data[1000:]

        return parts

    for exclusive in (True, False):
        attempts: list = []
        assert st.write_file(f"s/{exclusive}.bin", flaky(attempts), exclusive=exclusive) == len(
            data
        )
        assert len(attempts) == 2 and st.read(f"s/{exclusive}.bin") == data

    def broken():
        yield data[:1000]
        raise CheckpointCorruptError("the bytes did not match their checksums (injected)")

    with pytest.raises(CheckpointCorruptError):
        st.write_file("s/never.bin", broken, exclusive=True)
    assert not st.exists("s/never.bin")


@pytest.mark.parametrize("backend", ["memory", "s3"])  # (the local disk: test_local_faults.py)
@pytest.mark.parametrize("first", ["landed", "stranger-landed"])
def test_an_exclusive_write_whose_answer_was_lost_is_retried(request, backend, first):
    """The first attempt timed out and the name is taken at the retry: by this write's own upload
    (it landed, its answer lost), and the write succeeds; or by another writer's bytes, and the
    retry never takes them for its own."""
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        url, opts = f"s3://{s3.new_bucket()}/run", s3.options
    else:
        url, opts = f"memory://excl-{time.monotonic_ns()}", None
    st = Storage(url, opts, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.001))
    st.makedirs("s")
    data = bytes(range(256)) * 1000
    real, calls = st.fs.open, []

    def open_once_lost(path, mode="rb", **kw):
        calls.append(mode)
        if len(calls) > 1:
            return real(path, mode, **kw)
        with real(path, "wb") as f:  # the first attempt's upload lands (or a stranger's does)
            f.write(data if first == "landed" else data[::-1])
        raise TimeoutError("the answer of the final request was lost (injected)")

    st.fs.open = open_once_lost
    if first == "landed":
        assert st.write_file("s/r.bin", [data[:7], data[7:]], exclusive=True) == len(data)
        assert st.read("s/r.bin") == data
    else:
        with pytest.raises(WriteConflict):
            st.write_file("s/r.bin", [data[:7], data[7:]], exclusive=True)
        assert st.read("s/r.bin") == data[::-1]
    assert calls == ["xb", "xb"]


def test_storage_contract(storage_url):
    url, opts = storage_url
    st = Storage(url, opts)
    st.makedirs("step_00000001")
    data = bytes(range(256)) * 100
    n = st.write_file("step_00000001/a.bin", [data[:1000], memoryview(data[1000:])])
    assert n == len(data)
    assert st.exists("step_00000001/a.bin") and not st.exists("step_00000001/b.bin")
    assert st.size("step_00000001/a.bin") == len(data)
    assert st.read("step_00000001/a.bin") == data
    assert st.read_range("step_00000001/a.bin", 10, 300) == data[10:300]
    assert st.read_ranges("step_00000001/a.bin", [(0, 5), (500, 600), (25000, 25600)]) == [
        data[0:5],
        data[500:600],
        data[25000:25600],
    ]
    into = bytearray(700)
    assert st.read_into("step_00000001/a.bin", 300, memoryview(into)[:600]) == 600
    assert into[:600] == data[300:900] and into[600:] == bytes(100)  # only the view is written
    assert (
        st.read_into("step_00000001/a.bin", len(data) - 50, memoryview(into)) == 50
    )  # short at EOF
    assert into[:50] == data[-50:]
    st.write_atomic("step_00000001/MANIFEST.json", b'{"x": 1}')
    st.write_atomic("step_00000001/MANIFEST.json", b'{"x": 2}')  # replaces
    assert st.read("step_00000001/MANIFEST.json") == b'{"x": 2}'
    assert st.listdir("") == ["step_00000001"]
    assert st.listdir("step_00000001") == ["MANIFEST.json", "a.bin"]
    assert st.listdir("nothing-here") == []
    st.remove("step_00000001/a.bin")
    assert st.listdir("step_00000001") == ["MANIFEST.json"]
    st.remove_tree("step_00000001")
    assert not st.exists("step_00000001/MANIFEST.json")
    with pytest.raises(
        StorageError,
        match=r"storage read of .*missing.bin failed after 1 attempt.*FileNotFoundError",
    ):
        st.read("missing.bin")


def test_checkpointer_on_every_backend(storage_url):
    url, opts = storage_url
    lay = Layout(dp=1)
    state = {"w": torch.randn(300, 7), "b": torch.arange(10).bfloat16(), "meta": {"k": [1, 2]}}
    with Checkpointer(url, layout=lay, storage_options=opts, keep_last=1, block_bytes=4096) as ck:
        ck.save(1, state)
        ck.save(2, state).wait()
        assert ck.steps() == [2]
        out = {"w": torch.zeros(300, 7), "b": torch.zeros(10).bfloat16(), "meta": {"k": []}}
        assert ck.load(out) == 2
        assert ck.verify(2).ok
    assert (
        torch.equal(out["w"], state["w"])
        and torch.equal(out["b"], state["b"])
        and out["meta"] == {"k": [1, 2]}
    )


def test_local_streamed_writes_start_write_back_as_they_go(tmp_path, monkeypatch):
    # A stream (parts as a function) asks the kernel, every WRITEBACK_BYTES written, to start
    # writing the range just written, so the final fsync waits only for the tail; the ranges tile
    # the file in order.  Parts already in memory (a list) go straight to the flush.
    from resilient.checkpoint import storage as storage_mod

    calls = []
    monkeypatch.setattr(storage_mod, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(
        storage_mod, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags))
    )
    data = bytes(range(256)) * 20  # 5120 bytes in parts of 700
    parts = [data[i : i + 700] for i in range(0, len(data), 700)]
    st = Storage(str(tmp_path))
    assert st.write_file("a.bin", lambda: iter(parts)) == len(data)
    assert (tmp_path / "a.bin").read_bytes() == data
    assert calls == [(0, 1400, 2), (1400, 1400, 2), (2800, 1400, 2)]  # the 920-byte tail: fsync's
    assert st.write_file("b.bin", parts) == len(data) and len(calls) == 3
    assert (tmp_path / "b.bin").read_bytes() == data
    monkeypatch.undo()
    if storage_mod._SYNC_FILE_RANGE is not None:  # Linux: the real call, on a real file
        big = memoryview(bytes(9 << 20))
        assert st.write_file("c.bin", lambda: iter([big, big])) == 2 * len(big)
        assert (tmp_path / "c.bin").stat().st_size == 2 * len(big)


def test_transient_classification():
    import errno

    assert is_transient(ConnectionError()) and is_transient(TimeoutError())
    assert is_transient(OSError(errno.EIO, "io"))
    assert not is_transient(OSError(errno.ENOSPC, "full")) and not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError())


def test_latency_injection_slows_but_does_not_break(tmp_path):
    import time

    rules = [{"id": "slow-read", "op": "read", "latency_s": 0.05}]
    rules += [{"id": "slow-write", "op": "write", "latency_s": 0.05}]
    with Checkpointer(f"faulty://{tmp_path}", storage_options={"faults": rules}) as ck:
        ck.save(1, {"w": torch.ones(3)}).wait()
        out = {"w": torch.zeros(3)}
        t0 = time.monotonic()
        ck.load(out)
        took = time.monotonic() - t0
        fired = ck.storage.fs.fired
    assert torch.equal(out["w"], torch.ones(3))
    # the latency really applied: the rules fired on reads and writes of the checkpoint, and the
    # load (a manifest read and a ranged read, at least) took at least two delays
    reads = [p for op, p, kind in fired if op == "read" and kind == "latency"]
    assert any(p.endswith("MANIFEST.json") for p in reads)
    assert any("rank_00000" in p for p in reads)
    assert any(op == "write" and kind == "latency" for op, _, kind in fired)
    assert took >= 0.1


@pytest.mark.parametrize("options", ["anon=True", ["anon"], 3])
def test_storage_options_that_are_not_a_mapping_are_refused_by_name(options):
    # (a str reached fsspec, which raised a bare TypeError of its own)
    with pytest.raises(ValueError, match=r"storage_options must be None or a mapping of fsspec"):
        Storage("memory://x", options)
    with pytest.raises(ValueError, match=rf"for 'memory://x' .*got {type(options).__name__} "):
        Checkpointer("memory://x", storage_options=options)


def test_retry_policy_validation():
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        RetryPolicy(max_attempts=0)


def _s3_rank(rank, world, url, opts, sizes, step, mode):
    lay = Layout(list(sizes))
    g = torch.arange(96.0).reshape(12, 8)
    from tests.ckpt_sim import local_chunk

    if mode == "save":
        with Checkpointer(url, layout=lay, storage_options=opts) as ck:
            ck.save(
                step, {"w": sharded(local_chunk(g, {"tp": Shard(0)}, lay, rank), {"tp": Shard(0)})}
            ).wait()
        return True
    out = {
        "w": sharded(
            torch.zeros_like(local_chunk(g, {"tp": Shard(0)}, lay, rank)), {"tp": Shard(0)}
        )
    }
    with Checkpointer(url, layout=lay, storage_options=opts) as ck:
        ck.load(out)
    return torch.equal(out["w"], local_chunk(g, {"tp": Shard(0)}, lay, rank))


@pytest.mark.distributed
@pytest.mark.s3
def test_s3_two_ranks_save_and_reshard(s3):
    from tests.dist import run_distributed

    url = f"s3://{s3.new_bucket()}/job"
    run_distributed(_s3_rank, 2, url, s3.options, (("tp", 2),), 4, "save")
    assert run_distributed(_s3_rank, 4, url, s3.options, (("tp", 4),), 4, "load") == [True] * 4


def test_a_call_that_succeeds_first_time_skips_the_retry_machinery_and_one_that_fails_retries(
    tmp_path,
):
    """Storage._call runs the call once directly; after a transient failure the retry machinery
    takes over with the same attempt count, backoff and time budget as when it ran every call."""
    st = Storage(str(tmp_path), retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.0))
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    assert st._call("read", "x", lambda: "first") == "first" and st.retries_done == 0
    assert st._call("read", "x", flaky) == "ok"
    assert len(calls) == 3 and st.retries_done == 2

    def always():
        raise ConnectionError("down")

    with pytest.raises(StorageError, match=r"kept failing after 3 attempt\(s\)"):
        st._call("read", "x", always)

    def full():
        raise OSError(errno.ENOSPC, "full")

    with pytest.raises(StorageError, match=r"failed after 1 attempt\(s\)"):
        st._call("write", "x", full)

    # the time budget counts from the first attempt: one that used it up is not retried
    slow = Storage(str(tmp_path), retry=RetryPolicy(max_attempts=5, max_total_s=0.05))
    tries = []

    def slow_fail():
        tries.append(1)
        time.sleep(0.1)
        raise ConnectionError("slow")

    with pytest.raises(StorageError, match=r"kept failing after 1 attempt\(s\)"):
        slow._call("read", "x", slow_fail)
    assert len(tries) == 1

    # a BaseException is never retried, whatever its name says, on the first attempt or later
    class GreenletTimeout(BaseException):
        pass

    seen = []

    def interrupted():
        seen.append(1)
        if len(seen) == 1:
            raise ConnectionError("reset")
        raise GreenletTimeout()

    with pytest.raises(GreenletTimeout):
        st._call("read", "x", interrupted)
    assert len(seen) == 2


# --- exclusive writes: retries below Storage, in-place partial files, wrappers ---


def _s3_storage(s3, **retry):
    url = f"s3://{s3.new_bucket()}/run"
    st = Storage(url, s3.options, retry=RetryPolicy(initial_backoff_s=0.001, **retry))
    st.makedirs("s")
    return st


def _lose_first_answer(st: Storage, method: str) -> list:
    """The first ``method`` request reaches the server and lands; its answer is lost (a read
    timeout), which s3fs (and botocore) retry by themselves, below Storage._call."""
    import botocore.exceptions

    st.fs.call_s3("list_buckets")  # (a session and a client)
    client = st.fs._s3
    real = getattr(client, method)
    calls: list = []

    @functools.wraps(real)
    async def lossy(*a, **kw):
        calls.append(kw.get("IfNoneMatch"))
        out = await real(*a, **kw)
        if len(calls) == 1:
            raise botocore.exceptions.ReadTimeoutError(endpoint_url="http://lost-answer")
        return out

    setattr(client, method, lossy)
    return calls


def test_an_exclusive_put_whose_answer_was_lost_and_retried_by_s3fs_is_not_a_conflict(s3):
    """The one-shot PUT (a rank file under s3fs's block size) lands; its answer is lost; s3fs
    retries it itself (S3_RETRYABLE_ERRORS) and the retry, If-None-Match: *, gets 412, which s3fs
    turns into FileExistsError on Storage's *first* attempt: the bytes there are compared all the
    same (they were only on a retry of Storage's own, and this save failed as a conflict)."""
    st = _s3_storage(s3)
    data = bytes(range(256)) * 1000
    calls = _lose_first_answer(st, "put_object")
    n = st.write_file("s/rank_00000.safetensors", [data], exclusive=True)
    assert calls == ["*", "*"]
    assert n == len(data) and st.read("s/rank_00000.safetensors") == data


def test_a_transient_write_fault_whose_clean_up_also_failed_is_not_a_conflict(tmp_path):
    """faulty:// over a local disk (the chaos harness; any fsspec filesystem whose exclusive
    open creates the file in place): a transient write fault leaves half the bytes at the rank
    file's own name, and removing them fails too (transiently): the retry removes this call's own
    partial file first (it failed as a conflict, the partial file left behind)."""
    import resilient.chaos.faultfs  # noqa: F401  (registers faulty://)

    faults = [
        {"op": "write", "error": "transient", "path": "rank_", "count": 1},
        {"op": "remove", "error": "transient", "path": "rank_", "count": 1},
    ]
    st = Storage(
        f"faulty://{tmp_path}/ck",
        {"target_protocol": "file", "faults": faults},
        retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.001),
    )
    st.makedirs("s")
    data = bytes(range(256)) * 64
    n = st.write_file("s/rank_00000.safetensors", [data], exclusive=True)
    assert [f[0] for f in st.fs.fired] == ["write", "remove"]
    assert n == len(data) and st.read("s/rank_00000.safetensors") == data


def _simplecache(tmp_path):
    """simplecache:: over memory://, commit_method="put" (the project treats its writes as
    writes of the target: Storage.location); every upload to the target recorded."""
    url = f"simplecache::memory://probe-{uuid.uuid4().hex[:8]}"
    st = Storage(
        url,
        {"simplecache": {"cache_storage": str(tmp_path / "cache")}},
        retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.001),
        commit_method="put",
    )
    st.makedirs("s")
    target, published = st.fs.fs, []
    real_put = target.put_file

    def put_file(lpath, rpath, **kw):
        with open(lpath, "rb") as f:
            published.append(f.read())
        return real_put(lpath, rpath, **kw)

    target.put_file = put_file
    return st, published


def test_simplecache_a_write_that_fails_part_way_uploads_nothing(tmp_path):
    """simplecache's LocalTempFile uploads its bytes to the target at close(): a failed write
    discards it instead (it was closed: the partial rank file was published, then deleted)."""
    from resilient.errors import CheckpointCorruptError

    st, published = _simplecache(tmp_path)

    def broken():
        yield b"partial-"
        raise CheckpointCorruptError("the bytes did not match their checksums (injected)")

    with pytest.raises(CheckpointCorruptError):
        st.write_file("s/rank_00000.safetensors", broken, exclusive=True)
    assert published == []


def test_simplecache_a_retried_exclusive_write_is_not_a_conflict(tmp_path):
    """simplecache's "xb" is exclusive on the local *cache* file, not on the target: it is not
    used there (the first attempt's cache file made the retry's exclusive open fail, and the
    write failed as a conflict with nothing at the name on the target)."""
    st, _ = _simplecache(tmp_path)
    attempts: list = []

    def flaky():
        attempts.append(1)
        yield b"partial-"
        if len(attempts) == 1:
            raise ConnectionError("the connection dropped part-way (injected)")
        yield b"rest"

    assert st.write_file("s/rank_00000.safetensors", flaky, exclusive=True) == 12
    assert st.read("s/rank_00000.safetensors") == b"partial-rest"
    # a name written before through this cache, removed (a swept step), and written again: the
    # cache still holds its file, which an "xb" open there took for the name being taken
    st.remove("s/rank_00000.safetensors")
    assert st.write_file("s/rank_00000.safetensors", [b"again"], exclusive=True) == 5
    assert st.read("s/rank_00000.safetensors") == b"again"


def test_a_conditional_publish_replaces_only_what_it_saw(storage_url):
    """S3: publish_if replaces a manifest only if it still holds the ETag seen before (or, where
    nothing was, only if nothing is); other stores have no conditional replace (version None)."""
    url, opts = storage_url
    st = Storage(url, opts, retry=RetryPolicy(max_attempts=1))
    st.makedirs("s")
    before = st.version_of("s/M.json")
    if not url.startswith("s3://"):
        assert before is None  # (a plain publish)
        st.publish_if("s/M.json", b"one", before)
        assert st.read("s/M.json") == b"one"
        return
    assert before == ""  # nothing there
    st.publish_if("s/M.json", b"one", before)
    with pytest.raises(WriteConflict, match="changed since this commit began"):
        st.publish_if("s/M.json", b"stale", before)  # something is there now
    seen = st.version_of("s/M.json")
    st.publish("s/M.json", b"two")  # another writer's commit
    with pytest.raises(WriteConflict):
        st.publish_if("s/M.json", b"stale", seen)
    assert st.read("s/M.json") == b"two"
    st.publish_if("s/M.json", b"three", st.version_of("s/M.json"))
    assert st.read("s/M.json") == b"three"


def test_a_conditional_publish_whose_answer_was_lost_is_not_a_conflict(s3):
    """The conditional PUT of a manifest lands and its answer is lost; the retry (s3fs's own, or
    Storage's) finds the ETag changed, by these very bytes: the publish succeeded."""
    st = _s3_storage(s3)
    calls = _lose_first_answer(st, "put_object")
    st.publish_if("s/MANIFEST.json", b"the manifest", st.version_of("s/MANIFEST.json"))
    assert calls == ["*", "*"] and st.read("s/MANIFEST.json") == b"the manifest"
    seen = st.version_of("s/MANIFEST.json")
    calls = _lose_first_answer(st, "put_object")
    st.publish_if("s/MANIFEST.json", b"the next one", seen)
    assert st.read("s/MANIFEST.json") == b"the next one"


def test_a_client_without_exclusive_writes_still_saves_and_says_so(s3, monkeypatch, caplog):
    """fsspec and s3fs before 2024.12 know no 'xb' open and pass pipe_file's mode= on to
    put_object (refused): every S3 save failed.  Such a client writes plainly, said once."""
    import s3fs

    real_open, real_pipe = s3fs.S3FileSystem._open, s3fs.S3FileSystem._pipe_file

    def old_open(self, path, mode="rb", *a, **kw):
        if mode not in {"rb", "wb", "ab"}:
            raise NotImplementedError("File mode not supported")  # fsspec < 2024.12
        return real_open(self, path, mode, *a, **kw)

    async def old_pipe(self, path, data, chunksize=50 * 2**20, **kwargs):
        if "mode" in kwargs or "IfMatch" in kwargs:  # an older s3fs or botocore refuses
            raise TypeError("put_object() got an unexpected keyword argument")
        return await real_pipe(self, path, data, chunksize=chunksize, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_open", old_open)
    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", old_pipe)
    url = f"s3://{s3.new_bucket()}/run"
    with caplog.at_level("WARNING", logger="resilient.checkpoint.storage"):
        with Checkpointer(url, storage_options=s3.options, job_id="job-A") as ck:
            ck.save(1, {"w": torch.arange(100.0)}).wait()
            ck.save(1, {"w": torch.arange(100.0) * 2}).wait()  # (a manifest there: If-Match)
            assert ck.steps() == [1] and ck.verify(1).ok
    said = [r.getMessage() for r in caplog.records if "this client cannot" in r.getMessage()]
    assert len(said) == 2 and "upgrade fsspec and s3fs to 2024.12" in said[0]


def test_a_conditional_remove_never_removes_what_another_writer_put_there_since(storage_url):
    """remove_if (a lease's release) removes a file only while it holds what was judged: on a
    local disk and S3 a file that another writer put at the name after it was read (here: while
    it is being judged) stays; memory:// has neither an atomic rename nor a conditional delete
    (a window of one call, documented)."""
    url, opts = storage_url
    st = Storage(url, opts, retry=RetryPolicy(max_attempts=1))
    st.makedirs("")
    assert st.remove_if("L.json", lambda data: True, 64) is False  # nothing there
    st.publish("L.json", b"mine")
    assert st.remove_if("L.json", lambda data: data == b"theirs", 64) is False
    assert st.read("L.json") == b"mine"  # (not what was meant: left as it was)
    assert st.remove_if("L.json", lambda data: data == b"mine", 64) is True
    assert not st.exists("L.json")
    if url.startswith("memory://"):
        return

    def judged_while_a_successor_writes(data: bytes) -> bool:
        Storage(url, opts).publish("L.json", b"theirs")  # a successor took it over just now
        return data == b"mine"

    st.publish("L.json", b"mine")
    st.remove_if("L.json", judged_while_a_successor_writes, 64)
    assert st.read("L.json") == b"theirs"
    assert [n for n in st.listdir("") if n.startswith("L.json")] == ["L.json"]  # (nothing aside)


def test_a_server_without_conditional_deletes_still_gets_the_lease_removed(s3, caplog):
    """An S3-compatible server that answers a DELETE with If-Match by 501 NotImplemented: the
    release was retried six times, then LEASE.json stayed (a job on another host then waited out
    the lease timeout at every start).  It is removed plainly, said once."""
    from tests.s3server import WithoutConditionalDeletes

    proxy = WithoutConditionalDeletes(s3)
    try:
        url = f"s3://{s3.new_bucket()}/run1"
        st = Storage(url, proxy.options)
        st.makedirs("")
        st.publish("L.json", b"mine")
        with caplog.at_level("WARNING"):
            assert st.remove_if("L.json", lambda data: data == b"mine", 64) is True
        assert not Storage(url, s3.options).exists("L.json")
        assert "this server cannot remove conditionally (If-Match on DELETE)" in caplog.text
        st.publish("L.json", b"theirs")
        assert st.remove_if("L.json", lambda data: data == b"mine", 64) is False  # not ours
        assert Storage(url, s3.options).read("L.json") == b"theirs"
    finally:
        proxy.stop()
