"""Turning a user's nested ``state`` into flat, named leaves, and writing loaded values back.

This module owns what the Checkpointer accepts: plain tensors (replicated), DTensors, tensors
annotated with :func:`sharded`, ``nn.Module`` and ``torch.optim.Optimizer`` objects, any other
Stateful object (``state_dict()``/``load_state_dict()``), nested mappings and lists, and JSON-able
values.  Keys are joined with ``.``: ``model.layers.0.attn.qkv.weight``,
``optim.state.model.layers.0.attn.qkv.weight.exp_avg``.  It does not own files or bytes.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.checkpoint.codec import SAFETENSORS_METADATA
from resilient.errors import LayoutError, StateMismatchError
from resilient.layout import (
    AxisPlacement,
    Layout,
    Placement,
    chunk_box,
    expanded_shape,
    fused_parts,
    local_shape,
    normalize_placement,
    placement_from_dtensor,
)

__all__ = [
    "sharded",
    "shard_of",
    "init_optimizer_state",
    "TensorLeaf",
    "DescribeCache",
    "FlatState",
    "flatten_state",
    "json_snapshot",
]

_ATTR = "_resilient_sharding"


@dataclass(frozen=True)
class _Sharding:
    placement: Mapping[str, AxisPlacement]
    global_shape: tuple[int, ...] | None
    layout: Layout | None
    rank: int | None


def sharded(
    tensor: torch.Tensor,
    placement: Mapping[str, AxisPlacement],
    *,
    global_shape: tuple[int, ...] | list[int] | None = None,
    layout: Layout | None = None,
    rank: int | None = None,
) -> torch.Tensor:
    """Declare that ``tensor`` is this rank's chunk of a global tensor split by ``placement``.

    Annotates the tensor in place (parameters keep the annotation, and so optimizer state of the
    same shape inherits it) and returns it.  ``placement`` maps layout axes to ``Shard(dim,
    parts)``/``Replicate()``; unnamed axes replicate.  Pass ``global_shape`` when a split is
    uneven; otherwise it is inferred as an even split.  ``layout``/``rank``, when given, are checked
    against the Checkpointer's.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sharded() takes a tensor, got {type(tensor).__name__}")
    setattr(
        tensor,
        _ATTR,
        _Sharding(
            dict(placement), tuple(global_shape) if global_shape is not None else None, layout, rank
        ),
    )
    return tensor


def shard_of(
    global_tensor: torch.Tensor, placement: Mapping[str, AxisPlacement], layout: Layout, rank: int
) -> torch.Tensor:
    """``rank``'s chunk of a global tensor (a copy), annotated with :func:`sharded`.

    Fused dims give the rank its slice of every block.  Handy for building sharded state from a
    full tensor (tests, demos, single-process conversions).
    """
    pl = normalize_placement(placement, layout)
    shape = tuple(global_tensor.shape)
    box = chunk_box(shape, pl, layout, rank)
    view = (
        global_tensor.reshape(expanded_shape(shape, fused_parts(shape, pl)))
        if shape
        else global_tensor
    )
    for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        view = view.narrow(d, o, n)
    local = view.reshape(local_shape(shape, pl, layout, rank)).clone()
    return sharded(local, placement, global_shape=shape)


@dataclass(slots=True)
class TensorLeaf:
    key: str
    local: torch.Tensor  # the rank-local tensor (a DTensor's local shard); a load destination
    shape: tuple[int, ...]  # global
    placement: Placement

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


@dataclass
class FlatState:
    tensors: dict[str, TensorLeaf] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    # load only: how to put a loaded JSON value back, and what to call once everything is filled
    setters: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    finalizers: list[Callable[[], None]] = field(default_factory=list)
    # load only: what puts the state back as it was if the load is abandoned (a lazily created
    # optimizer state that the walk had to create to have something to load into)
    undo: list[Callable[[], None]] = field(default_factory=list)


def _is_json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _contains_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, Mapping):
        return any(_contains_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_contains_tensor(x) for x in v)
    return False


def _plain(value: Any) -> bool:
    """A JSON scalar that is its own snapshot (json_snapshot returns it as it is)."""
    kind = type(value)
    return (
        kind is str
        or kind is bool
        or value is None
        or (kind is int and value.bit_length() <= 64)
        or (kind is float and math.isfinite(value))
    )


