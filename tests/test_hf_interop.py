"""Hugging Face transformers, both ways: `reshape export --format hf` writes what
AutoModelForCausalLM loads and computes the trainer's logits; `reshape import --format hf` brings
such a directory (or a Mixtral / Qwen2-MoE one transformers wrote) back in any layout, and the
trainer starts from it with --init-from."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import reshape.formats.hf as hf_format
from reference_trainer.config import PRESETS, ConfigError, TrainConfig, preset
from reference_trainer.model import MoETransformer, init_parameters
from reference_trainer.parallel import PLACEMENTS, ParallelContext
from reshape.cli import app
from reshape.execute import convert
from reshape.formats.hf import (
    HfFormatError,
    MoEConfig,
    UnsupportedModelError,
    architecture_for,
    export_reference_hf,
    hf_config,
    import_hf,
)
from reshape.formats.reference import REFERENCE_PLACEMENTS
from resilient import Checkpointer, Layout
from resilient.errors import CheckpointCorruptError, StateMismatchError
from tests.dist import run_distributed
from tests.integration.trainer_runs import run_train

runner = CliRunner()
TOL = 1e-5  # float32 logits, the bound
TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(7))

# The presets' structure (routing, shared expert, grouped KV ratio) at a width tests can train
SHRUNK = {
    "tiny": {},
    "small": {"dim": 64, "num_layers": 2, "head_dim": 8, "expert_ffn_dim": 32, "seq_len": 64},
    "zaya1-mini": {
        "dim": 64,
        "num_layers": 2,
        "head_dim": 8,
        "num_experts": 8,
        "expert_ffn_dim": 32,
        "seq_len": 64,
    },
}


def trainer_logits(url: str, model_cfg, tokens=TOKENS) -> torch.Tensor:
    """The reference trainer's own forward pass (one process) on the weights of ``url``."""
    pc = ParallelContext.single()
    model = MoETransformer(model_cfg, pc)
    init_parameters(model, pc, seed=123)  # overwritten by the load
    with Checkpointer(url, layout=pc.layout) as ck:
        ck.load({"model": model})
    with torch.no_grad():
        return model(tokens)[0]


