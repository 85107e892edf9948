"""A resumable sampler for user training loops: the same global sample order at any dp size.

This module owns :class:`ResumableSampler`, a ``torch.utils.data.Sampler`` over any map-style
dataset (anything with ``len()``), and :func:`epoch_order`, the pure function behind it.  It does
not own datasets, batching or collation (``DataLoader`` does) nor saving (``Run.track`` does).

**The global order.**  Epoch ``e`` visits the dataset in the order ``epoch_order(N, seed=s,
epoch=e)``: a pseudo-random permutation of ``range(N)`` that depends on (seed, epoch) only.  It is
computed index by index (a keyed Feistel network with cycle walking, defined here in full), so it
needs no O(N) table, and it does not change with the torch or numpy version.  The epochs are laid
end to end as one stream; a *position* counts the samples of the current epoch consumed by all
ranks together.  Each step consumes one *global batch* of ``world_size * batch_size`` consecutive
samples from the position on, and rank ``r`` takes the ``r``-th run of ``batch_size`` of them.  So
the sequence of samples the job consumes is the same at any world size, and a run resumed at
another world size continues from the saved position: no sample skipped, none repeated.  A
position need not be a multiple of the new global batch: the next global batch simply starts
there.

**The epoch's tail** (fewer samples left than one global batch).  ``drop_last=True`` skips them,
as ``DistributedSampler`` with ``drop_last`` does (how many depends on the global batch when the
epoch ends, or at the resume: a larger global batch that no longer fits ends the epoch there); ``drop_last=False`` drops nothing and pads nothing: the last global batch is completed
with the first samples of the next epoch, whose pass then starts after them.  Either way every
rank gets exactly ``batch_size`` samples at every step, so ranks never disagree on the number of
steps, and within an epoch every sample comes at most once (exactly once with ``drop_last=False``).

**Recording consumption.**  A ``DataLoader`` draws indices ahead of the loop (``num_workers`` times
``prefetch_factor`` batches), so what the sampler has handed out is not what the loop has used.
The loop therefore says what it used: ``sampler.advance()`` after it takes each batch (``n``
batches: ``advance(n)``), on every rank alike.  ``state_dict()`` is the recorded position, the same
on every rank, which is what ``Run.track(data=sampler)`` saves at a step boundary: a save after
step ``k`` resumes at the batch after those ``k`` steps took, whatever the loader had prefetched.
(Being the same on every rank matters: a checkpoint keeps rank 0's JSON values, plus another
rank's only where they differ, and a rank the saved world did not have reads rank 0's.)
Call ``advance()`` as soon as a batch is in hand (before asking for the next one, also when
accumulating gradients over micro-batches): a new pass (``iter(loader)``) starts at the recorded
position, and warns when the pass before handed out batches that were never recorded.

**Passes.**  ``iter(sampler)`` is one pass: this rank's indices of the current epoch from the
recorded position on.  Loops that count steps, not epochs, chain passes::

    def batches():
        while True:
            yield from loader     # each pass starts where advance() left off

An iterator created before ``load_state_dict`` (``Run.track``) would hand out the old order: it
raises instead.  Create the loader's iterator after ``run.track(...)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from resilient.errors import StateMismatchError

__all__ = ["ResumableSampler", "epoch_order", "STATE_VERSION"]

STATE_VERSION = 1  # of state_dict(); a new version gets an explicit upgrade in load_state_dict

_MASK64 = (1 << 64) - 1
_ROUNDS = 6  # Feistel rounds: 3-4 make a pseudo-random permutation, more mix small domains better
_GOLDEN = 0x9E3779B97F4A7C15
_MAX_CURSOR = 2**63 - 1  # samples consumed, epochs laid end to end: an int64, as a step is


def _mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (a bijection of 64-bit values)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (numpy array arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    base = _mix64(_mix64(seed + _GOLDEN) + epoch)
    return [np.uint64(_mix64(base + (i + 1) * _GOLDEN)) for i in range(_ROUNDS)]


def _permute(
    positions: np.ndarray, num_samples: int, seed: int, epoch: int, shuffle: bool
) -> np.ndarray:
    """The sample index at each position of epoch ``epoch``'s order (int64 array in, int64 out)."""
    if not shuffle or num_samples == 1:
        return positions.astype(np.int64)
    # a balanced Feistel network permutes [0, 4**half); cycle walking (applying it again while the
    # value is >= num_samples) restricts it to a permutation of [0, num_samples)
    half = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    keys = _round_keys(seed, epoch)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64_array(right + k) & mask)
        return (left << shift) | right

    out = feistel(positions.astype(np.uint64))
    todo = np.flatnonzero(out >= np.uint64(num_samples))
    while todo.size:  # ends: 4**half < 4 * num_samples, so most values land in range each time
        out[todo] = feistel(out[todo])
        todo = todo[out[todo] >= np.uint64(num_samples)]
    return out.astype(np.int64)


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Epoch ``epoch``'s global sample order: a permutation of ``range(num_samples)`` that depends
    only on (num_samples, seed, epoch); ``shuffle=False``: ``range(num_samples)`` itself."""
    _check_int("num_samples", num_samples, 1)
    _check_int("epoch", epoch, 0)
    _check_int("seed", seed, None)
    positions = np.arange(num_samples, dtype=np.int64)
    return _permute(positions, num_samples, seed, epoch, shuffle).tolist()


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class ResumableSampler(Sampler[int]):
    """This rank's sample indices of a global order that depends only on (seed, epoch, position).

    ``ResumableSampler(dataset, *, batch_size, seed=0, shuffle=True, drop_last=True, rank=None,
    world_size=None, group=None)``:

    - ``dataset``: a map-style dataset (anything with ``len()``) or its length.
    - ``batch_size``: samples per rank per step; give the ``DataLoader`` the same
      (``batch_size=sampler.batch_size``).  A global batch is ``world_size * batch_size``.
    - ``drop_last``: what happens to an epoch's tail shorter than a global batch (module
      docstring): skipped (True), or completed from the next epoch (False).
    - ``rank``/``world_size``: this rank's place among the data-parallel replicas; default: the
      rank and size of ``group``, else of the default process group, else a world of one.  Under
      tensor or expert parallelism the data-parallel rank is not the global rank: pass the dp
      group, or both numbers.

    Use it as ``DataLoader(dataset, sampler=sampler, batch_size=sampler.batch_size)``, register it
    with ``run.track(data=sampler)``, and call ``sampler.advance()`` once per batch the loop takes.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dataset, int) and not isinstance(dataset, bool):
            num_samples = dataset
        elif isinstance(dataset, Sized):
            num_samples = len(dataset)
        else:
            raise ValueError(
                f"dataset must be a map-style dataset (with len()) or its length, got "
                f"{type(dataset).__name__}; an IterableDataset has no positions to resume at"
            )
        _check_int("the dataset's length", num_samples, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("seed", seed, None)
        if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
            raise ValueError(
                f"shuffle and drop_last must be bools, got shuffle={shuffle!r}, "
                f"drop_last={drop_last!r}"
            )
        rank, world_size = _dp_place(rank, world_size, group)
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = world_size * batch_size
        if drop_last and self.global_batch_size > num_samples:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (world_size {world_size} x batch_size {batch_size}): "
                f"with drop_last=True no epoch would hold a single batch. Use a smaller "
                f"batch_size, or drop_last=False (batches then run on into the next epoch)"
            )
        self._cursor = 0  # recorded consumption: epoch * num_samples + position, canonical
        self._loads = 0  # load_state_dict calls: an iterator from before a load is stale
        self._passes = 0  # passes begun; only the newest one's end is remembered
        self._last_pass: tuple[int, int] | None = None  # (start, end) of the last finished pass

    # --- the recorded position -------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the next batch the loop has not recorded with ``advance``."""
        return self._cursor // self.num_samples

    @property
    def position(self) -> int:
        """Samples of ``epoch`` consumed by all ranks together (as recorded by ``advance``)."""
        return self._cursor % self.num_samples

    def _canonical(self, cursor: int) -> int:
        """The start of the next global batch at or after ``cursor``: with ``drop_last`` an epoch
        whose tail is shorter than a global batch ends there."""
        epoch, position = divmod(cursor, self.num_samples)
        if self.drop_last and position + self.global_batch_size > self.num_samples:
            return (epoch + 1) * self.num_samples
        return cursor

    def advance(self, num_batches: int = 1) -> None:
        """Record that the loop took ``num_batches`` more batches on every rank (one global batch
        each).  Call it as each batch is taken, on every rank alike; ``state_dict`` and the next
        pass start after what was recorded."""
        _check_int("num_batches", num_batches, 0)
        n, size, total = num_batches, self.global_batch_size, self.num_samples
        if not self.drop_last:
            self._cursor += n * size
            return
        epoch, position = divmod(self._cursor, total)
        left = (total - position) // size  # batches left in this epoch, this one included
        if n < left:
            self._cursor += n * size
            return
        n -= left
        per_epoch = total // size
        self._cursor = (epoch + 1 + n // per_epoch) * total + (n % per_epoch) * size

    # --- Stateful ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The recorded position (JSON; the same on every rank and at any world size)."""
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position (saved at any world size and batch size).  Raises
        ``StateMismatchError`` when the state is malformed or belongs to another order (another
        dataset length, seed or shuffle)."""
        what = "ResumableSampler.load_state_dict"
        if not isinstance(state, Mapping):
            raise StateMismatchError(
                f"{what}: expected the dict that state_dict() returns, got "
                f"{type(state).__name__}; pass the sampler's saved state"
            )
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise StateMismatchError(
                f"{what}: the saved state has no {missing} (found keys {sorted(state)}); it was "
                f"not saved by a ResumableSampler"
            )
        for key in ("version", "num_samples", "seed", "epoch", "position"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise StateMismatchError(
                    f"{what}: the saved {key!r} is {value!r} ({type(value).__name__}), expected "
                    f"an int; the state is damaged or was not saved by a ResumableSampler"
                )
        if not isinstance(state["shuffle"], bool):
            raise StateMismatchError(
                f"{what}: the saved 'shuffle' is {state['shuffle']!r}, expected a bool; the state "
                f"is damaged or was not saved by a ResumableSampler"
            )
        if state["version"] != STATE_VERSION:
            raise StateMismatchError(
                f"{what}: the saved state has version {state['version']}, this sampler reads "
                f"version {STATE_VERSION}; resume with the resilient version that saved it"
            )
        how = "resume with the same dataset and settings, or start a fresh run (a new checkpoint)"
        if state["num_samples"] != self.num_samples:
            raise StateMismatchError(
                f"{what}: the saved position is in a dataset of {state['num_samples']} samples, "
                f"this sampler's dataset has {self.num_samples}; {how}"
            )
        if state["shuffle"] != self.shuffle:
            raise StateMismatchError(
                f"{what}: the saved order has shuffle={state['shuffle']}, this sampler has "
                f"shuffle={self.shuffle}; {how}"
            )
        if self.shuffle and state["seed"] != self.seed:
            raise StateMismatchError(
                f"{what}: the saved order has seed {state['seed']}, this sampler has seed "
                f"{self.seed}; {how}"
            )
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position < self.num_samples:
            raise StateMismatchError(
                f"{what}: the saved epoch {epoch} and position {position} are out of range "
                f"(expected epoch >= 0 and 0 <= position < {self.num_samples}); the state is "
                f"damaged"
            )
        most = _MAX_CURSOR // self.num_samples
        if epoch > most:
            # (no run reads 2**63 samples; and from epoch 2**64 on, the order repeats epoch 0's:
            # the round keys are 64-bit)
            raise StateMismatchError(
                f"{what}: the saved epoch {epoch} is beyond any run (expected epoch <= {most}: "
                f"{self.num_samples} samples an epoch, fewer than 2**63 samples in all); the "
                f"state is damaged"
            )
        # a position the old global batch reached may leave too short a tail for this one
        self._cursor = self._canonical(epoch * self.num_samples + position)
        self._loads += 1
        self._last_pass = None

    # --- iteration ---------------------------------------------------------------------------------
    def _pass_bounds(self) -> tuple[int, int]:
        """(start, end) cursors of a pass begun now: from the recorded position to the first
        global batch that starts in a later epoch."""
        start = self._cursor
        epoch, position = divmod(start, self.num_samples)
        left = self.num_samples - position
        if self.drop_last:
            num_batches = left // self.global_batch_size
        else:
            num_batches = -(-left // self.global_batch_size)
        return start, start + num_batches * self.global_batch_size

    def __len__(self) -> int:
        """This rank's number of indices in a pass begun now."""
        start, end = self._pass_bounds()
        return (end - start) // self.world_size

    def __iter__(self) -> Iterator[int]:
        start, end = self._pass_bounds()
        last = self._last_pass
        if last is not None and start < last[1]:
            # a loop that takes batches before recording them would see these twice
            last_epoch, last_position = divmod(last[1], self.num_samples)
            warnings.warn(
                f"ResumableSampler (rank {self.rank}): a new pass starts at epoch {self.epoch} "
                f"position {self.position}, but the previous pass handed out batches up to "
                f"epoch {last_epoch} position {last_position}, which advance() has not recorded; "
                f"they are handed out again. If the loop used them, call sampler.advance() as "
                f"each batch is taken",
                stacklevel=2,
            )
        self._passes += 1
        return self._iterate(start, end, self._loads, self._passes)

    def _iterate(self, start: int, end: int, loads: int, number: int) -> Iterator[int]:
        offset = self.rank * self.batch_size
        for batch_start in range(start, end, self.global_batch_size):
            if loads != self._loads:
                raise StateMismatchError(
                    f"ResumableSampler (rank {self.rank}): this iterator was created before "
                    f"load_state_dict() moved the sampler to epoch {self.epoch} position "
                    f"{self.position}, so it hands out the old order; create the DataLoader's "
                    f"iterator after run.track(...)"
                )
            yield from self._stream(batch_start + offset, self.batch_size)
        if number == self._passes:  # an older, abandoned iterator finishing late says nothing
            self._last_pass = (start, end)

    def _stream(self, first: int, count: int) -> list[int]:
        """Sample indices of stream entries [first, first + count): epochs laid end to end."""
        out: list[int] = []
        cursor, stop = first, first + count
        while cursor < stop:
            epoch, position = divmod(cursor, self.num_samples)
            n = min(stop - cursor, self.num_samples - position)
            positions = np.arange(position, position + n, dtype=np.int64)
            out += _permute(positions, self.num_samples, self.seed, epoch, self.shuffle).tolist()
            cursor += n
        return out

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
            f"rank={self.rank}, world_size={self.world_size}, epoch={self.epoch}, "
            f"position={self.position})"
        )


def _dp_place(rank: int | None, world_size: int | None, group: Any | None) -> tuple[int, int]:
    """(rank, world_size) among the data-parallel replicas."""
    if group is not None:
        if rank is not None or world_size is not None:
            raise ValueError(
                f"pass either group or rank and world_size, not both (got group, rank={rank!r}, "
                f"world_size={world_size!r})"
            )
        return dist.get_rank(group), dist.get_world_size(group)
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"pass rank and world_size together (got rank={rank!r}, world_size={world_size!r}); "
            f"leave both out to use the default process group's"
        )
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size
