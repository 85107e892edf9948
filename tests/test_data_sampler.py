"""``ResumableSampler``: one global order at any dp size, resumed across shrink and grow with every
sample exactly once, through a real ``DataLoader`` (prefetching) and a real ``Run`` checkpoint."""

from __future__ import annotations

import collections
import itertools
import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from resilient import Run
from resilient.data import ResumableSampler, epoch_order
from resilient.errors import StateMismatchError
from tests.dist import run_distributed

# --- the order ----------------------------------------------------------------------------------


def test_epoch_order_is_pinned():
    # resuming after an upgrade needs the same order: a change here breaks running jobs
    assert epoch_order(10, seed=0, epoch=0) == [2, 6, 1, 8, 5, 3, 0, 4, 9, 7]
    assert epoch_order(10, seed=0, epoch=1) == [4, 0, 5, 1, 7, 6, 3, 2, 8, 9]
    assert epoch_order(10, seed=1, epoch=0) == [0, 9, 8, 7, 6, 5, 1, 4, 2, 3]
    assert epoch_order(5, seed=0, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]


def test_epoch_order_is_a_permutation_that_varies_with_seed_and_epoch():
    for n in range(1, 130):
        assert sorted(epoch_order(n, seed=7, epoch=3)) == list(range(n))
    a = epoch_order(1000, seed=0, epoch=0)
    assert a == epoch_order(1000, seed=0, epoch=0)
    assert a != epoch_order(1000, seed=0, epoch=1) and a != epoch_order(1000, seed=1, epoch=0)
    assert abs(np.corrcoef(a, np.arange(1000))[0, 1]) < 0.1  # shuffled, not a shifted range


def test_epoch_order_is_uniform_on_a_small_dataset():
    counts = np.zeros((5, 5))
    for seed in range(2000):
        for position, index in enumerate(epoch_order(5, seed=seed, epoch=0)):
            counts[position, index] += 1
    assert np.abs(counts / 2000 - 0.2).max() < 0.04


