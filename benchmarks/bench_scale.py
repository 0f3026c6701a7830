"""Real size on gloo: a GPT of >= 0.5 B parameters built on the meta device, each of 4 ranks
materializing only its part, against the same plan run from real weights on every rank.

For ZeRO-3 (dp=4) and tp=2 x dp=2 it prints, per rank, the peak resident memory (RSS,
sampled every 5 ms from /proc) during `parallelize` + loading, and during two AdamW steps,
next to the full model's size; and the first step's loss against one process's loss from
the same checkpoint.

    python benchmarks/bench_scale.py                 # 0.55 B parameters, seq 16, batch 4
    python benchmarks/bench_scale.py --layers 4      # quicker, smaller
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time

import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, loss_fn
from autopar.runtime.launch import run_world

GiB = 2**30


class PeakRSS:
    """The process's peak resident set size over a phase, sampled from /proc/self/statm."""

    def __init__(self, period_s: float = 0.005):
        self.period, self.peak, self._stop = period_s, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.now()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def config(a) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128, n_kv_heads=a.dim // 256,
                     ffn_dim=a.ffn, max_seq_len=max(64, a.seq))


def batch(a, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _rank(rank, ws, a, mesh_kw, opts, source):
    gc.collect()
    base = PeakRSS().now()
    x0, _ = batch(a, 0)
    with PeakRSS() as build:
        if source == "meta":
            with torch.device("meta"):
                model = GPT(config(a))
            pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(x0,), weights=a.weights, **opts)
        else:  # the full model in every rank's memory, then the same plan
            torch.manual_seed(0)
            model = GPT(config(a))
            pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(x0,), **opts)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    losses = []
    with PeakRSS() as train:
        for s in range(2):
            x, y = batch(a, s)
            losses.append(pm.step((x, y), loss_fn).item())
            opt.step()
            opt.zero_grad()
    return {"base": base, "build": build.peak, "train": train.peak, "losses": losses}


def write_checkpoint(a) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = GPT(config(a))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.weights)


def one_process_loss(a) -> float:
    """The first step's loss of one process whose weights are read from the checkpoint."""
    from safetensors.torch import load_file

    model = GPT(config(a))
    model.load_state_dict(load_file(a.weights), strict=False)  # RoPE tables are non-persistent
    x, y = batch(a, 0)
    with torch.no_grad():
        loss = loss_fn(model(x), y).item()
    del model
    gc.collect()
    return loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cells", default="zero3,tp2dp2")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    with torch.device("meta"):
        n_params = sum(t.numel() for t in GPT(config(a)).parameters())
    full = n_params * 4
    import multiprocessing as mp

    spawn = mp.get_context("spawn")  # the parent never holds the model: forked ranks start small
    with tempfile.TemporaryDirectory() as d, spawn.Pool(1) as pool:
        a.weights = os.path.join(d, "model.safetensors")
        t0 = time.perf_counter()
        pool.apply(write_checkpoint, (a,))
        print(f"GPT {n_params / 1e9:.3f} B parameters, fp32 {full / GiB:.2f} GiB; checkpoint written in "
              f"{time.perf_counter() - t0:.1f} s; 4 gloo ranks, batch {a.batch} x seq {a.seq}")
        ref = pool.apply(one_process_loss, (a,))
        cells = {"zero3": ({"dp": 4}, {"zero_stage": 3}), "tp2dp2": ({"dp": 2, "tp": 2}, {"hardware": "h100-sxm"})}
        print(f"{'cell':8} {'weights':22} {'rank':>4} {'base':>9} {'parallelize+load':>17} {'2 steps':>9} "
              f"{'above base / full model':>23}   first loss (one process {ref:.6f})")
        for cell in a.cells.split(","):
            mesh_kw, opts = cells[cell]
            peaks = {}
            for source in ("meta", "real"):
                t0 = time.perf_counter()
                res = run_world(4, _rank, a, mesh_kw, opts, source, timeout_s=1800)
                wall = time.perf_counter() - t0
                label = "meta + safetensors" if source == "meta" else "real on every rank"
                for r, out in enumerate(res):
                    print(f"{cell:8} {label:22} {r:>4} {out['base'] / GiB:8.2f}G {out['build'] / GiB:16.2f}G "
                          f"{out['train'] / GiB:8.2f}G {(max(out['build'], out['train']) - out['base']) / full:22.2f}x   "
                          f"{out['losses'][0]:.6f} (diff {abs(out['losses'][0] - ref):.1e})")
                peaks[source] = max(max(o["build"], o["train"]) - o["base"] for o in res)
                print(f"{cell:8} {label:22} wall {wall:.1f} s")
            print(f"{cell:8} peak RSS above base, meta / real: {peaks['meta'] / peaks['real']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
