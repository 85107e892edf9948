"""What the import formats share: the reference trainer's placement table, writing whole
tensors as a checkpoint in any layout, and opening a file of an import's source directory.

``reshape`` does not import the trainer (the import boundary, ../shared/DESIGN.md section 10), so
the table of how the reference trainer splits each weight is restated here as part of its
checkpoint format; tests/test_hf_interop.py checks that it equals reference_trainer/parallel.py's.
A tensor whose name is not in the table (an optimizer moment, a user's model) is written
replicated, which every layout can load (a load reshards).

An import first writes an ordinary checkpoint of one rank (layout dp=1 x ep=1 x tp=1, each tensor
annotated with its placement) into a scratch directory (beside a local destination, else in the
temp directory), then converts it to the requested layout
with ``reshape.execute.convert``: the bytes are verified and committed like any conversion, and an
interrupted import leaves no committed step at the destination.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch

from reshape.execute import ConvertReport, DestinationExistsError, convert
from resilient.checkpoint import Checkpointer, sharded
from resilient.checkpoint.retention import step_dirs
from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError, StateMismatchError
from resilient.layout import Layout, Shard

__all__ = [
    "LAYOUT_AXES",
    "REFERENCE_PLACEMENTS",
    "check_memory",
    "open_source_file",
    "reference_placement",
    "tensor_bytes",
    "write_checkpoint",
]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

LAYOUT_AXES = ("dp", "ep", "tp")  # the reference trainer's Layout(dp=, ep=, tp=), in its order

# name (without the "model." prefix) -> placement; the same table as reference_trainer/parallel.py
REFERENCE_PLACEMENTS: list[tuple[str, dict]] = [
    (r"embed\.weight", {}),
    (r"layers\.\d+\.(attn_norm|moe_norm)\.weight", {}),
    (r"layers\.\d+\.attn\.wq\.weight", {"tp": Shard(0)}),
    (r"layers\.\d+\.attn\.wkv\.weight", {"tp": Shard(0, parts=2)}),
    (r"layers\.\d+\.attn\.wo\.weight", {"tp": Shard(1)}),
    (r"layers\.\d+\.moe\.router\.weight", {}),
    (r"layers\.\d+\.moe\.w_gate_up", {"ep": Shard(0), "tp": Shard(1, parts=2)}),
    (r"layers\.\d+\.moe\.w_down", {"ep": Shard(0), "tp": Shard(2)}),
    (r"layers\.\d+\.moe\.shared_gate_up\.weight", {"tp": Shard(0, parts=2)}),
    (r"layers\.\d+\.moe\.shared_down\.weight", {"tp": Shard(1)}),
    (r"norm\.weight", {}),
    (r"lm_head\.weight", {}),
]


def reference_placement(key: str) -> dict:
    """The reference trainer's placement of checkpoint key ``key`` (``model.<name>``); ``{}``
    (replicated) for any other key."""
    if not key.startswith("model."):
        return {}
    name = key[len("model.") :]
    for pattern, placement in REFERENCE_PLACEMENTS:
        if re.fullmatch(pattern, name):
            return dict(placement)
    return {}


def check_memory(need: int) -> None:
    """An import holds its tensors in memory, and about as much again while it writes them:
    refuse, before reading them, one that this machine cannot hold."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return
    if 2 * need > memory:
        raise StateMismatchError(
            f"importing {need / 2**30:.1f} GiB of tensors needs about twice that in memory while "
            f"it is written, and this machine has {memory / 2**30:.1f} GiB; run it on a larger one"
        )


def tensor_bytes(shapes: Mapping[str, tuple[int, ...]], itemsize: int) -> int:
    return sum(math.prod(s) * itemsize for s in shapes.values())


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model.a.b": t}`` -> ``{"model": {"a.b": t}}``: one level, as the trainer's state has
    it (a module's state_dict keys keep their dots)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if not rest:
            raise ValueError(f"tensor name {key!r} has no '<group>.' prefix (such as 'model.')")
        out.setdefault(head, {})[rest] = value
    return out


def write_checkpoint(
    out: str,
    tensors: Mapping[str, torch.Tensor],
    sizes: Mapping[str, int],
    *,
    values: Mapping[str, Any] | None = None,  # top-level groups of JSON values: {"config": {...}}
    step: int = 0,
    placement: Callable[[str], dict] = reference_placement,
    overwrite: bool = False,
    out_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> ConvertReport:
    """Write whole ``tensors`` (``group.name`` keys, such as ``model.layers.0.attn.wq.weight``)
    and JSON ``values`` as step ``step`` of a checkpoint at ``out`` in the layout ``sizes``
    (``{"tp": 2, "ep": 1, "dp": 1}``), each tensor split by ``placement(key)``."""
    unknown = sorted(set(sizes) - set(LAYOUT_AXES))
    if unknown:
        raise ValueError(f"layout axes {unknown}: the axes are {list(LAYOUT_AXES)}")
    dest = Storage(out, out_options)
    existing = sorted(step_dirs(dest))
    if existing and not overwrite:
        raise DestinationExistsError(
            f"the destination {dest.url} already holds checkpoint steps {existing[-10:]}; pass "
            f"--overwrite to replace step {step} there, or choose an empty destination"
        )
    one = Layout([(a, 1) for a in LAYOUT_AXES])
    state: dict[str, Any] = {}
    for key, t in tensors.items():
        state[key] = sharded(t, placement(key), global_shape=tuple(t.shape))
    tree: dict[str, Any] = _unflatten(state)
    for key, value in (values or {}).items():
        if key in tree:
            raise ValueError(f"values[{key!r}] has the name of a group of tensors")
        tree[key] = value
    check_memory(sum(t.numel() * t.element_size() for t in tensors.values()))
    # the one-rank copy goes beside a local destination (the same disk, which must hold the
    # result anyway), else into the temp directory; the name says what it is if a crash leaves it
    parent = None
    if dest.is_local:
        parent = os.path.dirname(os.path.abspath(dest.root)) or None
        os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".reshape-import-scratch-", dir=parent)
    try:
        with Checkpointer(scratch + "/ckpt", layout=one, keep_last=1) as ck:
            ck.save(step, tree).wait()
        return convert(
            scratch + "/ckpt",
            out,
            {a: int(sizes.get(a, 1)) for a in LAYOUT_AXES},
            step=step,
            overwrite=overwrite,
            dst_options=out_options,
            progress=progress,
        )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(scratch)


def open_source_file(path: str, what: str, error: Callable[[str], ResilientError]) -> BinaryIO:
    """Open ``path``, a file of an import's source directory (a DCP or Hugging Face directory:
    untrusted input), for reading: never through a symbolic link (nothing below the directory is
    reached through one, as for a checkpoint), and only a regular file (``O_NONBLOCK``: opening a
    FIFO does not wait for a writer; a device or directory is refused after ``fstat``).  Anything
    else raises ``error(message)`` naming the file; a missing file raises FileNotFoundError, for
    the caller to explain."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(
                f"{what} {path} is a symbolic link; an import does not follow links (one could "
                f"point anywhere): copy the file itself into the directory"
            ) from None
        raise error(f"cannot open {what} {path}: {e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO")]
            kinds += [(stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
            kind = next((k for test, k in kinds if test(mode)), "a special file")
            raise error(
                f"{what} {path} is {kind}, not a regular file; an import reads only regular "
                f"files: copy the real file into the directory"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