def json_snapshot(key: str, value: Any) -> Any:
    """A deep, JSON-only copy of ``value`` (tuples become lists), or a TypeError naming the key."""
    if _plain(value):  # its own copy (an optimizer's dozen hyperparameters)
        return value
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"state key {key!r}: value of type {type(value).__name__} is neither a tensor nor "
            f"JSON-able ({e}); convert it (for example to a list or a string) or wrap it in an "
            f"object with state_dict()/load_state_dict()"
        ) from None


class DescribeCache:
    """(saves) The tensor descriptions of the previous flatten of a state, for the next one.

    A trainer saves the same tensors at every snapshot, and describing one (its annotation, its
    global shape, the layout arithmetic, the check that its storage holds it) costs more than the
    checks that show it unchanged: the same tensor object, with the same storage size and offset,
    shape, strides, dtype and device, the same annotation (its own, or for optimizer state its
    parameter's), under the same layout and rank.  A tensor that fails any of them is described
    again.  Only the keys of the newest flatten are kept, and no tensor is held: a model the
    caller drops is freed as before."""

    def __init__(self) -> None:
        self._where: tuple[Layout, int] | None = None
        self._old: dict[str, tuple[weakref.ref, tuple, tuple[int, ...], Placement]] = {}
        self._new: dict[str, tuple[weakref.ref, tuple, tuple[int, ...], Placement]] = {}
        self._misses = 0
        # after end(): whether this flatten described exactly the tensors of the one before, in
        # the same order, each by checks alone (what a plan made of that one holds for); and
        # how many flattens have ended
        self.unchanged = False
        self.generation = 0

    def begin(self, layout: Layout, rank: int) -> None:
        if self._where != (layout, rank):
            self._where, self._old = (layout, rank), {}
        self._new, self._misses, self.unchanged = {}, 0, False

    def end(self) -> None:
        self.unchanged = bool(self._old) and not self._misses and list(self._new) == list(self._old)
        self._old, self._new = self._new, {}
        self.generation += 1

    def describe(
        self, key: str, t: torch.Tensor, layout: Layout, rank: int, inherit: torch.Tensor | None
    ) -> TensorLeaf:
        hit = self._old.get(key)
        # (a DTensor or a sparse tensor is never entered below: its shard is new each time)
        if hit is not None and hit[0]() is t:
            sig = hit[
                1
            ]  # _signature(t, inherit), compared term by term (a save checks 92 each step)
            if (
                t.data_ptr() == sig[0]
                and t.untyped_storage().nbytes() == sig[1]
                and t.shape == sig[2]
                and t.stride() == sig[3]
                and t.dtype == sig[4]
                and t.device == sig[5]
                and getattr(t, _ATTR, None) == sig[6]
                and (None if inherit is None else getattr(inherit, _ATTR, None)) == sig[7]
            ):
                self._new[key] = hit
                # (a tensor that needs no gradient is its own detached view, for a save)
                return TensorLeaf(key, t.detach() if t.requires_grad else t, hit[2], hit[3])
        self._misses += 1
        leaf = describe_tensor(key, t, layout, rank, inherit)
        if not is_dtensor(t) and t.layout is torch.strided:
            sig = _signature(t, inherit)
            self._new[key] = (weakref.ref(t), sig, leaf.shape, leaf.placement)
        return leaf


def _signature(t: torch.Tensor, inherit: torch.Tensor | None) -> tuple:
    """What a cached description of ``t`` holds for: its storage, place, shape and annotation."""
    return (
        t.data_ptr(),
        t.untyped_storage().nbytes(),  # (a storage freed or shrunk since: described again)
        t.shape,
        t.stride(),
        t.dtype,
        t.device,
        getattr(t, _ATTR, None),
        None if inherit is None else getattr(inherit, _ATTR, None),
    )


