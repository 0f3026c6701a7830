"""One cost model (issue 22 item 1): for every one-stage candidate the joint planner ranks, its
predicted step time and peak memory equal `cost.estimate`'s for the Plan the planner writes, to
1e-6 relative, on the reference models, on cpu-gloo and h100-sxm.

The candidates are the planner's own enumeration (`search.candidate.candidates`, every pp = 1
one: dp, tp, ZeRO 0-3, micro-batches), each evaluated as the search evaluates it
(`_Search._evaluate`, at the planner's default memory limit) and written as the search writes
its chosen plan (`search.plan_write.write_plan`). The planner's step includes the tensor-
parallel conversions it inserts, which estimate does not count on the captured graph; that
term is checked on its own against the sharding ILP's recount. Variants: a precision recipe
with masters and offload, small gradient buckets (several buckets in flight), and ZeRO 3 with
micro-batches (every micro-batch gathers, the last one alone reduce-scatters, as
`runtime.program` runs it under no_sync), and every block recomputed.

Fusions: the planner ranks each candidate as its unfused graph (the fusion search then picks
the fused kernels for the written plan), so each plan is compared with `plan.fusions` emptied;
`plan.predicted["estimate"]` prices the fusions that run (`cost/fused_graph.py`,
tests/unit/test_fused_estimate.py).

Expert parallelism (ep > 1, one stage): the plan carries `plan.extra["expert"]` as
`build.plan_complete` would write it, and both sides price the rank's experts on their routed
rows (balanced routing; dropless, or the model's capacity), the dispatcher's all-to-alls and
count all-gathers, the router statistics' all-reduces over dp and ep, and the non-expert
gradients' all-reduce over ep, by the same functions (`cost.expert_memory`, `cost.expert_comm`).

Pipelines (pp > 1, with ep too): tests/unit/test_one_cost_model_pipeline.py.
"""
import copy
import math

import pytest
import torch

import autopar
from autopar.cost import analyze, estimate, load_profile
from autopar.models import get
from autopar.models.zoo import spec as zoo_spec
from autopar.search.candidate import candidates
from autopar.search.expert_detect import detect_moe
from autopar.search.plan_write import write_plan
from autopar.search.planner import DEFAULT_HEADROOM, RUNTIME_SUPPORT, _Search

WORLD = 8  # at dp = 8 a small all-reduce is faster by tree than by ring: the planner must pick as estimate does
SMALL = 4  # the variants: fewer candidates
RTOL = 1e-6


def _capture(name, batch=8):
    torch.manual_seed(0)
    spec = zoo_spec(name) if name.startswith("hf-") else get(name)  # hf-*: the transformers zoo rows
    x, _ = spec.example_batch(batch, generator=torch.Generator().manual_seed(0))
    return autopar.capture(spec.build(), x)


@pytest.fixture(scope="module")
def graphs():
    return {}


def _graph(graphs, name):
    if name not in graphs:
        graphs[name] = _capture(name)
    return graphs[name]


def _close(got: float, want: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=RTOL, atol=0.0, msg=lambda m: f"{what}: planner {got!r}, estimate {want!r}\n{m}")


def _ilp_solves(s, t: int) -> bool:
    """Whether the sharding ILP solves tp = t: the planner ranks no candidate of a tp degree it
    cannot solve (`_Search._ilp_failed` skips it, and says so)."""
    try:
        s.model.sharding(t)
    except Exception:  # noqa: BLE001 - as the planner catches it
        return False
    return True


