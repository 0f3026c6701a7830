"""Real size on gloo: a GPT of >= 0.5 B parameters built on the meta device, each of 4 ranks
materializing only its part, against the same plan run from real weights on every rank.

For ZeRO-3 (dp=4) and tp=2 x dp=2 it prints, per rank, the peak private memory (RssAnon,
sampled every 5 ms from /proc; the checkpoint's mmapped pages, RssFile, apart) during
`parallelize` + loading, and during two AdamW steps, next to the full model's size and the
plan's predicted peak; and the first step's loss against one process's loss from the same
checkpoint.

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
    """The process's peak memory over a phase, sampled from /proc/self/status.

    `anon` is the private anonymous memory (RssAnon: tensors, Python objects, malloc arenas):
    what the rank really costs the machine. `file` is RssFile: pages of mmapped files that
    the process touched, e.g. a safetensors checkpoint read through mmap; they are shared page
    cache that the kernel drops under pressure, so they are reported apart, not as the rank's
    memory.
    """

    def __init__(self, period_s: float = 0.005):
        self.period, self._stop = period_s, threading.Event()
        self.anon = self.file = 0

    @staticmethod
    def now() -> tuple[int, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    key, kb, _ = line.split()
                    fields[key] = int(kb) * 1024
        return fields["RssAnon:"], fields["RssFile:"]

    def _sample(self) -> None:
        anon, file = self.now()
        self.anon, self.file = max(self.anon, anon), max(self.file, file)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period)

    def __enter__(self):
        self._sample()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


def config(a) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128, n_kv_heads=a.dim // 256,
                     ffn_dim=a.ffn, max_seq_len=max(64, a.seq))


def batch(a, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _rank(rank, ws, a, mesh_kw, opts, source):
    gc.collect()
    base = PeakRSS.now()
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
        del model  # what the program still holds of the user's model stays counted
        gc.collect()
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    losses = []
    with PeakRSS() as train:
        for s in range(2):
            x, y = batch(a, s)
            losses.append(pm.step((x, y), loss_fn).item())
            opt.step()
            opt.zero_grad()
    pred = pm.plan.predicted.get("estimate", pm.plan.predicted)
    return {"base": base[0], "build": build.anon, "train": train.anon, "file": max(build.file, train.file),
            "predicted": pred.get("peak_bytes"), "losses": losses}


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
        print("memory is each rank's private anonymous RSS (RssAnon); 'file' is the most checkpoint/library "
              "pages it had mapped (RssFile, shared page cache, not counted); 'predicted' is the plan's "
              "cost-model peak for the rank")
        print(f"{'cell':8} {'weights':18} {'rank':>4} {'base':>7} {'parallelize+load':>16} {'2 steps':>8} "
              f"{'file':>6} {'above base / model':>18} {'predicted':>9}   first loss (one process {ref:.6f})")
        for cell in a.cells.split(","):
            mesh_kw, opts = cells[cell]
            peaks = {}
            for source in ("meta", "real"):
                t0 = time.perf_counter()
                res = run_world(4, _rank, a, mesh_kw, opts, source, timeout_s=1800)
                wall = time.perf_counter() - t0
                label = "meta + safetensors" if source == "meta" else "real on every rank"
                for r, out in enumerate(res):
                    above = max(out["build"], out["train"]) - out["base"]
                    pred = f"{out['predicted'] / GiB:8.2f}G" if out["predicted"] else f"{'-':>9}"
                    print(f"{cell:8} {label:18} {r:>4} {out['base'] / GiB:6.2f}G {out['build'] / GiB:15.2f}G "
                          f"{out['train'] / GiB:7.2f}G {out['file'] / GiB:5.2f}G {above / full:17.2f}x {pred}   "
                          f"{out['losses'][0]:.6f} (diff {abs(out['losses'][0] - ref):.1e})")
                peaks[source] = max(max(o["build"], o["train"]) - o["base"] for o in res)
                print(f"{cell:8} {label:18} wall {wall:.1f} s")
            print(f"{cell:8} peak anonymous memory above base, meta / real: {peaks['meta'] / peaks['real']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
