"""Moving weights in and out: ``reshape export --format hf`` and ``reshape import --format dcp``
against the raw disk and against what the ecosystem does with the same weights.

The weights are the reference trainer's ``small`` preset (initialised, not trained: the bytes are
what matters), in a checkpoint written in layout tp 2 (two rank files).  Each trial runs, in a
rotating order, each after ``os.sync()`` (the page cache stays warm: the source is read from
memory, as right after training):

* ``export_reference_hf``: read every model tensor (every block's checksum verified), cut it into
  transformers' names, write safetensors shards + config.json + the index;
* transformers' ``save_pretrained`` of the same model (loaded from that export beforehand);
* ``import_dcp`` of a DCP checkpoint of the same weights into layout tp 2 (torch's reader, then
  a one-rank checkpoint converted to tp 2 and verified against ``dcp.load``);
* ``dcp.save`` of the same weights (no process group), and ``dcp.load`` of them into plain
  tensors (what the import does first);
* the raw disk: the same bytes written to one file, with and without ``fsync``.

    python benchmarks/interop.py [--trials 3] [--dir DIR] [--preset small] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine, markdown_table, median, write_results  # noqa: E402

from reference_trainer.config import preset  # noqa: E402
from reference_trainer.model import MoETransformer, init_parameters  # noqa: E402
from reference_trainer.parallel import ParallelContext  # noqa: E402
from reshape.execute import convert  # noqa: E402
from reshape.formats.hf import export_reference_hf  # noqa: E402
from resilient import Checkpointer  # noqa: E402


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def raw_write(path: str, nbytes: int, fsync: bool) -> None:
    buf = memoryview(bytearray(64 << 20))
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(buf[: min(left, len(buf))])
        if fsync:
            os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (a local disk); default $TMPDIR")
    p.add_argument("--preset", default="small")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    import transformers

    from reshape.formats.dcp import import_dcp

    root = tempfile.mkdtemp(prefix="interop-bench-", dir=args.dir)
    try:
        cfg = preset(args.preset)
        pc = ParallelContext.single()
        model = MoETransformer(cfg, pc)
        init_parameters(model, pc, seed=0)
        one, src = os.path.join(root, "one"), os.path.join(root, "src")
        with Checkpointer(one, layout=pc.layout) as ck:
            ck.save(1, {"model": model, "config": {"model": dataclasses.asdict(cfg)}}).wait()
        convert(one, src, {"dp": 1, "ep": 1, "tp": 2}, step=1)
        shutil.rmtree(one)
        weights = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        export_reference_hf(src, os.path.join(root, "hf0"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf0"))
        dcp_src = os.path.join(root, "dcp0")
        dcp.save(weights, checkpoint_id=dcp_src, no_dist=True)
        del model

        def out(name: str) -> str:
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            return path

        methods = {
            "reshape export --format hf": lambda: export_reference_hf(src, out("hf")),
            "transformers save_pretrained": lambda: hf.save_pretrained(out("pretrained")),
            "reshape import --format dcp (tp 2)": lambda: import_dcp(
                dcp_src, out("imported"), sizes={"tp": 2}, trust_pickle=True
            ),
            "dcp.save": lambda: dcp.save(weights, checkpoint_id=out("dcp"), no_dist=True),
            "dcp.load (the import's first phase)": lambda: dcp.load(
                {k: torch.empty_like(v) for k, v in weights.items()},
                checkpoint_id=dcp_src,
                no_dist=True,
            ),
            "raw write": lambda: raw_write(out("raw"), nbytes, fsync=False),
            "raw write + fsync": lambda: raw_write(out("raw"), nbytes, fsync=True),
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        names = list(methods)
        for trial in range(args.trials):
            for name in names[trial % len(names) :] + names[: trial % len(names)]:
                os.sync()
                time.sleep(0.5)
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
        sizes = {
            "reshape export --format hf": du(os.path.join(root, "hf")),
            "transformers save_pretrained": du(os.path.join(root, "pretrained")),
            "reshape import --format dcp (tp 2)": du(os.path.join(root, "imported")),
            "dcp.save": du(os.path.join(root, "dcp")),
            "dcp.load (the import's first phase)": 0,
            "raw write": nbytes,
            "raw write + fsync": nbytes,
        }
        rows = []
        raw = median(times["raw write + fsync"])
        for name in names:
            m = median(times[name])
            rows.append(
                [
                    name,
                    f"{m:.2f}",
                    f"{min(times[name]):.2f}-{max(times[name]):.2f}",
                    f"{sizes[name] / 2**20:.0f}",
                    f"{sizes[name] / m / 2**20:.0f}",
                    f"{m / raw:.2f}x",
                ]
            )
        print(f"{machine()}; {args.preset} preset, {nbytes / 2**20:.0f} MiB of float32 weights")
        print(
            markdown_table(
                ["what", "median s", "range s", "MiB written", "MiB/s", "vs raw write + fsync"],
                rows,
            )
        )
        write_results(
            args.json,
            {"machine": machine(), "bytes": nbytes, "times_s": times, "written": sizes},
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
