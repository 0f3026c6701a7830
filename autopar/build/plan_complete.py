"""Complete a Plan for this mesh and graph: what `parallelize` decides after the plan's shape.

`complete_plan(plan, global_gm, local_gm, mesh, ...)` fills what a plan leaves open once its mesh
is fixed (a default plan, a pinned one, or the joint planner's), in this order:

  * (no refusal of recompute: under the zero-bubble schedules a stage holding checkpoint regions
    runs its backward whole, runtime/pipeline.py; under expert parallelism the expert pass places
    its nodes in their block, and a checkpointed block keeps the dispatch's collectives);
  * context parallelism (a cp axis): the attention exchange, ring or Ulysses
    (`search.context.plan_context`, `plan.extra["context"]`);
  * experts (an ep axis): `search.expert.plan_experts` (`plan.extra["expert"]`), before the tp
    search, which then keeps each MoE block's routed nodes replicated on tp
    (`expert_node_pins`: the expert pass needs them whole);
  * tensor parallelism: the sharding search (`search.shard_search.search_sharding`: parameter and
    node layouts, sequence parallelism; rank 0 searches and every rank takes its answer);
  * with ep, the grouped experts' ep layouts; without ep, an MoE model's router statistics
    averaged over the axes that split its tokens (`plan.extra["router_stats"]`);
  * fusions: checked when pinned, else searched (`search.fusion.search_fusions`);
  * the axis notes of `build.plan_check.axis_notes`.

Reads node.meta["autopar"] of the captured graph (through the searches); writes the plan's
layouts, plan.extra ("context", "shard", "expert", "router_stats"), plan.fusions and plan.notes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autopar.build.plan_check import axis_notes
from autopar.passes.plan import Plan
from autopar.runtime.mesh import Mesh, planning_group
from autopar.runtime.placement import Replicate
from autopar.search.context import plan_context
from autopar.search.expert import grouped_expert_layouts
from autopar.search.fusion import search_fusions
from autopar.search.shard_search import batch_is_static, search_sharding

__all__ = ["complete_plan", "expert_node_pins", "router_stats_without_ep"]


def complete_plan(plan: Plan, global_gm: fx.GraphModule, local_gm: fx.GraphModule, mesh: Mesh, *, hardware: Any,
                  context_method: str = "auto",
                  fusions_pinned: bool = False) -> None:
    """Fill `plan` in place for `mesh` (see the module docstring). `local_gm` is this rank's copy
    of the graph (the fusion search reads it when the batch was captured static)."""
    dp = plan.dp * mesh.size("ep")  # the batch is split over dp x ep
    if mesh.size("cp") > 1 and "context" not in plan.extra:
        plan.extra["context"] = plan_context(global_gm, dict(mesh.sizes), context_method, hardware)
        plan.notes += plan.extra["context"]["notes"]
    if mesh.size("ep") > 1 and "expert" not in plan.extra:
        from autopar.search.expert import plan_experts  # noqa: PLC0415

        plan.extra["expert"] = plan_experts(global_gm, mesh, dp_axis=plan.dp_axis, n_microbatches=plan.n_microbatches,
                                            hardware=hardware)
        plan.notes += plan.extra["expert"]["notes"]
    search_sharding(plan, global_gm, mesh, hardware, group=planning_group(), node_pins=expert_node_pins(plan, mesh))
    if mesh.size("ep") > 1:
        grouped_expert_layouts(plan, tuple(mesh.sizes))
    else:
        router_stats_without_ep(plan, global_gm, mesh)
    if fusions_pinned:
        from autopar.passes.rules.fusion_table import selection  # noqa: PLC0415

        selection(plan.fusions)  # a bad entry is a ValueError here, not a PassError
    else:
        static = batch_is_static(global_gm)
        search_fusions(plan, local_gm if static else global_gm, hardware,
                        1 if static else dp * plan.n_microbatches)
    plan.notes += [n for n in axis_notes(plan) if n not in plan.notes]


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

    keys = router_stats(global_gm)
    if keys:
        plan.extra["router_stats"] = {"keys": keys, "axes": axes}
        plan.notes.append(f"MoE router statistics ({len(keys)} reductions over tokens) averaged over "
                          f"{' and '.join(axes)}: the load-balancing loss is the global batch's"
                          + (f", per micro-batch ({plan.n_microbatches})" if plan.n_microbatches > 1 else ""))