def flatten_state(
    state: Mapping[str, Any],
    layout: Layout,
    rank: int,
    *,
    for_load: bool = False,
    flat: FlatState | None = None,
    cache: DescribeCache | None = None,
) -> FlatState:
    """Flatten ``state`` into tensor leaves and JSON values (and, for loads, setters, finalizers
    and undo actions).  Pass ``flat`` to keep its ``undo`` list even if flattening fails, and
    (saves) ``cache`` to describe the tensors the previous save described by checks alone."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to values, got {type(state).__name__}")
    flat = flat if flat is not None else FlatState()
    if cache is not None and not for_load:
        cache.begin(layout, rank)
        _Walker(flat, layout, rank, for_load, state, cache).walk(state, "")
        cache.end()
    else:
        _Walker(flat, layout, rank, for_load, state).walk(state, "")
    return flat


def _param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """id(parameter) -> fully qualified key, for the modules anywhere in ``state``."""
    names: dict[int, str] = {}

    def visit(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.nn.Module):
            for n, p in obj.named_parameters():
                names.setdefault(id(p), prefix + n)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                visit(v, f"{prefix}{k}.")

    visit(state, "")
    return names


class _Walker:
    def __init__(
        self,
        flat: FlatState,
        layout: Layout,
        rank: int,
        for_load: bool,
        root: Mapping[str, Any],
        cache: DescribeCache | None = None,
    ) -> None:
        self.flat, self.layout, self.rank, self.for_load = flat, layout, rank, for_load
        self.root, self.cache = root, cache
        self._param_names: dict[int, str] | None = None

    @property
    def param_names(self) -> dict[int, str]:
        """The parameters' keys (a walk of every module in the state), made when a
        ``torch.optim.Optimizer`` first needs them: a state without one (the reference trainer's
        snapshot at every step) does not pay for the walk."""
        if self._param_names is None:
            self._param_names = _param_names(self.root)
        return self._param_names

    def walk(
        self,
        obj: Any,
        prefix: str,
        setter: Callable[[Any], None] | None = None,
        inherit: torch.Tensor | None = None,
    ) -> None:
        if type(obj) is dict:  # (first: the commonest, and an ABC check costs)
            self.mapping(obj, prefix)
        elif isinstance(obj, torch.Tensor):
            self.tensor(prefix.rstrip("."), obj, inherit)
        elif isinstance(obj, torch.nn.Module):
            for k, v in obj.state_dict(keep_vars=True).items():
                self.tensor(prefix + k, v, None)
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizer(obj, prefix)
        elif (
            hasattr(obj, "state_dict")
            and hasattr(obj, "load_state_dict")
            and not isinstance(obj, Mapping)
        ):
            sd = obj.state_dict()
            if not isinstance(sd, MutableMapping):
                raise TypeError(
                    f"{prefix.rstrip('.')}: state_dict() returned {type(sd).__name__}, expected a dict"
                )
            self.mapping(sd, prefix)
            if self.for_load:
                self.flat.finalizers.append(lambda obj=obj, sd=sd: obj.load_state_dict(sd))
        elif isinstance(obj, Mapping):
            self.mapping(obj, prefix)
        elif isinstance(obj, (list, tuple)) and self._json_list(obj, prefix, setter):
            pass
        elif isinstance(obj, (list, tuple)) and _contains_tensor(obj):
            for i, v in enumerate(obj):
                item_setter = None
                if isinstance(obj, list):
                    item_setter = lambda val, obj=obj, i=i: obj.__setitem__(i, val)  # noqa: E731
                self.walk(v, f"{prefix}{i}.", item_setter)
        else:
            key = prefix.rstrip(".")
            self.flat.values[key] = obj if self.for_load else json_snapshot(key, obj)
            if setter is not None:
                self.flat.setters[key] = setter

    def _json_list(
        self, obj: list | tuple, prefix: str, setter: Callable[[Any], None] | None
    ) -> bool:
        """(saves) Take a list that is plain JSON as one value, in one pass of the C encoder
        (an RNG state of 625 ints, a sampler's indices: one Python call per element otherwise);
        False for one that is not (it holds a tensor, or something else: see the caller)."""
        if self.for_load:
            return False
        if all(_plain(x) for x in obj):  # (a list of scalars is its own copy, less the list)
            self.flat.values[prefix.rstrip(".")] = list(obj)
            return True
        try:
            value = json.loads(json.dumps(obj, allow_nan=False))
        except (TypeError, ValueError):
            return False
        key = prefix.rstrip(".")
        self.flat.values[key] = value
        if setter is not None:
            self.flat.setters[key] = setter
        return True

    def mapping(self, m: Mapping[str, Any], prefix: str) -> None:
        values = None if self.for_load else self.flat.values
        for k, v in m.items():
            if not isinstance(k, (str, int)):
                raise TypeError(
                    f"state key {prefix}{k!r} must be a str or int, got {type(k).__name__}"
                )
            # (what walk() would do, without its checks: a plain tensor, and a save's scalar)
            kind = type(v)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                self.tensor(f"{prefix}{k}.".rstrip("."), v, None)
                continue
            if values is not None and _plain(v):
                values[f"{prefix}{k}.".rstrip(".")] = v
                continue
            setter = None
            if self.for_load and isinstance(m, MutableMapping):
                setter = lambda val, m=m, k=k: m.__setitem__(k, val)  # noqa: E731
            self.walk(v, f"{prefix}{k}.", setter)

    def tensor(self, key: str, t: torch.Tensor, inherit: torch.Tensor | None) -> None:
        if key in self.flat.tensors:
            raise ValueError(f"state key {key!r} appears twice; give each tensor a unique name")
        if key == SAFETENSORS_METADATA:
            raise ValueError(
                "state key '__metadata__' is a safetensors header's own key, so no rank file "
                "could hold a tensor of that name; rename it"
            )
        if self.cache is not None:
            self.flat.tensors[key] = self.cache.describe(key, t, self.layout, self.rank, inherit)
        else:
            self.flat.tensors[key] = describe_tensor(key, t, self.layout, self.rank, inherit)

    def optimizer(self, opt: torch.optim.Optimizer, prefix: str) -> None:
        load = self.for_load
        if load and init_optimizer_state(opt):
            self.flat.undo.append(opt.state.clear)
        names, state, tensor = self.param_names, opt.state, self.tensor
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                st = state.get(p)
                if not st:
                    continue
                name = names.get(id(p)) or f"{gi}.{pi}"
                for k, v in st.items():
                    key = f"{prefix}state.{name}.{k}"
                    if isinstance(v, torch.Tensor):
                        same = v.shape == p.shape and v.dim() > 0
                        tensor(key, v, p if same else None)
                    else:
                        setter = (lambda val, st=st, k=k: st.__setitem__(k, val)) if load else None
                        self.walk(v, key + ".", setter)
            for hp, v in group.items():
                if hp == "params":
                    continue
                setter = (
                    (lambda val, group=group, hp=hp: group.__setitem__(hp, val)) if load else None
                )
                self.walk(v, f"{prefix}param_groups.{gi}.{hp}.", setter)


def is_dtensor(obj: Any) -> bool:
    """Without importing torch.distributed.tensor (slow): no DTensor exists until someone has."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(obj, mod.DTensor)


def describe_tensor(
    key: str, t: torch.Tensor, layout: Layout, rank: int, inherit: torch.Tensor | None = None
) -> TensorLeaf:
    """The global shape and placement of ``t``: from a DTensor, a ``sharded`` annotation (its own
    or, for optimizer state, its parameter's), or replicated."""
    if is_dtensor(t):
        try:
            placement = placement_from_dtensor(t, layout)
        except LayoutError as e:
            raise LayoutError(f"tensor {key!r}: {e}") from None
        local = t.to_local()
        _check_dense(key, local)
        return _checked(key, local.detach(), tuple(t.shape), placement, layout, rank)
    _check_dense(key, t)
    spec: _Sharding | None = getattr(t, _ATTR, None)
    if spec is None and inherit is not None:
        spec = getattr(inherit, _ATTR, None)
    if spec is None:
        return TensorLeaf(key, t.detach(), tuple(t.shape), normalize_placement(None, layout))
    if spec.layout is not None and spec.layout != layout:
        raise LayoutError(
            f"tensor {key!r} was annotated for layout {spec.layout}, but the checkpointer uses "
            f"{layout}; pass the same layout to Checkpointer(layout=...)"
        )
    if spec.rank is not None and spec.rank != rank:
        raise LayoutError(
            f"tensor {key!r} was annotated for rank {spec.rank}, but this is rank {rank}"
        )
    try:
        placement = normalize_placement(spec.placement, layout)
    except LayoutError as e:
        raise LayoutError(f"tensor {key!r}: {e}") from None
    shape = spec.global_shape
    if shape is None:  # even split: multiply each sharded dim by the axes that split it
        shape_l = list(t.shape)
        for axis, p in placement:
            if hasattr(p, "dim"):
                if p.dim >= t.dim():
                    raise LayoutError(
                        f"tensor {key!r}: axis {axis!r} shards dim {p.dim}, but the tensor has {t.dim()} dims"
                    )
                shape_l[p.dim] *= layout.size(axis)
        shape = tuple(shape_l)
    return _checked(key, t.detach(), shape, placement, layout, rank)


def _check_dense(key: str, t: torch.Tensor) -> None:
    """A tensor whose bytes can be read and written: dense, with data, and with a storage that
    holds every element its shape and strides reach (copying one whose storage was freed or shrunk,
    as FSDP does to the unsharded parameters it is not using, reads or writes memory that is not
    the tensor's: a crash, or another tensor's bytes)."""
    if t.layout is not torch.strided:
        raise TypeError(
            f"tensor {key!r} is a {t.layout} tensor; only dense (strided) tensors can be "
            f"checkpointed — convert it (for example with .to_dense()) in a state_dict() of your "
            f"own, and back in load_state_dict()"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"tensor {key!r} is on the meta device and has no data to checkpoint; materialize "
            f"it first (for example with to_empty() and an initialization)"
        )
    if t.numel():
        reach = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        need, have = reach * t.element_size(), t.untyped_storage().nbytes()
        if have < need:
            raise ValueError(
                f"tensor {key!r} of shape {list(t.shape)} reaches {need} bytes into its "
                f"storage, which holds {have}: its memory was freed or shrunk (as FSDP does with "
                f"the unsharded parameters it is not using); checkpoint the state that owns the "
                f"memory (with FSDP, its sharded state dict)"
            )


def _checked(
    key: str,
    local: torch.Tensor,
    shape: tuple[int, ...],
    placement: Placement,
    layout: Layout,
    rank: int,
) -> TensorLeaf:
    try:
        expected = _expected_shape(shape, placement, layout, rank)
    except LayoutError as e:
        raise LayoutError(f"tensor {key!r}: {e}") from None
    if tuple(local.shape) != expected:
        raise LayoutError(
            f"tensor {key!r}: rank {rank} holds a local shape {list(local.shape)}, but global shape "
            f"{list(shape)} split by {_fmt(placement)} on {layout.describe()} gives {list(expected)} "
            f"for this rank; pass global_shape= to sharded() for uneven splits"
        )
    return TensorLeaf(key, local, shape, placement)


@functools.lru_cache(maxsize=8192)
def _expected_shape(
    shape: tuple[int, ...], placement: Placement, layout: Layout, rank: int
) -> tuple[int, ...]:
    """The local shape ``rank`` must hold (checked dims and fused sizes): the same tensors are
    described at every save, so the layout arithmetic is done once per distinct tensor."""
    fused_parts(shape, placement)
    return local_shape(shape, placement, layout, rank)


def _fmt(placement: Placement) -> str:
    parts = [
        f"{a}:Shard({p.dim}{', parts=' + str(p.parts) if p.parts > 1 else ''})"
        for a, p in placement
        if hasattr(p, "dim")
    ]
    return "{" + ", ".join(parts) + "}" if parts else "replicate"


def init_optimizer_state(opt: torch.optim.Optimizer) -> bool:
    """Create a lazily initialised optimizer's state so that it can be loaded into in place;
    returns whether it did (``opt.state.clear()`` undoes it).

    Optimizers like Adam create their state on the first step.  Take one step with zero
    gradients and a learning rate of zero (so parameters do not move); the learning rates and the
    gradients the parameters had (a warm-up step may have left some) are put back whatever
    happens, and the load overwrites the state that step created.  Step counts and state tensors
    are then zeroed: for Adam, AdamW, RAdam, Adamax, RMSprop and SGD without dampening that is the
    state their own first step starts from, so a save of it before the first step (a size check,
    an early snapshot) does not change their training (NAdam, ASGD, Rprop and SGD with dampening
    start elsewhere: load into them, do not save them before their first step).  An optimizer that cannot take such a step (it needs a closure,
    sparse gradients) is a StateMismatchError naming it.
    """
    if opt.state:
        return False
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return False
    saved_lr = [g.get("lr") for g in opt.param_groups]
    saved_grads = [p.grad for p in params]
    try:
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            opt.step()
            for st in opt.state.values():  # as fresh as a lazily created state
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
                    elif k == "step" and isinstance(v, int | float):
                        st[k] = type(v)(0)
    except Exception as e:
        opt.state.clear()
        raise StateMismatchError(
            f"optimizer {type(opt).__name__} cannot create its state for loading by a step with "
            f"zero gradients ({type(e).__name__}: {e}); take one real step before loading, or "
            f"checkpoint it through an object with state_dict()/load_state_dict()"
        ) from e
    finally:
        for g, lr in zip(opt.param_groups, saved_lr):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    return True
