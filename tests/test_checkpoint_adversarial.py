"""Probes from an adversarial review of the checkpoint data-safety work.

Each test documents one probe.  A docstring that starts with "DEFECT" describes what the code did
when it was reviewed (the test failed then) and the behaviour now expected; the others are
regression tests for things that held.
"""

import json
import os
import threading
import time
import uuid

import pytest
import torch

from resilient import Checkpointer, Layout
from resilient.checkpoint import storage as storage_mod
from resilient.checkpoint.format import MANIFEST_NAME, parse_step_dir
from resilient.checkpoint.lease import LEASE_NAME, WriterLease, _machine, default_job_id
from resilient.checkpoint.reader import read_manifest, verify_step
from resilient.checkpoint.storage import Storage
from resilient.errors import (
    CheckpointCorruptError,
    LeaseError,
    ResilientError,
    StateMismatchError,
    StepRetiredError,
)


def state(v: float, n: int = 64) -> dict:
    return {"w": torch.arange(float(n)) * v, "v": {"s": v}}


def blank(n: int = 64) -> dict:
    return {"w": torch.zeros(n), "v": {"s": 0.0}}


def saved(root, steps=(1, 2), **kw):
    with Checkpointer(str(root), **kw) as ck:
        for s in steps:
            ck.save(s, state(s)).wait()
    return root


def edit_manifest(root, step, fn):
    p = root / f"step_{step:08d}" / MANIFEST_NAME
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


# --- hostile manifests ----------------------------------------------------------------------------


def test_manifest_validation_does_not_enumerate_every_piece_of_a_wide_axis(tmp_path):
    """DEFECT (format.py distinct_nonempty_chunks): FORMAT.md section 5 promises the chunk check is
    "bounded by the number of chunks listed" and never loops over ranks.  But each split builds
    the full list of pieces *before* comparing it with the limit
    (``split += [... for i in range(0, length, step)]``), so a tensor of shape [2**k] sharded over
    an axis of 2**k ranks (within the 2**24 cap) materialises 2**k tuples even though the manifest
    lists one chunk.  Measured: one such tensor at 2**24 costs 8 s and 1.8 GiB; a manifest can list
    thousands of them.  Expected: count the pieces arithmetically (ceil(length / step)) and stop
    before building them once the count passes the limit, so this fails in milliseconds."""
    saved(tmp_path, steps=(2,))
    n = 1 << 22

    def widen(m):
        m["layout"] = [["dp", n]]
        w = m["tensors"]["w"]
        for i in range(3):
            m["tensors"][f"w{i}"] = {
                **w,
                "shape": [n],
                "placement": {"dp": {"dim": 0, "parts": 1}},
            }

    edit_manifest(tmp_path, 2, widen)
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptError):
        read_manifest(Storage(str(tmp_path)), 2)
    took = time.monotonic() - t0
    assert took < 1.0, f"validating one listed chunk per tensor took {took:.1f}s"


def test_created_unix_s_past_the_float_range_is_a_corrupt_step_that_loads_fall_back_from(tmp_path):
    """DEFECT (format.py Manifest.from_json): ``float(created)`` on an integer with more than 308
    digits raises OverflowError, which escapes load(), verify_step(), convert() and the
    `reshape verify` / `reshape inspect` / `resilient verify` CLIs as a traceback.  Worse, load
    classifies it as "not a read failure" (code 2), so load(fallback=True) raises instead of
    falling back to the good step 1: one hostile byte string blocks auto-resume.  The field fuzz
    cannot find it (its integers stop at 2**70).  Expected: CheckpointCorruptError naming
    manifest.created_unix_s (e.g. require a finite float via math.isfinite after a guarded
    conversion); load falls back to step 1."""
    saved(tmp_path)
    edit_manifest(tmp_path, 2, lambda m: m.update(created_unix_s=10**400))
    with Checkpointer(str(tmp_path)) as ck:
        out = blank()
        assert ck.load(out, fallback=True) == 1  # step 2 is damaged: not a commit at all
        with pytest.raises(CheckpointCorruptError, match="created_unix_s must be a finite number"):
            ck.load(blank(), step=2)
    assert torch.equal(out["w"], state(1)["w"])
    try:
        report = verify_step(Storage(str(tmp_path)), 2)
        assert not report.ok
    except ResilientError:
        pass


