"""How long the pipeline split takes on a Llama-3-70B-size graph (80 blocks), 8 stages.

    python benchmarks/bench_split.py [--stages 8] [--schedule 1f1b] [--microbatches 16] [--seq 4096]

Captures the reference `llama3-70b` on the meta device (bf16, dynamic batch), then times the
three parts of splitting it: costing the pipeline units (`autopar.search.stages.layer_costs`:
`analyze` + `estimate` + state and boundary bytes), the DP search (`search_stages` on the
costed chain) and cutting the graph into stage GraphModules (`split_stages`). The target is
under 5 s for the three together; printed as a ratio to that budget and to the capture
measured in the same run (the reference: what any plan of this model costs first).
Also shows that an impossible request is refused at once with a clear error.
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.models import get
from autopar.passes.split_pipeline import split_stages
from autopar.search.stages import layer_costs, n_virtual_for, search_stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--stages", type=int, default=8, help="pipeline ranks")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hardware", default="h100-64")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--zero", type=int, default=3)
    a = ap.parse_args()

    spec = get(a.model)
    with torch.device("meta"):
        model = spec.build().to(torch.bfloat16)
    (idx,), _ = spec.example_batch(2, seq_len=a.seq, device="meta")
    t0 = time.perf_counter()
    gm = autopar.capture(model, (idx,))
    t_capture = time.perf_counter() - t0

    v = n_virtual_for(a.schedule)
    mesh = {"pp": a.stages, "dp": a.dp}
    t0 = time.perf_counter()
    chain = layer_costs(gm, a.hardware, microbatch=1, zero_stage=a.zero, dp=a.dp)
    t_cost = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = search_stages(chain, a.stages, n_virtual=v, schedule=a.schedule, n_microbatches=a.microbatches,
                        hardware=a.hardware, mesh=mesh)
    t_search = time.perf_counter() - t0
    t0 = time.perf_counter()
    split = split_stages(gm, res.split_points)
    t_cut = time.perf_counter() - t0
    total = t_cost + t_search + t_cut

    print(f"model: {a.model} (bf16, seq {a.seq}), {len(gm.graph.nodes)} nodes, {len(chain.layers)} pipeline units; "
          f"{a.stages} ranks x {v} stages, {a.schedule}, {a.microbatches} micro-batches, mesh {mesh}, "
          f"ZeRO-{a.zero}, hardware {a.hardware}")
    print(f"capture (reference)        {t_capture:7.2f} s")
    print(f"cost the units             {t_cost:7.2f} s")
    print(f"DP search                  {t_search:7.3f} s")
    print(f"cut into stage graphs      {t_cut:7.2f} s   ({[len(s.graph.nodes) for s in split.stages]} nodes)")
    print(f"split total                {total:7.2f} s   = {total / 5.0:.2f} x the 5 s budget, "
          f"{total / t_capture:.3f} x the capture")
    print(f"split points: {res.split_points}")
    print("stage time per micro-batch (ms): " + ", ".join(f"{t * 1e3:.1f}" for t in res.stage_time_s))
    print("memory per rank (GiB):           " + ", ".join(f"{m / 2**30:.1f}" for m in res.rank_memory)
          + f"  (limit {res.memory_limit / 2**30:.1f})")
    print(f"simulated step {res.step_s:.3f} s, bubble {res.bubble:.1%}")
    for kwargs in ({"n_ranks": 100}, {"n_ranks": 2, "memory_limit": 40 * 2**30}):
        t0 = time.perf_counter()
        try:
            search_stages(chain, schedule="1f1b", n_microbatches=a.microbatches, hardware=a.hardware, **kwargs)
            print(f"{kwargs}: unexpectedly accepted")
        except ValueError as e:
            print(f"{kwargs}: refused in {time.perf_counter() - t0:.3f} s: {e}")


if __name__ == "__main__":
    main()
