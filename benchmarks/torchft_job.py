"""One replica group of the torchft comparison job (benchmarks/detection.py ``--paths torchft``).

The reference trainer's tiny MoE, data parallel across replica groups of one rank each, through
torchft (``pip install torchft==0.2.0``): its ``Manager`` (quorum through a lighthouse, gloo
process group reconfigured on every quorum change, the gradients' allreduce averaged over the
quorum, ``should_commit`` before the optimizer step).  Each replica appends one JSON line per step it finished to ``OUT/replica<N>.jsonl``:
the manager's step, whether it committed, the quorum's size and the wall time.

    python benchmarks/torchft_job.py REPLICA NREPLICAS LIGHTHOUSE OUT STEPS [TIMEOUT_S]
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from reference_trainer.config import TrainConfig, preset  # noqa: E402
from reference_trainer.data import Loader, load_tokens  # noqa: E402
from reference_trainer.model import MoETransformer, init_parameters  # noqa: E402
from reference_trainer.parallel import ParallelContext  # noqa: E402


def main() -> None:
    replica, replicas, lighthouse, out, steps = sys.argv[1:6]
    timeout = timedelta(seconds=float(sys.argv[6]) if len(sys.argv) > 6 else 60.0)
    replica, replicas, steps = int(replica), int(replicas), int(steps)
    from torchft import Manager, ProcessGroupGloo

    # the model's own parallel context is one rank (tp = ep = 1): the replicas are torchft's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainConfig(preset="tiny", model=preset("tiny"), world_size=1)
    pc = ParallelContext.create(1, 1, 1, "cpu")
    model = MoETransformer(cfg.model, pc)
    init_parameters(model, pc, cfg.seed)  # the same weights on every replica: no initial sync
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    loader = Loader(
        load_tokens(None),
        seq_len=cfg.model.seq_len,
        global_batch=cfg.global_batch,  # 8 sequences a step over the replicas, as in our job
        seed=cfg.seed,
        replica=replica,
        num_replicas=replicas,
    )

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        init_sync=False,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    log = open(os.path.join(out, f"replica{replica}.jsonl"), "a", buffering=1)
    while manager.current_step() < steps:
        manager.start_quorum()
        optim.zero_grad(set_to_none=True)
        x, y = loader.batch(manager.current_step() + 1)
        logits, aux = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        (loss + cfg.model.aux_loss_coef * aux).backward()
        # one flat bucket, as DDP's reducer would send (torchft 0.2.0's DistributedDataParallel
        # comm hook asserts when a peer dies mid-allreduce; the manager's allreduce reports the
        # error to should_commit instead)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        committed = manager.should_commit()
        if committed:
            optim.step()
        log.write(
            json.dumps(
                {
                    "replica": replica,
                    "pid": os.getpid(),
                    "step": manager.current_step(),
                    "committed": committed,
                    "participants": manager.num_participants(),
                    "time": time.time(),
                }
            )
            + "\n"
        )
    log.close()
    os._exit(0)  # torchft's threads and servers need not be shut down one by one


if __name__ == "__main__":
    main()
