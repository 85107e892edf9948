"""The trainer's pieces without processes: config checks, presets, sizing rules, data order."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from reference_trainer.config import PRESETS, ConfigError, TrainConfig, preset, sizing_warnings
from reference_trainer.data import Loader
from reference_trainer.model import global_shapes
from reference_trainer.parallel import PLACEMENTS, placement_of, zero_dim
from resilient.errors import StateMismatchError


def test_presets_sizes():
    assert PRESETS["tiny"].num_params < 1_000_000
    assert 10_000_000 < PRESETS["small"].num_params < 100_000_000
    z = preset("zaya1-mini")
    assert z.top_k == 1 and z.head_dim == 128 and z.num_params > PRESETS["small"].num_params
    with pytest.raises(ConfigError, match="not a preset"):
        preset("nope")


def test_every_parameter_has_a_placement_and_even_tp_splits():
    for name, cfg in PRESETS.items():
        shapes = global_shapes(cfg)
        for pname, shape in shapes.items():
            placement = placement_of(pname)
            for p in placement.values():
                assert p.dim < len(shape), (name, pname)
            zero_dim(pname, torch.Size(shape))  # ZeRO always finds a whole dim
    assert all(isinstance(p, str) for p, _ in PLACEMENTS)


def test_config_messages_name_the_flags():
    with pytest.raises(
        ConfigError, match=r"--dp 2 x --ep 2 x --tp 2 = 8 ranks, but the job has 4 ranks"
    ):
        TrainConfig(dp=2, ep=2, tp=2, world_size=4)
    with pytest.raises(ConfigError, match="--steps 0"):
        TrainConfig(steps=0)


def test_sizing_warnings_say_which_dimension_and_what_to_do():
    tiny = preset("tiny")
    warns = sizing_warnings(tiny, 2, on_gpu=True, tokens_per_rank=512)
    assert any("head_dim 16" in w and "64 or 128" in w for w in warns)
    assert any("dim 64 / tp 2 = 32 per rank is not a multiple of 64" in w for w in warns)
    assert any("too small to fill the GPU" in w for w in warns)
    assert sizing_warnings(preset("zaya1-mini"), 1, on_gpu=True, tokens_per_rank=8192) == []
    assert not any(
        "fill the GPU" in w for w in sizing_warnings(tiny, 1, on_gpu=False, tokens_per_rank=1)
    )


def test_sample_order_does_not_depend_on_the_data_parallel_size():
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    whole = Loader(tokens, seq_len=16, global_batch=12, seed=3, replica=0, num_replicas=1)
    for replicas in (2, 3, 4, 6):
        parts = [
            Loader(tokens, seq_len=16, global_batch=12, seed=3, replica=r, num_replicas=replicas)
            for r in range(replicas)
        ]
        for step in (1, 7):
            x, y = whole.batch(step)
            xs = torch.cat([p.batch(step)[0] for p in parts])
            assert torch.equal(x, xs)
            ids = [i for p in parts for i in p.sample_ids(step)]
            assert ids == whole.sample_ids(step) == list(range((step - 1) * 12, step * 12))
    x, y = whole.batch(2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert whole.state_dict() == {"next_step": 3}


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_model_trains_under_bf16_autocast(name):
    """The trainer's GPU path runs the model under bf16 autocast; the same dtypes meet on the CPU
    (the experts' matmuls give bf16, the residual stream stays fp32), so CI catches a mix-up
    that only a GPU run would otherwise show."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from reference_trainer.model import MoETransformer, init_parameters
    from reference_trainer.parallel import ParallelContext

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = preset(name)
        pc = ParallelContext.create(1, 1, 1, "cpu")
        model = MoETransformer(cfg, pc)
        init_parameters(model, pc, 0)
        x = torch.randint(0, cfg.vocab_size, (2, min(cfg.seq_len, 64)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, aux = model(x)
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
        (loss + aux).backward()
        assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())
        assert torch.isfinite(loss)
    finally:
        dist.destroy_process_group()


def test_metrics_are_appended_on_a_fresh_line_after_a_record_a_kill_cut(tmp_path):
    """A kill can cut rank 0's last metrics record mid-write; the restart's first record must
    not land on that line (the chaos verifier would read the two as one cut record)."""
    from reference_trainer.train import open_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    with open_metrics(str(path)) as f:
        f.write('{"step": 2}\n')
    with open_metrics(str(path)) as f:  # a whole last line: nothing added
        f.write('{"step": 3}\n')
    assert path.read_text().splitlines() == [
        '{"step": 1}',
        '{"step": 2, "lo',
        '{"step": 2}',
        '{"step": 3}',
    ]
    with open_metrics(str(tmp_path / "new.jsonl")) as f:  # a new file starts at its start
        f.write('{"step": 1}\n')
    assert (tmp_path / "new.jsonl").read_text() == '{"step": 1}\n'


# --- the trainer review: flags refused by name, resumes that would read other samples, and
# non-finite gradients never applied


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"memory_commit_every": -1}, "--memory-commit-every"),  # (was a bare ValueError)
        ({"keep_last": 0}, "--keep-last"),  # (was refused by Run, after the process group)
        ({"keep_last": -2}, "--keep-last"),
        ({"global_batch": 0}, "--global-batch"),  # (0 and -8 "divide" every replica count)
        ({"global_batch": -8}, "--global-batch"),
        ({"lr": float("nan")}, "--lr"),
        ({"lr": -1.0}, "--lr"),
        ({"warmup_steps": -1}, "--warmup-steps"),
        ({"grad_clip": float("nan")}, "grad_clip"),
        ({"min_lr_ratio": -0.5}, "min_lr_ratio"),
    ],
)
def test_a_value_no_run_can_use_is_a_config_error(tmp_path, kw, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(ckpt=str(tmp_path), save_every=1, **kw)


def test_the_command_line_refuses_a_negative_memory_commit_every_with_exit_code_2(capsys):
    from reference_trainer.__main__ import main

    assert main(["--memory-commit-every", "-1", "--steps", "1"]) == 2
    assert "--memory-commit-every" in capsys.readouterr().err


@pytest.mark.parametrize("change", [{"global_batch": 4}, {"seed": 5}])
def test_a_resume_with_another_seed_or_global_batch_is_refused(tmp_path, change):
    """Sample ids are (step - 1) x global_batch and their windows come from the seed: resumed
    with --global-batch 4 after 2 steps of 8, step 3 read ids [8, 12), which step 2 had
    consumed (and said so in its metrics); with another --seed the same ids named other
    windows.  Refused by name now."""
    from tests.dist import run_distributed
    from tests.integration.trainer_runs import run_train

    ckpt = str(tmp_path / "ck")
    run_distributed(run_train, 1, {"save_every": 2, "ckpt": ckpt, "steps": 2, "global_batch": 8})
    with pytest.raises(AssertionError) as e:
        run_distributed(
            run_train, 1, {"save_every": 2, "ckpt": ckpt, "steps": 4, "global_batch": 8, **change}
        )
    flag = "--" + next(iter(change)).replace("_", "-")
    assert "ConfigError" in str(e.value) and f"was trained with {flag}" in str(e.value)


def test_a_resume_on_another_corpus_is_refused(tmp_path, monkeypatch):
    """Every step's windows are drawn from the corpus: resumed with another --data (or the same
    path edited), the run read other samples than the one it continues, without a word.  The
    checkpoint records the corpus by content now: another is refused by name (the same text
    under another path is the same corpus: test_the_corpus_id_is_its_content_...)."""
    from tests.dist import run_distributed
    from tests.integration.trainer_runs import run_train

    monkeypatch.setenv("RESILIENT_CACHE", str(tmp_path / "cache"))
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.replace("fox", "cat"))
    ckpt = str(tmp_path / "ck")
    run = {"save_every": 2, "ckpt": ckpt, "global_batch": 8}
    run_distributed(run_train, 1, {**run, "steps": 2, "data": str(tmp_path / "a.txt")})
    with pytest.raises(AssertionError) as e:
        run_distributed(run_train, 1, {**run, "steps": 4, "data": str(tmp_path / "b.txt")})
    assert "ConfigError" in str(e.value) and "another corpus" in str(e.value), str(e.value)[-2000:]


