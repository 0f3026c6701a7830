"""Context parallelism in the joint planner, on one process: cp candidates and their gating, the
cost model's cp predictions against `cost.estimate` (the one-cost-model rule), the planner
choosing cp when a long sequence does not fit without it, pins, and the explanations.

Graphs are captured with a symbolic sequence (`dynamic_seq=True`, as parallelize captures for a
mesh with cp)."""
import math

import pytest
import torch

from autopar.capture import capture
from autopar.cost import estimate
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.runtime.placement import Layout
from autopar.search.plan_cost import Candidate, PlanCostModel
from autopar.search.planner import RUNTIME_SUPPORT, candidates, clear_cache, plan_for

SEQ, LONG = 256, 1024


def _graph(seq=SEQ, batch=2, heads=4, kv=2, dynamic=True):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=2, n_heads=heads, n_kv_heads=kv, ffn_dim=128, max_seq_len=seq)
    return capture(GPT(cfg).double(), (torch.zeros(batch, seq, dtype=torch.long),), dynamic_seq=dynamic)


@pytest.fixture(scope="module")
def long_graph():
    return _graph(seq=LONG, batch=8)


def _estimate(m: PlanCostModel, gm, c: Candidate, hw: str):
    """cost.estimate of the Plan the planner would write for `c` (layouts, context entry)."""
    sh = m.sharding(c.tp)
    mesh = c.mesh()
    lay = lambda d: {k: Layout.replicated(tuple(mesh)).replace("tp", p) for k, p in d.items()}  # noqa: E731
    plan = Plan(mesh=mesh, dp_axis="dp" if "dp" in mesh else None, zero_stage=c.zero, n_microbatches=c.micro,
                param_layouts=lay(sh.param_placements), node_layouts=lay(sh.node_placements))
    if c.cp > 1:
        plan.extra["context"] = m.context_entry(c)
    return estimate(gm, plan, hw, batch_is_global=True)


EXACT = [Candidate(cp=2, context="ring"), Candidate(cp=2, tp=2, context="ring"),
         Candidate(dp=2, cp=4, zero=2, context="ring")]
BANDED = [Candidate(dp=2, cp=4, context="ring"), Candidate(dp=2, cp=2, zero=1, context="ulysses"),
          Candidate(dp=4, cp=2, micro=2, context="ring"), Candidate(dp=2, cp=2, zero=3, context="ring")]


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_cp_predictions_equal_cost_estimate_for_the_same_plan(long_graph, hw):
    """The planner's step for a cp plan is cost.estimate's (plus the tp conversions estimate does
    not count): to 1e-9 where the data-parallel buckets are costed alike (no dp sync, or ZeRO 2),
    within test_planner.py's bands otherwise (3 %, ZeRO 3 30 %: its bucket and regather
    simplifications, which cp does not change); activations equal to 1e-9 in every plan; the
    exchange on the cp axis equal to estimate's attention-phase report."""
    m = PlanCostModel(long_graph, hw, 8)
    for c in EXACT + BANDED:
        ev = m.evaluate(c, math.inf, recompute="none")
        e = _estimate(m, long_graph, c, hw)
        tp_s = ev.comm["tp"]["time_s"] if c.tp > 1 else 0.0
        tol = 1e-9 if c in EXACT else 0.30 if c.zero == 3 else 0.03
        assert ev.step_s == pytest.approx(e.step_s + tp_s, rel=tol), (hw, c.label())
        assert ev.memory["activations"] == pytest.approx(e.memory["activations"], rel=1e-9), (hw, c.label())
        exchange = [r.exposed_s for r in e.comm if r.axis == "cp" and r.phase == "attention"]
        assert exchange and ev.comm["cp"]["exposed_s"] == pytest.approx(sum(exchange), rel=1e-12), (hw, c.label())
        data = "+".join(a for a, k in (("dp", c.dp), ("cp", c.cp)) if k > 1)
        assert data in ev.comm and any(r.axis == data for r in e.comm if r.phase in ("backward", "forward")), data


def test_activations_shrink_with_cp_and_attention_work_is_the_balanced_share(long_graph):
    m = PlanCostModel(long_graph, "h100-sxm", 8)
    base = m.units(1, 8, 1)
    for cp in (2, 4):
        u = m.units(1, 8, cp)
        assert float(u.act.sum()) == pytest.approx(float(base.act.sum()) / cp, rel=0.05), cp
        # model FLOPs per rank: a 1/cp share of everything, attention included (cp chunks of s / cp keys)
        assert float(u.flops.sum()) == pytest.approx(float(base.flops.sum()) / cp, rel=1e-9), cp
        assert m.workspace(1, 8, cp) < m.workspace(1, 8, 1)


