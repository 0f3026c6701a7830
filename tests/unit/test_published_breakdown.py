"""benchmarks/bench_published.py --breakdown: each term of the predicted step is printed from
the plan's own prediction (a Plan made here, no capture: the line is plain formatting)."""
from __future__ import annotations

from autopar.passes.plan import Plan

from bench_module import load_bench


def _bench():
    return load_bench("bench_published")


def test_breakdown_names_every_term_of_the_predicted_step():
    bench = _bench()
    plan = Plan(mesh={"tp": 8, "dp": 2}, dp_axis="dp")
    plan.recompute = {"layers.0": "full", "layers.1": "full"}
    plan.predicted = {"step_s": 1.25, "compute_s": 0.875, "recompute_s": 0.125, "bubble": 0.0625, "optimizer_s": 0.0375,
                      "comm_per_axis": {"tp": {"exposed_s": 0.25}, "dp": {"exposed_s": 0.0875}}}
    line = bench.breakdown({"row": bench.ROWS["megatron-22b"], "plan": plan})
    assert line == ("breakdown megatron-22b: step 1.25 s = compute 0.875 s (recompute 0.125 s) with bubble 6.2%; "
                    "exposed comm: dp 0.0875 s, tp 0.25 s; optimizer 0.0375 s; 2 blocks recomputed")
