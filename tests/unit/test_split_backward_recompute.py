"""Zero-bubble schedules (zb_h1, zbv) and activation recomputation (issue 21: refused or planned
only as it runs).

zb_h1 and zbv compute input and weight gradients in two backward passes over the same forward;
a selective-checkpoint region allows one (torch: "Trying to backward an extra time ... selective
activation checkpoint"), which the planned 8-rank gpt-tiny hit in CI when the planner first chose
zb_h1 with recompute. The planner now plans those schedules without recompute
(`RUNTIME_SUPPORT["recompute_with_split_backward"]`), and `parallelize` refuses the pair before
any step (autopar/api.py)."""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build  # noqa: E402

import autopar  # noqa: E402
from autopar.search.planner import RUNTIME_SUPPORT, clear_cache, plan_for  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def _gm():
    model, args = build("gpt-tiny", batch=8, seq=32)
    return autopar.capture(model, args)


def _tight(gm, pins) -> float:
    """A memory limit under the schedule's no-recompute peak: recompute would be needed to fit."""
    clear_cache()
    plan, _ = plan_for(gm, 2, "cpu-gloo", pins={**pins, "recompute": "none"})
    return 0.97 * plan.predicted["peak_bytes"]


def test_zero_bubble_schedules_are_planned_without_recompute():
    assert RUNTIME_SUPPORT["recompute_with_split_backward"] is False
    gm = _gm()
    for schedule in ("zb_h1", "zbv"):
        pins = {"pp": 2, "dp": 1, "schedule": schedule, "n_microbatches": 4}
        clear_cache()
        plan, _ = plan_for(gm, 2, "cpu-gloo", pins=pins)
        assert plan.schedule == schedule
        assert all(v == "none" for v in plan.recompute.values()), (schedule, plan.recompute)
        # under a limit only recompute could meet, the pair is not planned (1f1b still recomputes)
        limit = _tight(gm, pins)
        clear_cache()
        with pytest.raises(ValueError):
            plan_for(gm, 2, "cpu-gloo", pins=pins, memory_limit=limit)
        clear_cache()  # the gate is what forbids it: allowed, the same request recomputes
        allowed, _ = plan_for(gm, 2, "cpu-gloo", pins=pins, memory_limit=limit,
                              allow={"recompute_with_split_backward": True})
        assert any(v != "none" for v in allowed.recompute.values()), schedule
    clear_cache()
    pins = {"pp": 2, "dp": 1, "schedule": "1f1b", "n_microbatches": 4}
    limit = _tight(gm, pins)
    clear_cache()
    plan, _ = plan_for(gm, 2, "cpu-gloo", pins=pins, memory_limit=limit)
    assert any(v != "none" for v in plan.recompute.values()), "1f1b fits the same limit by recomputing"
    assert math.isfinite(plan.predicted["step_s"])
