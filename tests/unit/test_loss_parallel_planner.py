"""The joint planner prices the vocab-parallel loss (`Plan.loss_parallel`) as `cost.estimate` does
(issue 22: one cost model). The pin "loss_parallel" reaches the sharding ILP (the head pinned
column-parallel, its logits leaving the graph Shard(last dim), the loss's two tp all-reduces in
the objective instead of a logits all-gather that does not run), the planner's memory tables
(`ShardInfo.loss`: VOCAB_PARALLEL) and the written plan (`plan.loss_parallel`).

Pipelines (pp 2 x tp 2, gpt-tiny): per-rank peaks and step equal estimate's to 1e-6
(`cost.tp_conversions.resolve_strategies` leaves the vocab-sharded logits Shard(last dim) under
loss_parallel; before, it priced the logits all-gather the runtime does not run: 2.4-3.9 % on
cpu-gloo, measured 2026-11-26).
"""
import pytest
import torch
from test_one_cost_model import _capture, _close
from test_one_cost_model_pipeline import _check, _pipelines

from autopar.cost import estimate, load_profile
from autopar.cost.comm import axis_links
from autopar.cost.loss_memory import VOCAB_PARALLEL
from autopar.cost.memory import CROSS_ENTROPY
from autopar.cost.placements import Replicate, Shard, conversion_time
from autopar.search.plan_pins import normalise_pins
from autopar.search.plan_write import unfused
from autopar.search.planner import DEFAULT_HEADROOM, RUNTIME_SUPPORT, _Search, plan_for
from autopar.search.shard_ilp import solve_sharding
from autopar.search.shard_loss import head_pins, vocab_output

STEP_RTOL_PP = 1e-6


@pytest.fixture(scope="module")
def gpt():
    return _capture("gpt-tiny")


def test_loss_parallel_pin_must_be_a_bool_and_false_is_the_default():
    assert normalise_pins({"loss_parallel": True}, 4)["loss_parallel"] is True
    assert "loss_parallel" not in normalise_pins({"loss_parallel": False}, 4)
    with pytest.raises(ValueError, match="loss_parallel='yes' must be True or False"):
        normalise_pins({"loss_parallel": "yes"}, 4)


def test_sharding_ilp_keeps_the_logits_sharded_and_prices_the_loss_not_their_gather(gpt):
    """Under the same head pins, loss_parallel removes exactly the logits' all-gather (S(last) ->
    R, a partial-free conversion) from the ILP's communication, and adds the loss's all-reduces
    (`cost.loss_memory.loss_collectives` timed on the tp link) to its compute side."""
    hw = load_profile("h100-sxm")
    mesh = {"dp": 1, "tp": 2}
    pp, npins = head_pins(gpt, 2, None, None)
    assert pp == {"lm_head.weight": Shard(0)} and list(npins.values()) == [Shard(2)]
    lp = solve_sharding(gpt, "tp", 2, mesh=mesh, hardware=hw, param_pins=pp, node_pins=npins, loss_parallel=True)
    gathered = solve_sharding(gpt, "tp", 2, mesh=mesh, hardware=hw, param_pins=pp, node_pins=npins)
    out = next(n for n in lp.chosen if n.op == "output")
    ins = [a for a in out.all_input_nodes if a in lp.chosen]
    j, logits = vocab_output(gpt, ins, 2)
    assert lp.chosen[out].ins[j] == Shard(2) and lp.chosen[logits].out == Shard(2)
    assert gathered.chosen[out].ins[j] == Replicate() and gathered.loss_s == 0.0
    link = axis_links(hw, mesh)["tp"]
    shape = logits.meta["val"].shape  # (batch: symbolic, 8 captured; never compared, which would specialise it)
    assert isinstance(shape[0], torch.SymInt) and list(shape[1:]) == [32, 128]
    nbytes = 8 * 32 * 128 * 4  # the logits at the captured batch, fp32
    gather = conversion_time(Shard(2), Replicate(), False, nbytes, link, 2, hw.kernel_overhead_s)
    _close(gathered.recounted_comm_s - lp.recounted_comm_s, gather, "the logits all-gather")
    tokens = 8 * 32  # the max (fp32, one a token), the sums (two a token, fp32)
    want = link.time("all_reduce", tokens * 4, "auto") + link.time("all_reduce", 2 * tokens * 4, "auto")
    _close(lp.loss_s, want, "the loss's all-reduces")


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_plan_for_with_the_pin_writes_loss_parallel_and_prices_it_as_estimate(gpt, hw):
    """plan_for(..., pins={"loss_parallel": True}) at tp 2: the written plan carries it, pins the
    head S(0) on tp, and its predicted peak and step (less the tp conversions, which estimate
    does not count on the captured graph) equal estimate's of that plan."""
    plan, _rep = plan_for(gpt, {"tp": 2, "dp": 2}, hw, pins={"loss_parallel": True}, global_batch=8)
    assert plan.loss_parallel and plan.param_layouts["lm_head.weight"].get("tp") == Shard(0)
    e = estimate(gpt, unfused(plan), hw, batch_is_global=True)  # as the planner ranks it
    pr = plan.predicted
    _close(pr["peak_bytes"], e.memory["peak"], f"{hw} peak")
    _close(pr["step_s"], e.step_s + pr["comm_per_axis"]["tp"]["time_s"], f"{hw} step")
    plain, _ = plan_for(gpt, {"tp": 2, "dp": 2}, hw, global_batch=8)
    assert not plain.loss_parallel and plain.predicted["peak_bytes"] > pr["peak_bytes"]