def test_a_commit_seq_at_the_cap_never_lets_a_save_report_a_commit_readers_cannot_see(tmp_path):
    """DEFECT (checkpointer.py _coordinate / catalog.next_commit_seq): a step whose manifest has
    commit_seq 2**63-1 (valid under the caps: a copied-in or hostile step) makes every later save
    write commit_seq 2**63, which the reader's own cap rejects: the save returns committed=True,
    yet the step is "damaged", invisible to steps()/latest_step()/load(), and never retired.  A
    job keeps saving into the void and on restart resumes from the planted step.  Expected: the
    coordinator never publishes a manifest its reader would reject (check the manifest it is
    about to publish with manifest_summary / the caps, and raise a ResilientError naming the step
    whose commit_seq is at the cap), or the commit is visible as the latest step."""
    saved(tmp_path, steps=(5,))
    edit_manifest(tmp_path, 5, lambda m: m.update(commit_seq=2**63 - 1))
    with Checkpointer(str(tmp_path)) as ck:
        try:
            stats = ck.save(10, state(10)).wait()
        except ResilientError:
            return  # refusing to commit is fine
        assert stats.committed
        assert 10 in ck.steps(), f"step 10 reported committed but steps() is {ck.steps()}"
        assert ck.latest_step() == 10


def test_a_save_whose_values_nest_past_the_cap_is_refused_before_retention_drops_good_steps(
    tmp_path,
):
    """DEFECT (writer.build_manifest / checkpointer._coordinate): the writer validates its manifest
    with Manifest.validate(), but the reader also applies the caps of Manifest.from_json (JSON
    depth of extras, axes, created_unix_s) and of manifest_summary (commit_seq, step).  A state
    value nested deeper than 64 levels (a list of lists in a data-loader position, a tree) is
    saved and reported committed; the catalog counts it (it only reads the top level), so with
    keep_last=1 retention deletes step 1, and then load() fails with "manifest.extras nests
    deeper than 64 levels": every committed step is gone or unreadable.  Expected: the
    coordinator parses the exact bytes it is about to publish through the reader's path
    (manifest_from_bytes + manifest_summary) and refuses the commit with a CommitError naming the
    value; step 1 stays."""

    def nest(n):
        v = 0
        for _ in range(n):
            v = [v]
        return v

    with Checkpointer(str(tmp_path), keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(8), "v": {"tree": nest(3)}}).wait()
        try:
            ck.save(2, {"w": torch.ones(8) * 2, "v": {"tree": nest(70)}}).wait()
        except ResilientError:
            pass
        out = {"w": torch.zeros(8), "v": {"tree": None}}
        loaded = ck.load(out, fallback=True)
    assert loaded in (1, 2)
    assert out["w"][0] == loaded


def test_save_refuses_a_step_number_that_readers_cannot_see(tmp_path):
    """DEFECT (checkpointer.py save checks only step >= 0): save(2**63) writes
    step_9223372036854775808 and reports committed=True, but parse_step_dir refuses steps past
    2**63-1, so the step is invisible to steps()/load() and never retired.  Expected: save raises
    ValueError for a step above 2**63-1 (FORMAT.md section 5 caps every step)."""
    with Checkpointer(str(tmp_path)) as ck:
        try:
            stats = ck.save(2**63, state(1)).wait()
        except (ValueError, ResilientError):
            return
        assert stats.committed and ck.steps() == [2**63], ck.steps()


def test_a_non_ascii_step_directory_does_not_hide_a_committed_step(tmp_path):
    """DEFECT (format.py _STEP_RE / _FILE_RE use \\d, which matches any Unicode digit; catalog.scan
    keys steps by number, so the last directory listed wins): an empty directory named
    'step_' + '\\u0660' * 7 + '\\u0661' (Arabic-Indic digits) parses as step 1, sorts after
    'step_00000001' and replaces it in the catalog as an *uncommitted* step, so the committed step
    1 vanishes: steps() == [], load() raises CheckpointNotFoundError and auto-resume starts from
    scratch.  The rank-key regex already uses [0-9] for this reason.  Expected: [0-9] in both
    regexes, and a step directory accepted only under its canonical name (or duplicates of one
    step number reported as damaged, never shadowing a commit)."""
    saved(tmp_path, steps=(1,))
    (tmp_path / ("step_" + "\u0660" * 7 + "\u0661")).mkdir()
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.steps() == [1]
        assert ck.load(blank()) == 1
    assert parse_step_dir("step_" + "\u0660" * 7 + "\u0661") is None


