"""Virtual pipeline stages: interleaved 1F1B's stages per rank (v) are searched, priced by the
activations its own schedule holds, and an even split is admitted when the rank fits.

* The v the search tries (`candidate.virtual_choices`) and the planner's pick: a deep model on
  4 pipeline ranks with few micro-batches (bubble-bound) gets v > 2, which the cost model prices
  faster than v = 2; a model with too few units for more than two stages per rank gets v = 2;
  the "pp_virtual" pin fixes v, and the plan carries it to the runtime (plan.extra["pp_virtual"]).
* In-flight activations per schedule: the counts the cost model reads (`in_flight_per_stage`,
  `held_peaks`, `in_flight_floor` from the schedule with min(m, 2p) micro-batches) equal what
  the runtime's simulator of the same action lists reports, for GPipe, 1F1B, interleaved 1F1B
  with v = 2, 3, 4, ZB-H1 and ZB-V.
* Even split: at a memory limit equal to the peak of the even split of a uniform model, the
  cost model finds a plan that fits; with the former rule (each of a rank's v stages gets 1/v of
  the device) no split fits.

No timings are asserted; the costs are the cost model's (deterministic).
"""
from __future__ import annotations

import pytest
import torch

import autopar
import autopar.search.plan_cost as plan_cost
from autopar.cost.schedule import held_peaks, in_flight_per_stage, make_schedule, simulate, small_schedule
from autopar.models import GPT, GPTConfig
from autopar.search.candidate import Candidate, virtual_choices
from autopar.search.plan_cost import PlanCostModel
from autopar.search.plan_pins import normalise_pins
from autopar.search.plan_split import in_flight_floor
from autopar.search.planner import plan_for

BIG = 80e9  # bytes: no plan of these small models comes near it


def _capture(n_layers: int, dim: int = 64, seq: int = 32, batch: int = 8):
    cfg = GPTConfig(vocab_size=128, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
                    max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    return autopar.capture(model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),))


@pytest.fixture(scope="module")
def deep():
    return _capture(16)  # 19 pipeline units: tok_emb, 16 layers, norm, lm_head


@pytest.fixture(scope="module")
def shallow():
    return _capture(6)  # 9 units: at most 2 stages per rank on 4 ranks


# ------------------------------------------------------------------------ which v
def test_virtual_choices_keep_the_least_v_per_longest_stage_and_the_even_splits():
    # Llama 3 405B: 126 layers + embedding + head (128 units) on 16 ranks: 8, 4, 3, 2 units
    # per stage at most; 126 layers do not split evenly over 16 ranks
    assert virtual_choices(128, 16, 126) == [2, 3, 4, 8]
    # Megatron 1T: 128 layers on 64 ranks: 2 layers a rank, one per stage at v = 2
    assert virtual_choices(131, 64, 128) == [2]
    assert virtual_choices(19, 4, 16) == [2, 3, 4]
    assert virtual_choices(7, 4, 4) == [] and virtual_choices(40, 1, 38) == []
    for n, p, nb in [(19, 4, 16), (128, 16, 126), (67, 8, 64), (30, 2, 27)]:
        assert all(p * v <= n for v in virtual_choices(n, p, nb))  # each stage keeps >= 1 unit


def test_a_deep_bubble_bound_pipeline_gets_more_than_two_virtual_stages(deep):
    pins = {"pp": 4, "schedule": "interleaved_1f1b", "n_microbatches": 4}
    plan, _ = plan_for(deep, 4, "h100-sxm", pins=pins, global_batch=8, memory_limit=BIG)
    v = plan.extra["pp_virtual"]
    assert v > 2
    assert len(plan.split_points) + 1 == 4 * v
    two, _ = plan_for(deep, 4, "h100-sxm", pins={**pins, "pp_virtual": 2}, global_batch=8, memory_limit=BIG)
    assert two.extra["pp_virtual"] == 2 and len(two.split_points) + 1 == 8
    assert plan.predicted["step_s"] < two.predicted["step_s"]
    assert plan.predicted["bubble"] < two.predicted["bubble"]


def test_a_shallow_model_keeps_two_virtual_stages(shallow):
    pins = {"pp": 4, "schedule": "interleaved_1f1b", "n_microbatches": 4}
    plan, _ = plan_for(shallow, 4, "h100-sxm", pins=pins, global_batch=8, memory_limit=BIG)
    assert plan.extra["pp_virtual"] == 2 and len(plan.split_points) + 1 == 8


def test_the_pp_virtual_pin_is_checked_and_excludes_other_depths(deep):
    with pytest.raises(ValueError, match="pp_virtual"):
        normalise_pins({"pp_virtual": 0}, 4)
    with pytest.raises(ValueError, match="no plan of 4 ranks matches"):  # 4 x 8 stages > 19 units
        plan_for(deep, 4, "h100-sxm", pins={"pp": 4, "schedule": "interleaved_1f1b", "pp_virtual": 8},
                 global_batch=8, memory_limit=BIG)