def test_ranks_that_read_different_corpora_all_refuse(tmp_path, monkeypatch):
    """Each node reads its own copy of --data: with copies that differ, a fresh run trained its
    ranks on different text without a word, and a resume was refused only by the ranks whose
    copy differed from the checkpoint's (the others waited for the failure detector).  Every
    rank refuses alike now, before the first step."""
    from tests.dist import run_distributed
    from tests.integration.trainer_runs import refused_config

    monkeypatch.setenv("RESILIENT_CACHE", str(tmp_path / "cache"))
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.replace("fox", "cat"))
    data = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    got = run_distributed(refused_config, 2, {"steps": 1, "dp": 2, "data_by_rank": data})
    assert all(isinstance(m, str) and "do not read the same corpus" in m for m in got), got
    assert "rank(s) [1]" in got[0] and "this rank, 1," in got[1]


def test_a_step_that_records_no_corpus_resumes_with_a_warning(tmp_path, caplog):
    """A step saved by a trainer before the corpus was recorded lacks the value (loaded as
    optional: it keeps None): it resumes, said, and the run's own saves record its corpus."""
    from reference_trainer.train import _check_resumed_corpus

    cfg = TrainConfig(ckpt=str(tmp_path), save_every=1)
    config = {"corpus": None}
    with caplog.at_level("WARNING"):
        _check_resumed_corpus(config, cfg, 4, "100:abc")
    assert "does not record which corpus" in caplog.text
    assert config["corpus"] == "100:abc"
    _check_resumed_corpus(config, cfg, 4, "100:abc")  # (the same: nothing said)
    with pytest.raises(ConfigError, match="another corpus"):
        _check_resumed_corpus(config, cfg, 4, "100:abd")