def test_fifos_planted_as_step_directories_or_manifests_never_block_readers_or_writers(tmp_path):
    """Held: FIFOs named like a step directory or a MANIFEST.json are damaged steps (listed
    without blocking, never deleted), a save onto such a step number is refused with a
    StorageError, and other saves go on."""
    saved(tmp_path, steps=(1,))
    os.mkfifo(tmp_path / "step_00000009")
    (tmp_path / "step_00000003").mkdir()
    os.mkfifo(tmp_path / "step_00000003" / MANIFEST_NAME)
    box = {}

    def work():
        with Checkpointer(str(tmp_path)) as ck:
            box["steps"] = ck.steps()
            box["damaged"] = [i.step for i in ck.catalog().damaged()]
            try:
                ck.save(9, state(9)).wait()
            except ResilientError as e:
                box["save9"] = type(e).__name__
            ck.save(4, state(4)).wait()
            box["after"] = ck.steps()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "blocked on a FIFO"
    assert box == {"steps": [1], "damaged": [3, 9], "save9": "StorageError", "after": [1, 4]}
    assert (tmp_path / "step_00000009").exists() and (tmp_path / "step_00000003").exists()


# --- the writer lease -----------------------------------------------------------------------------


def test_a_taker_with_a_shorter_lease_timeout_never_takes_a_live_lease(tmp_path):
    """DEFECT (lease.py WriterLease.acquire): the taker waits for *its own* timeout_s, not the
    owner's.  The owner records its timeout_s in LEASE.json and renews only every timeout_s / 4,
    so a second job (or `reshape convert` into the URL, which always uses 60 s) with a shorter
    lease_timeout_s sees no heartbeat within its own timeout and takes over a *live* lease.
    End to end: Checkpointer(url, job_id="A", lease_timeout_s=600) saving, then
    Checkpointer(url, job_id="B", lease_timeout_s=0.5).save() takes A's lease after 0.5 s and
    commits; B's retention then counts and deletes A's steps and A dies at its next commit.
    Here B watches on a fake clock (50 s per poll) so the test stays fast after the fix.
    Expected: watch for max(own timeout, the record's timeout_s) (plus a margin) before taking
    over another job's lease, or refuse with a LeaseError naming A."""
    a = WriterLease(Storage(str(tmp_path)), "job-A", timeout_s=600)  # renews every 150 s
    a.acquire()
    fake = [0.0]

    def sleep(_s):
        fake[0] += 50.0

    b = WriterLease(
        Storage(str(tmp_path)), "job-B", timeout_s=0.5, clock=lambda: fake[0], sleep=sleep
    )
    try:
        try:
            b.acquire()
            taken_after = fake[0]
        except LeaseError:
            taken_after = None
        assert taken_after is None or taken_after >= 600, (
            f"job B took the live lease of job A (timeout 600 s) after watching {taken_after:.0f} s"
        )
    finally:
        b.release()
        a.release()