def _global_sequence(num_samples, world_size, batch_size, num_steps, drop_last, seed=3):
    """The samples a job of ``world_size`` ranks consumes in ``num_steps`` steps, rank by rank."""
    samplers = [
        ResumableSampler(
            num_samples,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            rank=r,
            world_size=world_size,
        )
        for r in range(world_size)
    ]
    loaders = [_RankLoader(s, prefetch=0) for s in samplers]
    out = []
    for _ in range(num_steps):
        for loader in loaders:
            out += loader.next()
        for s in samplers:
            s.advance()
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_global_sequence_is_the_same_at_world_sizes_1_to_4(drop_last):
    # global batches of 12 = 1 x 12 = 2 x 6 = 3 x 4 = 4 x 3; drop_last: two whole epochs of 24;
    # carry: 36 samples, one epoch of 23 and 13 of the next
    n, num_steps = (24, 4) if drop_last else (23, 3)
    seq = {w: _global_sequence(n, w, 12 // w, num_steps, drop_last) for w in (1, 2, 3, 4)}
    assert seq[1] == seq[2] == seq[3] == seq[4]
    stream = epoch_order(n, seed=3, epoch=0) + epoch_order(n, seed=3, epoch=1)
    assert seq[1] == stream[: num_steps * 12]


def test_drop_last_skips_the_tail_and_carry_runs_into_the_next_epoch():
    e0, e1 = (epoch_order(10, seed=3, epoch=e) for e in (0, 1))
    assert _global_sequence(10, 2, 2, 3, drop_last=True) == e0[:8] + e1[:4]
    assert _global_sequence(10, 2, 2, 3, drop_last=False) == e0 + e1[:2]
    s = ResumableSampler(10, batch_size=2, drop_last=False, rank=0, world_size=2)
    s.advance(3)
    assert (s.epoch, s.position, len(s)) == (1, 2, 4)  # the epoch-1 pass starts after its 2
    s = ResumableSampler(10, batch_size=2, drop_last=True, rank=0, world_size=2)
    assert len(s) == 4
    s.advance(2)
    assert (s.epoch, s.position) == (1, 0)
    s.advance(5)  # 2 batches per epoch: 2 epochs and one batch on
    assert (s.epoch, s.position) == (3, 4)


# --- resuming at other world sizes: the property ------------------------------------------------


class _RankLoader:
    """What a DataLoader does with one rank's sampler, by hand: passes chained one after another,
    batches of ``batch_size``, ``prefetch`` batches drawn from the sampler ahead of the loop."""

    def __init__(self, sampler, prefetch):
        self.sampler, self.prefetch = sampler, prefetch
        self.indices = None  # the current pass
        self.ready = collections.deque()

    def next(self):
        if self.indices is None and not self.ready:
            self.indices = iter(self.sampler)  # a new pass, once the last one is delivered
        while self.indices is not None and len(self.ready) <= self.prefetch:
            batch = list(itertools.islice(self.indices, self.sampler.batch_size))
            if not batch:
                self.indices = None  # this pass is exhausted (its batches may still wait)
                break
            assert len(batch) == self.sampler.batch_size
            self.ready.append(batch)
        if not self.ready:
            return self.next()
        return self.ready.popleft()


def _run_segments(num_samples, seed, drop_last, segments):
    """Run ``segments`` of (world_size, batch_size, num_steps, prefetch) one after another, each
    resumed from the JSON state the last one saved at its final step boundary; returns, for each
    step, the recorded (epoch, position) before it, its global batch (rank by rank) and the
    largest global batch size the samplers had since the step before (with drop_last, a tail
    shorter than that may have been skipped)."""
    state, batches, largest = None, [], 0
    for world_size, batch_size, num_steps, prefetch in segments:
        largest = max(largest, world_size * batch_size)
        samplers = [
            ResumableSampler(
                num_samples,
                batch_size=batch_size,
                seed=seed,
                drop_last=drop_last,
                rank=r,
                world_size=world_size,
            )
            for r in range(world_size)
        ]
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        loaders = [_RankLoader(s, prefetch) for s in samplers]
        for _ in range(num_steps):
            start = (samplers[0].epoch, samplers[0].position)
            batch = [i for loader in loaders for i in loader.next()]
            for s in samplers:
                s.advance()
            batches.append((start, batch, largest))
            largest = world_size * batch_size
        states = [s.state_dict() for s in samplers]
        assert all(x == states[0] for x in states), states  # what every rank saves is the same
        state = json.loads(json.dumps(states[0]))
    return batches


segments_st = st.lists(
    st.tuples(
        st.integers(1, 4),  # world size
        st.integers(1, 4),  # batch size per rank
        st.integers(0, 12),  # steps until the save and the restart
        st.integers(0, 3),  # batches the loader prefetched (not consumed) when it stopped
    ),
    min_size=2,
    max_size=5,
)


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 40),
    seed=st.integers(0, 2**40),
    drop_last=st.booleans(),
    segments=segments_st,
)
@example(
    num_samples=23, seed=0, drop_last=False, segments=[(2, 2, 3, 2), (1, 3, 2, 0), (3, 2, 9, 1)]
)
@example(
    num_samples=16, seed=5, drop_last=True, segments=[(4, 2, 1, 3), (1, 2, 3, 0), (3, 1, 9, 2)]
)
@example(  # a segment that takes no step still ends the epoch its global batch no longer fits
    num_samples=2, seed=0, drop_last=True, segments=[(1, 1, 1, 0), (1, 2, 0, 0), (1, 1, 1, 0)]
)
def test_every_sample_once_across_shrink_and_grow(num_samples, seed, drop_last, segments):
    if drop_last:  # an epoch must hold a global batch; the constructor refuses otherwise
        num_samples = max(num_samples, max(w * b for w, b, _, _ in segments))
    batches = _run_segments(num_samples, seed, drop_last, segments)
    orders = {}

    def order(e):
        if e not in orders:
            orders[e] = epoch_order(num_samples, seed=seed, epoch=e)
        return orders[e]

    # 1. each global batch is the next run of the stream of epoch orders laid end to end; with
    # drop_last an epoch's tail is skipped only when it is shorter than a global batch
    expected, seen = 0, collections.Counter()
    for k, ((epoch, position), batch, largest) in enumerate(batches):
        cursor = epoch * num_samples + position
        if cursor != expected:
            assert drop_last, f"step {k}: skipped from {divmod(expected, num_samples)}"
            e, p = divmod(expected, num_samples)
            assert p > 0 and cursor == (e + 1) * num_samples, f"step {k}: jumped to {epoch}"
            assert num_samples - p < largest, f"step {k}: dropped a tail of {num_samples - p}"
        stream = range(cursor, cursor + len(batch))
        assert batch == [order(t // num_samples)[t % num_samples] for t in stream]
        seen.update((t // num_samples, order(t // num_samples)[t % num_samples]) for t in stream)
        expected = cursor + len(batch)
    # 2. exactly once: nothing twice in an epoch, and a finished epoch is whole (or lost less
    # than a global batch at its end, with drop_last)
    assert max(seen.values(), default=1) == 1
    last_epoch = (expected - 1) // num_samples if batches else 0
    for e in range(last_epoch):
        got = sum(1 for (ep, _) in seen if ep == e)
        if drop_last:
            assert num_samples - got < max(w * b for w, b, _, _ in segments)
        else:
            assert got == num_samples
    # 3. the same samples, in the same order, as one rank taking each whole global batch
    alone = _run_segments(
        num_samples, seed, drop_last, [(1, w * b, n, 0) for w, b, n, _ in segments]
    )
    assert [b for _, b, _ in alone] == [b for _, b, _ in batches]


# --- a real DataLoader, with worker processes prefetching ----------------------------------------


class _Ids(Dataset):
    """Sample i is the number i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _forever(loader):
    while True:
        yield from loader


def test_a_prefetching_dataloader_resumes_at_another_world_size():
    n, ds = 26, _Ids(26)
    samplers = [
        ResumableSampler(ds, batch_size=2, seed=11, drop_last=False, rank=r, world_size=2)
        for r in range(2)
    ]
    loaders = [
        DataLoader(ds, sampler=s, batch_size=s.batch_size, num_workers=1, prefetch_factor=4)
        for s in samplers
    ]
    assert len(loaders[0]) == 7  # ceil(26 / 4) global batches: the last runs into epoch 1
    its = [_forever(loader) for loader in loaders]
    consumed = []
    for _ in range(3):
        for it in its:
            consumed += next(it).tolist()
        for s in samplers:
            s.advance()
    state = json.loads(json.dumps(samplers[0].state_dict()))  # the workers hold more, unused
    assert state == samplers[1].state_dict()
    assert (state["epoch"], state["position"]) == (0, 12)
    del its, loaders
    resumed = [
        ResumableSampler(ds, batch_size=3, seed=11, drop_last=False, rank=r, world_size=3)
        for r in range(3)
    ]
    for s in resumed:
        s.load_state_dict(state)
    its = [_forever(DataLoader(ds, sampler=s, batch_size=s.batch_size)) for s in resumed]
    for _ in range(3):  # 12 + 3 * 9 = 39 = one epoch and 13 of the next
        for it in its:
            consumed += next(it).tolist()
        for s in resumed:
            s.advance()
    assert sorted(consumed[:n]) == list(range(n))
    order = epoch_order(n, seed=11, epoch=0) + epoch_order(n, seed=11, epoch=1)
    assert consumed == order[:39]
    assert (resumed[0].epoch, resumed[0].position) == (1, 13)


def test_an_iterator_from_before_the_restore_refuses_to_go_on():
    s = ResumableSampler(20, batch_size=2, rank=0, world_size=1)
    it = iter(s)
    assert [next(it), next(it)] == epoch_order(20, seed=0, epoch=0)[:2]
    s.load_state_dict({**s.state_dict(), "position": 6})
    with pytest.raises(StateMismatchError, match=r"created before load_state_dict\(\) moved"):
        list(it)
    assert list(s)[:2] == epoch_order(20, seed=0, epoch=0)[6:8]


def test_a_new_pass_before_advance_recorded_the_last_one_warns():
    s = ResumableSampler(8, batch_size=2, rank=0, world_size=1)
    first = list(s)  # taken but not recorded
    with pytest.warns(
        UserWarning, match="advance\\(\\) has not recorded; they are handed out again"
    ):
        again = list(s)
    assert again == first
    s.advance(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(s) == epoch_order(8, seed=0, epoch=1)


# --- mistakes are named -------------------------------------------------------------------------


def _state(**changes):
    return {**ResumableSampler(10, batch_size=2, seed=4).state_dict(), **changes}


@pytest.mark.parametrize(
    "state, message",
    [
        (_state(num_samples=12), "a dataset of 12 samples, this sampler's dataset has 10"),
        (_state(seed=5), "the saved order has seed 5, this sampler has seed 4"),
        (_state(shuffle=False), "the saved order has shuffle=False, this sampler has shuffle=True"),
        (_state(position="3"), "the saved 'position' is '3' \\(str\\), expected an int"),
        (_state(epoch=1.0), "the saved 'epoch' is 1.0 \\(float\\), expected an int"),
        (_state(shuffle=1), "the saved 'shuffle' is 1, expected a bool"),
        (_state(position=True), "the saved 'position' is True \\(bool\\)"),
        (_state(position=10), "expected epoch >= 0 and 0 <= position < 10"),
        (_state(epoch=-1), "the saved epoch -1 and position 0 are out of range"),
        (
            _state(epoch=2**64),
            f"the saved epoch {2**64} is beyond any run \\(expected epoch <= {(2**63 - 1) // 10}",
        ),  # fmt: skip
        (_state(epoch=2**63 // 10 + 1), "is beyond any run"),
        (_state(version=2), "version 2, this sampler reads version 1"),
        ({"epoch": 0, "position": 0}, "the saved state has no \\['num_samples', 'seed'"),
        ([0, 0], "expected the dict that state_dict\\(\\) returns, got list"),
    ],
)
def test_a_bad_state_is_refused_with_what_was_expected(state, message):
    s = ResumableSampler(10, batch_size=2, seed=4)
    with pytest.raises(StateMismatchError, match=message):
        s.load_state_dict(state)
    assert (s.epoch, s.position) == (0, 0)  # untouched


def test_without_shuffle_the_seed_may_change():
    s = ResumableSampler(10, batch_size=2, seed=1, shuffle=False)
    s.load_state_dict({**s.state_dict(), "seed": 2, "position": 4})
    assert list(s) == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset": 10, "batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"dataset": 0, "batch_size": 1}, "the dataset's length must be >= 1, got 0"),
        ({"dataset": iter([1]), "batch_size": 1}, "map-style dataset .* got list_iterator"),
        ({"dataset": 10, "batch_size": 1, "rank": 0}, "pass rank and world_size together"),
        ({"dataset": 10, "batch_size": 1, "rank": 2, "world_size": 2}, "rank must be in \\[0, "),
        (
            {"dataset": 10, "batch_size": 1, "rank": 0, "world_size": 1, "group": "dp"},
            "pass either group or rank and world_size, not both",
        ),
        (
            {"dataset": 10, "batch_size": 4, "rank": 0, "world_size": 3},
            "the dataset has 10 samples, fewer than one global batch of 12 \\(world_size 3 x "
            "batch_size 4\\)",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResumableSampler(kwargs.pop("dataset"), **kwargs)
    s = ResumableSampler(10, batch_size=1)
    with pytest.raises(ValueError, match="num_batches must be >= 0, got -1"):
        s.advance(-1)


# --- a real Run, a real checkpoint, real process groups -----------------------------------------

_N, _SEED, _BATCH = 33, 5, 2


def _train(rank, world_size, url, total, crash_after, num_workers):
    """Train ``total`` steps (or crash after ``crash_after``); returns the restored step and the
    samples this rank took at each step."""
    ds = _Ids(_N)
    sampler = ResumableSampler(ds, batch_size=_BATCH, seed=_SEED, drop_last=False)
    assert (sampler.rank, sampler.world_size) == (rank, world_size)  # the default group's
    if world_size > 1:  # or a data-parallel group's, given explicitly
        dp = ResumableSampler(ds, batch_size=_BATCH, group=torch.distributed.group.WORLD)
        assert (dp.rank, dp.world_size) == (rank, world_size)
    loader = DataLoader(ds, sampler=sampler, batch_size=sampler.batch_size, num_workers=num_workers)
    model = torch.nn.Linear(2, 1)
    taken = {}
    restored = None
    try:
        with Run(url, save_every=2, detect=False) as run:
            restored = run.track(model=model, data=sampler)
            batches = _forever(loader)
            for step in run.steps(total):
                taken[step] = next(batches).tolist()
                sampler.advance()
                if step == crash_after:
                    raise _Crash(step)
    except _Crash:
        pass
    return restored, taken


class _Crash(Exception):
    pass


@pytest.mark.distributed
@pytest.mark.slow
def test_run_track_resumes_the_order_on_2_then_3_ranks_then_1(tmp_path):
    url = str(tmp_path / "ckpt")
    # 2 ranks take steps 1-5 (4 samples a step) and crash: step 4 is the newest committed
    first = run_distributed(_train, 2, url, 100, 5, 0, timeout_s=300)
    # 3 ranks resume after step 4 (6 samples a step), take steps 5-7 and crash: step 6 committed
    second = run_distributed(_train, 3, url, 100, 7, 0, timeout_s=300)
    # one process (no process group) resumes after step 6 and finishes at step 9, with a loader
    # worker prefetching (the ranks above are daemons, which may not start workers)
    third = _train(0, 1, url, 9, None, 1)
    assert [r for r, _ in first] == [0, 0]
    assert [r for r, _ in second] == [4, 4, 4]
    assert third[0] == 6

    def committed(ranks, steps):
        return [i for step in steps for _, taken in ranks for i in taken[step]]

    consumed = (
        committed(first, range(1, 5))
        + committed(second, range(5, 7))
        + committed([third], [7, 8, 9])
    )
    assert len(consumed) == 16 + 12 + 6
    assert sorted(consumed[:_N]) == list(range(_N))  # every sample once, the 34th opens epoch 1
    order = epoch_order(_N, seed=_SEED, epoch=0) + epoch_order(_N, seed=_SEED, epoch=1)
    assert consumed == order[:34]
    # the steps lost in the crashes were taken again, the same samples at the other world size
    lost = committed(first, [5]) + committed(second, [7])
    assert lost == order[16:20] + order[28:34]
