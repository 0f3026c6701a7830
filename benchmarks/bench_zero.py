"""ZeRO step time against PyTorch's references, and bytes per step against the prediction.

    python benchmarks/bench_zero.py [--world 4] [--rounds 6] [--warmup 2]

Spawns a gloo world (CPU), builds one GPT per implementation from the same seed, and runs
the implementations round-robin, one training step each per round (so machine noise hits
all of them alike); prints the median step time of each and its ratio to the reference
measured in the same run: autopar stage 0 / DDP, stages 1-2 / DDP + ZeroRedundancyOptimizer,
stage 3 / FSDP2 (fully_shard per block and root).

Then, for each autopar stage, the payload bytes that `collectives.COUNTER` counted in one
step next to the bytes predicted from the parameter sizes (runtime/zero.py's formula:
P = parameter bytes, Pp = the same with dim 0 padded to a multiple of dp; stage 3 does
not re-gather in backward a unit whose only weights are embeddings), and the bytes each
rank sends on the wire for that payload by the cost model's ring formula
(`autopar.cost.comm.bytes_sent`).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.models import GPT, GPTConfig
from autopar.models.gpt import loss_fn
from autopar.runtime import collectives as C
from autopar.runtime.launch import run_world
from autopar.runtime.mesh import make_mesh
from autopar.runtime.zero import make_engine

CONFIG = GPTConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=64)
BATCH, SEQ, LR = 2, 64, 1e-3


def predicted_payload(model: nn.Module, dp: int, stage: int) -> dict[str, int]:
    shapes = [(n, tuple(p.shape), p.element_size()) for n, p in model.named_parameters()]
    P = sum(torch.Size(s).numel() * e for _, s, e in shapes)
    pad = lambda s, e: -(-s[0] // dp) * dp * torch.Size(s[1:]).numel() * e
    Pp = sum(pad(s, e) for _, s, e in shapes)
    if stage == 0:
        return {"all_reduce@dp": P}
    if stage in (1, 2):
        return {("all_reduce@dp" if stage == 1 else "reduce_scatter@dp"): P if stage == 1 else Pp,
                "all_gather@dp": Pp // dp}
    emb = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    bwd = sum(pad(s, e) for n, s, e in shapes if n not in emb) // dp
    return {"reduce_scatter@dp": Pp, "all_gather@dp": Pp // dp + bwd}


def _world(rank: int, ws: int, rounds: int, warmup: int):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = make_mesh(dp=ws)
    C.set_active_mesh(mesh)
    torch.manual_seed(0)
    base = GPT(CONFIG)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(rounds)]

    impls = {}
    ddp = DDP(copy.deepcopy(base))
    impls["DDP"] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), None)
    zddp = DDP(copy.deepcopy(base))
    impls["DDP + ZeroRedundancyOptimizer"] = (zddp, ZeroRedundancyOptimizer(zddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR), None)
    fsdp = copy.deepcopy(base)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh.device_mesh)
    fully_shard(fsdp, mesh=mesh.device_mesh)
    impls["FSDP2"] = (fsdp, torch.optim.AdamW(fsdp.parameters(), lr=LR), None)
    for stage in (0, 1, 2, 3):
        m = copy.deepcopy(base)
        eng = make_engine(m, mesh, "dp", stage=stage)
        impls[f"autopar stage {stage}"] = (m, eng.make_optimizer(torch.optim.AdamW, lr=LR), eng)

    times = {k: [] for k in impls}
    counted = {}
    for r in range(rounds):
        idx = batches[r]
        for name, (m, opt, eng) in impls.items():
            if eng is not None:
                C.COUNTER.reset()
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_fn(m(idx[:, :-1]), idx[:, 1:])
            loss.backward()
            if eng is not None:
                eng.finish_backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
            if eng is not None:
                counted[eng.stage] = {k: v["bytes"] for k, v in C.COUNTER.snapshot().items()}
    C.COUNTER.enabled = False  # the barriers above are plain dist calls; nothing else to count
    predicted = {s: predicted_payload(base, ws, s) for s in range(4)}
    return {k: statistics.median(v) for k, v in times.items()}, counted, predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.rounds <= args.warmup:
        raise ValueError(f"--rounds ({args.rounds}) must exceed --warmup ({args.warmup})")
    t0 = time.perf_counter()
    res = run_world(args.world, _world, args.rounds, args.warmup, timeout_s=1200.0, collective_timeout_s=300.0)
    wall = time.perf_counter() - t0
    times, counted, predicted = res[0]
    slowest = {k: max(r[0][k] for r in res) for k in times}  # a step ends when its last rank ends
    n_params = sum(p.numel() for p in GPT(CONFIG).parameters())
    print(f"bench_zero: GPT dim={CONFIG.dim} layers={CONFIG.n_layers} vocab={CONFIG.vocab_size} "
          f"({n_params / 1e6:.2f} M params, {n_params * 4 / 2**20:.1f} MiB fp32), gloo on CPU, {args.world} processes, "
          f"batch {BATCH}x{SEQ} per rank, median of {args.rounds - args.warmup} steps (wall {wall:.0f} s)")
    refs = {"autopar stage 0": "DDP", "autopar stage 1": "DDP + ZeroRedundancyOptimizer",
            "autopar stage 2": "DDP + ZeroRedundancyOptimizer", "autopar stage 3": "FSDP2"}
    print(f"{'implementation':32s} {'step ms':>9s}   ratio")
    for k in ("DDP", "autopar stage 0", "DDP + ZeroRedundancyOptimizer", "autopar stage 1", "autopar stage 2",
              "FSDP2", "autopar stage 3"):
        ref = refs.get(k)
        ratio = f"{slowest[k] / slowest[ref]:.2f}x {ref}" if ref else "(reference)"
        print(f"{k:32s} {slowest[k] * 1e3:9.1f}   {ratio}")
    from autopar.cost.comm import bytes_sent

    print("\nbytes per step on rank 0: payload counted by COUNTER vs predicted from parameter sizes; "
          "wire = bytes rank 0 sends (cost model, ring)")
    print(f"{'stage':>5s}  {'collective':20s} {'counted':>12s} {'predicted':>12s} {'match':>6s} {'wire sent':>12s}")
    for s in range(4):
        keys = sorted(set(counted[s]) | set(predicted[s]))
        for key in keys:
            c, p = counted[s].get(key, 0), predicted[s].get(key, 0)
            op = key.split("@")[0]
            wire = bytes_sent(op, c, args.world)
            print(f"{s:>5d}  {key:20s} {c:12,d} {p:12,d} {'yes' if c == p else 'NO':>6s} {wire:12,.0f}")


if __name__ == "__main__":
    main()