def test_default_job_ids_of_single_node_jobs_on_two_hosts_differ(monkeypatch):
    """DEFECT (lease.py default_job_id): two single-node jobs on two hosts (or two Kubernetes pods,
    each with its own loopback) launched as `torchrun --master-port 29500 ...` use static
    rendezvous: rdzv id 'none', MASTER_ADDR 127.0.0.1.  Both get the job id
    'torchrun:none@127.0.0.1:29500', so when both write one S3 URL the second takes the first's
    *live* lease at once as "the same job, restarted" (no LeaseError), and its retention then
    deletes the other job's commits.  The same holds for 'pg@localhost:PORT' (mp.spawn jobs).
    Expected: a loopback (or otherwise host-local) store address is qualified with the host
    (hostname + boot id), or such ids are not trusted for an immediate takeover."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr("socket.gethostname", lambda: "node-a")
    on_a = default_job_id()
    monkeypatch.setattr("socket.gethostname", lambda: "node-b")
    on_b = default_job_id()
    assert on_a != on_b, f"two jobs on two hosts share the job id {on_a!r}"


def test_two_first_acquisitions_on_an_object_store_never_both_hold():
    """DEFECT (lease.py WriterLease.acquire on a store without exclusive create): the race between
    two first takers is settled by sleeping settle_s (<= 1 s) and re-reading.  If B's PUT lands
    after A's re-read (B's PUT delayed or retried for longer than settle_s, routine on S3), both
    acquire() calls succeed and both jobs believe they hold the lease.  The loser only learns at
    its commit's check(), after all its ranks wrote a full checkpoint, contradicting the README
    ("gets a LeaseError ... before it writes or deletes anything").  Reproduced here with the
    interleaving made explicit (no timing).  Expected: a conditional create (S3 If-None-Match,
    GCS ifGenerationMatch=0, a lock on memory://) or a second verification after the step's
    begin, so that at most one holds."""
    url = f"memory://lease-race-{uuid.uuid4().hex[:8]}"
    sa, sb = Storage(url), Storage(url)
    no_sleep = lambda s: None  # noqa: E731
    a = WriterLease(sa, "job-A", timeout_s=30, sleep=no_sleep)
    b = WriterLease(sb, "job-B", timeout_s=30, sleep=no_sleep)
    real_create = sb.create_exclusive
    fired = []

    def late_create(rel, data):  # B read "no lease" before A's acquire; its PUT lands after
        if rel == LEASE_NAME and not fired:
            fired.append(1)
            a.acquire()
        return real_create(rel, data)

    sb.create_exclusive = late_create
    outcomes = []
    try:
        for lease in (b,):
            try:
                lease.acquire()
                outcomes.append("B")
            except LeaseError:
                pass
        if a.held:
            outcomes.append("A")
        assert len(outcomes) <= 1, f"both jobs hold the writer lease of {url}: {outcomes}"
    finally:
        a.release()
        b.release()


@pytest.mark.parametrize(
    "field,value",
    [("acquired_unix_s", "yesterday"), ("acquired_unix_s", 1e300), ("pid", 2**70)],
)
def test_a_malformed_lease_record_is_a_lease_error_or_taken_over(tmp_path, field, value):
    """DEFECT (lease.py LeaseRecord.from_bytes checks the types of only some fields):
    acquired_unix_s is never checked, and describe() feeds it to time.localtime (TypeError,
    OverflowError); a pid past the C int range (with this machine's id) reaches os.kill in
    _gone() (OverflowError).  acquire() then raises that raw exception: save() turns it into a
    CommitError "save failed: TypeError ...", and `reshape convert` into such a URL dies with a
    traceback.  Expected: such a record is treated like an unparseable lease (watched, then taken
    over), or a LeaseError naming the file."""
    record = {
        "format": "resilient-lease-v1",
        "job_id": "job-other",
        "token": "feedfeedfeedfeed",
        "host": "h",
        "machine": _machine(),
        "pid": 2**22 + 12345,
        "pid_start": "1",
        "acquired_unix_s": 0.0,
        "heartbeat_unix_s": 0.0,
        "beat": 1,
        "timeout_s": 0.2,
        field: value,
    }
    (tmp_path / LEASE_NAME).write_text(json.dumps(record))
    lease = WriterLease(Storage(str(tmp_path)), "job-me", timeout_s=0.2)
    try:
        lease.acquire()
    except ResilientError:
        pass
    finally:
        lease.release()


def test_a_lease_file_hard_linked_to_an_outside_file_is_replaced_never_written_through(tmp_path):
    """Held: a LEASE.json planted as a hard link to a file outside the root is taken over (after
    the timeout, as an unreadable owner) by rename, and the outside file is never written."""
    outside = tmp_path / "precious.txt"
    outside.write_text("do not touch")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(outside, root / LEASE_NAME)
    with Checkpointer(str(root), job_id="job-me", lease_timeout_s=0.3) as ck:
        ck.save(1, state(1)).wait()
        assert json.loads((root / LEASE_NAME).read_text())["job_id"] == "job-me"
    assert outside.read_text() == "do not touch"
    assert not (root / LEASE_NAME).exists()


# --- readers racing retention ----------------------------------------------------------------


def test_a_step_retired_between_the_pick_and_the_read_says_so(tmp_path, monkeypatch):
    """DEFECT (reader.py watching_retirement / checkpointer.py _read_step): load() picks the newest
    step from a catalog scan, then starts reading it.  If the writer's retention retires that step
    in between (an eval job loading a live run with keep_last=1: the common case, since every
    commit retires the previous step), watching_retirement's "before" stat is already None, so
    the failure is not recognised and load raises StorageError "storage read of
    .../MANIFEST.json failed ...: FileNotFoundError ... the path does not exist" instead of
    StepRetiredError ("not corruption: read again").  Same gap in verify(step=None) and in
    reshape convert (resolve_step, then watching_retirement).  Expected: a step the catalog listed
    as committed whose manifest is gone when the read starts is StepRetiredError (or the load
    re-resolves to the newest step)."""
    writer = Checkpointer(str(tmp_path), job_id="writer", keep_last=1)
    writer.save(1, state(1)).wait()
    reader = Checkpointer(str(tmp_path))
    rel = f"step_00000001/{MANIFEST_NAME}"
    calls = []
    real = Storage.stat_key

    def stat_key(self, r):
        if self is reader.storage and r == rel:
            calls.append(r)
            if len(calls) == 2:  # the read is about to start: the writer retires step 1 now
                writer.save(2, state(2)).wait()
                writer.wait()
        return real(self, r)

    monkeypatch.setattr(Storage, "stat_key", stat_key)
    try:
        out = blank()
        try:
            assert reader.load(out) == 2  # re-resolving to the newest step is fine too
            assert torch.equal(out["w"], state(2)["w"])
        except StepRetiredError as e:
            assert "step 1 of" in str(e)
    finally:
        monkeypatch.undo()
        writer.close()
        reader.close()


def test_a_commit_after_the_lease_changed_hands_never_collects_the_new_owners_save(
    tmp_path, monkeypatch
):
    """DEFECT (checkpointer.py _coordinate -> retention.retire_steps): the lease is checked once,
    before the manifest is published; retention and garbage collection run after it without
    looking again, and collect *every* uncommitted step directory.  If the lease changes hands
    in between (A's PUT retried through a storage outage that also stopped its renewals, a
    process pause), A's retention deletes B's step in progress.  On an object store B's
    coordinator then publishes a manifest naming files that no longer exist: a committed-but-
    broken step that B's retention counts (pushing good steps out).  Expected: re-check the lease
    after publishing and skip retention/GC when it is no longer ours (ideally also raise
    LeaseError), and never collect an uncommitted directory first seen less than
    lease_timeout_s ago (mark, then sweep at a later commit)."""
    a = Checkpointer(str(tmp_path), job_id="job-A")
    a.save(1, state(1)).wait()
    real = Storage.publish
    fired = []

    def publish(self, rel, data):
        if rel == f"step_00000002/{MANIFEST_NAME}" and not fired:
            fired.append(1)
            # job B takes the lease over (A looked stale) and starts writing step 3
            lease = tmp_path / LEASE_NAME
            rec = json.loads(lease.read_text())
            rec.update(job_id="job-B", token="b" * 16)
            lease.write_text(json.dumps(rec))
            (tmp_path / "step_00000003").mkdir()
            (tmp_path / "step_00000003" / "rank_00000.safetensors").write_bytes(b"B's bytes")
        return real(self, rel, data)

    monkeypatch.setattr(Storage, "publish", publish)
    try:
        a.save(2, state(2)).wait()
    except LeaseError:
        pass
    finally:
        monkeypatch.undo()
        try:
            a.close()
        except ResilientError:
            pass
    assert (tmp_path / "step_00000003" / "rank_00000.safetensors").exists(), (
        "job A, no longer the lease holder, deleted job B's step in progress"
    )


# --- all-or-nothing loads -------------------------------------------------------------------------


def test_a_failed_load_does_not_leave_the_optimizer_with_lr_zero(tmp_path):
    """DEFECT (state.py init_optimizer_state): to load into a lazily initialised optimizer the
    loader sets every group's lr to 0, sets zero gradients and calls opt.step(); when step()
    raises (SparseAdam refuses dense gradients; LBFGS needs a closure; a user optimizer with a
    check), nothing restores them: the load raises a raw RuntimeError and leaves lr == 0.0 and
    .grad set on every parameter, so a caller who catches the error and trains on does so at
    learning rate 0.  Expected: restore lr and grads in a finally (and surface the failure as a
    ResilientError, e.g. StateMismatchError naming the optimizer); the state is as before."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    opt.zero_grad()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"e": emb, "o": opt}).wait()
    emb2 = torch.nn.Embedding(10, 4, sparse=True)
    opt2 = torch.optim.SparseAdam(emb2.parameters(), lr=0.1)
    with Checkpointer(str(tmp_path)) as ck:
        try:
            ck.load({"e": emb2, "o": opt2})
        except Exception:
            pass
    assert opt2.param_groups[0]["lr"] == 0.1
    assert emb2.weight.grad is None


def test_loading_into_an_optimizer_whose_params_have_gradients_does_not_drop_its_state(tmp_path):
    """DEFECT (state.py init_optimizer_state returns early when any parameter has a .grad): the
    Adam moments in the checkpoint are then silently not loaded (load returns success, the
    optimizer state stays empty) if the caller ran a forward/backward before loading (warm-up,
    torch.compile tracing, a dry-run step).  Committed data is dropped without a word.
    Expected: create the state regardless (saving and restoring the existing grads), or raise
    StateMismatchError saying the checkpoint holds optimizer state the given optimizer lacks."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"model": m, "opt": opt}).wait()
    ref = opt.state[m.weight]["exp_avg"].clone()
    m2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    m2(torch.randn(2, 4)).sum().backward()  # gradients exist when the load happens
    with Checkpointer(str(tmp_path)) as ck:
        try:
            ck.load({"model": m2, "opt": opt2})
        except StateMismatchError:
            return  # refusing is fine
    assert m2.weight in opt2.state, "the checkpoint's optimizer state was silently not loaded"
    assert torch.equal(opt2.state[m2.weight]["exp_avg"], ref)


def _mixed_load(rank, world, url, new_manifest, flag):
    """Rank 0 reads step 1, then the step is re-saved (its manifest atomically replaced, as a
    re-save's commit does); rank 1 starts reading only after that."""
    from resilient import Shard, sharded
    from resilient.checkpoint import checkpointer as ckmod

    real = ckmod.Checkpointer._read_step

    def read_step(self, st, step, layout, *version):
        if rank == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag):  # waits for an event in another process
                assert time.monotonic() < deadline, "rank 0 never finished reading"
                time.sleep(0.01)
        out = real(self, st, step, layout, *version)
        if rank == 0:
            tmp = os.path.join(url, "step_00000001", "MANIFEST.json.tmp-review")
            with open(tmp, "wb") as f:
                f.write(new_manifest)
            os.replace(tmp, os.path.join(url, "step_00000001", MANIFEST_NAME))
            open(flag, "w").close()
        return out

    ckmod.Checkpointer._read_step = read_step
    lay = Layout(tp=2)
    st = {"w": sharded(torch.full((2048,), -1.0), {"tp": Shard(0)}, global_shape=(4096,))}
    with Checkpointer(url, layout=lay) as ck:
        try:
            step = ck.load(st)
        except ResilientError as e:
            return ("error", type(e).__name__)
    return ("ok", step, float(st["w"][0]))


@pytest.mark.distributed
def test_every_rank_loads_the_same_commit_of_a_step_that_is_re_saved_meanwhile(tmp_path):
    """DEFECT (checkpointer.py load/_candidates: ranks agree on the step *number* only): each rank
    reads MANIFEST.json itself.  When the step is re-saved while the ranks read (a writer's final
    or preemption save at the step of its last periodic save, a post-rollback save over an
    abandoned number, `reshape convert --overwrite`), rank 0 can read the old commit and rank 1
    the new one; both succeed, every rank applies, and load() returns success with the ranks
    holding different checkpoints (here rank 0 gets 1.0, rank 1 gets 2.0): silent corruption of
    a distributed state, the opposite of "every rank loads the step rank 0 picks".  Expected:
    rank 0 broadcasts the identity of the manifest it picked (commit_seq, generation, a digest of
    its bytes) with the candidates, and a rank whose manifest differs fails that candidate with
    StepRetiredError, so every rank falls back or retries together."""
    from tests.dist import run_distributed

    url, other = tmp_path / "a", tmp_path / "b"
    with Checkpointer(str(url), layout=Layout(dp=1)) as ck:
        ck.save(1, {"w": torch.full((4096,), 1.0)}).wait()
    with Checkpointer(str(other), layout=Layout(dp=1)) as ck:  # the re-save's files and manifest
        ck.save(1, {"w": torch.full((4096,), 0.0)}).wait()
        ck.save(1, {"w": torch.full((4096,), 2.0)}).wait()
    resaved = other / "step_00000001" / "rank_00000.g1.safetensors"
    (url / "step_00000001" / resaved.name).write_bytes(resaved.read_bytes())
    new_manifest = (other / "step_00000001" / MANIFEST_NAME).read_bytes()
    (url / LEASE_NAME).unlink(missing_ok=True)
    out = run_distributed(
        _mixed_load, 2, str(url), new_manifest, str(tmp_path / "flag"), timeout_s=120
    )
    if out[0][0] == "ok" and out[1][0] == "ok":
        assert out[0][2] == out[1][2], f"ranks loaded different commits of step 1: {out}"


# --- convert onto its own source ------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", ["simplecache", "filecache"])
def test_convert_refuses_its_own_source_read_through_a_caching_wrapper(tmp_path, wrapper):
    """DEFECT (storage.py Storage.location): location() unwraps dir:: but not fsspec's caching
    wrappers, so `reshape convert simplecache::/ckpt /ckpt --overwrite` is not recognised as
    converting onto its own source: it rewrites the step in place and deletes the source's rank
    files (the step now holds the target layout's files).  Expected: location() resolves
    through CachingFileSystem-style wrappers (their .fs / target protocol) like it does for
    dir::, and convert raises DestinationExistsError "is the source"."""
    from reshape.execute import DestinationExistsError, convert

    src = tmp_path / "ckpt"
    with Checkpointer(str(src), layout=Layout(dp=1)) as ck:
        ck.save(7, state(7)).wait()
    before = sorted(os.listdir(src / "step_00000007"))
    with pytest.raises(DestinationExistsError, match="is the source"):
        convert(f"{wrapper}::{src}", str(src), {"dp": 1}, overwrite=True)
    assert sorted(os.listdir(src / "step_00000007")) == before


@pytest.mark.parametrize("spelling", ["local", "dirfs-option", "double-slash"])
def test_convert_refuses_its_own_source_under_more_spellings(tmp_path, spelling):
    """Held: local://, dir::file:/// with a path option, and doubled slashes resolve to the
    source.  (Note: fsspec itself resolves "dir::file://" + path=P to P/<cwd> and "dir::P" to
    P/P; Storage follows fsspec there.)"""
    from reshape.execute import DestinationExistsError, convert

    src = tmp_path / "ckpt"
    with Checkpointer(str(src)) as ck:
        ck.save(7, state(7)).wait()
    dst, opts = {
        "local": (f"local://{src}", None),
        "dirfs-option": ("dir::file:///", {"path": str(src)}),
        "double-slash": (f"{tmp_path}//ckpt//", None),
    }[spelling]
    with pytest.raises(DestinationExistsError, match="is the source"):
        convert(str(src), dst, {"dp": 1}, overwrite=True, dst_options=opts)
    with Checkpointer(str(src)) as ck:
        assert ck.load(blank()) == 7 and ck.verify(7).ok


# --- durability -----------------------------------------------------------------------------------


def test_the_root_directory_is_fsynced_after_a_step_directory_is_created(tmp_path):
    """DEFECT (checkpointer.py _begin / storage.py makedirs): a new step directory is created with
    mkdir in the root, but the root directory is never fsynced afterwards (only LEASE.json's
    creation fsyncs it, once).  The manifest and its step directory are fsynced, so the commit
    looks durable, yet after a power loss the step directory's entry in the root may be gone
    (POSIX requires fsync of the parent after mkdir), while retention's removals of the older
    steps may have reached the disk.  FORMAT.md promises "directory fsync".  Expected: fsync the
    parent after creating the step directory (makedirs(create=True) fsyncs each parent it
    changed), before the manifest is published."""
    root_ino = os.stat(tmp_path).st_ino
    events = []

    class Recording(storage_mod.LocalOps):
        def mkdir(self, name, *, dir_fd):
            events.append(("mkdir", os.fstat(dir_fd).st_ino, name))
            super().mkdir(name, dir_fd=dir_fd)

        def fsync(self, fd):
            events.append(("fsync", os.fstat(fd).st_ino, ""))
            super().fsync(fd)

        def rename(self, src, dst, *, dir_fd):
            events.append(("rename", os.fstat(dir_fd).st_ino, dst))
            super().rename(src, dst, dir_fd=dir_fd)

    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state(1)).wait()
        previous = storage_mod.set_local_ops(Recording())
        try:
            ck.save(2, state(2)).wait()
        finally:
            storage_mod.set_local_ops(previous)
    made = next(i for i, e in enumerate(events) if e[0] == "mkdir" and e[1] == root_ino)
    published = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == MANIFEST_NAME)
    assert any(e == ("fsync", root_ino, "") for e in events[made:published]), (
        "the root directory was not fsynced between creating step_00000002 and its commit"
    )


