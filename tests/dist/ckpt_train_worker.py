"""A training job for torchrun that survives a lost rank (run by test_checkpoint_faults.py):

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 1 \
        tests/dist/ckpt_train_worker.py --root DIR --steps 10 --every 3 --kill-rank 1 --kill-step 7

gpt-tiny on dp=2 x tp=2 with ZeRO-3, AdamW. On the first attempt it first trains `--steps`
steps uninterrupted from the fresh model (the reference trajectory), then goes back to the
initial state (a checkpoint saved before training) and trains again, saving an asynchronous
checkpoint every `--every` steps; rank `--kill-rank` dies (os._exit) before step
`--kill-step`. torchrun stops the other ranks and restarts all four; the second attempt loads
the latest complete checkpoint and trains to the end. Rank 0 appends one JSON line per event
to DIR/log.jsonl: {"attempt", "what": "ref" | "run", "step", "loss"} and {"attempt",
"what": "resume", "from", "path"}. Losses are compared exactly by the test.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import autopar
from autopar import checkpoint_api as ckpt
from autopar import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=7)
    a = ap.parse_args()
    ckpt.init_restartable("gloo", timeout_s=60)  # plain env:// init cannot be restarted on gloo (see there)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = models.get("gpt-tiny")

    def batch(step: int):
        (x,), y = spec.example_batch(8, generator=torch.Generator().manual_seed(1000 + step))
        return (x,), y

    def log(**kw) -> None:
        if rank == 0:
            with open(os.path.join(a.root, "log.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": attempt, **kw}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    torch.manual_seed(0)
    pm = autopar.parallelize(spec.build(), autopar.mesh(dp=2, tp=2), example_inputs=batch(0)[0], zero_stage=3,
                             hardware="h100-sxm")
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)

    def train_step(i: int) -> float:
        loss = pm.step(batch(i), spec.loss_fn)
        opt.step()
        opt.zero_grad()
        return loss.item()

    runs = os.path.join(a.root, "run")
    if attempt == 0:
        ckpt.save(pm, os.path.join(a.root, "init"), optimizer=opt, step=0)
        for i in range(a.steps):
            log(what="ref", step=i, loss=train_step(i))
        ckpt.load(pm, os.path.join(a.root, "init"), optimizer=opt)  # the fresh model and optimizer again
        start = 0
    else:
        path = ckpt.latest_checkpoint(runs)
        if path is None:
            raise SystemExit(f"rank {rank}: no complete checkpoint under {runs} to resume from")
        start = ckpt.load(pm, path, optimizer=opt)["step"]
        log(what="resume", **{"from": start, "path": os.path.basename(path)})
    pending = None
    for i in range(start, a.steps):
        if attempt == 0 and rank == a.kill_rank and i == a.kill_step:
            os._exit(13)  # a lost rank: no cleanup, no goodbye
        log(what="run", step=i, loss=train_step(i))
        if pending is not None:  # the previous save overlapped this step; finish it now
            pending.wait()
            pending = None
        if (i + 1) % a.every == 0:
            pending = ckpt.save(pm, os.path.join(runs, f"step_{i + 1:04d}"), optimizer=opt, step=i + 1,
                                async_save=True)
    if pending is not None:
        pending.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
