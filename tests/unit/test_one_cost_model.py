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

Not covered at 1e-6 (see the planner's docstrings): pipelines (pp > 1) and expert parallelism
(ep > 1) keep the per-unit model.
"""
import math

import pytest
import torch

import autopar
from autopar.cost import estimate, load_profile
from autopar.models import get
from autopar.search.candidate import candidates
from autopar.search.plan_write import write_plan
from autopar.search.planner import DEFAULT_HEADROOM, RUNTIME_SUPPORT, _Search

WORLD = 8  # at dp = 8 a small all-reduce is faster by tree than by ring: the planner must pick as estimate does
SMALL = 4  # the variants: fewer candidates
RTOL = 1e-6


def _capture(name, batch=8):
    torch.manual_seed(0)
    spec = get(name)
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


def _agree(gm, hw: str, pins=None, precision=None, world=WORLD, recompute=False) -> list:
    """Every pp = 1 candidate of the planner's enumeration: its evaluation against estimate of
    the Plan the planner writes for it. Returns [(candidate, evaluation, estimate)]."""
    prof = load_profile(hw)
    s = _Search(gm, prof, world, dict(pins or {}), DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None, precision=precision)
    out = []
    for c in candidates(s.model, world, s.pins, s.support):
        if c.pp > 1:
            continue
        ev = s._evaluate(c)
        assert ev is not None and ev.feasible and bool(ev.recompute) == recompute, c.label()
        plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
        e = estimate(gm, plan, hw, batch_is_global=True)
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


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_recomputed_blocks_equal_cost_estimate(graphs, hw):
    """Every block recomputed (pinned): the checkpointed regions' walk (`cost.timeline`) gives
    both the peak and the recompute time."""
    for name in ("gpt-tiny", "vit-tiny"):
        done = _agree(_graph(graphs, name), hw, pins={"recompute": "full"}, world=SMALL, recompute=True)
        assert all(e.recompute_s > 0 for _c, _ev, e in done), name


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
