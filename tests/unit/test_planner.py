"""The joint planner on one process: its search against exhaustive enumeration under the same
cost model, its bounds, pins, the infeasible error, plans and reports as JSON, the cache, and
the cost model's single-stage predictions against `cost.estimate`.

Exhaustive enumeration here costs every candidate the outer search could pick, with every
split of the pipeline units into its stages and (where recompute can run) every subset of
blocks recomputed, each through `PlanCostModel.evaluate` with the split and recompute set
pinned; the search must come within 1% of its best (the cost model is deterministic, so
equal plans give equal times)."""
import itertools
import json
import math

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig, get
from autopar.passes.plan import Plan
from autopar.search.explain import PlanReport
from autopar.search.plan_cost import Candidate, PlanCostModel
from autopar.search.planner import RUNTIME_SUPPORT, _Search, candidates, clear_cache, plan_for


def _capture(name, batch=8):
    torch.manual_seed(0)
    if name in ("gpt-3l", "gpt-4l"):
        cfg = GPTConfig(vocab_size=128, dim=64, n_layers=int(name[4]), n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_seq_len=32)
        model, batch_fn = GPT(cfg), get("gpt-tiny").example_batch
    else:
        spec = get(name)
        model, batch_fn = spec.build(), spec.example_batch
    x, _ = batch_fn(batch, generator=torch.Generator().manual_seed(0))
    return autopar.capture(model, x)


@pytest.fixture(scope="module")
def graphs():
    return {n: _capture(n) for n in ("gpt-tiny", "gpt-3l", "gpt-4l", "moe-tiny")}


def _exhaustive(search: _Search):
    """Best feasible evaluation over every candidate x split x recompute subset."""
    m = search.model
    names = m.unit_names
    blocks = [names[i] for i in range(m.L) if m.blocks[i] > 0]
    best = None
    n = 0
    for c in candidates(m, search.world, search.pins, search.support):
        S = c.n_stages
        rc_sets = [()] if c.pp > 1 and not search.support.get("recompute_with_pp") else \
            [sub for r in range(len(blocks) + 1) for sub in itertools.combinations(blocks, r)]
        for cut in itertools.combinations(range(1, m.L), S - 1):
            for sub in rc_sets:
                rc = {b: ("full" if b in sub else "none") for b in blocks}
                try:
                    ev = m.evaluate(c, search.limit, pins=[names[i] for i in cut], recompute=rc)
                except ValueError:
                    continue
                n += 1
                if ev.feasible and (best is None or ev.step_s < best.step_s):
                    best = ev
    return best, n


def _single_device_peak(gm, hw):
    m = PlanCostModel(gm, hw, 1)
    return m.evaluate(Candidate(), math.inf, recompute="none").peak_bytes


CASES = [  # (model, world, hardware, memory limit as a fraction of one device's need without recompute)
    ("gpt-tiny", 4, "h100-sxm", None),
    ("gpt-tiny", 8, "cpu-gloo", 0.45),
    ("gpt-4l", 4, "cpu-gloo", 0.6),
    ("gpt-3l", 4, "h100-sxm", 0.35),
    ("moe-tiny", 4, "cpu-gloo", 0.5),
]


@pytest.mark.parametrize("name,world,hw,frac", CASES)
def test_search_is_within_one_percent_of_exhaustive_enumeration(graphs, name, world, hw, frac):
    gm = graphs[name]
    limit = None if frac is None else frac * _single_device_peak(gm, hw)
    clear_cache()
    plan, rep = plan_for(gm, world, hw, memory_limit=limit, top_k=3)
    ref = _Search(gm, autopar.cost.load_profile(hw), world, {}, rep.memory_limit, None, 1, "adamw",
                  dict(RUNTIME_SUPPORT), None)
    best, n = _exhaustive(ref)
    assert best is not None and n > 20
    got = rep.chosen["step_s"]
    # the search cannot beat exhaustive enumeration of the same model (else the reference is not exhaustive) ...
    assert got >= best.step_s * (1 - 1e-9), (rep.chosen["label"], best.candidate.label())
    # ... and comes within 1% of it
    assert got <= best.step_s * 1.01, f"search {rep.chosen['label']} {got} vs exhaustive {best.candidate.label()} " \
                                      f"{best.step_s} ({n} plans costed)"
    assert rep.chosen["peak_bytes"] <= rep.memory_limit