def test_cp_candidates_follow_the_graph_the_runtime_and_the_pins():
    gm = _graph()
    m = PlanCostModel(gm, "cpu-gloo", 4)
    cands = candidates(m, 4, {}, RUNTIME_SUPPORT)
    cps = {c for c in cands if c.cp > 1}
    assert {(c.cp, c.dp, c.tp) for c in cps} >= {(2, 2, 1), (4, 1, 1), (2, 1, 2)}
    assert all(c.ep == 1 for c in cps), "gpt has no MoE block: no ep"
    assert {(c.cp, c.pp) for c in cps} >= {(2, 2)}, "pp x cp trains (tests/dist/test_pipeline_context.py)"
    assert all(c.context in ("ring", "ulysses") for c in cps) and all(c.context == "none" for c in cands
                                                                         if c.cp == 1)
    assert {c.zero for c in cps if c.cp == 4 and c.dp == 1} == {0, 1, 2, 3}  # ZeRO over the cp ranks
    # the method is the cheaper of the two at that mesh
    for c in cps:
        prices = m.context_entry(c)["exposed_s"]
        assert prices[c.context] == min(p for p in prices.values() if p is not None)
    # the planner prunes cp candidates with bounds that never exceed their predictions
    for c in sorted(cps)[::3]:
        ev = m.evaluate(c, math.inf)
        for lb_t, lb_m in (m.optimistic_bounds(c), m.lower_bounds(c)):
            assert lb_t <= ev.step_s * (1 + 1e-9) and lb_m <= ev.peak_bytes * (1 + 1e-9), c.label()
    # pins: cp and the method
    only = candidates(m, 4, {"cp": 2, "context_method": "ulysses"}, RUNTIME_SUPPORT)
    assert only and all(c.cp == 2 and c.context == "ulysses" for c in only)
    assert not [c for c in candidates(m, 4, {"cp": 1}, RUNTIME_SUPPORT) if c.cp > 1]
    # 4 query heads over 8 cp ranks: Ulysses cannot run, the ring can
    m8 = PlanCostModel(_graph(), "cpu-gloo", 8)
    assert m8.context_options(8, 1, "ulysses") == [] and m8.context_options(8, 1) == ["ring"]
    # a sequence that 2 cp chunks do not divide: no such cp
    assert m.context_options(4, 1) and not PlanCostModel(_graph(seq=36), "cpu-gloo", 4).context_options(4, 1)
    # a static sequence: no cp at all, and the report says why
    static = PlanCostModel(_graph(dynamic=False), "cpu-gloo", 4)
    assert not [c for c in candidates(static, 4, {}, RUNTIME_SUPPORT) if c.cp > 1]
    assert "static" in static.context_refusal()


def test_the_planner_chooses_cp_when_the_long_sequence_does_not_fit_without_it():
    """gpt at 256 tokens, 2 rows, 4 ranks, a 2.25 MiB limit (the sequence is long for this limit;
    the best cp plan needs 2.13 MiB since the planner walks recompute as cost.estimate does):
    no plan without cp fits (pinned cp=1 is the infeasible error), the planner's plan has a cp
    axis, its context entry, and a reason naming the exchange and the activation saving."""
    gm = _graph(seq=SEQ, batch=2)
    clear_cache()
    limit = 2.25 * 2**20
    with pytest.raises(ValueError, match="fits the memory limit"):
        plan_for(gm, 4, "cpu-gloo", memory_limit=limit, pins={"cp": 1})
    plan, rep = plan_for(gm, 4, "cpu-gloo", memory_limit=limit)
    cp = plan.mesh.get("cp", 1)
    assert cp > 1 and plan.predicted["peak_bytes"] <= limit, (plan.mesh, rep.chosen["label"])
    ctx = plan.extra["context"]
    assert ctx["method"] in ("ring", "ulysses") and ctx["axis"] == "cp" and ctx["exposed_s"][ctx["method"]] >= 0
    why = rep.reason("cp")
    assert why.startswith(f"cp={cp}: {ctx['method']} exchange: activations per rank") and "exposed" in why, why
    assert "cp=1 " in why and "ring " in why and ("ulysses " in why or "not possible" in why), why
    assert any(n.startswith(f"cp={cp}: ") for n in plan.notes)
    # the prediction is cost.estimate's for the plan it wrote (the exchange included)
    e = estimate(gm, plan, "cpu-gloo", batch_is_global=True)
    assert any(r.axis == "cp" and r.phase == "attention" for r in e.comm)
    # plenty of memory on h100-sxm: fits without cp, and the report says what cp would cost
    clear_cache()
    plan2, rep2 = plan_for(_graph(), 4, "h100-sxm", pins={"pp": 1, "tp": 1})
    if plan2.mesh.get("cp", 1) == 1:
        assert "cp not chosen: the plan fits without it" in rep2.reason("cp")
        assert "cp=2 would cost +" in rep2.reason("cp") or "cp=2 cannot beat it" in rep2.reason("cp")


