"""plan.predicted: what the cost model says the program that runs will cost.

`predict(plan, global_gm, local_gm, hardware)` fills `plan.predicted` from `cost.estimate` for
the hardware the plan was made for, once the rank's passes have run and the recompute choice is
made. Sizes are per rank: the global graph with the batch split over dp x micro-batches, or the
per-rank capture when the batch dim was captured static. The global graph has no tensor-parallel
collectives: their time, as the sharding search priced it, is added to the step (they block
the ops that wait for them) and to the communication. A planner's plan keeps its own figures
and gets the estimate beside them (`plan.predicted["estimate"]`).

A pipeline plan whose split is complete before the cut (a planner's plan, or one with every
split point pinned) is estimated as the pipeline it is: the schedule's step with the stages'
tensor-parallel conversions and ZeRO-3 gathers inside (not added on top), and the per-rank peaks
(`peak_bytes_per_pp_rank`, with the split they are for); the stage search (build/pipeline.py)
then takes those peaks instead of estimating the same split again: one estimate per build.
`take_pipeline_prediction(plan)` then replaces the one-stage step time and memory by the
pipeline's own (`plan.extra["pipeline"]`: the simulated schedule and the per-pp-rank peaks,
build/pipeline.py) where the estimate could not cost the pipeline (a split chosen at the cut).

A plan with fusions is estimated on the global graph with them applied, as the rank's graph
runs them (`cost.estimate` fuses a copy: cost/fused_graph.py).

The global graph's estimate depends only on that graph, the plan and the hardware: rank 0
makes it and every rank whose plan carries the same recompute choice takes it (build/rank0.py),
reusing the cost analysis the fusion search made (`cost`, build/plan_complete.py); a rank whose
recompute choice differs, and every rank of a static-batch capture (its own per-rank graph),
estimates its own.

A prediction failure never stops the build: it is written into plan.predicted["error"].
Reads no node.meta.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from autopar.build.rank0 import on_rank0
from autopar.cost import GraphCost
from autopar.passes.plan import Plan
from autopar.search.shard_search import batch_is_static

__all__ = ["estimated_pipeline", "predict", "take_pipeline_prediction"]


def predict(plan: Plan, global_gm: fx.GraphModule, local_gm: fx.GraphModule, hardware: Any, *,
            cost: GraphCost | None = None) -> None:
    """Fill plan.predicted (see the module docstring). Collective under torch.distributed: every
    rank calls it. `cost`: `cost.analyze(global_gm, hardware)` when the caller has it."""
    if batch_is_static(global_gm):
        plan.predicted = _predicted(plan, global_gm, local_gm, hardware, True, None)
        return
    mine = _recompute_choice(plan)
    got = on_rank0(lambda: {"recompute": mine, "predicted": _predicted(plan, global_gm, local_gm, hardware, False,
                                                                       cost)}, what="the cost prediction")
    if got["recompute"] == mine:
        plan.predicted = got["predicted"]
    else:  # this rank chose another recompute set: its own estimate
        plan.predicted = _predicted(plan, global_gm, local_gm, hardware, False, cost)


def _recompute_choice(plan: Plan) -> Any:
    return (dict(plan.recompute), plan.extra.get("recompute_save"))


def _predicted(plan: Plan, global_gm: fx.GraphModule, local_gm: fx.GraphModule, hardware: Any, static: bool,
               cost: GraphCost | None) -> dict[str, Any]:
    """What `predict` writes into plan.predicted."""
    from autopar.cost import estimate as cost_estimate  # noqa: PLC0415

    planned = plan.predicted if plan.predicted.get("source") == "planner" else None
    try:
        if static:
            est = cost_estimate(local_gm, plan, hardware)
        else:
            # with fusions the graph itself: estimate costs a fused copy of it (cost/fused_graph.py)
            src = global_gm if plan.fusions or cost is None else cost
            est = cost_estimate(src, plan, hardware, batch_is_global=True, analysis=cost if plan.fusions else None)
        predicted = est.summary()
        per_rank = est.memory.get("peak_per_pp_rank")
        if per_rank is not None and (static or not plan.schedule):
            per_rank = None  # the stage search's figures stand there (build/pipeline.py)
        if per_rank is not None:  # the pipeline's own figures (see the module docstring)
            predicted.update(peak_bytes_per_pp_rank=[float(x) for x in per_rank],
                             pipeline_split_points=list(plan.split_points), pipeline_schedule=plan.schedule)
        for axis, info in plan.extra.get("shard", {}).items():
            t = float(info["comm_s"]) * plan.n_microbatches  # the search prices one micro-batch
            predicted[f"{axis}_comm_s"] = t
            for k in ("step_s", "comm_s", "comm_exposed_s"):
                if k in predicted and not (per_rank is not None and k == "step_s"):  # a pipeline's are inside
                    predicted[k] += t
    except Exception as e:  # noqa: BLE001 - a prediction failure must not stop training; it is reported
        predicted = {"error": f"{type(e).__name__}: {e}"}
    return {**planned, "estimate": predicted} if planned is not None else predicted


def estimated_pipeline(plan: Plan) -> dict | None:
    """The estimate `predict` made of the pipeline as it is split now, if it could cost it."""
    pred = plan.predicted.get("estimate") if plan.predicted.get("source") == "planner" else plan.predicted
    if not isinstance(pred, dict) or pred.get("pipeline_split_points") != list(plan.split_points) \
            or pred.get("pipeline_schedule") != plan.schedule:
        return None
    return pred if pred.get("peak_bytes_per_pp_rank") else None


def take_pipeline_prediction(plan: Plan) -> None:
    """The pipeline's step time and per-rank memory in place of `estimate`'s one-stage figures
    (kept where `predict` estimated the pipeline itself: `estimated_pipeline`)."""
    pipe = plan.extra.get("pipeline")
    if not pipe:
        return
    target = plan.predicted["estimate"] if plan.predicted.get("source") == "planner" else plan.predicted
    if estimated_pipeline(plan) is not None:
        target.update(pipeline_bubble=pipe["bubble"], peak_bytes_source="cost.estimate")
        return
    target.update(step_s=pipe["step_s"], pipeline_bubble=pipe["bubble"],
                  peak_bytes_per_pp_rank=pipe["rank_memory_bytes"], peak_bytes=max(pipe["rank_memory_bytes"]),
                  peak_bytes_source=pipe.get("rank_memory_source", "stage search"))
