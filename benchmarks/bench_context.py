"""Context parallelism on gloo: a long sequence that one rank cannot hold in the budget given,
split over cp=2 and cp=4 ranks with ring and with Ulysses attention, against one process.

For each cell it prints, per rank, the peak private memory (RssAnon, sampled every 5 ms from
/proc) above the rank's memory before the first step, during two AdamW steps; the mean step
time of the steps after the first; the loss of the first step against one process's; and the
ratios to the one-process run measured in the same job. The memory budget (default: 60 % of
the one-process peak, `--budget-gib` to set it) is what "fits" means: the one-process run
does not fit it, each cp rank must.

    python benchmarks/bench_context.py                  # seq 8192, dim 256, 2 layers, 4 heads
    python benchmarks/bench_context.py --seq 4096       # quicker
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, loss_fn
from autopar.runtime.launch import run_world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import PeakRSS  # noqa: E402

MiB = 2**20


def config(a) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.heads,
                     ffn_dim=4 * a.dim, max_seq_len=a.seq)


def batch(a, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, a.vocab, (1, a.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _train(model_step, opt, a):
    losses, times = [], []
    with PeakRSS() as peak:
        for s in range(a.steps):
            x, y = batch(a, s)
            t0 = time.perf_counter()
            losses.append(model_step((x, y)))
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    return losses, times, peak.anon


def one_process(a):
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(config(a))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch_):
        x, y = batch_
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.item()

    gc.collect()
    base = PeakRSS.now()[0]
    losses, times, peak = _train(step, opt, a)
    return {"losses": losses, "times": times, "above": peak - base}


def _rank(rank, ws, a, method):
    torch.set_num_threads(max(1, a.threads // ws))
    torch.manual_seed(0)
    model = GPT(config(a))
    x0, _ = batch(a, 0)
    pm = autopar.parallelize(model, autopar.mesh(cp=ws), example_inputs=(x0,), context_method=method)
    del model
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    gc.collect()
    base = PeakRSS.now()[0]
    losses, times, peak = _train(lambda b: pm.step(b, loss_fn).item(), opt, a)
    pred = pm.plan.predicted.get("estimate", pm.plan.predicted)
    return {"losses": losses, "times": times, "above": peak - base, "predicted": pred.get("peak_bytes"),
            "method": pm.plan.extra["context"]["method"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--budget-gib", type=float, default=None)
    p.add_argument("--cells", default="2:ring,2:ulysses,4:ring,4:ulysses")
    a = p.parse_args(argv)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        ref = pool.apply(one_process, (a,))
    ref_t = sum(ref["times"][1:]) / max(1, len(ref["times"]) - 1)
    budget = a.budget_gib * 2**30 if a.budget_gib else 0.6 * ref["above"]
    print(f"GPT dim {a.dim}, {a.layers} layers, {a.heads} heads, batch 1 x seq {a.seq}; {a.steps} AdamW steps; "
          f"{os.cpu_count()} CPU cores; memory: peak RssAnon above the rank's memory before the first step")
    print(f"budget per rank {budget / MiB:.0f} MiB; one process: {ref['above'] / MiB:.0f} MiB "
          f"({'fits' if ref['above'] <= budget else 'does NOT fit'}), step {ref_t:.3f} s, first loss "
          f"{ref['losses'][0]:.6f}")
    print(f"{'cell':12} {'rank':>4} {'peak MiB':>9} {'/ 1 proc':>8} {'fits':>5} {'pred MiB':>9} {'step s':>7} "
          f"{'/ 1 proc':>8} {'first loss diff':>15}")
    for cell in a.cells.split(","):
        cp, method = cell.split(":")
        res = run_world(int(cp), _rank, a, method, timeout_s=1800)
        for r, out in enumerate(res):
            t = sum(out["times"][1:]) / max(1, len(out["times"]) - 1)
            pred = f"{out['predicted'] / MiB:9.0f}" if out.get("predicted") else f"{'-':>9}"
            print(f"cp{cp} {method:7} {r:>4} {out['above'] / MiB:9.0f} {out['above'] / ref['above']:8.2f} "
                  f"{'yes' if out['above'] <= budget else 'NO':>5} {pred} {t:7.3f} {t / ref_t:8.2f} "
                  f"{abs(out['losses'][0] - ref['losses'][0]):15.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