def test_pins_name_bad_cp_values():
    gm = _graph()
    clear_cache()
    with pytest.raises(ValueError, match="context_method"):
        plan_for(gm, 4, "cpu-gloo", pins={"context_method": "zigzag"})
    with pytest.raises(ValueError, match=r"no plan of 4 ranks matches the pins cp=4, pp=2: .*cp=4 runs on a sequence"):
        plan_for(gm, 4, "cpu-gloo", pins={"cp": 4, "pp": 2})  # 8 ranks' worth on 4
    plan, _ = plan_for(gm, 4, "cpu-gloo", pins={"cp": 2, "context_method": "ulysses"})
    assert plan.mesh.get("cp") == 2 and plan.extra["context"]["method"] == "ulysses"


def test_pp_x_cp_plans_price_each_pipeline_ranks_share_of_the_exchange(long_graph):
    """With pp each rank runs the attention calls of its stages only, and an exposed second in
    every stage slot lengthens the schedule: gpt's 2 attention layers on pp=2 (one a rank) under
    1F1B with 2 micro-batches add half the whole model's exchange times (2 + 2 - 1) / 2 = 3/4
    of it; the evaluation's step holds it, its bounds stay under the evaluation, and a pinned
    pp x cp plan comes out of plan_for with its context entry."""
    m = PlanCostModel(long_graph, "h100-sxm", 8)
    piped = Candidate(pp=2, dp=2, cp=2, micro=2, schedule="1f1b", context="ring")
    whole = m.context_entry(piped)["exposed_s"]["ring"]
    assert whole > 0
    assert m.context_exposed(piped) == pytest.approx(whole * 0.5 * 1.5, rel=1e-12)
    gpipe = Candidate(pp=2, dp=2, cp=2, micro=4, schedule="gpipe", context="ring")  # (4 + 1) / 4 of half
    assert m.context_exposed(gpipe) == pytest.approx(m.context_entry(gpipe)["exposed_s"]["ring"] * 0.5 * 1.25,
                                                     rel=1e-12)
    ev = m.evaluate(piped, math.inf)
    assert math.isfinite(ev.step_s) and ev.step_s > m.context_exposed(piped)
    assert ev.comm["cp"]["exposed_s"] == pytest.approx(m.context_exposed(piped), rel=1e-12)
    for lb_t, lb_m in (m.optimistic_bounds(piped), m.lower_bounds(piped)):
        assert lb_t <= ev.step_s * (1 + 1e-9) and lb_m <= ev.peak_bytes * (1 + 1e-9)
    clear_cache()
    plan, _ = plan_for(long_graph, 8, "h100-sxm", pins={"pp": 2, "cp": 2, "dp": 2, "schedule": "1f1b"})
    assert plan.mesh.get("pp") == 2 and plan.mesh.get("cp") == 2 and len(plan.split_points) == 1, plan.mesh
    assert plan.extra["context"]["method"] in ("ring", "ulysses") and plan.extra["context"]["axis"] == "cp"


def test_the_exchange_is_priced_at_the_kv_heads_a_gqa_model_repeats_before_attention():
    """gpt repeats its 2 kv heads to the 4 query heads before attention; the context pass
    exchanges the 2 kv heads themselves (passes/context_attention.py `unrepeated_kv`), so the
    ring's K/V bytes are those of 2 heads: half of what the same model with 4 kv heads moves."""
    from autopar.cost.comm import axis_links
    from autopar.cost.hardware import load_profile
    from autopar.search.context import context_facts, price_context

    gqa, mha = context_facts(_graph(kv=2)), context_facts(_graph(kv=4))
    assert {c[2] for c in gqa.calls} == {2} and {c[2] for c in mha.calls} == {4}
    hw = load_profile("h100-sxm")
    link = axis_links(hw, {"cp": 4})["cp"]
    ring = [price_context(f, 4, 1, 2, link, hw)["bytes"]["ring"] for f in (gqa, mha)]
    assert ring[0] == pytest.approx(ring[1] / 2, rel=1e-12)