def test_the_cost_model_prices_each_v_on_its_own_schedule(deep):
    pm = PlanCostModel(deep, "h100-sxm", world=4, global_batch=8)
    for v in (2, 3, 4):
        c = Candidate(pp=4, micro=4, schedule="interleaved_1f1b", vpp=v)
        sched = pm.schedule(c)
        assert sched.n_stages == 4 * v and sched.stage_to_rank == tuple(s % 4 for s in range(4 * v))
        ev = pm.evaluate(c, BIG, recompute="none")
        assert len(ev.stage_units) == 4 * v and c.label().endswith(f"interleaved_1f1b(v={v})")


# ------------------------------------------------------------------------ in-flight activations
def _cases():
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"):
        for p in (2, 3, 4):
            for v in ((2, 3, 4) if name == "interleaved_1f1b" else (0,)):
                for m in (p, 2 * p, 3 * p, 4 * p):
                    yield name, p, v, m


def test_in_flight_activations_are_what_the_runtime_schedule_holds_for_every_schedule():
    n = 0
    for name, p, v, m in _cases():
        c = Candidate(pp=p, micro=m, schedule=name, vpp=v)
        real = make_schedule(name, p, m, c.virtual if c.virtual > 1 else None)
        S = real.n_stages
        sim = simulate(real, f=[1.0] * S, b=[2.0] * S)
        assert sim.ok, (name, p, v, m)
        # per rank: micro-batch-stages held at once along the action order == the simulator's
        assert [round(x) for x in held_peaks(real, [1.0] * S)] == list(sim.peak_in_flight), (name, p, v, m)
        # what the cost model reads without building the step's schedule is the same
        k, s2r = in_flight_floor(c)
        assert list(k) == in_flight_per_stage(real) and list(s2r) == list(real.stage_to_rank), (name, p, v, m)
        small = small_schedule(name, p, m if name == "gpipe" else min(m, 2 * p), c.virtual)
        act = [1.0 + 0.37 * s for s in range(S)]  # stages of unequal size
        assert held_peaks(small, act) == pytest.approx(held_peaks(real, act), rel=1e-12), (name, p, v, m)
        n += 1
    assert n == 3 * 4 * (4 + 3)


def test_interleaving_deeper_holds_fewer_micro_batches_of_the_whole_rank():
    # Megatron's interleaved 1F1B holds about (1 + (p - 1) / (p v)) p micro-batches of the rank's
    # layers at its peak: per rank, sum over held (stage, micro-batch) of 1/v of the rank
    p, m = 4, 16
    held = {}
    for v in (1, 2, 4):
        s = make_schedule("interleaved_1f1b" if v > 1 else "1f1b", p, m, v if v > 1 else None)
        held[v] = held_peaks(s, [1.0 / v] * s.n_stages)[0]
    assert held[1] == p
    assert held[1] < held[2] and held[4] < held[2]
    assert held[2] == pytest.approx(p * (1 + (p - 1) / (p * 2)), abs=0.5)


# ------------------------------------------------------------------------ even split
def _old_budgets(chain, k_s, s2r, limit, fixed, mode, small=None, pins=()):
    """The former rule: each of a rank's v stages gets 1/v of what the working set leaves."""
    v = len(s2r) // (max(s2r) + 1)
    return [(limit - fixed) / v + fixed] * len(s2r), limit / v


def test_the_even_split_is_admitted_when_the_rank_fits_by_its_schedule(deep, monkeypatch):
    # 8 micro-batches on 4 ranks, v = 2: rank 0's first stage holds 8 micro-batches at once, its
    # second 4, but the rank's walk never holds more than 11 (not 12): the even split, at a limit
    # equal to its own peak, fits; the former rule (each stage 1/v of the rank) forced a slower,
    # uneven split
    pm = PlanCostModel(deep, "h100-sxm", world=4, global_batch=8)
    c = Candidate(pp=4, micro=8, schedule="interleaved_1f1b", vpp=2)
    assert in_flight_floor(c)[0][0::4] == (8.0, 4.0) and held_peaks(pm.schedule(c), [1.0] * 8)[0] == 11
    even = [f"layers.{i}" for i in range(2, 16, 2)]  # 8 stages, 2 layers each
    ev_even = pm.evaluate(c, BIG, pins=even, recompute="none")
    assert ev_even.split_points == even
    limit = ev_even.peak_bytes * (1 + 1e-6)
    ev = pm.evaluate(c, limit, recompute="none")
    assert ev.feasible and max(ev.rank_peaks) <= limit
    assert ev.split_points == even and ev.step_s == pytest.approx(ev_even.step_s, rel=1e-12)
    monkeypatch.setattr(plan_cost, "stage_budgets", _old_budgets)
    old = pm.evaluate(c, limit, recompute="none")
    assert old.split_points != even and old.step_s > ev.step_s * 1.05
