"""Capture time and peak RAM of real-size reference models on the meta device.

    python benchmarks/bench_capture.py [--models llama3-70b llama2-7b]

Each model is captured in a fresh process (so peak RSS is that capture's alone) and printed
next to the time of a plain eager forward on meta in the same process, as the reference.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time


def _one(name, q):
    import torch

    import autopar
    from autopar.models import get

    spec = get(name)
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(1, seq_len=128, device="meta")
    t0 = time.perf_counter()
    with torch.no_grad():
        model(*inputs)
    t_eager = time.perf_counter() - t0
    t0 = time.perf_counter()
    gm = autopar.capture(model, inputs)
    t_cap = time.perf_counter() - t0
    q.put((name, sum(p.numel() for p in model.parameters()), t_cap, t_eager,
           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, len(gm.graph.nodes)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama2-7b", "llama3-70b"])
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for name in a.models:
        q = ctx.Queue()
        p = ctx.Process(target=_one, args=(name, q))
        p.start()
        name, n, t_cap, t_eager, rss, nodes = q.get()
        p.join()
        print(f"{name:>12}: {n / 1e9:6.2f} B params | capture {t_cap:6.1f} s | meta eager forward {t_eager:5.2f} s "
              f"| capture / eager {t_cap / t_eager:6.1f}x | peak RAM {rss:.2f} GiB | {nodes} nodes")


if __name__ == "__main__":
    main()
