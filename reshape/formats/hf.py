"""Hugging Face transformers, both ways, for the reference trainer's MoE.

The reference trainer's model (reference_trainer/model.py) is a decoder with RMSNorm, RoPE
(rotate-half), grouped KV heads, a softmax top-k router (weights renormalised over the chosen
experts when k > 1, the raw probability when k = 1), SwiGLU experts and an optional ungated shared
expert.  Two architectures that transformers ships compute the same thing:

* **Qwen2-MoE** (``qwen2_moe``) for every configuration.  Its router renormalises only when
  ``norm_topk_prob`` is set: it is set exactly when k > 1.  Its shared expert is gated by
  ``sigmoid(shared_expert_gate(x))``: the gate is written as zeros, so the gate is exactly 0.5, and
  the shared expert's down projection is written doubled (scaling by a power of two is exact).  A
  model without a shared expert gets a shared expert of width 1 whose weights are all zero: it
  adds exactly 0.  Its attention has q/k/v biases: written as zeros.
* **Mixtral** (``mixtral``) when there is no shared expert and k > 1 (Mixtral always
  renormalises, so top-1 is not Mixtral).  The export prefers it there: no zero tensors.

Import takes either architecture back, and refuses, naming the option, what the trainer's model
cannot compute (a learned shared-expert gate, non-zero biases, sliding windows, RoPE scaling, a
top-1 Mixtral, ...).  The model's configuration is read from the checkpoint: the reference trainer
records it (``config.model.*``); for a checkpoint written before it did, pass ``model_config``.

Tensor names on disk are the canonical Hub ones (one tensor per expert: ``experts.{j}.gate_proj``
for Qwen2-MoE, ``experts.{j}.w1`` for Mixtral), which every transformers version loads; import also
reads the fused ``experts.gate_up_proj`` / ``experts.down_proj`` names of transformers 5.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from reshape.execute import resolve_step
from reshape.export import (
    INDEX_NAME,
    ExportReport,
    byte_batches,
    check_export_dtype,
    check_source_files,
    clear_destination,
    read_many,
    refuse_inside_source,
    write_shards,
)
from reshape.formats.reference import (
    check_memory,
    open_source_file,
    tensor_bytes,
    write_checkpoint,
)
from resilient.checkpoint.format import Manifest, dtype_info
from resilient.checkpoint.reader import read_manifest
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError, ResilientError, StateMismatchError

__all__ = [
    "HfFormatError",
    "MoEConfig",
    "UnsupportedModelError",
    "architecture_for",
    "export_reference_hf",
    "hf_config",
    "import_hf",
    "is_reference_checkpoint",
    "model_config_of",
    "recorded_model_config",
    "reference_export_bytes",
]

CONFIG_NAME = "config.json"
_MAX_CONFIG_BYTES = 1 << 20
_MAX_INDEX_BYTES = 64 << 20
_CONFIG_PREFIX = "config.model."
# RoPE's theta where config.json names none: transformers 5's default for each architecture
_DEFAULT_THETA = {"mixtral": 1e6, "qwen2_moe": 1e4}
READ_AHEAD = 128 << 20  # bytes of checkpoint tensors an export reads in one batch


class UnsupportedModelError(ResilientError, ValueError):
    """The model cannot be expressed exactly in the other format; the message names the option."""


class HfFormatError(CheckpointCorruptError, ValueError):
    """A Hugging Face directory that is not what it says (config, index or weights)."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The reference trainer's ModelConfig fields that decide the forward pass (and seq_len,
    which sizes RoPE's table)."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_expert: bool
    seq_len: int
    rope_theta: float
    norm_eps: float

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], where: str) -> MoEConfig:
        kinds = {
            "shared_expert": (bool,),
            "rope_theta": (int, float),
            "norm_eps": (int, float),
        }
        out: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                raise StateMismatchError(f"{where} has no model field {f.name!r}")
            v = d[f.name]
            ok = kinds.get(f.name, (int,))
            if isinstance(v, bool) != (ok == (bool,)) or not isinstance(v, ok):
                raise StateMismatchError(f"{where}: model field {f.name!r} is {v!r}")
            if ok == (int,) and not 1 <= v <= 1 << 24:
                raise StateMismatchError(f"{where}: model field {f.name!r} = {v} is out of range")
            if ok == (int, float) and not (math.isfinite(v) and v > 0):
                raise StateMismatchError(f"{where}: model field {f.name!r} = {v} must be > 0")
            out[f.name] = float(v) if ok == (int, float) else v
        cfg = cls(**out)
        if cfg.num_heads % cfg.num_kv_heads or cfg.top_k > cfg.num_experts or cfg.head_dim % 2:
            raise StateMismatchError(
                f"{where}: heads {cfg.num_heads} / kv heads {cfg.num_kv_heads}, top_k "
                f"{cfg.top_k} of {cfg.num_experts} experts, head_dim {cfg.head_dim}: not a model "
                f"the reference trainer builds"
            )
        return cfg

    def weight_bytes(self, itemsize: int) -> int:
        """The bytes of ``tensor_shapes()`` at ``itemsize`` bytes an element, without listing
        every layer's (a hostile config's 2^24 layers would be a hundred million entries)."""
        shapes = replace(self, num_layers=1).tensor_shapes()
        layer = {k: v for k, v in shapes.items() if k.startswith("model.layers.")}
        rest = {k: v for k, v in shapes.items() if k not in layer}
        return tensor_bytes(rest, itemsize) + self.num_layers * tensor_bytes(layer, itemsize)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys and global shapes of this model's weights."""
        d, f, e = self.dim, self.expert_ffn_dim, self.num_experts
        out = {"model.embed.weight": (self.vocab_size, d)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "attn_norm.weight"] = (d,)
            out[p + "attn.wq.weight"] = (self.num_heads * self.head_dim, d)
            out[p + "attn.wkv.weight"] = (2 * self.num_kv_heads * self.head_dim, d)
            out[p + "attn.wo.weight"] = (d, self.num_heads * self.head_dim)
            out[p + "moe_norm.weight"] = (d,)
            out[p + "moe.router.weight"] = (e, d)
            out[p + "moe.w_gate_up"] = (e, 2 * f, d)
            out[p + "moe.w_down"] = (e, d, f)
            if self.shared_expert:
                out[p + "moe.shared_gate_up.weight"] = (2 * f, d)
                out[p + "moe.shared_down.weight"] = (d, f)
        out["model.norm.weight"] = (d,)
        out["model.lm_head.weight"] = (self.vocab_size, d)
        return out