def test_the_lower_bounds_never_exceed_the_prediction(graphs):
    """Pruning is only sound if every bound is below what evaluate predicts for the candidate."""
    for name, hw in (("gpt-4l", "cpu-gloo"), ("moe-tiny", "h100-sxm"), ("gpt-tiny", "h100-sxm")):
        m = PlanCostModel(graphs[name], hw, 8)
        checked = 0
        for c in candidates(m, 8, {}, dict(RUNTIME_SUPPORT)):
            ev = m.evaluate(c, math.inf, recompute="none")
            opt_t, opt_m = m.optimistic_bounds(c, recompute=False)
            lb_t, lb_m = m.lower_bounds(c, recompute=False)
            assert opt_t <= lb_t * (1 + 1e-9) and lb_t <= ev.step_s * (1 + 1e-9), (c.label(), opt_t, lb_t, ev.step_s)
            assert opt_m <= lb_m * (1 + 1e-9) and lb_m <= ev.peak_bytes * (1 + 1e-9), (c.label(), lb_m, ev.peak_bytes)
            cut = m.evaluate(c, math.inf, recompute="none", cutoff=0.0)  # the split's own bound, before simulating
            assert cut.step_s <= ev.step_s * (1 + 1e-9)
            full = m.evaluate(c, math.inf, recompute="full")  # with recompute the memory bound still holds
            assert m.lower_bounds(c, recompute=True)[1] <= full.peak_bytes * (1 + 1e-9)
            assert m.optimistic_bounds(c, recompute=True)[1] <= full.peak_bytes * (1 + 1e-9)
            checked += 1
        assert checked > 30


def test_pins_are_honoured_and_the_rest_is_solved(graphs):
    gm = graphs["gpt-4l"]
    clear_cache()
    plan, rep = plan_for(gm, 8, "h100-sxm", pins={"tp": 2, "split_points": ["layers.2"]})
    assert plan.mesh.get("tp") == 2 and plan.mesh.get("pp", 1) >= 2
    assert "layers.2" in plan.split_points
    assert rep.chosen["candidate"]["tp"] == 2
    assert all(a["candidate"]["tp"] == 2 for a in rep.alternatives)
    plan, _ = plan_for(gm, {"dp": 4, "tp": 2}, "cpu-gloo", pins={"zero_stage": 3})
    assert plan.mesh == {"dp": 4, "tp": 2} and plan.zero_stage == 3
    assert plan.param_layouts and plan.strategies["tp"]
    plan, _ = plan_for(gm, 4, "cpu-gloo", pins={"pp": 2, "schedule": "gpipe", "n_microbatches": 4})
    assert plan.mesh["pp"] == 2 and plan.schedule == "gpipe" and plan.n_microbatches == 4
    with pytest.raises(ValueError, match="tp=3"):
        plan_for(gm, 8, "h100-sxm", pins={"tp": 3})
    with pytest.raises(ValueError, match="not pipeline units"):
        plan_for(gm, 8, "h100-sxm", pins={"split_points": ["layers.9"]})
    with pytest.raises(ValueError, match="unknown pins"):
        plan_for(gm, 8, "h100-sxm", pins={"tensor_parallel": 2})


def test_an_infeasible_request_names_the_smallest_shortfall(graphs):
    gm = graphs["gpt-4l"]
    limit = 0.05 * _single_device_peak(gm, "cpu-gloo")
    clear_cache()
    with pytest.raises(ValueError) as err:
        plan_for(gm, 2, "cpu-gloo", memory_limit=limit)
    msg = str(err.value)
    assert "no plan of 2 ranks" in msg and "needs" in msg and "over" in msg
    # the number in the message is the least memory any plan needs (every candidate, its
    # memory-minimising split, every block recomputed where recompute can run)
    s = _Search(gm, autopar.cost.load_profile("cpu-gloo"), 2, {}, limit, None, 1, "adamw", dict(RUNTIME_SUPPORT), None)
    least = min(s._evaluate(c, minimise="memory").peak_bytes for c in candidates(s.model, 2, {}, s.support))
    from autopar.search.explain import gib
    assert f"needs {gib(least)} on its fullest rank" in msg


def test_plan_and_report_round_trip_through_json(graphs, tmp_path):
    gm = graphs["gpt-tiny"]
    clear_cache()
    plan, rep = plan_for(gm, 8, "cpu-gloo", memory_limit=0.45 * _single_device_peak(gm, "cpu-gloo"),
                         cache_dir=str(tmp_path))
    json.dumps(plan.to_dict(), allow_nan=False)  # plain JSON data, no numpy scalars (to_json would refuse them too)
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == json.loads(plan.to_json())
    assert again.mesh == plan.mesh and again.split_points == plan.split_points and \
        again.param_layouts == plan.param_layouts and again.strategies == plan.strategies
    rep2 = PlanReport.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert rep2.text().splitlines()[:-1] == rep.text().splitlines()[:-1]
    assert plan.predicted["step_s"] == rep.chosen["step_s"] and plan.predicted["source"] == "planner"
    assert any(line.startswith("tp=") for line in rep.reasons())
    # deterministic: a fresh search gives the same plan, byte for byte (no timings in it)
    clear_cache()
    again_plan, _ = plan_for(gm, 8, "cpu-gloo", memory_limit=rep.memory_limit)
    assert again_plan.to_json() == plan.to_json()
    # cached: in memory, and on disk for a fresh process (memory cleared)
    _, rep3 = plan_for(gm, 8, "cpu-gloo", memory_limit=rep.memory_limit, cache_dir=str(tmp_path))
    assert rep3.search["cached"]
    clear_cache()
    plan4, rep4 = plan_for(gm, 8, "cpu-gloo", memory_limit=rep.memory_limit, cache_dir=str(tmp_path))
    assert rep4.search["cached"] and plan4.to_dict()["mesh"] == plan.mesh
    assert list(tmp_path.glob("plan-*.json"))


