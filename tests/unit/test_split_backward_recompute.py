"""Zero-bubble schedules (zb_h1, zbv) with activation recomputation (issue 21): planned, accepted
and run as they train.

zb_h1 and zbv compute input and weight gradients in two backward passes (I, then W) over the
same forward; a checkpoint region allows one (a selective checkpoint's cache is spent by the
first: torch's "Trying to backward an extra time"; a plain one would recompute again for every
W call). A stage holding regions therefore runs its backward whole at its I's place and no W
(`runtime.schedules.fuse_backward`, chosen by the executor through
`runtime.pipeline_split.allows_one_backward`); the other stages keep the split. The planner
may now recompute under those schedules (`RUNTIME_SUPPORT["recompute_with_split_backward"]`)
and `parallelize` accepts the pair; tests/dist/test_zero_bubble_recompute.py trains it against
one process. The plan it writes predicts what it chose (issue 22, item 6): `plan.predicted`'s
per-rank peaks, step and recompute seconds are `cost.estimate`'s of that Plan, to 1e-6.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import estimate  # noqa: E402
from autopar.passes.plan import Plan  # noqa: E402
from autopar.passes.recompute import CheckpointRegion, recompute  # noqa: E402
from autopar.runtime.pipeline_split import allows_one_backward  # noqa: E402
from autopar.runtime.schedules import Kind, fuse_backward, make_schedule, simulate  # noqa: E402
from autopar.search.planner import RUNTIME_SUPPORT, clear_cache, plan_for  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


# ------------------------------------------------------------------ the runtime's schedule
@pytest.mark.parametrize("name,p,m,fuse", [("zb_h1", 2, 4, [1]), ("zb_h1", 4, 6, [0, 2]), ("zbv", 2, 4, [0, 3]),
                                           ("zbv", 2, 3, [1]), ("zbv", 4, 8, [0, 1, 2, 3, 4, 5, 6, 7])])
def test_fuse_backward_turns_the_given_stages_i_into_b_in_place_and_drops_their_w(name, p, m, fuse):
    sched = make_schedule(name, p, m, 2 if name == "zbv" else None)
    fused = fuse_backward(sched, fuse)
    assert fused.name == sched.name and fused.stage_to_rank == sched.stage_to_rank
    for before, after in zip(sched.actions, fused.actions):
        kept = [a for a in before if not (a.kind is Kind.W and a.stage in fuse)]
        assert len(after) == len(kept)
        for a, b in zip(kept, after):
            assert (b.stage, b.mb) == (a.stage, a.mb)
            assert b.kind is (Kind.B if a.kind is Kind.I and a.stage in fuse else a.kind), (a, b)
    for acts in fused.actions:  # the other stages keep I and W, the fused ones have neither
        for a in acts:
            assert (a.kind in (Kind.I, Kind.W)) == (a.stage not in fuse and a.kind is not Kind.F), a
    sim = simulate(fused, f=1.0, b=3.0, i=1.0, w=2.0)
    assert sim.ok, sim.summary()
    # a fused stage's backward is one action of the full backward's length, and nothing is lost:
    # every rank is busy as long as before (I + W = B here)
    assert sim.busy == pytest.approx(simulate(sched, f=1.0, b=3.0, i=1.0, w=2.0).busy)


def test_fuse_backward_leaves_schedules_without_a_split_alone():
    for name in ("1f1b", "gpipe", "interleaved_1f1b"):
        sched = make_schedule(name, 2, 4)
        assert fuse_backward(sched, [0, 1]) is sched
    sched = make_schedule("zb_h1", 2, 4)
    assert fuse_backward(sched, []) is sched


def test_a_stage_holding_a_checkpoint_region_allows_one_backward():
    model, args = build("gpt-tiny", batch=2, seq=8)
    gm = autopar.capture(model, args)
    assert not allows_one_backward(gm)
    assert not allows_one_backward(nn.Linear(2, 2))

    class Ctx:
        plan = Plan(mesh={"dp": 1}, recompute={"layers.0": "selective", "layers.1": "full"})

    gm = recompute(gm, Ctx())
    kinds = sorted(m.selective for m in gm.modules() if isinstance(m, CheckpointRegion))
    assert kinds == [False, True]  # a plain and a selective region: both allow one backward
    assert allows_one_backward(gm)


# ------------------------------------------------------------------ the planner and the door
def _gm():
    model, args = build("gpt-tiny", batch=8, seq=32)
    return autopar.capture(model, args)


def _tight(gm, pins) -> float:
    """A memory limit under the schedule's no-recompute peak: recompute is needed to fit."""
    clear_cache()
    plan, _ = plan_for(gm, 2, "cpu-gloo", pins={**pins, "recompute": "none"})
    return 0.97 * plan.predicted["peak_bytes"]


def _predicted_is_the_estimate(gm, plan) -> None:
    """plan.predicted reflects the chosen recompute: its per-rank peaks, step and recompute seconds
    are `cost.estimate`'s of the Plan (which walks the stages' checkpoint regions), to 1e-6."""
    e = estimate(gm, plan, "cpu-gloo", batch_is_global=True)
    assert e.recompute_s > 0, e.notes
    got = plan.predicted
    for what, a, b in [("peak", got["peak_bytes"], e.memory["peak"]), ("step", got["step_s"], e.step_s),
                       ("recompute", got["recompute_s"], e.recompute_s)]:
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                   rtol=1e-6, atol=0.0, msg=lambda m, w=what: f"{plan.schedule} {w}: {m}")
    torch.testing.assert_close(torch.tensor(got["peak_bytes_per_pp_rank"], dtype=torch.float64),
                               torch.tensor(e.memory["peak_per_pp_rank"], dtype=torch.float64), rtol=1e-6, atol=0.0)


def test_zero_bubble_schedules_recompute_when_memory_demands_it():
    assert RUNTIME_SUPPORT["recompute_with_split_backward"] is True
    gm = _gm()
    for schedule in ("zb_h1", "zbv"):
        pins = {"pp": 2, "dp": 1, "schedule": schedule, "n_microbatches": 4}
        clear_cache()
        plan, _ = plan_for(gm, 2, "cpu-gloo", pins=pins)
        assert plan.schedule == schedule
        assert all(v == "none" for v in plan.recompute.values()), (schedule, plan.recompute)  # no need: none
        limit = _tight(gm, pins)
        clear_cache()
        plan, _ = plan_for(gm, 2, "cpu-gloo", pins=pins, memory_limit=limit)
        assert plan.schedule == schedule
        assert any(v != "none" for v in plan.recompute.values()), (schedule, plan.recompute)
        assert plan.predicted["peak_bytes"] <= limit * (1 + 1e-9)
        assert math.isfinite(plan.predicted["step_s"])
        _predicted_is_the_estimate(gm, plan)
        clear_cache()  # pinned on, the same request carries it out too
        pinned, _ = plan_for(gm, 2, "cpu-gloo", pins={**pins, "recompute": "full"})
        assert pinned.schedule == schedule and any(v == "full" for v in pinned.recompute.values()), schedule

