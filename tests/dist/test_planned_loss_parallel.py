"""`parallelize(model, autopar.mesh(world_size=2), loss_parallel=True, pins={"tp": 2})`: the joint
planner plans the vocab-parallel loss (issue 22: one cost model). On 2 gloo ranks, gpt-tiny in
fp64: the plan carries `loss_parallel`, the head is column-parallel and the rank's program
returns V / 2 logit columns; the planner's predicted peak equals `cost.estimate`'s of the plan
that runs (`plan.predicted["estimate"]`, made by build/predict.py on the built rank) to 1e-6, its
step equals estimate's plus the tp conversions (`plan.predicted["tp_comm_s"]`) to 1e-6; and the
first step's loss equals one process's `F.cross_entropy` over the batch to 1e-9.
"""
import torch
import torch.nn.functional as F
from autopar.models import get
from harness import capture_before_fork, world

import autopar

BATCH, SEQ, VOCAB = 8, 16, 128


def _model():
    torch.manual_seed(0)
    return get("gpt-tiny").build().double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _rank(rank, ws):
    x, y = _batch()
    pm = autopar.parallelize(_model(), autopar.mesh(world_size=2), example_inputs=(x,), loss_parallel=True,
                             pins={"tp": 2}, hardware="h100-sxm")
    prog = pm.program
    with torch.no_grad():
        raw = prog.module(prog.local_batch((x, y))[0])
    width = (raw[prog.vocab_shard["output"]] if isinstance(raw, (tuple, list)) else raw).shape[-1] \
        if prog.vocab_shard else -1  # -1: the logits left gathered
    loss = pm.step(((x,), y), autopar.cross_entropy).item()
    pr = pm.plan.predicted
    return dict(loss=loss, width=width, loss_parallel=pm.plan.loss_parallel, mesh=dict(pm.plan.mesh),
                head=str(pm.plan.param_layouts["lm_head.weight"].get("tp")), source=pr.get("source"),
                peak=pr["peak_bytes"], step=pr["step_s"], est=pr["estimate"])


def test_planned_tp2_plan_runs_the_vocab_parallel_loss_and_predicts_what_estimate_does():
    capture_before_fork(_model(), (_batch()[0],), search_world=2)
    x, y = _batch()
    want = F.cross_entropy(_model()(x).reshape(-1, VOCAB), y.reshape(-1)).item()
    for r in world(2, _rank):
        assert r["loss_parallel"] and r["mesh"] == {"tp": 2} and r["head"] == "S(0)" and r["source"] == "planner"
        assert r["width"] == VOCAB // 2, r["width"]
        est = r["est"]
        assert "error" not in est, est
        torch.testing.assert_close(r["loss"], want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(r["peak"], est["peak_bytes"], rtol=1e-6, atol=0.0)
        torch.testing.assert_close(r["step"], est["step_s"], rtol=1e-6, atol=0.0)
        assert est["tp_comm_s"] > 0
