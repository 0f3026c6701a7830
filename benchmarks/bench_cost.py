"""How long the cost model takes on a Llama-3-70B-size graph for a 512-GPU H100 cluster.

Captures the reference `llama3-70b` (80 blocks; transformers' LlamaConfig at 70B sizes if the
reference model is unavailable) on the meta device with a dynamic batch dimension, then times
`analyze` (per-node costs, symbolic in b) and `estimate` (DP over 512 ranks, ZeRO 1 and 3,
re-costed at three batch sizes). The target is under 5 s for costing.

Printed as ratios against references measured in the same run: the capture itself, and
FlopCounterMode counting one forward of the same model on meta tensors (the FLOP totals
must agree). Usage: python benchmarks/bench_cost.py [--seq 4096] [--layers 80] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch.export import Dim
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost import analyze, estimate, load_profile
from autopar.passes.plan import Plan


def build(layers: int | None):
    try:
        import autopar.models as M

        cfg = M.get("llama3-70b").config
        if layers is not None:
            cfg = dataclasses.replace(cfg, n_layers=layers)
        with torch.device("meta"):
            return "autopar.models llama3-70b", M.GPT(cfg)
    except (ImportError, ValueError):
        import transformers as T

        cfg = T.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers or 80,
                            num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, use_cache=False)
        with torch.device("meta"):
            return "transformers LlamaForCausalLM (70B config)", T.LlamaForCausalLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: all 80)")
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype (fp32 master weights when 16-bit)")
    args = ap.parse_args()
    name, model = build(args.layers)
    model = model.to(getattr(torch, args.dtype))
    x = torch.empty(2, args.seq, dtype=torch.long, device="meta")

    t0 = time.perf_counter()
    ep = torch.export.export(model, (x,), strict=False, dynamic_shapes=({0: Dim("batch", min=1, max=4096)},))
    gm = ep.module()
    t_capture = time.perf_counter() - t0

    t0 = time.perf_counter()
    with FlopCounterMode(display=False) as fc:
        model(x)
    t_fc = time.perf_counter() - t0

    hw = load_profile("h100-512")
    t0 = time.perf_counter()
    gc = analyze(gm, hw)
    t_analyze = time.perf_counter() - t0
    t0 = time.perf_counter()
    ests = [estimate(gc, Plan(mesh={"dp": 512}, zero_stage=z), hw, sizes={"b": b}) for z in (1, 3) for b in (1, 2, 4)]
    t_estimate = time.perf_counter() - t0
    t_cost = t_analyze + t_estimate

    ours = gc.at(gc.flops, {"b": 2})
    print(f"model: {name} ({args.dtype}), {len(gm.graph.nodes)} nodes, seq {args.seq}, hardware {hw.name} "
          f"({hw.world_size} GPUs)")
    print(f"capture (torch.export on meta)          {t_capture:8.2f} s")
    print(f"FlopCounterMode forward on meta         {t_fc:8.2f} s   forward FLOPs {fc.get_total_flops():.4e}")
    print(f"analyze (symbolic per-node costs)       {t_analyze:8.2f} s   forward FLOPs {ours:.4e} at b=2 "
          f"(ratio to FlopCounterMode {ours / fc.get_total_flops():.6f}); {gc.evaluations} distinct calls costed")
    print(f"estimate x{len(ests)} (ZeRO 1/3, b = 1, 2, 4)   {t_estimate:8.2f} s")
    print(f"costing total                           {t_cost:8.2f} s   = {t_cost / 5.0:.2f} x the 5 s budget, "
          f"{t_cost / t_capture:.3f} x the capture, {t_cost / t_fc:.2f} x FlopCounterMode's forward")
    for e in ests:
        print(f"  ZeRO-{e.zero_stage} b={e.sizes.get('b')}: step {e.step_s:.3f} s, exposed comm {e.comm_exposed_s:.3f} s, "
              f"MFU {e.mfu:.1%}, peak {e.memory['peak'] / 2**30:.1f} GiB of {e.memory['capacity'] / 2**30:.0f}")


if __name__ == "__main__":
    main()
