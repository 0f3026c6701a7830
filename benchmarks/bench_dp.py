"""Data-parallel step time of autopar against PyTorch's DDP, same model, same world, same job.

    python benchmarks/bench_dp.py [--world-size 4] [--steps 10] [--dim 256] [--layers 4]

Each rank builds the same GPT, wraps one copy with autopar (ZeRO-0: bucketed async
all-reduce) and one with DDP (default 25 MB buckets), and times forward+backward+AdamW
steps, alternating the two in rounds so machine noise hits both alike. Prints the median
step time of each and the ratio autopar / DDP (target <= 1.0).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rank(rank, ws, steps, dim, layers, batch, seq):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from autopar.models import GPT, GPTConfig, gpt

    cfg = GPTConfig(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=4 * dim,
                    max_seq_len=seq)
    torch.manual_seed(0)
    m1, m2 = GPT(cfg), GPT(cfg)
    m2.load_state_dict(m1.state_dict())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    pm = autopar.parallelize(m1, autopar.mesh(dp=ws), example_inputs=x)
    opt1 = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    ddp = DDP(m2)
    opt2 = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    k = batch // ws
    lx, ly = x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]

    def step_autopar():
        pm.step((x, y), gpt.loss_fn)
        opt1.step()
        opt1.zero_grad()

    def step_ddp():
        loss = gpt.loss_fn(ddp(lx), ly)
        loss.backward()
        opt2.step()
        opt2.zero_grad()

    times = {"autopar": [], "ddp": []}
    for i in range(steps + 2):
        for name, fn in (("autopar", step_autopar), ("ddp", step_ddp)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= 2:  # warm-up rounds
                times[name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in m1.parameters())
    return {k: statistics.median(v) for k, v in times.items()} | {"params": n_params}


def main():
    from autopar.runtime.launch import run_world

    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    res = run_world(a.world_size, _rank, a.steps, a.dim, a.layers, a.batch, a.seq, timeout_s=1200)
    r0 = res[0]
    print(f"GPT {r0['params'] / 1e6:.1f} M params, gloo, {a.world_size} processes, global batch {a.batch} x {a.seq}, "
          f"median of {a.steps} steps (torch {torch.__version__})")
    print(f"  autopar dp (ZeRO-0) step: {r0['autopar'] * 1e3:8.1f} ms")
    print(f"  PyTorch DDP step:         {r0['ddp'] * 1e3:8.1f} ms")
    print(f"  ratio autopar / DDP:      {r0['autopar'] / r0['ddp']:.3f}   (target <= 1.0)")


if __name__ == "__main__":
    main()