def test_the_corpus_id_is_its_content_and_kept_beside_the_token_cache(tmp_path, monkeypatch):
    from reference_trainer.data import corpus_id, load_tokens

    monkeypatch.setenv("RESILIENT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("x" * 500)
    (tmp_path / "b.txt").write_text("x" * 500)
    (tmp_path / "c.txt").write_text("x" * 499 + "y")
    ids = [corpus_id(load_tokens(str(tmp_path / n))) for n in ("a.txt", "b.txt", "c.txt")]
    assert ids[0] == ids[1] != ids[2] and ids[0].startswith("502:")
    sides = sorted((tmp_path / "cache").glob("*.id"))
    assert len(sides) == 3 and {p.read_text().split()[0] for p in sides} == set(ids)


def test_an_edited_corpus_of_the_same_size_and_mtime_second_is_another_corpus(
    tmp_path, monkeypatch
):
    """The token cache was keyed by (path, size, whole seconds of mtime): a file rewritten with
    the same size within the same second (or with its mtime put back, as cp -p and rsync -t do)
    reused the stale cache, so the run trained on the old text and its corpus id said nothing."""
    from reference_trainer.data import corpus_id, load_tokens

    monkeypatch.setenv("RESILIENT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "a.txt"
    f.write_text("x" * 500)
    st = f.stat()
    first = load_tokens(str(f))
    was = corpus_id(first)
    f.write_text("y" * 500)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # (the same size, the same mtime)
    now = load_tokens(str(f))
    assert bytes(now[:3]) == b"yyy"
    assert corpus_id(now) != was


def test_a_stale_sidecar_does_not_name_a_rebuilt_cache(tmp_path, monkeypatch):
    """The corpus id beside the token cache was taken on the word of its length alone: a cache
    rebuilt with other content of the same length (deleted and made again, replaced by another
    process) kept the id of the old one, and a resume on it was let through."""
    from reference_trainer.data import corpus_id, load_tokens

    monkeypatch.setenv("RESILIENT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "a.txt"
    f.write_text("x" * 500)
    tokens = load_tokens(str(f))
    was = corpus_id(tokens)
    cache = tokens.filename
    del tokens
    tmp = str(cache) + ".new"
    with open(tmp, "wb") as out:
        out.write(b"z" * 502)
    os.replace(tmp, cache)
    rebuilt = np.memmap(cache, dtype=np.uint8, mode="r")
    assert corpus_id(rebuilt) != was


@pytest.mark.parametrize("value", [True, 2.7, "5", None, 0, -3, 2**63, [4]])
def test_a_loader_position_that_is_no_step_number_is_refused(value):
    """int() took True as step 1, 2.7 as 2, '5' as 5, 0, -3 and 2**63 as they were (other
    samples than the run's, without a word); None was a bare TypeError."""
    loader = Loader(np.zeros(100, np.uint8), seq_len=4, global_batch=2, seed=0, replica=0,
                    num_replicas=1)  # fmt: skip
    with pytest.raises(StateMismatchError, match="the loader's saved position 'data.next_step' "
                       f"is {re.escape(repr(value))} .* expected an int step number >= 1"):  # fmt: skip
        loader.load_state_dict({"next_step": value})
    assert loader.next_step == 1


def test_a_resume_whose_loader_position_is_not_the_next_step_is_refused(tmp_path):
    """A step-2 checkpoint whose loader says step 1 comes next served step 1's samples again at
    step 3 (and recorded them as consumed twice); refused by name now."""
    import json

    from tests.dist import run_distributed
    from tests.integration.trainer_runs import run_train

    ckpt = str(tmp_path / "ck")
    run_distributed(run_train, 1, {"save_every": 2, "ckpt": ckpt, "steps": 2, "global_batch": 8})
    manifest = tmp_path / "ck" / "step_00000002" / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    assert doc["extras"]["data.next_step"] == 3
    doc["extras"]["data.next_step"] = 1
    manifest.write_text(json.dumps(doc))
    with pytest.raises(AssertionError) as e:
        run_distributed(
            run_train, 1, {"save_every": 2, "ckpt": ckpt, "steps": 4, "global_batch": 8}
        )
    assert "StateMismatchError" in str(e.value)
    assert "holds the loader position data.next_step 1, expected 3" in str(e.value)


def _train_with_nan_losses(rank, world, kwargs, nan_calls):
    """The trainer with its cross entropy made NaN at some calls (a bad batch, an overflow)."""
    import types
    import warnings

    import torch.nn.functional as F

    import reference_trainer.train as T

    warnings.simplefilter("ignore")
    calls = {"n": 0}

    def ce(*a, **k):
        calls["n"] += 1
        out = F.cross_entropy(*a, **k)
        return out * float("nan") if calls["n"] in nan_calls else out

    T.F = types.SimpleNamespace(cross_entropy=ce)
    try:
        return T.train(TrainConfig(model=preset("tiny"), **kwargs))["losses"]
    except T.DivergedError as e:
        return f"diverged: {e}"


def test_non_finite_gradients_are_never_applied_nor_committed(tmp_path):
    """A NaN loss gave a NaN gradient norm (NaN > max_norm is False: no clip), the optimizer
    stepped with it, every weight became NaN and each later save committed them as a healthy
    step.  Such a step is skipped now; five in a row end the run with a named error."""
    import math

    from tests.dist import run_distributed
    from tests.integration.trainer_runs import gather_checkpoint

    ckpt = str(tmp_path / "ck")
    kw = {"steps": 3, "save_every": 1, "ckpt": ckpt}
    losses = run_distributed(_train_with_nan_losses, 1, kw, {2})[0]
    assert math.isnan(losses[1]) and math.isfinite(losses[2])  # step 2 skipped, 3 trained
    state = gather_checkpoint(ckpt, 3)
    assert all(torch.isfinite(v).all() for k, v in state.items() if k.startswith("model."))
    kw = {"steps": 8, "ckpt": str(tmp_path / "ck2")}
    out = run_distributed(_train_with_nan_losses, 1, kw, set(range(2, 100)))[0]
    assert out.startswith("diverged: step 6: the gradients were not finite"), out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nproc", "100000"], "--nproc 100000: expected a number of local ranks from 1 to 4096"),
        (["--nproc", "0"], "--nproc 0: expected a number of local ranks from 1 to 4096"),
        (["--nproc", "2", "--spares", "100000"], "--spares 100000: expected 0 to 4096 spare"),
        (["--nproc", "2", "--finish-timeout", "-1"], "--finish-timeout -1.0: expected a number"),
        (["--nproc", "2", "--finish-timeout", "nan"], "--finish-timeout nan: expected a number"),
        (["--finish-timeout", "5"], "--finish-timeout 5: it comes with --nproc"),
    ],
)
def test_the_command_line_refuses_a_number_of_processes_no_machine_runs(
    monkeypatch, capsys, flags, message
):
    """--nproc 100000 went on to start 100000 local ranks (forking until memory or pids ran
    out): a usage error naming the flag now."""
    from reference_trainer import __main__ as trainer_main

    def launched(*args, **kwargs):
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(trainer_main, "_launch", launched)
    assert trainer_main.main([*flags, "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_the_finish_timeout_goes_to_the_launcher_not_to_the_ranks(monkeypatch):
    """``--nproc N --finish-timeout S``: resilient launch's flag, taken out of the ranks' own."""
    from reference_trainer import __main__ as trainer_main
    from resilient.launch import agent

    seen = []
    monkeypatch.setattr(agent, "launch_main", lambda argv, **kw: seen.append(argv) or 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (_launch sets it where unset: undone after)
    assert (
        trainer_main.main(["--nproc", "2", "--dp", "2", "--finish-timeout", "7.5", "--steps", "1"])
        == 0
    )
    (argv,) = seen
    launcher, ranks = argv[: argv.index("-m")], argv[argv.index("-m") :]
    assert launcher[launcher.index("--finish-timeout") + 1] == "7.5"
    assert "--finish-timeout" not in ranks and ranks[:2] == ["-m", "reference_trainer"]


@pytest.mark.parametrize("flag", ["--finish", "--spare", "--max-r"])
def test_the_launchers_flags_are_not_taken_abbreviated(monkeypatch, capsys, flag):
    """``--spare 1`` with ``--nproc`` reached the launcher as ``--spares``, but the ranks' flags
    keep all but the full names: every rank refused it ("comes with --nproc") and exited 2."""
    from reference_trainer import __main__ as trainer_main

    monkeypatch.setattr(trainer_main, "_launch", lambda *a, **kw: 0)
    with pytest.raises(SystemExit) as e:
        trainer_main.main(["--nproc", "2", "--dp", "2", flag, "1", "--steps", "1"])
    assert e.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def _corpus_as_listed_before(root: str) -> list[str]:
    """The stdlib corpus as ``corpus_files(None)`` listed it before ``_corpus`` (sorted ``Path``
    objects): the cache key and the training data depend on the exact list."""
    found = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(parent, n) for n in names if n.endswith(".py")]
    return [str(p) for p in sorted(found)]


@pytest.mark.parametrize("spelling", ["{}", "{}/", "{}//", "{}/.", "{}/sub/.."])
def test_the_corpus_lists_the_same_paths_in_the_same_order_however_its_root_is_spelled(
    tmp_path, monkeypatch, spelling
):
    import sysconfig

    from reference_trainer import data

    for name in ("a.py", "a-b.py", "a.b.py", "A.py", "é.py", "sub/c.py", "sub-x/d.py", "s/e.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    root = spelling.format(tmp_path)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": root})
    listed = data._corpus(None)
    assert listed == _corpus_as_listed_before(root)
    assert len(listed) == 8 and all(os.path.isfile(f) for f in listed)
