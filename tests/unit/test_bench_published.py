"""benchmarks/bench_published.py: the row function costs the PUBLISHED plan, not another one.

The 22B Megatron row (8 GPUs, TP8, 4 micro-batches: the smallest row with tp > 1)
is costed without the free planner; the checks are structural: a positive finite prediction,
the error is predicted / published - 1, and the costed Plan's mesh, ZeRO stage and
micro-batches are the published ones. No timings, no predicted values.
"""
from __future__ import annotations

import math

from bench_module import load_bench


def _bench():
    return load_bench("bench_published")


def test_row_costs_the_published_plan_and_reports_its_relative_error():
    bench = _bench()
    row = bench.ROWS["megatron-22b"]  # tp8 on 8 A100s with 4 micro-batches: the smallest row with tp > 1
    r = bench.cost_row(row, planner=False)
    assert r.get("not_costed") is None, r.get("not_costed")
    pred = r["predicted"]
    assert math.isfinite(pred) and pred > 0
    assert r["error"] == pred / row.published - 1
    plan = r["plan"]
    mesh = {a: plan.mesh.get(a, 1) for a in ("tp", "pp", "dp")}
    assert mesh == {a: row.pins[a] for a in ("tp", "pp", "dp")}
    assert plan.zero_stage == row.pins["zero_stage"]
    assert plan.n_microbatches == row.pins["n_microbatches"]
    assert plan.predicted["fits"]
    assert "planner_plan" not in r  # --no-planner costs only the published plan


def test_cp_row_is_reported_not_costed_with_a_reason():
    bench = _bench()
    r = bench.cost_row(bench.ROWS["llama3-405b-128k-16384"], planner=True)
    assert "predicted" not in r and "cp=16" in r["not_costed"]
    line = bench.table_row(r)
    assert line[4].startswith("not costed") and line[5] == "-"


def test_summary_counts_only_costed_rows_and_prints_the_reason(capsys):
    bench = _bench()
    costed = {"row": bench.ROWS["megatron-22b"], "published": 1.10, "not_costed": None, "predicted": 1.21,
              "error": 1.21 / 1.10 - 1, "seconds": 0.0}
    skipped = bench.cost_row(bench.ROWS["llama3-405b-128k-16384"], planner=False)
    bench.print_table([costed, skipped])
    out = capsys.readouterr().out
    assert "summary: 1 rows costed of 2; within +-10 %: 1; within +-15 %: 1" in out
    assert "+10.0%" in out
    assert "note llama3-405b-128k-16384: not costed: cp=16" in out