@pytest.mark.parametrize("hw", ["cpu-gloo", "h100-sxm"])
def test_pp2_tp2_loss_parallel_candidates_equal_cost_estimate(gpt, hw):
    """pp 2 x tp 2 with the vocab-parallel loss on the last stage: per-rank peaks to 1e-6, the
    step within STEP_RTOL_PP (module docstring), every schedule the planner ranks."""
    prof = load_profile(hw)
    s = _Search(gpt, prof, 4, {"loss_parallel": True}, DEFAULT_HEADROOM * prof.device.memory_bytes, None, 1,
                "adamw", dict(RUNTIME_SUPPORT), None)
    assert s.model.sharding(2).loss == VOCAB_PARALLEL and s.model.sharding(1).loss == CROSS_ENTROPY
    done = _pipelines(gpt, hw, pins={"loss_parallel": True}, keep=lambda c: c.tp > 1)
    assert {c.schedule for c, _ev, _e in done} >= {"1f1b", "zb_h1", "zbv", "interleaved_1f1b"}
    _check(done, hw, STEP_RTOL_PP)
    plain = {c.label(): ev for c, ev, _e in _pipelines(gpt, hw, keep=lambda c: c.tp > 1)}
    # 1F1B, split where the gathered plan splits: the last rank has the loss on the shards, less memory
    same = [(ev, plain[c.label()]) for c, ev, _e in done
            if c.schedule == "1f1b" and list(ev.split_points) == list(plain[c.label()].split_points)]
    assert len(same) >= 2 and all(ev.rank_peaks[-1] < g.rank_peaks[-1] for ev, g in same)


def test_a_plan_file_with_a_non_bool_loss_parallel_is_refused_naming_the_key():
    from autopar.passes.plan import Plan
    from autopar.passes.plan_schema import validate_plan_dict

    d = Plan(mesh={"tp": 2}, dp_axis=None).to_dict()
    validate_plan_dict({**d, "extra": {"loss_parallel": True}})
    with pytest.raises(ValueError, match="'loss_parallel': expected true or false, got"):
        validate_plan_dict({**d, "extra": {"loss_parallel": "yes"}})


def test_plan_recompute_is_given_the_loss_the_plan_runs(gpt):
    """`build.recompute_plan.plan_loss`: VOCAB_PARALLEL for a planned loss_parallel tp plan (its
    logits vocab-sharded), CROSS_ENTROPY for the same plan without the flag."""
    from autopar.build.recompute_plan import plan_loss

    plan, _ = plan_for(gpt, {"tp": 2}, "cpu-gloo", pins={"loss_parallel": True}, global_batch=8)
    assert plan_loss(gpt, plan, "cpu-gloo") == VOCAB_PARALLEL
    plan.loss_parallel = False
    assert plan_loss(gpt, plan, "cpu-gloo") == CROSS_ENTROPY