# --- load agreement (single process: the code path every rank runs) ----------------------------


def test_a_newest_step_whose_rank_file_is_a_fifo_is_fallen_back_from_without_blocking(tmp_path):
    """Held: a rank file replaced by a FIFO is refused without blocking and load falls back."""
    saved(tmp_path)
    f = tmp_path / "step_00000002" / "rank_00000.safetensors"
    f.unlink()
    os.mkfifo(f)
    box = {}

    def work():
        with Checkpointer(str(tmp_path)) as ck:
            with pytest.warns(UserWarning, match="falling back to step 1"):
                box["step"] = ck.load(blank(), fallback=True)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "load blocked on a FIFO"
    assert box.get("step") == 1


def test_a_manifests_summary_line_round_trips_and_is_checked():
    """The summary rank 0 sends ahead of a manifest to the other nodes' leaders: one line, the
    same summary back, and the top-level checks of ``manifest_summary`` on it."""
    from types import SimpleNamespace

    from resilient.checkpoint.format import ManifestSummary, summary_from_line, summary_line

    files = {"rank_00001.safetensors": None, "rank_00000.safetensors": None}
    m = SimpleNamespace(
        step=7,
        commit_seq=41,
        generation=2,
        job_id="job-x",
        files=files,
        extras={"_resilient_memory_run": 3},
    )
    line = summary_line(m)
    assert b"\n" not in line
    assert summary_from_line(line, "where", 7) == ManifestSummary(
        step=7, commit_seq=41, generation=2, job_id="job-x", files=frozenset(files), run=3
    )
    # the memory tier's run: anything but a run number counts as none (never an error)
    for run in (b"0", b"-1", b"true", b'"3"', b"3.0", b"536870912", b"1e400", b"[3]", b"null"):
        odd = line.replace(b'"run":3', b'"run":' + run)
        assert summary_from_line(odd, "where", 7).run == 0, run
    with pytest.raises(CheckpointCorruptError, match="says step 7, not 8"):
        summary_from_line(line, "where", 8)
    for bad in (
        b"[]",
        b'{"step":7,"commit_seq":1,"generation":0,"job_id":"j","files":["../x"]}',
        b'{"step":7,"commit_seq":-1,"generation":0,"job_id":"j","files":[]}',
        b'{"step":7,"commit_seq":1,"generation":0,"job_id":"j","files":"rank_00000.safetensors"}',
        b"\xff",
    ):
        with pytest.raises(CheckpointCorruptError):
            summary_from_line(bad, "where", 7)


def _job_id_in_a_group(rank: int, world: int) -> str:
    os.environ.pop("WORLD_SIZE", None)  # (init_process_group(rank=, world_size=) sets none)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    return default_job_id()


def test_every_rank_of_a_group_initialized_without_world_size_gets_one_job_id():
    """A job that calls init_process_group(rank=..., world_size=...) with only MASTER_ADDR and
    MASTER_PORT in its environment: every rank's default job id is the group's, not a fresh one
    per process (a sealed snapshot's staged records must agree on it to be sealed)."""
    from tests.dist import run_distributed

    ids = run_distributed(_job_id_in_a_group, 2)
    assert ids[0] == ids[1] and ids[0].startswith("pg@"), ids
