"""MoE auxiliary losses over the global batch (`moe_aux_stats`, issue 21): on one process, a
plan with micro-batches for moe-tiny (load-balancing loss on) is refused before any step under
the default "global", with the value, the reason and both ways out; "micro_batch" runs it and
says so in plan.notes; a model without router statistics is not touched. The joint planner
never proposes micro-batches for moe-tiny under "global" (and does under "micro_batch"), and
its report says why. The per-micro-batch parity itself is tests/dist/test_ep_pipeline.py and
the plan fuzz (both pass moe_aux_stats="micro_batch")."""
import pytest
import torch

import autopar
from autopar.models import get
from autopar.search.candidate import candidates, one_micro_batch
from autopar.search.plan_cost import PlanCostModel
from autopar.search.planner import RUNTIME_SUPPORT, clear_cache, plan_for

BATCH = 8


def _model_and_batch(name):
    spec = get(name)
    torch.manual_seed(0)
    x, y = spec.example_batch(BATCH, generator=torch.Generator().manual_seed(0))
    return spec, spec.build(), x, y


@pytest.fixture(scope="module")
def moe():
    return _model_and_batch("moe-tiny")


@pytest.fixture(scope="module")
def moe_graph(moe):
    _spec, model, x, _y = moe
    return autopar.capture(model, x)


def test_micro_batches_with_global_aux_stats_are_refused_before_the_first_step(moe):
    _spec, model, x, _y = moe
    with pytest.raises(ValueError) as e:
        autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, n_microbatches=2, pins={"fusions": []})
    msg = str(e.value)
    for words in ("n_microbatches=2", "moe_aux_stats='global'", "per micro-batch", "Use n_microbatches=1",
                  "moe_aux_stats='micro_batch'", "Megatron"):
        assert words in msg, (words, msg)


def test_micro_batch_mode_runs_names_itself_and_a_step_override_is_checked_too(moe):
    spec, model, x, y = moe
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, n_microbatches=2,
                             moe_aux_stats="micro_batch", pins={"fusions": []})
    assert pm.plan.extra["moe_aux_stats"] == "micro_batch"
    assert '"moe_aux_stats": "micro_batch"' in pm.plan.to_json()
    assert any("per micro-batch (moe_aux_stats='micro_batch')" in n for n in pm.plan.notes), pm.plan.notes
    loss = pm.step((x, y), spec.loss_fn)
    assert torch.isfinite(loss)
    # the default: one micro-batch plans fine, a step asking for two is refused before it runs
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, pins={"fusions": []})
    assert pm.plan.extra["moe_aux_stats"] == "global"
    pm.zero_grad()  # the model object is shared with the first program, which left gradients on it
    with pytest.raises(ValueError, match=r"n_microbatches=4 with MoE auxiliary losses"):
        pm.step((x, y), spec.loss_fn, n_microbatches=4)
    assert all(v.grad is None for _, v in pm.named_parameters())  # refused before any backward ran
    with pytest.raises(ValueError, match=r"moe_aux_stats='per_token' is not a mode"):
        autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, moe_aux_stats="per_token")


def test_a_model_without_router_statistics_keeps_its_micro_batches():
    spec, model, x, y = _model_and_batch("gpt-tiny")
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, n_microbatches=2, pins={"fusions": []})
    assert "moe_aux_stats" not in pm.plan.extra and pm.plan.n_microbatches == 2
    assert torch.isfinite(pm.step((x, y), spec.loss_fn))


def test_the_planner_never_proposes_micro_batches_for_moe_with_global_aux_stats(moe_graph):
    m = PlanCostModel(moe_graph, "cpu-gloo", 4)
    glob = candidates(m, 4, {}, dict(RUNTIME_SUPPORT))
    per_mb = candidates(m, 4, {}, {**RUNTIME_SUPPORT, "moe_aux_stats": "micro_batch"})
    assert one_micro_batch(m, dict(RUNTIME_SUPPORT)) and not one_micro_batch(m, {"moe_aux_stats": "micro_batch"})
    assert glob and all(c.micro == 1 for c in glob)
    assert any(c.micro > 1 for c in per_mb)  # the restriction is what removes them
    assert {c for c in per_mb if c.micro == 1} == set(glob)
    assert any(c.pp > 1 for c in glob)  # pipelines stay, with one micro-batch
    clear_cache()
    plan, rep = plan_for(moe_graph, 4, "cpu-gloo", top_k=3)
    assert plan.n_microbatches == 1 and plan.extra["moe_aux_stats"] == "global"
    assert all(a["candidate"]["n_microbatches"] == 1 for a in rep.alternatives)
    rows = rep.dimensions["n_microbatches"]
    assert any(r["status"] == "refused" and "moe_aux_stats='micro_batch'" in r["reason"] for r in rows), rows
    assert "n_microbatches=2+ not planned" in rep.reason("n_microbatches")
    pp_rows = [r for r in rep.dimensions.get("pp", []) if r["status"] != "chosen" and r["value"] != 1]
    assert all("with one micro-batch only" in r["reason"] for r in pp_rows)
    with pytest.raises(ValueError, match="moe_aux_stats='micro_batch'"):
        plan_for(moe_graph, 4, "cpu-gloo", pins={"n_microbatches": 2})
    plan, _ = plan_for(moe_graph, 4, "cpu-gloo", pins={"n_microbatches": 2}, moe_aux_stats="micro_batch")
    assert plan.n_microbatches == 2 and plan.extra["moe_aux_stats"] == "micro_batch"  # what parallelize(plan=) runs
