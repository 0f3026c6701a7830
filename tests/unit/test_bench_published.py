"""benchmarks/bench_published.py: the row function costs the PUBLISHED plan, not another one.

The smallest row (our measured 1.1 B GPT on one H100) and the 22B Megatron row (8 GPUs, TP8)
are costed without the free planner; the checks are structural: a positive finite prediction,
the error is predicted / published - 1, and the costed Plan's mesh, ZeRO stage and
micro-batches are the published ones. No timings, no predicted values.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_published.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_published", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("key", ["ours-1.1b", "megatron-22b"])
def test_row_costs_the_published_plan_and_reports_its_relative_error(key):
    bench = _bench()
    row = bench.ROWS[key]
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
    assert line[4].startswith("not costed: ") and line[5] == "-"
