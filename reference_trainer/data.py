"""Byte-level training data and its deterministic order.

The embedded default corpus is the Python standard library's own source files (present on every
machine; sorted and read deterministically), so the demo needs no download; ``--data PATH`` takes a
text file or a directory of them.  Tokens are bytes (vocabulary 256), prepared once into a cached
token file.

The global sample order is a pure function of (seed, global step), independent of the data-parallel
size: step s draws ``global_batch`` window starts, and data replica r of R reads samples
[r * B/R, (r+1) * B/R).  A run resumed in another layout therefore sees exactly the samples the
original would have.  The loader is Stateful: its state is the next step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resilient.checkpoint.format import _short
from resilient.errors import StateMismatchError

__all__ = ["corpus_files", "corpus_id", "load_tokens", "Loader"]


def corpus_files(data: str | None) -> list[Path]:
    return [Path(f) for f in _corpus(data)]


def _corpus(data: str | None) -> list[str]:
    """The corpus's files, as strings, in ``Path`` order (by their parts: ``sorted`` of the same
    ``Path`` objects, without making and comparing 1,800 of them at every rank's start)."""
    if data is None:  # the standard library's *.py files, not the packages installed beside it
        # (no separator at its end: each file's path below is the root's and the rest of it)
        root = sysconfig.get_paths()["stdlib"].rstrip(os.sep) or os.sep
        as_path = str(Path(root))  # (what Path(root, ...) would print)
        found = []
        for parent, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != "site-packages"]  # never walked, not filtered after
            found += [os.path.join(parent, n) for n in names if n.endswith(".py")]
        return sorted((as_path + f[len(root) :] for f in found), key=_parts)
    path = Path(data)
    if path.is_file():
        return [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"--data {data}: the directory holds no files")
    return [str(f) for f in files]


def _parts(path: str) -> list[str]:
    return path.split(os.sep)


def _cache_dir() -> Path:
    base = os.environ.get("RESILIENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "resilient"
    )
    return Path(base)


def _cache_path(files: list[str]) -> Path:
    # (nanoseconds, and the change time, which no one sets: a file rewritten with the same size
    # in the same second, or with its mtime put back as cp -p does, is not the cached one)
    stats = [os.stat(f) for f in files]
    key = hashlib.sha256(
        json.dumps(
            [[f, s.st_size, s.st_mtime_ns, s.st_ctime_ns] for f, s in zip(files, stats)]
        ).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"tokens-{key}.u8"


def corpus_id(tokens: np.ndarray) -> str:
    """What the corpus is, by content: ``"<tokens>:<sha256 of them, 16 hex>"`` (the same text
    under another path is the same corpus; an edited file is another).  A run records it, and a
    resumed run must read the same corpus: the windows of every step are drawn from it.  Taken
    once per token cache (``load_tokens``'s), kept beside it."""
    where = getattr(tokens, "filename", None)
    side = Path(where).with_suffix(".id") if where else None
    stamp = ""
    if side is not None:
        # the id holds for the cache file it was taken of (inode, size, mtime): one rebuilt or
        # replaced since (other content of the same length) is hashed again
        try:
            st = os.stat(where)
            stamp = f" {st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            known = side.read_text().strip()
            if known.startswith(f"{len(tokens)}:") and known.endswith(stamp):
                return known[: -len(stamp)]
        except OSError:
            pass
    ident = f"{len(tokens)}:{hashlib.sha256(tokens).hexdigest()[:16]}"
    if side is not None and stamp:
        tmp = side.with_suffix(f".id.tmp{os.getpid()}")
        try:
            tmp.write_text(ident + stamp)
            os.replace(tmp, side)  # concurrent ranks may race; the content is the same
        except OSError:
            pass  # (taken again next time)
    return ident


def load_tokens(data: str | None) -> np.ndarray:
    """All tokens of the corpus as a read-only uint8 array (memory-mapped from the cache)."""
    files = _corpus(data)
    cache = _cache_path(files)
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as out:
            for f in files:
                out.write(Path(f).read_bytes())
                out.write(b"\n\n")
        os.replace(tmp, cache)  # concurrent ranks may race; the content is the same
    return np.memmap(cache, dtype=np.uint8, mode="r")


class Loader:
    """Batches for one data replica; Stateful (``state_dict`` is the next step)."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        replica: int,
        num_replicas: int,
    ) -> None:
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}"
            )
        self.tokens, self.seq_len, self.global_batch, self.seed = (
            tokens,
            seq_len,
            global_batch,
            seed,
        )
        self.replica, self.num_replicas = replica, num_replicas
        self.next_step = 1

    def starts(self, step: int) -> torch.Tensor:
        """The window starts of global step ``step``: a pure function of (seed, step)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(
            0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=g
        )

    def sample_ids(self, step: int) -> list[int]:
        """Global ids of the samples this replica reads at ``step``."""
        per = self.global_batch // self.num_replicas
        first = (step - 1) * self.global_batch + self.replica * per
        return list(range(first, first + per))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.global_batch // self.num_replicas
        starts = self.starts(step)[self.replica * per : (self.replica + 1) * per].tolist()
        windows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        w = torch.from_numpy(windows)
        self.next_step = step + 1
        return w[:, :-1], w[:, 1:]  # inputs, targets: (B/R, T)

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """The saved next step: an int >= 1, refused by name otherwise (``int()`` took True as
        step 1, 2.7 as 2 and '5' as 5: samples served again or skipped without a word)."""
        value = sd.get("next_step") if isinstance(sd, Mapping) else sd
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**63:
            raise StateMismatchError(
                f"the loader's saved position 'data.next_step' is {_short(value)} "
                f"({type(value).__name__}), expected an int step number >= 1 (the step whose "
                f"batch comes next); the checkpoint is damaged or was not saved by this trainer: "
                f"resume from another step, or start a new run (another --ckpt)"
            )
        self.next_step = value