def hf_logits(path: str, tokens=TOKENS) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
    # every weight came from the files, and every tensor in them was used
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def model_weights(url: str) -> dict[str, torch.Tensor]:
    pc = ParallelContext.single()
    with Checkpointer(url, layout=pc.layout) as ck:
        cfg = MoEConfig.from_mapping(
            {
                k[len("config.model.") :]: v
                for k, v in ck.manifest().extras.items()
                if k.startswith("config.model.")
            },
            url,
        )
        model = MoETransformer(dataclasses.replace(preset("tiny"), **dataclasses.asdict(cfg)), pc)
        ck.load({"model": model})
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer checkpoint written by 4 ranks (tp 2 x ep 2), and the same step converted to
    dp 2, ep 2 and tp 2: the source layouts of the export."""
    root = tmp_path_factory.mktemp("hf")
    url = str(root / "tp2xep2")
    kw = {"steps": 2, "global_batch": 8, "ep": 2, "tp": 2, "save_every": 2, "ckpt": url}
    run_distributed(run_train, 4, kw)
    out = {"tp2xep2": url}
    for name, sizes in (
        ("dp2", {"dp": 2, "ep": 1, "tp": 1}),
        ("ep2", {"dp": 1, "ep": 2, "tp": 1}),
        ("tp2", {"dp": 1, "ep": 1, "tp": 2}),
    ):
        out[name] = str(root / name)
        convert(url, out[name], sizes, step=2)
    return out


def test_the_placement_table_is_the_trainers():
    assert [(p, dict(x)) for p, x in REFERENCE_PLACEMENTS] == [(p, dict(x)) for p, x in PLACEMENTS]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("source", ["tp2xep2", "dp2", "ep2", "tp2"])
def test_export_loads_in_transformers_and_computes_the_trainers_logits(trained, source, tmp_path):
    out = str(tmp_path / "hf")
    report = export_reference_hf(trained[source], out)
    assert report.architecture == "Qwen2MoeForCausalLM"  # tiny has a shared expert
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["model_type"] == "qwen2_moe" and cfg["norm_topk_prob"] is True
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    files = set(index["weight_map"].values())
    on_disk = {}
    for f in files:
        on_disk.update(load_file(os.path.join(out, f)))
    assert set(on_disk) == set(index["weight_map"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in on_disk
    assert all(t.dtype == torch.float32 for t in on_disk.values())
    got, want = hf_logits(out), trainer_logits(trained["tp2xep2"], preset("tiny"))
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_structure_exports_exactly(name, tmp_path):
    """Each preset's routing and shared expert (top-2 + shared: Qwen2-MoE with a zero gate;
    top-1, none: Qwen2-MoE with a zero shared expert), trained a step at a test's width."""
    url = str(tmp_path / "ckpt")
    kw = {"steps": 1, "global_batch": 2, "save_every": 1, "ckpt": url, "preset": name}
    run_distributed(run_train, 1, {**kw, "model": SHRUNK[name]})
    model_cfg = dataclasses.replace(preset(name), **SHRUNK[name])
    export_reference_hf(url, str(tmp_path / "hf"))
    diff = hf_logits(str(tmp_path / "hf")) - trainer_logits(url, model_cfg)
    assert diff.abs().max().item() <= TOL, name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_config_builds_its_shapes_in_transformers(name):
    """At the presets' real sizes (on the meta device): every tensor the export writes is a
    parameter of the transformers model, with the same shape, and nothing is missing."""
    cfg = MoEConfig.from_mapping(dataclasses.asdict(preset(name)), name)
    arch = architecture_for(cfg)
    conf = transformers.AutoConfig.for_model(**hf_config(cfg, arch, "float32"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    from reshape.formats.hf import _rules

    want = {n: shape for n, (_, _, shape) in _rules(cfg, arch).items()}
    have = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # transformers 5 keeps the experts fused in memory; the files use one tensor per expert
    fused = {n for n in have if re.search(r"experts\.(gate_up_proj|down_proj)$", n)}
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for n in fused:  # (E, 2F, D) = E x [gate (F, D); up (F, D)], (E, D, F) = E x down (D, F)
        base, kind = n.rsplit(".", 1)
        e, rows, cols = have[n]
        for j in range(e):
            if kind == "gate_up_proj":
                for part in names[:2]:
                    assert want.pop(f"{base}.{j}.{part}.weight") == (rows // 2, cols), (n, j)
            else:
                assert want.pop(f"{base}.{j}.{names[2]}.weight") == (rows, cols), (n, j)
    assert want == {n: s for n, s in have.items() if n not in fused}


def test_mixtral_where_it_computes_the_same(tmp_path):
    cfg = {**dataclasses.asdict(preset("tiny")), "shared_expert": False}
    model_cfg = MoEConfig.from_mapping(cfg, "test")
    assert architecture_for(model_cfg) == "mixtral"
    top1 = dataclasses.replace(model_cfg, top_k=1)
    assert architecture_for(top1) == "qwen2_moe"  # Mixtral's top-1 weighs by 1.0
    url = str(tmp_path / "ckpt")
    kw = {"steps": 1, "global_batch": 2, "save_every": 1, "ckpt": url}
    run_distributed(run_train, 1, {**kw, "model": {"shared_expert": False}})
    report = export_reference_hf(url, str(tmp_path / "hf"))
    assert report.architecture == "MixtralForCausalLM"
    trainer_cfg = dataclasses.replace(preset("tiny"), shared_expert=False)
    diff = hf_logits(str(tmp_path / "hf")) - trainer_logits(url, trainer_cfg)
    assert diff.abs().max().item() <= TOL


@pytest.mark.distributed
@pytest.mark.slow
def test_import_round_trips_bit_exact_and_the_trainer_starts_from_it(trained, tmp_path):
    hf = str(tmp_path / "hf")
    export_reference_hf(trained["tp2xep2"], hf)
    back = str(tmp_path / "imported")
    report = import_hf(hf, back, sizes={"tp": 2, "ep": 2, "dp": 1})
    assert report["layout"] == [["dp", 1], ["ep", 2], ["tp", 2]]
    src, got = model_weights(trained["tp2xep2"]), model_weights(back)
    assert src.keys() == got.keys()
    for k in src:
        assert torch.equal(src[k], got[k]), k  # the shared expert's 2x then 0.5x is exact
    with Checkpointer(back) as ck:
        m = ck.manifest()
        assert m.layout == Layout(dp=1, ep=2, tp=2)
        assert m.tensors["model.layers.0.moe.w_gate_up"].placement[1][1].dim == 0  # ep splits
    # the trainer starts from it: with a zero learning rate its first save equals the import
    ckpt = str(tmp_path / "run")
    kw = {"steps": 1, "global_batch": 8, "dp": 2, "save_every": 1, "ckpt": ckpt, "lr": 0.0}
    run_distributed(run_train, 2, {**kw, "init_from": back})
    after = model_weights(ckpt)
    for k in src:
        assert torch.equal(after[k], src[k]), k
    # ZeRO-1 too: its fp32 masters are made from the weights the import gave
    zero = str(tmp_path / "zero")
    run_distributed(run_train, 2, {**kw, "ckpt": zero, "zero": True, "init_from": back})
    after = model_weights(zero)
    for k in src:
        assert torch.equal(after[k], src[k]), k
    # and without --init-from the same run starts elsewhere (the test can fail)
    fresh = str(tmp_path / "fresh")
    run_distributed(run_train, 2, {**kw, "ckpt": fresh})
    assert not torch.equal(model_weights(fresh)["embed.weight"], src["embed.weight"])
    # once --ckpt holds a step, --init-from is not read at all (here: it is gone)
    shutil.rmtree(back)
    run_distributed(run_train, 2, {**kw, "steps": 2, "init_from": back})


def test_init_from_refuses_another_model(tmp_path):
    url = str(tmp_path / "ckpt")
    cfg = MoEConfig.from_mapping(dataclasses.asdict(preset("tiny")), "t")
    tensors = {k: torch.zeros(s) for k, s in cfg.tensor_shapes().items()}
    from reshape.formats.reference import write_checkpoint

    write_checkpoint(url, tensors, {}, values={"config": {"model": dataclasses.asdict(cfg)}})
    from reference_trainer.train import _init_from

    other = dataclasses.replace(preset("tiny"), num_experts=8)
    pc = ParallelContext.single()
    model = MoETransformer(other, pc)
    init_parameters(model, pc, 0)
    train_cfg = TrainConfig(model=other, init_from=url)
    with pytest.raises(ConfigError, match=r"num_experts 4 there, 8 here"):
        _init_from(train_cfg, pc, model)
    model = MoETransformer(preset("tiny"), pc)
    init_parameters(model, pc, 0)
    _init_from(TrainConfig(model=preset("tiny"), init_from=url), pc, model)
    assert all(not p.count_nonzero() for p in model.parameters())


def _tiny_hf_config(kind: str, **extra):
    common = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, num_experts_per_tok=2,
    )  # fmt: skip
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, sliding_window=None, **extra
        )
    return transformers.Qwen2MoeConfig(
        **common, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        norm_topk_prob=True, intermediate_size=32, **extra,
    )  # fmt: skip


def _save(model, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)


def test_import_a_mixtral_that_transformers_wrote(tmp_path):
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")).eval()
    _save(hf, tmp_path / "mixtral")
    report = import_hf(str(tmp_path / "mixtral"), str(tmp_path / "ckpt"), sizes={"tp": 2})
    assert report["architecture"] == "mixtral" and report["model"]["shared_expert"] is False
    assert report["model"]["rope_theta"] == 1e6  # Mixtral's default, carried over
    cfg = dataclasses.replace(preset("tiny"), **report["model"])
    want = hf_logits(str(tmp_path / "mixtral"))  # what transformers makes of the files
    diff = trainer_logits(str(tmp_path / "ckpt"), cfg) - want
    assert diff.abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", ["int8", "bool"])
def test_export_of_a_reference_checkpoint_refuses_a_dtype_other_than_floating_point(
    tmp_path, dtype
):
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    import_hf(str(tmp_path / "m"), str(tmp_path / "ckpt"), sizes={})
    r = runner.invoke(
        app,
        [
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--format",
            "hf",
            "--dtype",
            dtype,
        ],
    )
    assert r.exit_code == 2 and f"--dtype '{dtype}' is not floating point" in r.output, r.output
    assert not (tmp_path / "hf").exists()


def test_export_progress_of_a_reference_checkpoint_counts_what_is_written(tmp_path, monkeypatch):
    """Its total was the checkpoint's model tensors: transformers' tensors are cut from them, and
    some are zeros (Qwen2-MoE's attention biases and shared-expert gate)."""
    from tests.test_reshape import _recording_progress

    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(_tiny_hf_config("qwen2_moe"))
    with torch.no_grad():
        for layer in hf.model.layers:  # what the trainer computes: no gate, no biases
            layer.mlp.shared_expert_gate.weight.zero_()
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    _save(hf, tmp_path / "m")
    import_hf(str(tmp_path / "m"), str(tmp_path / "ckpt"), sizes={})
    seen = _recording_progress(monkeypatch)
    out = tmp_path / "hf"
    args = ["export", str(tmp_path / "ckpt"), str(out), "--format", "hf", "--dtype", "bfloat16"]
    assert runner.invoke(app, args).exit_code == 0
    written = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
    assert seen["total"] == seen["done"] == written["total_size"]


def test_import_a_qwen2_moe_only_where_the_trainer_computes_the_same(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(_tiny_hf_config("qwen2_moe")).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.shared_expert_gate.weight.normal_()  # a learned gate: not expressible
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    _save(hf, tmp_path / "gated")
    with pytest.raises(UnsupportedModelError, match="shared_expert_gate.weight is not all zeros"):
        import_hf(str(tmp_path / "gated"), str(tmp_path / "no"), sizes={})
    assert not os.path.exists(tmp_path / "no")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.shared_expert_gate.weight.zero_()
    _save(hf, tmp_path / "ungated")
    report = import_hf(str(tmp_path / "ungated"), str(tmp_path / "ckpt"), sizes={"ep": 2})
    assert report["model"]["shared_expert"] is True
    cfg = dataclasses.replace(preset("tiny"), **report["model"])
    want = hf_logits(str(tmp_path / "ungated"))
    assert (trainer_logits(str(tmp_path / "ckpt"), cfg) - want).abs().max().item() <= TOL
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.bias.fill_(0.5)
    _save(hf, tmp_path / "biased")
    with pytest.raises(UnsupportedModelError, match="k_proj.bias is not all zeros"):
        import_hf(str(tmp_path / "biased"), str(tmp_path / "no2"), sizes={})


@pytest.mark.parametrize(
    "kind, change, match",
    [
        ("mixtral", {"num_experts_per_tok": 1}, "top-1 Mixtral"),
        ("mixtral", {"sliding_window": 16}, "sliding_window 16"),
        ("mixtral", {"model_type": "llama"}, "model_type 'llama'"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("mixtral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn'"),
        # transformers reads rope_scaling before rope_parameters
        ("mixtral", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
        ("mixtral", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ("qwen2_moe", {"num_experts_per_tok": 1}, "norm_topk_prob is true with top-1"),
        ("qwen2_moe", {"norm_topk_prob": False}, "norm_topk_prob is false with top-2"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, "some layers are dense"),
    ],
)
def test_import_refuses_what_the_trainer_cannot_compute(tmp_path, kind, change, match):
    torch.manual_seed(0)
    cls = transformers.MixtralForCausalLM if kind == "mixtral" else transformers.Qwen2MoeForCausalLM
    _save(cls(_tiny_hf_config(kind)), tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(UnsupportedModelError, match=match):
        import_hf(str(tmp_path / "m"), str(tmp_path / "out"), sizes={})


def test_a_mixtral_without_a_theta_gets_transformers_default(tmp_path):
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    conf = json.loads(path.read_text())
    conf.pop("rope_theta", None)
    conf.pop("rope_parameters", None)
    path.write_text(json.dumps(conf))
    report = import_hf(str(tmp_path / "m"), str(tmp_path / "ckpt"), sizes={})
    assert report["model"]["rope_theta"] == 1e6
    cfg = dataclasses.replace(preset("tiny"), **report["model"])
    diff = trainer_logits(str(tmp_path / "ckpt"), cfg) - hf_logits(str(tmp_path / "m"))
    assert diff.abs().max().item() <= TOL


def test_import_names_a_damaged_directory(tmp_path):
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    with pytest.raises(HfFormatError, match="is not a directory"):
        import_hf(str(tmp_path / "nope"), str(tmp_path / "o"), sizes={})
    weights = [f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    path = tmp_path / "m" / weights[0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointCorruptError, match=re.escape(weights[0])):
        import_hf(str(tmp_path / "m"), str(tmp_path / "o"), sizes={})
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(HfFormatError):
        import_hf(str(tmp_path / "m"), str(tmp_path / "o"), sizes={})
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    with pytest.raises(HfFormatError, match="must be a JSON object"):
        import_hf(str(tmp_path / "m"), str(tmp_path / "o"), sizes={})
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("kind", ["symbolic link", "FIFO"])
def test_import_reads_only_regular_files_and_follows_no_link(tmp_path, name, kind):
    """A config or weight file that is a link to a file outside the directory was imported
    silently; one that is a FIFO hung the import forever (open waited for a writer)."""
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    path = tmp_path / "m" / name
    writer = None
    if kind == "FIFO":
        path.unlink()
        os.mkfifo(path)
        # a writer that opens and closes the FIFO at once, for 20 s at most: a reader blocked in
        # open() (safetensors' open holds the GIL: nothing in this process could free it) gets
        # EOF, so without the fix this test fails instead of hanging
        writer = subprocess.Popen(
            ["timeout", "20", "sh", "-c", 'exec 3>"$0"', str(path)], start_new_session=True
        )
    else:
        path.rename(tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    what = r"is a symbolic link; an import does not follow links" if kind != "FIFO" else "FIFO"
    try:
        with pytest.raises(HfFormatError, match=re.escape(str(path)) + ".* " + what):
            import_hf(str(tmp_path / "m"), str(tmp_path / "o"), sizes={})
    finally:
        if writer is not None:  # (its group: killing timeout alone left sh blocked in open)
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait()
    assert not os.path.exists(tmp_path / "o")


def test_import_reads_the_weight_file_it_checked_not_one_swapped_in_after(tmp_path, monkeypatch):
    """safe_open takes a path: a shard swapped for a link (here to a file that is not weights)
    between the import's check and safe_open's own open was read through the link."""
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    want = import_hf(str(tmp_path / "m"), str(tmp_path / "first"), sizes={})
    (tmp_path / "outside").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      " + b"not weights")
    real = hf_format.open_source_file
    swapped: list[str] = []

    def check_then_swap(path, what, error):
        f = real(path, what, error)
        if path.endswith(".safetensors"):  # the checked file moves away, a link takes its name
            os.rename(path, str(tmp_path / "moved"))
            os.symlink(tmp_path / "outside", path)
            swapped.append(path)
        return f

    monkeypatch.setattr(hf_format, "open_source_file", check_then_swap)
    got = import_hf(str(tmp_path / "m"), str(tmp_path / "second"), sizes={})
    assert swapped and got["model"] == want["model"]

    def tensors(out: str) -> dict[str, torch.Tensor]:
        files = sorted((tmp_path / out).rglob("*.safetensors"))
        assert files
        return {f"{f.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}

    ta, tb = tensors("first"), tensors("second")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_checkpoint_without_its_model_config_names_the_option(tmp_path):
    cfg = MoEConfig.from_mapping(dataclasses.asdict(preset("tiny")), "t")
    url = str(tmp_path / "old")
    with Checkpointer(url, layout=Layout(dp=1, ep=1, tp=1)) as ck:
        tensors = {k[len("model.") :]: torch.randn(s) for k, s in cfg.tensor_shapes().items()}
        ck.save(3, {"model": tensors, "config": {"preset": "tiny"}}).wait()
    with pytest.raises(StateMismatchError, match=r"--model-config FILE.*preset\('tiny'\)"):
        export_reference_hf(url, str(tmp_path / "hf"))
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(dataclasses.asdict(preset("tiny"))))
    r = runner.invoke(
        app,
        ["export", url, str(tmp_path / "hf"), "--format", "hf", "--model-config", str(model_json)],
    )
    assert r.exit_code == 0, r.output
    assert "Qwen2MoeForCausalLM" in r.output and "loads it" in r.output
    bad = dict(dataclasses.asdict(preset("tiny")), num_experts=8)
    model_json.write_text(json.dumps(bad))
    r = runner.invoke(
        app,
        ["export", url, str(tmp_path / "hf2"), "--format", "hf", "--model-config", str(model_json)],
    )
    assert r.exit_code == 2 and "makes it (8, 64)" in r.output, r.output


def test_other_checkpoints_keep_their_names_or_a_name_map(tmp_path):
    url = str(tmp_path / "user")
    with Checkpointer(url) as ck:  # a user's own config.model values do not make it the trainer's
        state = {"model": {"enc.w": torch.ones(2, 3), "dec.w": torch.zeros(3)}}
        ck.save(1, {**state, "config": {"model": {"width": 3}}}).wait()
    r = runner.invoke(app, ["export", url, str(tmp_path / "a"), "--format", "hf"])
    assert r.exit_code == 0 and "Not a reference-trainer checkpoint" in r.output, r.output
    names = set(load_file(str(tmp_path / "a" / "model-00001-of-00001.safetensors")))
    assert names == {"model.enc.w", "model.dec.w"}
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"model.enc.w": "encoder.weight"}))
    r = runner.invoke(
        app, ["export", url, str(tmp_path / "b"), "--format", "hf", "--name-map", str(mapping)]
    )
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "b" / "model-00001-of-00001.safetensors"))
    assert set(got) == {"encoder.weight", "model.dec.w"} and torch.equal(
        got["encoder.weight"], torch.ones(2, 3)
    )
    mapping.write_text(json.dumps({"model.nope": "x"}))
    r = runner.invoke(
        app, ["export", url, str(tmp_path / "c"), "--format", "hf", "--name-map", str(mapping)]
    )
    assert r.exit_code == 2 and "model.nope" in r.output
    mapping.write_text(json.dumps({"model.enc.w": "model.dec.w"}))
    r = runner.invoke(
        app, ["export", url, str(tmp_path / "d"), "--format", "hf", "--name-map", str(mapping)]
    )
    assert r.exit_code == 2 and "the same name" in r.output


def test_cli_import_and_export_round_trip(tmp_path):
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")).eval()
    _save(hf, tmp_path / "m")
    out = str(tmp_path / "ckpt")
    r = runner.invoke(app, ["import", str(tmp_path / "m"), out, "--format", "hf", "--tp", "2"])
    assert r.exit_code == 0 and "--init-from" in r.output, r.output
    r = runner.invoke(app, ["import", str(tmp_path / "m"), out, "--format", "hf"])
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = runner.invoke(app, ["export", out, str(tmp_path / "again"), "--format", "hf"])
    assert r.exit_code == 0 and "MixtralForCausalLM" in r.output, r.output
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (hf_logits(str(tmp_path / "again")) - want).abs().max().item() <= TOL
    r = runner.invoke(app, ["import", str(tmp_path / "m"), out, "--format", "onnx"])
    assert r.exit_code == 2 and "one of 'hf', 'dcp'" in r.output


def test_preset_checkpoint_takes_the_model_the_import_recorded(tmp_path):
    from reference_trainer.__main__ import config_from, parser

    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    imported = str(tmp_path / "imported")
    import_hf(str(tmp_path / "m"), imported, sizes={})
    ckpt = str(tmp_path / "run")
    argv = ["--preset", "checkpoint", "--init-from", imported, "--ckpt", ckpt, "--steps", "1"]
    cfg = config_from(parser().parse_args(argv), 1)
    assert cfg.model.rope_theta == 1e6 and cfg.model.expert_ffn_dim == 32
    assert cfg.model.shared_expert is False and cfg.model.num_experts == 4
    # it trains from those weights (a zero learning rate: its first save equals the import)
    kw = {"steps": 1, "global_batch": 2, "save_every": 1, "ckpt": ckpt, "lr": 0.0}
    run_distributed(
        run_train, 1, {**kw, "init_from": imported, "model": dataclasses.asdict(cfg.model)}
    )
    assert model_weights(ckpt).keys() == model_weights(imported).keys()
    for k, v in model_weights(imported).items():
        assert torch.equal(model_weights(ckpt)[k], v), k
    # once --ckpt has a step, the model comes from there
    shutil.rmtree(imported)
    assert config_from(parser().parse_args(argv), 1).model == cfg.model
    with pytest.raises(ConfigError, match="neither --ckpt nor --init-from holds a committed step"):
        config_from(parser().parse_args(["--preset", "checkpoint", "--ckpt", imported]), 1)
    user = str(tmp_path / "user")
    with Checkpointer(user) as ck:
        ck.save(1, {"model": {"w": torch.ones(1)}}).wait()
    with pytest.raises(ConfigError, match="records no model configuration"):
        config_from(parser().parse_args(["--preset", "checkpoint", "--init-from", user]), 1)


_HOSTILE = r"""
import json, os, resource, sys, tempfile, types
import torch  # (mapped before the cap)
from reshape.formats.hf import import_hf, model_config_of
from resilient.errors import ResilientError
with open("/proc/self/status") as f:
    vm = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
def attempt(which):
    if which == "import":
        d = tempfile.mkdtemp()
        cfg = dict(model_type="mixtral", vocab_size=8, hidden_size=8, num_hidden_layers=1 << 24,
                   num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                   max_position_embeddings=8, rms_norm_eps=1e-5, num_experts_per_tok=2,
                   num_local_experts=2, intermediate_size=8, sliding_window=None)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        import_hf(d, os.path.join(d, "out"), sizes={})
    else:
        cfg = dict(vocab_size=8, dim=8, num_layers=1 << 24, num_heads=1, num_kv_heads=1,
                   head_dim=8, num_experts=2, top_k=2, expert_ffn_dim=8, shared_expert=False,
                   seq_len=8, rope_theta=1e4, norm_eps=1e-5)
        m = types.SimpleNamespace(
            extras={"config.model." + k: v for k, v in cfg.items()},
            tensors={"model.layers.0.attn_norm.weight": None},
        )
        model_config_of(m, "a hostile step")
for which in ("import", "export"):
    try:
        attempt(which)
        print(which, "NO ERROR")
    except ResilientError as e:
        print(which, "NAMED", type(e).__name__, str(e)[:300])
    except BaseException as e:
        print(which, "OTHER", type(e).__name__, str(e)[:300])
"""


def test_a_hostile_layer_count_is_refused_before_it_is_listed():
    """A config of 2^24 layers (a 300-byte config.json, or a checkpoint's recorded values) made
    the import and the export list every layer's tensors (a hundred million entries) before any
    check: a MemoryError (here, under a 1 GiB cap) or the OOM killer. Now a named error (both
    in one capped process: one import of torch)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-c", _HOSTILE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 2, p.stdout + p.stderr[-2000:]
    assert [line.split()[:2] for line in lines] == [["import", "NAMED"], ["export", "NAMED"]], (
        p.stdout
    )


def test_a_hugging_face_hub_cache_snapshot_imports_and_only_its_blobs_are_followed(tmp_path):
    """(a review) huggingface_hub keeps a downloaded revision as links into the repo's blobs/:
    refusing every link refused the most common Hugging Face directory there is."""
    torch.manual_seed(0)
    _save(transformers.MixtralForCausalLM(_tiny_hf_config("mixtral")), tmp_path / "m")
    repo = tmp_path / "hub" / "models--x--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(os.listdir(tmp_path / "m"))):
        (tmp_path / "m" / f).rename(blobs / f"blob{i}")
        (snapshot / f).symlink_to(f"../../blobs/blob{i}")
    report = import_hf(str(snapshot), str(tmp_path / "ckpt"), sizes={})
    cfg = dataclasses.replace(preset("tiny"), **report["model"])
    hf = hf_logits(str(snapshot))
    assert (trainer_logits(str(tmp_path / "ckpt"), cfg) - hf).abs().max().item() <= TOL
    # a link in the snapshot to anything but a blob of its repo is refused as anywhere else
    config = snapshot / "config.json"
    target = os.path.realpath(config)
    config.unlink()
    shutil.copy(target, tmp_path / "elsewhere.json")
    config.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(HfFormatError, match="is a symbolic link; an import does not follow"):
        import_hf(str(snapshot), str(tmp_path / "o"), sizes={})