# --- which checkpoint, which architecture ------------------------------------------------------


def recorded_model_config(extras: Mapping[str, Any]) -> dict[str, Any]:
    """The model configuration a checkpoint's values record (``config.model.<field>``), by
    field; empty when it records none."""
    return {k[len(_CONFIG_PREFIX) :]: v for k, v in extras.items() if k.startswith(_CONFIG_PREFIX)}


def is_reference_checkpoint(manifest: Manifest) -> bool:
    """Written by the reference trainer: its tensor names, or a model configuration it would
    write (a user's own ``config.model`` values of another kind do not count)."""
    if "model.layers.0.moe.w_gate_up" in manifest.tensors:
        return True
    recorded = {
        k[len(_CONFIG_PREFIX) :]: v
        for k, v in manifest.extras.items()
        if k.startswith(_CONFIG_PREFIX)
    }
    try:
        MoEConfig.from_mapping(recorded, "the checkpoint")
    except StateMismatchError:
        return False
    return True


def model_config_of(
    manifest: Manifest, where: str, override: Mapping[str, Any] | None = None
) -> MoEConfig:
    """The model configuration a reference-trainer checkpoint records (or ``override``), checked
    against the shapes of its tensors."""
    if override is not None:
        cfg = MoEConfig.from_mapping(override, "--model-config")
    else:
        recorded = recorded_model_config(manifest.extras)
        if not recorded:
            preset = manifest.extras.get("config.preset")
            hint = (
                f' (it was trained with --preset {preset}: python -c "import dataclasses, json; '
                f"from reference_trainer.config import preset; "
                f"print(json.dumps(dataclasses.asdict(preset('{preset}'))))\" > model.json)"
                if isinstance(preset, str) and re.fullmatch(r"[\w.-]{1,64}", preset)
                else ""
            )
            raise StateMismatchError(
                f"{where} does not record its model's configuration (config.model.*): it was "
                f"written before the reference trainer recorded it; pass --model-config FILE, a "
                f"JSON object of the trainer's ModelConfig fields{hint}"
            )
        cfg = MoEConfig.from_mapping(recorded, f"{where}'s config.model")
    # (before listing what the configuration needs: a hostile one's count of layers would make
    # that list unbounded, and a checkpoint cannot need more layers than its tensors name)
    layers = {k.split(".", 3)[2] for k in manifest.tensors if k.startswith("model.layers.")}
    if cfg.num_layers > len(layers):
        raise StateMismatchError(
            f"{where}: its model configuration has {cfg.num_layers} layers, and its tensors "
            f"name {len(layers)} (model.layers.<i>.*)"
        )
    want = cfg.tensor_shapes()
    for key, shape in want.items():
        t = manifest.tensors.get(key)
        if t is None:
            raise StateMismatchError(
                f"{where} has no tensor {key!r}, which its model configuration needs"
            )
        if tuple(t.shape) != shape:
            raise StateMismatchError(
                f"{where}: tensor {key!r} has shape {tuple(t.shape)}, but the model "
                f"configuration makes it {shape}"
            )
    extra = sorted(k for k in manifest.tensors if k.startswith("model.") and k not in want)
    if extra:
        raise StateMismatchError(
            f"{where} has model tensors its configuration does not explain: {extra[:5]}"
        )
    return cfg


