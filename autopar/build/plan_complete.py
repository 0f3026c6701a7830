"""Complete a Plan for this mesh and graph: what `parallelize` decides after the plan's shape.

`complete_plan(plan, global_gm, local_gm, mesh, ...)` fills what a plan leaves open once its mesh
is fixed (a default plan, a pinned one, or the joint planner's), in this order:

  * (no refusal of recompute: under the zero-bubble schedules a stage holding checkpoint regions
    runs its backward whole, runtime/pipeline.py; under expert parallelism the expert pass places
    its nodes in their block, and a checkpointed block keeps the dispatch's collectives);
  * context parallelism (a cp axis): the attention exchange, ring or Ulysses
    (`search.context.plan_context`, `plan.extra["context"]`);
  * experts (an ep axis): `search.expert.plan_experts` (`plan.extra["expert"]`; on rank 0, its
    answer or its error on every rank, as the fusion search below), before the tp
    search, which then keeps each MoE block's routed nodes replicated on tp
    (`expert_node_pins`: the expert pass needs them whole);
  * tensor parallelism: the sharding search (`search.shard_search.search_sharding`: parameter and
    node layouts, sequence parallelism; rank 0 searches and every rank takes its answer);
  * with ep, the grouped experts' ep layouts; without ep, an MoE model's router statistics
    averaged over the axes that split its tokens (`plan.extra["router_stats"]`);
  * fusions: checked when pinned, else searched (`search.fusion.plan_fusions`) on rank 0, whose
    answer every rank takes (build/rank0.py: the search depends only on the graph, the plan and
    the hardware; a failure is raised on every rank);
  * the axis notes of `build.plan_check.axis_notes`.

It returns rank 0's cost analysis of the global graph (`cost.analyze`, made for the fusion search
of a graph captured with a dynamic batch), which `build.predict.predict` reuses instead of
analysing the same graph again; None on the other ranks and when it made none.

Reads node.meta["autopar"] of the captured graph (through the searches); writes the plan's
layouts, plan.extra ("context", "shard", "expert", "router_stats"), plan.fusions and plan.notes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autopar.build.plan_check import axis_notes
from autopar.build.rank0 import on_rank0
from autopar.cost import GraphCost, analyze
from autopar.passes.plan import Plan
from autopar.runtime.mesh import Mesh, planning_group
from autopar.runtime.placement import Replicate
from autopar.search.context import plan_context
from autopar.search.expert import grouped_expert_layouts
from autopar.search.fusion import fusion_notes, plan_fusions
from autopar.search.shard_search import batch_is_static, search_sharding

__all__ = ["complete_plan", "expert_node_pins", "router_stats_without_ep"]


def complete_plan(plan: Plan, global_gm: fx.GraphModule, local_gm: fx.GraphModule, mesh: Mesh, *, hardware: Any,
                  context_method: str = "auto",
                  fusions_pinned: bool = False) -> GraphCost | None:
    """Fill `plan` in place for `mesh` (see the module docstring). `local_gm` is this rank's copy
    of the graph (the fusion search reads it when the batch was captured static). Returns the
    cost analysis of `global_gm` made on the way (rank 0), else None."""
    dp = plan.dp * mesh.size("ep")  # the batch is split over dp x ep
    if mesh.size("cp") > 1 and "context" not in plan.extra:
        plan.extra["context"] = plan_context(global_gm, dict(mesh.sizes), context_method, hardware)
        plan.notes += plan.extra["context"]["notes"]
    if mesh.size("ep") > 1 and "expert" not in plan.extra:
        from autopar.search.expert import plan_experts  # noqa: PLC0415

        plan.extra["expert"] = on_rank0(  # the same on every rank: rank 0 detects and plans, a bad mesh fails everywhere
            lambda: plan_experts(global_gm, mesh, dp_axis=plan.dp_axis, n_microbatches=plan.n_microbatches),
            what="the expert plan")
        plan.notes += plan.extra["expert"]["notes"]
    search_sharding(plan, global_gm, mesh, hardware, group=planning_group(), node_pins=expert_node_pins(plan, mesh))
    if mesh.size("ep") > 1:
        grouped_expert_layouts(plan, tuple(mesh.sizes))
    else:
        router_stats_without_ep(plan, global_gm, mesh)
    global_cost = None
    if fusions_pinned:
        from autopar.passes.rules.fusion_table import selection  # noqa: PLC0415

        selection(plan.fusions)  # a bad entry is a ValueError here, not a PassError
    else:
        global_cost = _search_fusions_on_rank0(plan, global_gm, local_gm, hardware, dp)
    plan.notes += [n for n in axis_notes(plan) if n not in plan.notes]
    return global_cost


def _search_fusions_on_rank0(plan: Plan, global_gm: fx.GraphModule, local_gm: fx.GraphModule, hardware: Any,
                             dp: int) -> GraphCost | None:
    """`search.fusion.search_fusions` computed on rank 0 and taken by every rank (it reads only
    the graph, the plan's batch split and the hardware). Returns rank 0's analysis of the global
    graph (None elsewhere, and for a static batch, whose search reads this rank's capture)."""
    static = batch_is_static(global_gm)
    made: dict[str, GraphCost] = {}

    def search() -> dict[str, Any]:
        gc = None
        if not static:  # the same analysis `predict` makes of the global graph: made once, shared
            gc = made["cost"] = analyze(global_gm, hardware)
        fusions, rows = plan_fusions(local_gm if static else global_gm, hardware,
                                     batch_split=1 if static else dp * plan.n_microbatches, gc=gc)
        return {"fusions": fusions, "notes": fusion_notes(rows), "rows": [r.to_dict() for r in rows]}

    got = on_rank0(search, what="the fusion search")
    plan.fusions = list(got["fusions"])
    plan.notes += got["notes"]
    plan.extra["fusion"] = got["rows"]
    return made.get("cost")


def expert_node_pins(plan: Plan, mesh: Mesh) -> dict[str, dict[str, Any]] | None:
    """{"tp": {node key: Replicate()}} for the nodes the expert pass needs whole on tp (each MoE
    block's tokens, routing table, entry and gathered nodes), so the tp search never shards them
    (it may otherwise choose sequence parallelism there, which the expert pass refuses: moe-tiny
    at 256 tokens on tp2 x ep2, CPU profile). None without both ep and tp, or without experts."""
    if mesh.size("ep") < 2 or mesh.size("tp") < 2 or not plan.extra.get("expert"):
        return None
    keys = set()
    for b in plan.extra["expert"].get("blocks", {}).values():
        keys.update([b["tokens"], b["expert_index"], *b.get("entries", []), *(d["node"] for d in b.get("gathers", []))])
    return {"tp": {k: Replicate() for k in keys}} if keys else None


def router_stats_without_ep(plan, global_gm, mesh) -> None:
    """An MoE model split over data ranks without expert parallelism: its load-balancing
    statistics (router reductions over tokens, `search.expert_detect.router_stats`) are
    averaged over the axes that split the tokens, so the auxiliary loss is the global batch's
    (the expert pass does it with ep; `passes/expert.py` reads `plan.extra["router_stats"]`)."""
    axes = [a for a in (plan.dp_axis, "cp") if a and mesh.size(a) > 1]
    if not axes or "router_stats" in plan.extra:  # with pp too: the expert pass runs before the stage cut
        return
    if not any(n.op == "call_function" and n.target is torch.ops.aten.topk.default for n in global_gm.graph.nodes):
        return
    from autopar.search.expert_detect import router_stats  # noqa: PLC0415

    keys = on_rank0(lambda: router_stats(global_gm), what="the router statistics' detection")  # same on every rank
    if keys:
        plan.extra["router_stats"] = {"keys": keys, "axes": axes}
        plan.notes.append(f"MoE router statistics ({len(keys)} reductions over tokens) averaged over "
                          f"{' and '.join(axes)}: the load-balancing loss is the global batch's"
                          + (f", per micro-batch ({plan.n_microbatches})" if plan.n_microbatches > 1 else ""))