def _agree(gm, hw: str, pins=None, precision=None, world=WORLD, recompute=False) -> list:
    """Every pp = 1 candidate of the planner's enumeration: its evaluation against estimate of
    the Plan the planner writes for it. Returns [(candidate, evaluation, estimate)]."""
    prof = load_profile(hw)
    s = _Search(gm, prof, world, dict(pins or {}), DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None, precision=precision)
    out = []
    # estimate's own analysis of the graph, once for every candidate (one stage: estimate of the
    # GraphCost is estimate of the graph; checked on the first candidate)
    gc = analyze(gm, prof)
    for c in candidates(s.model, world, s.pins, s.support):
        if c.pp > 1 or (c.tp > 1 and not _ilp_solves(s, c.tp)):
            continue
        ev = s._evaluate(c)
        assert ev is not None and ev.feasible and bool(ev.recompute) == recompute, c.label()
        plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
        plan.fusions = []  # the planner ranks candidates unfused (see the module docstring)
        e = estimate(gc, plan, hw, batch_is_global=True)
        if not out:
            whole = estimate(gm, plan, hw, batch_is_global=True)
            assert (whole.step_s, whole.memory["peak"]) == (e.step_s, e.memory["peak"]), c.label()
        tp_s = ev.comm["tp"]["time_s"] if c.tp > 1 else 0.0
        if c.tp > 1 and s.model.rows_per_micro(c) == s.model.captured_rows:  # the ILP's own recount
            _close(tp_s, s.model.sharding(c.tp).solution.recounted_comm_s, f"{hw} {c.label()} tp conversions")
        _close(ev.step_s, e.step_s + tp_s, f"{hw} {c.label()} step")
        _close(ev.peak_bytes, e.memory["peak"], f"{hw} {c.label()} peak memory")
        out.append((c, ev, e))
    return out


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
@pytest.mark.parametrize("name", ["gpt-tiny", "vit-tiny", "mlp-tiny", "gpt-tiny-tied"])
def test_every_one_stage_candidate_equals_cost_estimate(graphs, name, hw):
    done = _agree(_graph(graphs, name), hw)
    # the enumeration covers what the issue names: dp with every ZeRO stage, tp, micro-batches
    seen = {(c.tp > 1, c.dp > 1, c.zero, c.micro > 1) for c, _ev, _e in done}
    assert {(False, True, z, False) for z in range(4)} <= seen, seen
    assert any(c.tp > 1 for c, _ev, _e in done) and any(c.micro > 1 for c, _ev, _e in done)


def test_moe_candidates_without_expert_parallelism_equal_cost_estimate(graphs):
    done = _agree(_graph(graphs, "moe-tiny"), "h100-sxm", pins={"ep": 1}, world=SMALL)
    assert len(done) >= 8


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_precision_and_offload_candidates_equal_cost_estimate(graphs, hw):
    gm = _graph(graphs, "gpt-tiny")
    for prec in ({"param_dtype": "bf16", "master_dtype": "fp32"},
                 {"param_dtype": "bf16", "master_dtype": "fp32", "reduce_dtype": "fp32", "offload": True}):
        done = _agree(gm, hw, precision=prec, world=SMALL)
        assert all(e.memory["offloaded"] > 0 for c, _ev, e in done if prec.get("offload")), prec


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_small_gradient_buckets_equal_cost_estimate(graphs, hw):
    """bucket_mb = 0.05: several buckets per step, each reduced while backward runs (h100-sxm:
    the compute beside them slowed by the link's contention)."""
    done = _agree(_graph(graphs, "gpt-tiny"), hw, pins={"bucket_mb": 0.05}, world=SMALL)
    many = [r.calls for c, _ev, e in done if c.dp > 1 and c.zero < 3 for r in e.comm
            if r.phase == "backward" and r.op in ("all_reduce", "reduce_scatter")]
    assert many and min(many) >= 2 and max(many) > 3, many


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_recomputed_blocks_equal_cost_estimate(graphs, hw, mode):
    """Every block recomputed (pinned), whole or selective (the GEMMs' outputs kept,
    `search.plan_selective`): the checkpointed regions' walk (`cost.timeline`) gives both the
    peak and the recompute time."""
    for name in ("gpt-tiny", "vit-tiny"):
        done = _agree(_graph(graphs, name), hw, pins={"recompute": mode}, world=SMALL, recompute=True)
        assert all(e.recompute_s > 0 and set(ev.recompute.values()) == {mode} for _c, ev, e in done), name