def test_explanations_say_why_a_value_lost(graphs):
    gm = graphs["gpt-4l"]
    limit = 0.35 * _single_device_peak(gm, "h100-sxm")
    clear_cache()
    plan, rep = plan_for(gm, 4, "h100-sxm", memory_limit=limit)
    rows = {r["value"]: r for r in rep.dimensions["tp"]}
    assert sum(r["status"] == "chosen" for r in rows.values()) == 1
    for r in rows.values():
        if r["status"] == "no fit":
            assert r["peak_bytes"] > limit and "needs" in r["reason"]
        elif r["status"] == "slower":
            assert r["step_s"] >= rep.chosen["step_s"]
        elif r["status"] == "bound":
            assert "lower bound" in r["reason"]
    assert len(rep.alternatives) >= 2 and rep.alternatives[0]["label"] == rep.chosen["label"]
    steps = [a["step_s"] for a in rep.alternatives]
    assert steps == sorted(steps)
    assert "autopar joint plan" in rep.text() and "memory on the fullest rank" in rep.text()


def test_single_stage_predictions_follow_cost_estimate(graphs):
    """pp = 1 plans: the planner's step time equals cost.estimate's plus the tensor-parallel
    conversions (estimate does not count them; at the captured batch they are exactly the
    sharding ILP's recount), and its peak memory estimate's, to 1e-6 (one cost model:
    `search.plan_rank`; every candidate and reference model in tests/unit/test_one_cost_model.py)."""
    from autopar.cost import estimate
    from autopar.runtime.placement import Layout

    gm = graphs["gpt-tiny"]
    for hw in ("cpu-gloo", "h100-sxm"):
        m = PlanCostModel(gm, hw, 8)
        for c in (Candidate(dp=4), Candidate(dp=4, zero=1), Candidate(dp=4, zero=2), Candidate(dp=4, zero=3),
                  Candidate(tp=2), Candidate(dp=2, tp=2, zero=1), Candidate(dp=2, micro=2)):
            ev = m.evaluate(c, math.inf, recompute="none")
            sh = m.sharding(c.tp)
            mesh = c.mesh()
            rep = lambda d: {k: Layout.replicated(tuple(mesh)).replace("tp", p) for k, p in d.items()}  # noqa: E731
            plan = Plan(mesh=mesh, dp_axis="dp" if "dp" in mesh else None, zero_stage=c.zero, n_microbatches=c.micro,
                        param_layouts=rep(sh.param_placements), node_layouts=rep(sh.node_placements))
            e = estimate(gm, plan, hw, batch_is_global=True)
            tp_s = ev.comm["tp"]["time_s"] if c.tp > 1 else 0.0
            if c.tp > 1 and m.rows_per_micro(c) == 8:  # the captured batch: exactly the ILP's recount
                assert tp_s == pytest.approx(sh.solution.recounted_comm_s, rel=1e-6)
            assert ev.step_s == pytest.approx(e.step_s + tp_s, rel=1e-6, abs=0), (hw, c.label())
            assert ev.peak_bytes == pytest.approx(e.memory["peak"], rel=1e-6, abs=0), (hw, c.label())


def test_in_flight_floors_and_small_schedules_never_exceed_the_real_schedule():
    """The memory bounds and the early memory check read in-flight counts and held activations
    from formulas or from a schedule with at most 2p micro-batches; both must stay at or under
    what the step's schedule holds."""
    import random

    from autopar.runtime.schedules import make_schedule
    from autopar.cost.schedule import held_peaks as _held_peaks, small_schedule as _small_schedule
    from autopar.search.plan_split import in_flight_floor as _in_flight_floor
    from autopar.search.stages import in_flight_per_stage

    rnd = random.Random(0)
    for sched in ("1f1b", "zb_h1", "gpipe", "interleaved_1f1b", "zbv"):
        for p in (2, 3, 4):
            for m in (1, 2, 4, 6, 8, 16):
                c = Candidate(pp=p, micro=m, schedule=sched)
                if (c.virtual > 1 and m % p) or (sched != "1f1b" and m < p):
                    continue
                real = make_schedule(sched, p, m, c.virtual if c.virtual > 1 else None)
                k, s2r = _in_flight_floor(c)
                assert list(s2r) == list(real.stage_to_rank)
                assert all(a <= b for a, b in zip(k, in_flight_per_stage(real))), (sched, p, m)
                small = _small_schedule(sched, p, m if sched == "gpipe" else min(m, 2 * p), c.virtual)
                for _ in range(3):
                    act = [rnd.uniform(0, 1) for _ in range(real.n_stages)]
                    assert all(a <= b + 1e-12 for a, b in zip(_held_peaks(small, act), _held_peaks(real, act)))