def architecture_for(cfg: MoEConfig) -> str:
    """``mixtral`` where it computes the same thing (no shared expert, top-k > 1), else
    ``qwen2_moe`` (which can express every configuration exactly)."""
    return "mixtral" if not cfg.shared_expert and cfg.top_k > 1 else "qwen2_moe"


def hf_config(cfg: MoEConfig, arch: str, dtype: str) -> dict[str, Any]:
    """config.json for ``arch``."""
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k,
        "output_router_logits": False,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **common,
            "intermediate_size": cfg.expert_ffn_dim,
            "num_local_experts": cfg.num_experts,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **common,
        "intermediate_size": cfg.expert_ffn_dim,  # dense MLP width: no dense layer uses it
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "shared_expert_intermediate_size": cfg.expert_ffn_dim if cfg.shared_expert else 1,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": cfg.top_k > 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "qkv_bias": True,
    }


# --- the tensor mapping --------------------------------------------------------------------------

# How an HF tensor is made from a checkpoint tensor: (source key or None for zeros, transform).
_Rule = tuple[str | None, Callable[[torch.Tensor], torch.Tensor] | None, tuple[int, ...]]


def _rules(cfg: MoEConfig, arch: str) -> dict[str, _Rule]:
    """HF name -> (checkpoint key, how to cut it, HF shape), in the order they are written
    (slices of one checkpoint tensor next to each other: it is read once)."""
    d, f, kvd = cfg.dim, cfg.expert_ffn_dim, cfg.num_kv_heads * cfg.head_dim
    qd = cfg.num_heads * cfg.head_dim
    out: dict[str, _Rule] = {
        "model.embed_tokens.weight": ("model.embed.weight", None, (cfg.vocab_size, d))
    }
    for i in range(cfg.num_layers):
        src, hf = f"model.layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = (src + "attn_norm.weight", None, (d,))
        out[hf + "self_attn.q_proj.weight"] = (src + "attn.wq.weight", None, (qd, d))
        out[hf + "self_attn.k_proj.weight"] = (src + "attn.wkv.weight", lambda t: t[:kvd], (kvd, d))
        out[hf + "self_attn.v_proj.weight"] = (src + "attn.wkv.weight", lambda t: t[kvd:], (kvd, d))
        out[hf + "self_attn.o_proj.weight"] = (src + "attn.wo.weight", None, (d, qd))
        out[hf + "post_attention_layernorm.weight"] = (src + "moe_norm.weight", None, (d,))
        if arch == "mixtral":
            moe, gate, up, down = hf + "block_sparse_moe.", "w1", "w3", "w2"
        else:
            moe, gate, up, down = hf + "mlp.", "gate_proj", "up_proj", "down_proj"
            for n, size in (("q", qd), ("k", kvd), ("v", kvd)):
                out[hf + f"self_attn.{n}_proj.bias"] = (None, None, (size,))
        out[moe + "gate.weight"] = (src + "moe.router.weight", None, (cfg.num_experts, d))
        for j in range(cfg.num_experts):
            e = f"{moe}experts.{j}."
            out[e + f"{gate}.weight"] = (src + "moe.w_gate_up", lambda t, j=j: t[j, :f], (f, d))
            out[e + f"{up}.weight"] = (src + "moe.w_gate_up", lambda t, j=j: t[j, f:], (f, d))
        for j in range(cfg.num_experts):
            out[f"{moe}experts.{j}.{down}.weight"] = (
                src + "moe.w_down",
                lambda t, j=j: t[j],
                (d, f),
            )
        if arch == "qwen2_moe":
            s = moe + "shared_expert."
            if cfg.shared_expert:
                gu = src + "moe.shared_gate_up.weight"
                out[s + "gate_proj.weight"] = (gu, lambda t: t[:f], (f, d))
                out[s + "up_proj.weight"] = (gu, lambda t: t[f:], (f, d))
                # the gate below is sigmoid(0) = 0.5 exactly; doubling is exact
                out[s + "down_proj.weight"] = (
                    src + "moe.shared_down.weight",
                    lambda t: t * 2,
                    (d, f),
                )
            else:  # width 1, all zeros: adds exactly 0
                out[s + "gate_proj.weight"] = (None, None, (1, d))
                out[s + "up_proj.weight"] = (None, None, (1, d))
                out[s + "down_proj.weight"] = (None, None, (d, 1))
            out[moe + "shared_expert_gate.weight"] = (None, None, (1, d))
    out["model.norm.weight"] = ("model.norm.weight", None, (d,))
    out["lm_head.weight"] = ("model.lm_head.weight", None, (cfg.vocab_size, d))
    return out