def test_zero3_gathers_every_micro_batch_and_reduce_scatters_once():
    """estimate's ZeRO 3 with m micro-batches, as the runtime runs it: every micro-batch's forward
    gathers every unit, its backward re-gathers the saved ones, only the last reduce-scatters."""
    from autopar.cost.zero_comm import zero3_events
    from autopar.passes.plan import Plan

    gm = _capture("gpt-tiny")
    one = estimate(gm, Plan(mesh={"dp": 2}, zero_stage=3, n_microbatches=1), "cpu-gloo", batch_is_global=True)
    four = estimate(gm, Plan(mesh={"dp": 2}, zero_stage=3, n_microbatches=4), "cpu-gloo", batch_is_global=True)
    calls = lambda e, op, phase: sum(r.calls for r in e.comm if r.op == op and r.phase == phase)  # noqa: E731
    events = zero3_events(autopar.cost.analyze(gm, load_profile("cpu-gloo")))
    assert calls(one, "all_gather", "forward") == len(events.starts)
    assert calls(four, "all_gather", "forward") == 4 * len(events.starts)
    assert calls(four, "all_gather", "backward") == 4 * calls(one, "all_gather", "backward") == 4 * sum(events.saved)
    assert calls(four, "reduce_scatter", "backward") == calls(one, "reduce_scatter", "backward") > 0
    assert not all(events.saved), "an embedding's weight is not saved: its unit is not re-gathered"
    assert math.isfinite(four.step_s) and four.step_s > one.step_s


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
@pytest.mark.parametrize("name", ["moe-tiny", "moe-tiny-capacity", "hf-mixtral"])
def test_expert_parallel_candidates_equal_cost_estimate(graphs, name, hw):
    """Every one-stage candidate with ep > 1 (and the ep = 1 ones beside them) on the reference
    MoE, dropless and with the model's capacity (cf = 1), and on transformers' Mixtral (grouped
    (E, ...) experts, sorted dispatch, no router statistics: micro-batches too): ep = 2 with dp
    and ZeRO 0-3, ep = 4, tp x ep where the sharding ILP solves tp."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    gm = _graph(graphs, name)
    done = _agree(gm, hw, world=SMALL)
    eps = [(c, e) for c, _ev, e in done if c.ep > 1]
    assert {(c.ep, c.dp, c.zero) for c, _e in eps} >= {(2, 2, z) for z in range(4)} | {(4, 1, 0)}, eps
    assert any(c.tp > 1 for c, _e in eps)
    if name == "hf-mixtral":
        assert any(c.micro > 1 and c.dp > 1 for c, _e in eps)
    blocks = detect_moe(gm)
    per_block = [4 + 2 * bool(b.side_row_bytes) for b in blocks]  # dispatch, combine, their reverses (+ side data)
    for c, e in eps:  # estimate priced the expert entry the plan carries (graph collectives: per micro-batch)
        a2a = sum(r.calls for r in e.comm if r.op == "all_to_all" and r.axis == "ep")
        assert blocks and a2a == c.micro * sum(per_block), (c.label(), a2a)  # once per micro-batch
        assert any(r.op == "all_reduce" and r.axis == "ep" and r.phase == "backward" for r in e.comm), c.label()


def test_expert_parallel_plan_carries_the_expert_entry_build_would_write():
    """write_plan's `plan.extra["expert"]` is `search.expert.plan_experts` as
    `build.plan_complete` calls it, and estimate of the plan without it (every expert on every
    rank, no all-to-all) is another figure: the entry is what makes the two agree."""
    from autopar.search.expert import plan_experts

    gm = _capture("moe-tiny")
    prof = load_profile("h100-sxm")
    s = _Search(gm, prof, SMALL, {}, DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None)
    c = next(c for c in candidates(s.model, SMALL, s.pins, s.support) if c.ep == 4)
    ev = s._evaluate(c)
    plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
    plan.fusions = []  # the planner ranks candidates unfused (see the module docstring)
    want = plan_experts(gm, plan.mesh, dp_axis=plan.dp_axis, n_microbatches=plan.n_microbatches)
    assert plan.extra["expert"]["blocks"] == want["blocks"] and plan.extra["expert"]["router_stats"] == want[
        "router_stats"]
    assert plan.extra["expert"]["tokens_per_rank"] == want["tokens_per_rank"]
    bare = copy.deepcopy(plan)
    del bare.extra["expert"]
    e, e0 = (estimate(gm, p, "h100-sxm", batch_is_global=True) for p in (plan, bare))
    _close(ev.step_s, e.step_s, "ep4 step")
    assert e0.memory["peak"] > 1.2 * e.memory["peak"], (e0.memory["peak"], e.memory["peak"])
    assert not any(r.op == "all_to_all" for r in e0.comm)


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_expert_parallel_candidates_with_recomputed_blocks_equal_cost_estimate(graphs, hw):
    """ep > 1 with every block recomputed (pinned; `recompute_with_ep` allowed): the timeline's
    walk and recompute time see this rank's experts on their routed rows, and no other rank's."""
    gm = _graph(graphs, "moe-tiny")
    prof = load_profile(hw)
    s = _Search(gm, prof, SMALL, {"recompute": "full"}, DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT, recompute_with_ep=True), None)
    done = 0
    gc = analyze(gm, prof)  # one stage: estimate of the GraphCost is estimate of the graph (`_agree`)
    for c in candidates(s.model, SMALL, s.pins, s.support):
        if c.pp > 1 or c.ep < 2 or (c.tp > 1 and not _ilp_solves(s, c.tp)):
            continue
        ev = s._evaluate(c)
        assert ev is not None and ev.recompute and ev.recompute_s > 0, c.label()
        plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
        plan.fusions = []  # the planner ranks candidates unfused (see the module docstring)
        e = estimate(gc, plan, hw, batch_is_global=True)
        if not done:
            whole = estimate(gm, plan, hw, batch_is_global=True)
            assert (whole.step_s, whole.memory["peak"], whole.recompute_s) == (e.step_s, e.memory["peak"], e.recompute_s)
        tp_s = ev.comm["tp"]["time_s"] if c.tp > 1 else 0.0
        _close(ev.step_s, e.step_s + tp_s, f"{hw} {c.label()} step")
        _close(ev.peak_bytes, e.memory["peak"], f"{hw} {c.label()} peak memory")
        _close(ev.recompute_s, e.recompute_s, f"{hw} {c.label()} recompute")
        done += 1
    assert done >= 5


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_loss_parallel_candidates_equal_cost_estimate(graphs, hw):
    """pins={"loss_parallel": True} (`Plan.loss_parallel`, gpt-tiny): the tp candidates keep the
    logits vocab-sharded and the loss runs on the shards; the planner prices it as estimate does
    (`cost.loss_memory`: the shard-sized loss, the two tp all-reduces per micro-batch), to 1e-6,
    at tp 2 (world 2), tp 2 x dp 2 and tp 4 (world 4). Each is below the same candidate's peak
    with the logits gathered (the comparison sees the vocab-parallel loss)."""
    from autopar.cost.loss_memory import VOCAB_PARALLEL  # noqa: PLC0415

    gm = _graph(graphs, "gpt-tiny")
    seen = set()
    for world in (2, SMALL):
        lp = _agree(gm, hw, pins={"loss_parallel": True}, world=world)
        gathered = {c.label(): ev for c, ev, _e in _agree(gm, hw, world=world)}
        for c, ev, e in lp:
            if c.tp > 1:
                seen.add((c.tp, c.dp))
                assert ev.peak_bytes < gathered[c.label()].peak_bytes, c.label()
    assert {(2, 1), (2, 2), (4, 1)} <= seen, seen
    prof = load_profile(hw)
    s = _Search(gm, prof, 2, {"loss_parallel": True}, DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None)
    assert s.model.sharding(2).loss == VOCAB_PARALLEL and s.model.sharding(2).solution.loss_s > 0
