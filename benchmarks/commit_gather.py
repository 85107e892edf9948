"""The commit handshake's gather on rank 0, at many simulated ranks: this tree against another one.

Rank 0 of a commit collects every other rank's report (its file, its chunks' places and
checksums) from the c10d store. One real TCPStore on loopback holds ``world - 1`` reports the
size of a tiny-preset rank's (46 chunk entries); rank 0's ``Committer.gather`` of this tree and of
``--other``'s ``resilient/checkpoint/writer.py`` each read them, alternately, through a client
connection; the median of ``--repeats`` per size. Loopback is the kindest case for many round
trips: across hosts each request costs more.

Usage: ``python benchmarks/commit_gather.py --other /path/to/a/checkout`` (``git worktree add
/tmp/base <commit>``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch.distributed as dist

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from resilient.checkpoint.writer import Committer  # noqa: E402


def other_committer(tree: str):
    path = os.path.join(tree, "resilient", "checkpoint", "writer.py")
    spec = importlib.util.spec_from_file_location("resilient.checkpoint._other_writer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod.Committer


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--other", required=True, help="a checkout of the tree to compare with")
    p.add_argument("--worlds", default="2,8,64,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    trees = {"this tree": Committer, "other tree": other_committer(os.path.abspath(args.other))}
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=60))
    chunks = {
        f"layers.{i}.weight": {"offsets": [0, 0], "sizes": [64, 64], "checksums": [12345678]}
        for i in range(46)
    }
    print(f"other tree: {os.path.abspath(args.other)}")
    print("| ranks | other tree ms | this tree ms | other / this |")
    print("|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        prefix = f"bench/{world}"
        for r in range(1, world):
            server.set(f"{prefix}/report/{r}", json.dumps({"rank": r, "chunks": chunks}))
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, cls in trees.items():
                t0 = time.perf_counter()
                got = cls(client, prefix, 0, world, timeout_s=60).gather({"rank": 0})
                times[name].append(time.perf_counter() - t0)
                assert len(got) == world
        this, other = (statistics.median(times[n]) * 1e3 for n in ("this tree", "other tree"))
        print(f"| {world} | {other:.2f} | {this:.2f} | {other / this:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