def _reference_plan(
    manifest: Manifest, where: str, dtype: str | None, model_config: Mapping[str, Any] | None
) -> tuple[MoEConfig, str, str, dict[str, _Rule]]:
    """What an export of a reference-trainer checkpoint writes: (its model config, the dtype
    written, the architecture, the rules of every HF tensor)."""
    cfg = model_config_of(manifest, where, model_config)
    check_export_dtype(dtype)
    dtypes = {manifest.tensors[k].dtype for k in cfg.tensor_shapes()}
    if dtype is None and len(dtypes) > 1:
        raise StateMismatchError(
            f"{where} holds model weights in several dtypes {sorted(dtypes)}; pass --dtype"
        )
    out_dtype = dtype or dtypes.pop()
    arch = architecture_for(cfg)
    return cfg, out_dtype, arch, _rules(cfg, arch)


def reference_export_bytes(
    manifest: Manifest,
    where: str,
    dtype: str | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> int:
    """The tensor bytes ``export_reference_hf`` writes for ``manifest`` (what its progress
    counts): transformers' tensors, some cut from one checkpoint tensor, some zeros."""
    _, out_dtype, _, rules = _reference_plan(manifest, where, dtype, model_config)
    return sum(math.prod(shape) for _, _, shape in rules.values()) * dtype_info(out_dtype).itemsize


def export_reference_hf(
    src: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    model_config: Mapping[str, Any] | None = None,
    src_options: dict | None = None,
    out_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """A reference-trainer checkpoint as a directory that
    ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads with no custom code."""
    t0 = time.perf_counter()
    source, dest = Storage(src, src_options), Storage(out, out_options)
    step = resolve_step(source, step)
    manifest = read_manifest(source, step)
    where = f"step {step} of {source.url}"
    cfg, out_dtype, arch, rules = _reference_plan(manifest, where, dtype, model_config)
    torch_dtype = dtype_info(out_dtype).torch_dtype
    refuse_inside_source(source, dest)
    # the checkpoint tensors the rules read, in order, read in batches of READ_AHEAD bytes
    order = list(dict.fromkeys(k for k, _, _ in rules.values() if k is not None))
    check_source_files(source, manifest, order)
    clear_destination(dest, overwrite, also=(CONFIG_NAME,))
    batches = byte_batches(order, lambda k: manifest.tensors[k].nbytes, READ_AHEAD)
    batch_of = {k: i for i, batch in enumerate(batches) for k in batch}
    cache: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        key, cut, shape = rules[name]
        if key is None:
            return torch.zeros(shape, dtype=torch_dtype)
        if key not in cache:
            cache.clear()
            cache.update(read_many(source, manifest, batches[batch_of[key]]))
        t = cache[key]
        return (cut(t) if cut is not None else t).to(torch_dtype)

    items = [(name, out_dtype, shape) for name, (_, _, shape) in rules.items()]
    names, weight_map, total = write_shards(dest, items, produce, max_shard_bytes, progress)
    config = hf_config(cfg, arch, out_dtype)
    dest.write_atomic(CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    index = {
        "metadata": {"total_size": total, "step": step, "source": source.url},
        "weight_map": weight_map,
    }
    dest.write_atomic(INDEX_NAME, json.dumps(index, indent=2).encode())
    return ExportReport(
        step,
        dest.url,
        names,
        len(rules),
        total,
        dtype,
        time.perf_counter() - t0,
        architecture=config["architectures"][0],
    )


# --- import --------------------------------------------------------------------------------------


def _hub_blob(path: str) -> str:
    """A file of a Hugging Face hub cache snapshot as the blob it links to, else ``path``.

    ``huggingface_hub`` keeps each file of a downloaded revision as a link,
    ``<repo>/snapshots/<revision>/<name>`` -> ``../../blobs/<hash>``: the one place an import
    follows a link, and only to a file directly in that repo's ``blobs/`` (a link anywhere else is
    refused when the file is opened, as in any directory)."""
    if not os.path.islink(path):
        return path
    revisions = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if os.path.basename(revisions) != "snapshots":
        return path
    blobs = os.path.realpath(os.path.join(os.path.dirname(revisions), "blobs"))
    target = os.path.realpath(path)
    return target if os.path.dirname(target) == blobs else path


def _read_json(path: str, cap: int, what: str) -> Any:
    try:
        with open_source_file(_hub_blob(path), what, HfFormatError) as f:
            data = f.read(cap + 1)
    except OSError as e:
        raise HfFormatError(f"cannot read {what} {path}: {e}") from e
    if len(data) > cap:
        raise HfFormatError(f"{what} {path} is larger than {cap} bytes; not a {what}")
    try:
        out = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise HfFormatError(f"{what} {path} is not JSON: {e}") from e
    if not isinstance(out, dict):
        raise HfFormatError(f"{what} {path} must be a JSON object, found {type(out).__name__}")
    return out


def _field(
    c: Mapping[str, Any], name: str, kind: type | tuple, path: str, default: Any = ...
) -> Any:
    if name not in c or c[name] is None:
        if default is ...:
            raise HfFormatError(f"{path} has no {name!r}")
        return default
    v = c[name]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise HfFormatError(f"{path}: {name!r} is {v!r}, expected {kind}")
    return v


def _config_from_hf(c: Mapping[str, Any], path: str) -> tuple[str, MoEConfig, dict[str, Any]]:
    """(architecture, the trainer's model config, the HF fields that need the weights checked)."""
    arch = c.get("model_type")
    if arch not in ("mixtral", "qwen2_moe"):
        raise UnsupportedModelError(
            f"{path}: model_type {arch!r}; the reference trainer's MoE can be imported from "
            f"'mixtral' or 'qwen2_moe' checkpoints"
        )
    act = _field(c, "hidden_act", str, path, "silu")
    if act != "silu":
        raise UnsupportedModelError(
            f"{path}: hidden_act {act!r}; the trainer's experts are SwiGLU (silu)"
        )
    # transformers reads rope_scaling first, then rope_parameters; neither may scale
    for name in ("rope_scaling", "rope_parameters"):
        spec = c.get(name)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise HfFormatError(f"{path}: {name} is {spec!r}, expected an object")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise UnsupportedModelError(
                f"{path}: {name} has RoPE type {kind!r}; the trainer computes plain RoPE "
                f"(rope_type 'default')"
            )
        for key in sorted(set(spec) - {"rope_type", "type", "rope_theta"}):
            if key == "partial_rotary_factor" and spec[key] in (1, 1.0):
                continue
            raise UnsupportedModelError(
                f"{path}: {name}.{key} = {spec[key]!r}; the trainer computes plain RoPE over the "
                f"whole head (rope_type 'default', nothing else)"
            )
    if c.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise UnsupportedModelError(
            f"{path}: partial_rotary_factor {c['partial_rotary_factor']!r}; the trainer rotates "
            f"the whole head"
        )
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    # where config.json names no theta, transformers uses the architecture's default
    theta = rope.get("rope_theta", c.get("rope_theta", _DEFAULT_THETA[arch]))
    hidden = _field(c, "hidden_size", int, path)
    heads = _field(c, "num_attention_heads", int, path)
    if heads <= 0 or hidden <= 0:
        raise HfFormatError(f"{path}: hidden_size {hidden}, num_attention_heads {heads}")
    head_dim = _field(c, "head_dim", int, path, hidden // heads)
    top_k = _field(c, "num_experts_per_tok", int, path)
    if arch == "mixtral":
        window = c.get("sliding_window")
        if window is not None:
            raise UnsupportedModelError(
                f"{path}: sliding_window {window!r}; the trainer's attention is full causal "
                f"(sliding_window null)"
            )
        if top_k == 1:
            raise UnsupportedModelError(
                f"{path}: a top-1 Mixtral weighs each token's expert by 1.0 (it renormalises); "
                f"the trainer's top-1 router weighs it by its probability"
            )
        experts = _field(c, "num_local_experts", int, path)
        ffn = _field(c, "intermediate_size", int, path)
        shared_width = 0
    else:
        if c.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{path}: use_sliding_window is set; the trainer's attention is full causal"
            )
        if _field(c, "decoder_sparse_step", int, path, 1) != 1 or c.get("mlp_only_layers"):
            raise UnsupportedModelError(
                f"{path}: some layers are dense (decoder_sparse_step / mlp_only_layers); every "
                f"layer of the trainer's model is MoE"
            )
        experts = _field(c, "num_experts", int, path)
        ffn = _field(c, "moe_intermediate_size", int, path)
        shared_width = _field(c, "shared_expert_intermediate_size", int, path)
        norm = bool(c.get("norm_topk_prob", False))
        if norm != (top_k > 1):
            raise UnsupportedModelError(
                f"{path}: norm_topk_prob is {str(norm).lower()} with top-{top_k} routing; the "
                f"trainer renormalises the weights of its top-k experts when k > 1 and weighs a "
                f"top-1 expert by its probability (norm_topk_prob {str(top_k > 1).lower()})"
            )
    if c.get("tie_word_embeddings"):
        tied = True
    else:
        tied = False
    fields_ = {
        "vocab_size": _field(c, "vocab_size", int, path),
        "dim": hidden,
        "num_layers": _field(c, "num_hidden_layers", int, path),
        "num_heads": heads,
        "num_kv_heads": _field(c, "num_key_value_heads", int, path, heads),
        "head_dim": head_dim,
        "num_experts": experts,
        "top_k": top_k,
        "expert_ffn_dim": ffn,
        "shared_expert": arch == "qwen2_moe",  # settled from the weights (a zero expert: none)
        "seq_len": _field(c, "max_position_embeddings", int, path),
        "rope_theta": float(theta) if isinstance(theta, (int, float)) else theta,
        "norm_eps": _field(c, "rms_norm_eps", (int, float), path),
    }
    try:
        cfg = MoEConfig.from_mapping(fields_, path)
    except StateMismatchError as e:
        raise UnsupportedModelError(str(e)) from None
    return arch, cfg, {"shared_width": shared_width, "tied": tied}


class _Weights:
    """The tensors of a Hugging Face directory (an index and its shards, or model.safetensors),
    read one at a time through safetensors (no pickle)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._open: tuple[str, Any, Any] | None = None  # the shard's name, handle, open file
        index = os.path.join(root, INDEX_NAME)
        if os.path.lexists(index):
            data = _read_json(index, _MAX_INDEX_BYTES, "weight index")
            wm = data.get("weight_map")
            if not isinstance(wm, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
            ):
                raise HfFormatError(f"{index}: weight_map must map tensor names to file names")
            self.where = dict(wm)
        elif os.path.lexists(os.path.join(root, "model.safetensors")):
            self.where = {k: "model.safetensors" for k in self._keys("model.safetensors")}
        else:
            raise HfFormatError(
                f"{root} has neither {INDEX_NAME} nor model.safetensors; point at a directory "
                f"that save_pretrained wrote"
            )
        for f in set(self.where.values()):
            if os.path.basename(f) != f or not f.endswith(".safetensors"):
                raise HfFormatError(
                    f"{root}: the weight index names {f!r}, not a .safetensors file beside it"
                )

    def _keys(self, file: str) -> list[str]:
        return list(self._handle(file).keys())

    def _handle(self, file: str) -> Any:
        from safetensors import SafetensorError, safe_open

        if self._open is None or self._open[0] != file:
            path = _hub_blob(os.path.join(self.root, file))
            # safe_open takes a path and follows links: the shard is opened here as a plain file
            # (no link, no FIFO), and safe_open is given that open file's /proc/self/fd entry, so
            # a swap of the path after the check is not what it reads
            try:
                held = open_source_file(path, "weight file", HfFormatError)
            except FileNotFoundError:
                raise HfFormatError(
                    f"{path}: missing (the weights name it); copy the whole directory again"
                ) from None
            by_fd = f"/proc/self/fd/{held.fileno()}"
            try:
                handle = safe_open(by_fd if os.path.exists(by_fd) else path, framework="pt")
            except (SafetensorError, OSError) as e:
                held.close()
                raise HfFormatError(f"cannot open {path}: {e}") from e
            self.close()
            self._open = (file, handle, held)
        return self._open[1]

    def close(self) -> None:
        if self._open is not None:
            self._open[2].close()
            self._open = None

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        from safetensors import SafetensorError

        file = self.where.get(name)
        if file is None:
            raise HfFormatError(f"{self.root} has no tensor {name!r}")
        h = self._handle(file)
        try:
            sl = h.get_slice(name)
            got = tuple(sl.get_shape())
            if got != tuple(shape):
                raise HfFormatError(
                    f"{self.root}/{file}: tensor {name!r} has shape {got}, the config makes it "
                    f"{tuple(shape)}"
                )
            t = h.get_tensor(name)
        except SafetensorError as e:
            raise HfFormatError(f"{self.root}/{file}: cannot read tensor {name!r}: {e}") from e
        if not t.is_floating_point():
            raise HfFormatError(
                f"{self.root}/{file}: tensor {name!r} is {t.dtype}, not floating point"
            )
        return t.float()


def import_hf(
    src: str,
    out: str,
    *,
    sizes: Mapping[str, int],
    step: int = 0,
    overwrite: bool = False,
    out_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """A Qwen2-MoE or Mixtral directory (the export's output, or one of the same shape family)
    as step ``step`` of a reference-trainer checkpoint at ``out`` in the layout ``sizes``, model
    weights only (float32), with its model configuration recorded.  The trainer starts from it
    with ``--init-from OUT``."""
    t0 = time.perf_counter()
    if not os.path.isdir(src):
        raise HfFormatError(
            f"{src} is not a directory; import reads a local Hugging Face directory"
        )
    path = os.path.join(src, CONFIG_NAME)
    arch, cfg, extra = _config_from_hf(_read_json(path, _MAX_CONFIG_BYTES, "config"), path)
    check_memory(cfg.weight_bytes(4))  # float32, before reading any weight
    w = _Weights(src)
    d, f, kvd = cfg.dim, cfg.expert_ffn_dim, cfg.num_kv_heads * cfg.head_dim
    qd = cfg.num_heads * cfg.head_dim
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        used.add(name)
        return w.get(name, shape)

    def has(name: str) -> bool:
        return name in w.where

    def zero(name: str, shape: tuple[int, ...], why: str) -> None:
        if has(name) and get(name, shape).count_nonzero():
            raise UnsupportedModelError(f"{src}: {name} is not all zeros; {why}")

    # the shared expert: kept only where it adds something (settled on layer 0's weights)
    shared = False
    if arch == "qwen2_moe":
        width = extra["shared_width"]
        downs = [
            get(f"model.layers.{i}.mlp.shared_expert.down_proj.weight", (d, width))
            for i in range(cfg.num_layers)
        ]
        shared = any(bool(t.count_nonzero()) for t in downs)
        if shared and width != f:
            raise UnsupportedModelError(
                f"{src}: the shared expert is {width} wide and the experts {f}; the trainer's "
                f"shared expert has the experts' width (expert_ffn_dim)"
            )
    cfg = MoEConfig(**{**asdict(cfg), "shared_expert": shared})
    tensors: dict[str, torch.Tensor] = {}
    tensors["model.embed.weight"] = get("model.embed_tokens.weight", (cfg.vocab_size, d))
    for i in range(cfg.num_layers):
        hf, dst = f"model.layers.{i}.", f"model.layers.{i}."
        tensors[dst + "attn_norm.weight"] = get(hf + "input_layernorm.weight", (d,))
        tensors[dst + "attn.wq.weight"] = get(hf + "self_attn.q_proj.weight", (qd, d))
        tensors[dst + "attn.wkv.weight"] = torch.cat(
            [
                get(hf + "self_attn.k_proj.weight", (kvd, d)),
                get(hf + "self_attn.v_proj.weight", (kvd, d)),
            ]
        )
        tensors[dst + "attn.wo.weight"] = get(hf + "self_attn.o_proj.weight", (d, qd))
        tensors[dst + "moe_norm.weight"] = get(hf + "post_attention_layernorm.weight", (d,))
        for n, size in (("q", qd), ("k", kvd), ("v", kvd)):
            zero(hf + f"self_attn.{n}_proj.bias", (size,), "the trainer's attention has no biases")
        if arch == "mixtral":
            moe, gate, up, down = hf + "block_sparse_moe.", "w1", "w3", "w2"
            if not has(moe + "gate.weight"):
                moe = hf + "mlp."  # transformers 5's own names
        else:
            moe, gate, up, down = hf + "mlp.", "gate_proj", "up_proj", "down_proj"
        tensors[dst + "moe.router.weight"] = get(moe + "gate.weight", (cfg.num_experts, d))
        if has(moe + "experts.gate_up_proj"):  # transformers 5 fuses the experts
            tensors[dst + "moe.w_gate_up"] = get(
                moe + "experts.gate_up_proj", (cfg.num_experts, 2 * f, d)
            )
            tensors[dst + "moe.w_down"] = get(moe + "experts.down_proj", (cfg.num_experts, d, f))
        else:
            tensors[dst + "moe.w_gate_up"] = torch.stack(
                [
                    torch.cat(
                        [
                            get(f"{moe}experts.{j}.{gate}.weight", (f, d)),
                            get(f"{moe}experts.{j}.{up}.weight", (f, d)),
                        ]
                    )
                    for j in range(cfg.num_experts)
                ]
            )
            tensors[dst + "moe.w_down"] = torch.stack(
                [get(f"{moe}experts.{j}.{down}.weight", (d, f)) for j in range(cfg.num_experts)]
            )
        if arch == "qwen2_moe":
            s = moe + "shared_expert."
            width = extra["shared_width"]
            gate_w = get(moe + "shared_expert_gate.weight", (1, d))
            gu = [get(s + "gate_proj.weight", (width, d)), get(s + "up_proj.weight", (width, d))]
            if shared:
                if gate_w.count_nonzero():
                    raise UnsupportedModelError(
                        f"{src}: {moe}shared_expert_gate.weight is not all zeros: the shared "
                        f"expert is gated by a learned sigmoid, and the trainer's shared expert "
                        f"is not gated"
                    )
                tensors[dst + "moe.shared_gate_up.weight"] = torch.cat(gu)
                # sigmoid(0) = 0.5 exactly, folded into the down projection (exact)
                tensors[dst + "moe.shared_down.weight"] = (
                    get(s + "down_proj.weight", (d, width)) * 0.5
                )
            elif downs[i].count_nonzero():
                raise UnsupportedModelError(
                    f"{src}: layer {i}'s shared expert adds something, layer 0's does not"
                )
    tensors["model.norm.weight"] = get("model.norm.weight", (d,))
    if has("lm_head.weight"):
        tensors["model.lm_head.weight"] = get("lm_head.weight", (cfg.vocab_size, d))
    elif extra["tied"]:
        tensors["model.lm_head.weight"] = tensors["model.embed.weight"].clone()
    else:
        raise HfFormatError(f"{src} has no lm_head.weight and tie_word_embeddings is not set")
    w.close()
    unused = sorted(w.names() - used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise UnsupportedModelError(
            f"{src} has tensors the trainer's model has no place for: {unused[:5]}"
        )
    values = {"config": {"model": asdict(cfg), "source": {"format": "hf", "model_type": arch}}}
    report = write_checkpoint(
        out, tensors, sizes, values=values, step=step, overwrite=overwrite,
        out_options=out_options, progress=progress,
    )  # fmt: skip
    return {
        "step": step,
        "out": report.target,
        "architecture": arch,
        "layout": report.target_layout,
        "tensors": len(tensors),
        "bytes_written": report.bytes_written,
        "model": asdict(cfg),
        "seconds": time.perf_counter() - t0,
    }
