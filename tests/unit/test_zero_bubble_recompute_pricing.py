"""The cost model prices what zb_h1 / zbv run with activation recomputation (issue 21).

Under zb_h1 and zbv a pipeline stage holding checkpoint regions runs its backward whole at its
I's place and no W (runtime/pipeline.py, `runtime.schedules.fuse_backward`): its I costs the
full backward with the recompute, its W nothing, and it holds no state from I to W. The joint
planner (`search.plan_cost.PlanCostModel.evaluate`) and `cost.estimate` must simulate and walk
that schedule (`cost.schedule.fuse_backward`), not the split one.

Checked by watching what they price: every planner evaluation of a recompute candidate
simulates a schedule whose B actions are exactly the stages holding the units it recomputes
(the others keep I and W), and `cost.estimate` of a pinned plan simulates the schedule fused on
the stages holding the plan's recomputed modules. Needs the two call-site changes in
autopar/search/plan_cost.py and autopar/cost/estimate.py (helper-44's report).
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build  # noqa: E402

import autopar  # noqa: E402
from autopar.passes.plan import Plan  # noqa: E402
from autopar.runtime.schedules import Kind  # noqa: E402
from autopar.search.planner import clear_cache, plan_for  # noqa: E402

estimate_mod = importlib.import_module("autopar.cost.estimate")  # the module (autopar.cost.estimate is a function)
plan_cost = importlib.import_module("autopar.search.plan_cost")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def _kinds(sched) -> dict[int, list[str]]:
    return {s: sorted({a.kind.value for acts in sched.actions for a in acts if a.stage == s})
            for s in range(sched.n_stages)}


@pytest.fixture(scope="module")
def gm():
    model, args = build("gpt-tiny", batch=8, seq=32)
    return autopar.capture(model, args)


def test_the_planner_prices_recompute_stages_as_one_backward_under_zero_bubble_schedules(gm, monkeypatch):
    priced: list = []
    sim = plan_cost.simulate_ranks
    monkeypatch.setattr(plan_cost, "simulate_ranks", lambda sched, *a, **k: (priced.append(sched), sim(sched, *a, **k))[1])
    evaluate = plan_cost.PlanCostModel.evaluate
    seen: list = []

    def watched(self, c, *a, **k):
        priced.clear()
        ev = evaluate(self, c, *a, **k)
        if priced and ev.stage_units:
            seen.append((c.schedule, ev, priced[-1]))
        return ev

    monkeypatch.setattr(plan_cost.PlanCostModel, "evaluate", watched)
    for schedule in ("zb_h1", "zbv"):
        pins = {"pp": 2, "dp": 1, "schedule": schedule, "n_microbatches": 4}
        clear_cache()
        base, _ = plan_for(gm, 2, "cpu-gloo", pins={**pins, "recompute": "none"})
        clear_cache()
        plan, _ = plan_for(gm, 2, "cpu-gloo", pins=pins, memory_limit=0.97 * base.predicted["peak_bytes"])
        assert any(v != "none" for v in plan.recompute.values()), (schedule, plan.recompute)
    recomputing = [(sch, ev, s) for sch, ev, s in seen if ev.recompute]
    assert {sch for sch, _e, _s in recomputing} == {"zb_h1", "zbv"}, "no recompute candidate was priced"
    for sch, ev, sched in seen:
        held = {s for s, units in enumerate(ev.stage_units) if set(units) & set(ev.recompute)}
        for s, kinds in _kinds(sched).items():
            assert kinds == (["B", "F"] if s in held else ["F", "I", "W"]), (sch, ev.recompute, ev.stage_units, s, kinds)


@pytest.mark.parametrize("schedule,splits,rc,fused", [
    ("zb_h1", ["layers.1"], {"layers.0": "full"}, {0}),
    ("zb_h1", ["layers.1"], {}, set()),
    ("zbv", ["layers.0", "layers.1", "norm"], {"layers.1": "selective"}, {2}),
])
def test_estimate_prices_recompute_stages_as_one_backward_under_zero_bubble_schedules(gm, monkeypatch, schedule,
                                                                                      splits, rc, fused):
    priced: list = []
    step = estimate_mod.estimate_pipeline_step
    monkeypatch.setattr(estimate_mod, "estimate_pipeline_step",
                        lambda gc, sched, *a, **k: (priced.append(sched), step(gc, sched, *a, **k))[1])
    plan = Plan(mesh={"pp": 2}, dp_axis=None, schedule=schedule, split_points=splits, recompute=rc, n_microbatches=4)
    estimate_mod.estimate(gm, plan, "cpu-gloo", batch_is_global=True)
    assert len(priced) == 1
    for s, kinds in _kinds(priced[0]).items():
        assert kinds == (["B", "F"] if s in fused else ["F", "I", "W"]), (s, kinds)
    assert all(a.kind is not Kind.W for acts in priced[0].actions for a in acts if a.stage in fused)
