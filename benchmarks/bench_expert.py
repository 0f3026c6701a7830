"""Expert parallelism against data parallelism with every expert on every rank, and the
all-to-all bytes against the cost model.

    python benchmarks/bench_expert.py [--world 4] [--rounds 6] [--warmup 2] [--capacity 1.25]

Spawns a gloo world (CPU) and builds the same MoE (models/moe.py: 8 experts, top-2) from one
seed twice: EP, ep=world through the expert pass (`autopar.parallelize` on `autopar.mesh(ep=world)`:
each rank holds 8/world experts, tokens travel by uneven all-to-all), and DP, dp=world through
`autopar.parallelize` (every rank holds every expert and runs the model's own dispatch). The
two run round-robin, one training step (forward, backward, AdamW) each per round, so machine
noise hits both alike; printed: tokens/s of each (median step) and the ratio EP / DP, in
dropless mode and in capacity mode (`--capacity`).

Then, for one EP step, the payload bytes `collectives.COUNTER` counted for all_to_all on the
ep axis (mean over ranks and the busiest rank) next to the prediction of the one cost model,
`autopar.cost.estimate` of the EP program's plan (`Estimate.collectives()["all_to_all@ep"]`,
routing taken as balanced) — as it is for the mean; for the busiest rank scaled by the routing
imbalance measured in that step (f, max over ranks of rows received / mean, per layer): a
block's payload is (rows sent + rows received) x (2 rows' bytes + side data), its busiest rank's
(1 + f) / 2 times the balanced one (the model's layers share one config, so each block is
the balanced total / blocks).

Note on the DP reference: models/moe.py dispatches into static per-expert slots (capacity N
when dropless), so its experts compute E * N rows where a sparse dispatch computes N * K; the
capacity mode (E * C = cf * N * K rows) is the fairer compute comparison.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import autopar
from autopar.models import MoE, MoEConfig
from autopar.models.moe import loss_fn
from autopar.models import token_batch
from autopar.runtime import moe
from autopar.runtime.collectives import COUNTER
from autopar.runtime.launch import run_world
from autopar.cost import estimate
from autopar.search.expert import detect_moe, measured_imbalance

CONFIG = MoEConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512, max_seq_len=64,
                   n_experts=8, top_k=2)
BATCH, SEQ, LR = 16, 64, 1e-3


def _batch(g):
    return token_batch(BATCH, seq_len=SEQ, generator=g, vocab_size=CONFIG.vocab_size, max_seq_len=SEQ)


def _build(cf):
    torch.manual_seed(0)
    return MoE(dataclasses.replace(CONFIG, capacity_factor=cf))


def _world(rank: int, ws: int, rounds: int, warmup: int, cf: float):
    out = {}
    for mode, cfm in (("dropless", None), (f"capacity {cf}", cf)):
        x0, _ = _batch(torch.Generator().manual_seed(1))
        ep = autopar.parallelize(_build(cfm), autopar.mesh(ep=ws), example_inputs=x0)
        dp = autopar.parallelize(_build(cfm), autopar.mesh(dp=ws), example_inputs=x0)
        progs = {"ep": (ep, autopar.optimizer(ep, torch.optim.AdamW, lr=LR)),
                 "dp": (dp, autopar.optimizer(dp, torch.optim.AdamW, lr=LR))}
        times = {k: [] for k in progs}
        g = torch.Generator().manual_seed(2)
        for i in range(warmup + rounds):
            x, y = _batch(g)
            for k, (pm, opt) in progs.items():
                torch.distributed.barrier()
                t0 = time.perf_counter()
                pm.step((x, y), loss_fn)
                opt.step()
                opt.zero_grad()
                torch.distributed.barrier()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
        x, y = _batch(g)
        COUNTER.reset()
        with moe.recording() as routes:
            ep.step((x, y), loss_fn)
        counted = COUNTER.bytes[("all_to_all", "ep")]
        progs["ep"][1].zero_grad()
        out[mode] = {"ep_s": statistics.median(times["ep"]), "dp_s": statistics.median(times["dp"]),
                     "a2a_bytes": counted, "imbalance": [measured_imbalance([r]) for r in routes],
                     "predicted": estimate(ep.global_graph, ep.plan, "cpu-gloo", batch_is_global=True)
                     .collectives()["all_to_all@ep"]["bytes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=1.25)
    args = ap.parse_args()
    res = run_world(args.world, _world, args.rounds, args.warmup, args.capacity, timeout_s=1800)
    tokens = BATCH * SEQ
    print(f"MoE {CONFIG.n_layers} layers, dim {CONFIG.dim}, {CONFIG.n_experts} experts top-{CONFIG.top_k}, "
          f"batch {BATCH} x {SEQ} tokens, gloo, {args.world} processes")
    print(f"{'mode':<16}{'EP tokens/s':>14}{'DP tokens/s':>14}{'EP / DP':>10}")
    for mode in res[0]:
        ep_s = max(r[mode]["ep_s"] for r in res)  # a step ends when the slowest rank ends
        dp_s = max(r[mode]["dp_s"] for r in res)
        print(f"{mode:<16}{tokens / ep_s:>14.0f}{tokens / dp_s:>14.0f}{dp_s / ep_s:>10.2f}")
    print("\nall_to_all payload bytes on the ep axis in one step (COUNTER) against the cost model")
    print(f"{'mode':<16}{'counted mean':>14}{'predicted':>12}{'ratio':>8}{'counted max':>14}"
          f"{'pred. max':>12}{'ratio':>8}{'imbalance':>11}")
    with torch.device("meta"):
        model = MoE(CONFIG)
    blocks = detect_moe(autopar.capture(model, (torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),)))
    for mode in res[0]:
        counted = [r[mode]["a2a_bytes"] for r in res]
        f = res[0][mode]["imbalance"]  # per layer (every rank sees the same all-gathered counts)
        pred = res[0][mode]["predicted"]
        pred_max = sum(pred / len(blocks) * (1 + fl) / 2 for fl in f)
        mean = sum(counted) / len(counted)
        print(f"{mode:<16}{mean:>14.0f}{pred:>12.0f}{mean / pred:>8.3f}"
              f"{max(counted):>14.0f}{pred_max:>12.0f}{max(counted) / pred_max:>8.3f}"
              f"{' '.join(f'{x:.2f}' for x in f):>11}")
    print("(imbalance per layer. The busiest-rank prediction adds each layer's busiest rank, a bound when different\n"
          " ranks are busiest in different layers; capacity mode predicts the bound cf * N * K rows sent per rank,\n"
          " dropped assignments send nothing.)")


if __name__ == "__main__":
    main()
