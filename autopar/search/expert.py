"""Expert parallelism, the brain's side: write what the expert pass needs for the
mixture-of-experts blocks of a captured graph into `plan.extra["expert"]`. The blocks are
found by `search/expert_detect.py` (`detect_moe`, `router_stats`, `MoEBlock`,
`MoEDetectError`, re-exported here).

Cost: none here. An ep plan is priced by the one cost model, `cost.estimate` (its all-to-alls,
count gathers, router statistics and gradient averaging: `cost.expert_comm`; the experts'
rows and memory: `cost.expert_memory`), which the joint planner's tables share
(`search.plan_rank`). A second ep time model lived here until 2026-11-27 (`ep_cost`, and
`rank_ep_degrees` / `search_ep` over it, which nothing called): its figure in
`plan.extra["expert"]["predicted"]` could disagree with `plan.predicted`.

API: `measured_imbalance(routes)` (the routing-imbalance factor of recorded routes: max over
ranks of rows received / mean),
`plan_experts(global_gm, mesh, ...) -> dict` (the `plan.extra["expert"]` entry), which
`autopar.parallelize(model, autopar.mesh(ep=...))` reads; `grouped_expert_layouts(plan, axes)`
(the ep cut of grouped expert parameters in `plan.param_layouts`).

Guarantees: `plan_experts` refuses (ValueError) an ep degree that does not divide every
block's expert count, or an ep axis on a model without MoE blocks.

Reads node.meta["autopar"] (shapes, modules) and node.meta["val"]; writes nothing on nodes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.cost.placements import Layout, Replicate, Shard

# detection lives in expert_detect; its public names are re-exported for importers of this module
from autopar.search.expert_detect import (MoEBlock, MoEDetectError, MoEGraph, detect_moe,  # noqa: F401
                                          dtype_itemsize, no_moe_reasons, router_stats)


def measured_imbalance(routes) -> float:
    """Routing imbalance of recorded routes (runtime.moe.recording): max over ranks of rows
    received / mean, from the all-gathered counts each route holds (the worst layer)."""
    worst = 1.0
    for r in routes:
        P, El = r.ep, r.n_experts // r.ep
        table = r.counts
        recv = [sum(table[j][e] for j in range(P) for e in range(i * El, (i + 1) * El)) for i in range(P)]
        mean = sum(recv) / P
        if mean:
            worst = max(worst, max(recv) / mean)
    return worst


# --- the plan entry ----------------------------------------------------------------------------
def _hint(x) -> int | None:
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        h = x.node.hint
        return int(h) if h is not None else None
    return None


def plan_experts(global_gm: fx.GraphModule, mesh, *, ep_axis: str = "ep", dp_axis: str | None = "dp",
                 capacity_factor: float | None = None,
                 n_microbatches: int = 1, global_router_stats: bool = True, blocks: list[MoEBlock] | None = None,
                 router_stat_keys: list[str] | None = None) -> dict:
    """`plan.extra["expert"]` for a graph captured at the global batch on `mesh` (an autopar
    Mesh or {axis: size}). Empty when the model has no MoE block and ep is 1.

    capacity_factor: None keeps each block's own rule (dropless or the model's capacity);
    a number forces capacity C = min(Ng, ceil(cf * Ng * K / E)) per ep group of Ng tokens.
    blocks, router_stat_keys: `detect_moe(global_gm)` and `router_stats(global_gm, blocks)`
    when the caller has them (the planner does: on a 671B graph each costs seconds)."""
    sizes = dict(getattr(mesh, "sizes", mesh))
    ep = sizes.get(ep_axis, 1)
    blocks = detect_moe(global_gm) if blocks is None else blocks
    if not blocks:
        if ep > 1:
            reasons = no_moe_reasons(global_gm)
            if not reasons:
                raise ValueError(f"the mesh has {ep_axis}={ep} but the model has no mixture-of-experts block (no "
                                 "top-k in the graph); use a mesh without the ep axis")
            raise ValueError(f"the mesh has {ep_axis}={ep} but no top-k of the model is a mixture-of-experts router "
                             "feeding an expert dispatch, so it has no mixture-of-experts block:\n  "
                             + "\n  ".join(reasons) + "\nWhat to do: keep the routing module opaque with "
                             "autopar.capture(..., leaf_modules=[...]) (it then runs replicated), or use a mesh "
                             "without the ep axis (give those ranks to dp or tp)")
        return {}
    for b in blocks:
        if b.n_experts % ep:
            raise ValueError(f"MoE block {b.module!r} has {b.n_experts} experts, which do not divide over "
                             f"{ep_axis}={ep}; choose an ep degree that divides {b.n_experts}")
    batch_split = sizes.get(dp_axis, 1) * ep * n_microbatches if dp_axis else ep * n_microbatches
    tokens = _tokens(global_gm, blocks)
    return {"axis": ep_axis, "ep": ep, "blocks": {b.module: b.to_json() for b in blocks},
            "router_stats": (list(router_stat_keys) if router_stat_keys is not None else router_stats(global_gm, blocks))
            if global_router_stats else [],
            "capacity_factor": capacity_factor, "global_router_stats": global_router_stats,
            "tokens_per_rank": (tokens or 0) / batch_split,
            "notes": [f"{len(blocks)} MoE blocks ({blocks[0].idiom}, {blocks[0].n_experts} experts, top-"
                      f"{blocks[0].top_k}) over {ep_axis}={ep}: {blocks[0].n_experts // ep} experts per rank, "
                      + ("dropless" if capacity_factor is None and all(b.dropless for b in blocks)
                         else f"capacity {'cf=' + str(capacity_factor) if capacity_factor else 'as the model'}")]}


def grouped_expert_layouts(plan, axes) -> None:
    """Grouped expert parameters (transformers' fused (E, ...) experts, "sorted" and "dense"
    blocks of `plan.extra["expert"]`) keep this rank's experts' rows: their layouts get S(0) on
    ep (`axes`: the mesh's axis names), as the expert pass slices them; what checkpoints,
    exports and `cost.estimate` (their states per rank) read."""
    for b in plan.extra["expert"]["blocks"].values():
        if b["idiom"] not in ("sorted", "dense"):
            continue
        for name in b["expert_params"]:
            base = plan.param_layouts.get(name) or Layout.replicated(tuple(axes))
            if "ep" not in dict(base.axes):
                base = Layout(base.axes + (("ep", Replicate()),))
            plan.param_layouts[name] = base.replace("ep", Shard(0))


def _tokens(gm: fx.GraphModule, blocks: list[MoEBlock]) -> int | None:
    """Tokens of the first block at the captured batch."""
    g = MoEGraph(gm)
    by_key = {k: n for n, k in g.keys.items()}
    val = by_key[blocks[0].tokens].meta.get("val")
    return _hint(val.shape[0]) if isinstance(val, torch.Tensor) else None
