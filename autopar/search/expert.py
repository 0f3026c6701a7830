"""Expert parallelism, the brain's side: cost an ep degree for the mixture-of-experts blocks
of a captured graph and write what the expert pass needs into `plan.extra["expert"]`. The
blocks are found by `search/expert_detect.py` (`detect_moe`, `router_stats`, `MoEBlock`,
`MoEDetectError`, re-exported here).

Cost (`ep_cost`, `rank_ep_degrees`): per MoE layer and rank, dispatch and combine forward
and their reverses backward each move M rows (M = N * K dropless, at most E * C otherwise),
payload M * row_bytes as `collectives.COUNTER` counts it; the receiving side of the
busiest rank carries `imbalance` times the mean (the routing-imbalance factor, max over
ranks of rows received / mean). Time per all-to-all by the alpha-beta model of
`autopar.cost.comm` on the ep axis's link; expert compute scales with the busiest rank's rows.

API: `ep_cost(blocks, mesh, ...) -> EPCost`, `rank_ep_degrees(...)` / `search_ep(gm, world, ...)`
(the ep dimension of the planner: every feasible degree, cheapest first),
`measured_imbalance(routes)` (the imbalance factor of recorded routes),
`plan_experts(global_gm, mesh, ...) -> dict` (the `plan.extra["expert"]` entry), which
`autopar.parallelize(model, autopar.mesh(ep=...))` reads; `grouped_expert_layouts(plan, axes)`
(the ep cut of grouped expert parameters in `plan.param_layouts`).

Guarantees: `plan_experts` refuses (ValueError) an ep degree that does not divide every
block's expert count, or an ep axis on a model without MoE blocks.

Reads node.meta["autopar"] (shapes, modules) and node.meta["val"]; writes nothing on nodes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

import torch
import torch.fx as fx

from autopar.cost.comm import axis_links
from autopar.cost.hardware import load_profile
from autopar.cost.placements import Layout, Replicate, Shard

# detection lives in expert_detect; its public names are re-exported for importers of this module
from autopar.search.expert_detect import (MoEBlock, MoEDetectError, MoEGraph, detect_moe,  # noqa: F401
                                          dtype_itemsize, no_moe_reasons, router_stats)


# --- cost ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EPCost:
    """What ep degree `ep` costs one rank per training step (forward + backward), all MoE blocks."""

    ep: int
    imbalance: float  # busiest rank's received rows / mean
    rows_sent: float  # per rank per step, all blocks (kept assignments)
    a2a_payload_bytes: float  # mean rank, COUNTER convention (all_to_all@ep)
    a2a_payload_bytes_max: float  # the busiest rank
    count_bytes: float  # all_gather of per-expert counts
    a2a_s: float  # all-to-all time on the busiest rank
    expert_s: float  # expert compute time on the busiest rank
    grad_sync_s: float  # averaging non-expert gradients over ep
    expert_param_bytes: float  # expert parameters held per rank
    total_s: float

    def summary(self) -> dict[str, float]:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def a2a_payload_bytes(rows_sent: float, rows_received: float, row_bytes: float, side_row_bytes: float = 0.0) -> float:
    """Payload `COUNTER` records for one MoE block's all-to-alls in one forward + backward on
    one rank: dispatch (rows_sent x (row_bytes + side)) and combine (rows_received x row_bytes)
    forward; their reverses backward (rows_sent x row_bytes, rows_received x (row_bytes + side))."""
    return (rows_sent + rows_received) * (2 * row_bytes + side_row_bytes)


def kept_rows(tokens: float, top_k: int, capacity_factor: float | None) -> float:
    """Assignments a rank sends per block on average: N * K dropless, at most cf * N * K with capacity."""
    return tokens * top_k * (1.0 if capacity_factor is None else min(1.0, capacity_factor))


def ep_cost(blocks: list[MoEBlock], mesh: Mapping[str, int], ep_axis: str = "ep", hardware="cpu-gloo", *,
            tokens_per_rank: float, imbalance: float = 1.0, capacity_factor: float | None = None,
            non_expert_param_bytes: float = 0.0, expert_tp: int = 1) -> EPCost:
    """Cost of the ep degree `mesh[ep_axis]` for `blocks`, `tokens_per_rank` tokens per rank
    per step (the batch is split over dp x ep; tensor-parallel peers share tokens).
    `expert_tp`: the tp degree the experts themselves are sharded over (their compute and
    parameters divide by it; the all-to-alls do not)."""
    if imbalance < 1.0:
        raise ValueError(f"imbalance is the busiest rank's load over the mean, >= 1; got {imbalance}")
    hw = load_profile(hardware)
    ep = int(mesh.get(ep_axis, 1))
    if math.prod(mesh.values()) > hw.world_size:
        hw = hw.with_nodes(-(-math.prod(mesh.values()) // hw.gpus_per_node))
    link = axis_links(hw, dict(mesh)).get(ep_axis)
    sent = payload = payload_max = counts = a2a_s = expert_s = pbytes = 0.0
    for b in blocks:
        item = dtype_itemsize(b.dtype)
        row = b.hidden * item
        m = kept_rows(tokens_per_rank, b.top_k, capacity_factor)
        m_max = m * imbalance if ep > 1 else m
        sent += m
        flops = 3 * m_max * b.flops_per_row  # forward + backward (2x)
        rows = m_max * ep / max(b.n_experts, 1)  # one expert's rows: its GEMMs' m (small experts run short GEMMs)
        eff = hw.matmul_eff(_dtype_key(b.dtype), rows, b.hidden, b.hidden)
        expert_s += flops / expert_tp / (hw.peak(_dtype_key(b.dtype)) * eff)
        pbytes += _expert_param_bytes(b) / ep / expert_tp
        if ep == 1:
            continue
        payload += a2a_payload_bytes(m, m, row, b.side_row_bytes)
        payload_max += a2a_payload_bytes(m, m_max, row, b.side_row_bytes)
        counts += b.n_experts * 8
        big = max(m, m_max)
        for rb in (row, row) * 2 + ((b.side_row_bytes,) * 2 if b.side_row_bytes else ()):
            a2a_s += link.time("all_to_all", big * rb)
        a2a_s += link.time("all_gather", b.n_experts * 8)
    grad_s = link.time("all_reduce", non_expert_param_bytes) if ep > 1 and non_expert_param_bytes else 0.0
    return EPCost(ep, imbalance, sent, payload, payload_max, counts, a2a_s, expert_s, grad_s, pbytes,
                  a2a_s + expert_s + grad_s)


def _dtype_key(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, "fp32")


def _expert_param_bytes(b: MoEBlock) -> float:
    return b.flops_per_row / 2 * b.n_experts * dtype_itemsize(b.dtype)


def rank_ep_degrees(blocks: list[MoEBlock], world: int, hardware="cpu-gloo", *, global_tokens: float,
                    imbalance: float = 1.0, capacity_factor: float | None = None, non_expert_param_bytes: float = 0.0,
                    memory_budget_bytes: float | None = None, other_axes: Mapping[str, int] | None = None
                    ) -> list[EPCost]:
    """Every ep degree that divides the world (over `other_axes`) and every block's expert
    count, cheapest first; degrees whose expert parameters exceed `memory_budget_bytes` per
    rank are left out. The planner enumerates ep with the other mesh factors through this."""
    if not blocks:
        return []
    other = dict(other_axes or {})
    rest = world // math.prod(other.values()) if other else world
    E = math.gcd(*[b.n_experts for b in blocks])
    out = []
    for ep in range(1, rest + 1):
        if rest % ep or E % ep:
            continue
        mesh = {"dp": rest // ep, "ep": ep, **other}
        c = ep_cost(blocks, mesh, "ep", hardware, tokens_per_rank=global_tokens / rest, imbalance=imbalance,
                    capacity_factor=capacity_factor, non_expert_param_bytes=non_expert_param_bytes,
                    expert_tp=other.get("tp", 1))
        if memory_budget_bytes is not None and c.expert_param_bytes > memory_budget_bytes:
            continue
        out.append(c)
    return sorted(out, key=lambda c: (c.total_s, c.ep))


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
                 capacity_factor: float | None = None, hardware="cpu-gloo", imbalance: float = 1.0,
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
    tokens, other_bytes = _tokens_and_dense_bytes(global_gm, blocks)
    cost = ep_cost(blocks, sizes, ep_axis, hardware, tokens_per_rank=(tokens or 0) / batch_split,
                   imbalance=imbalance, capacity_factor=capacity_factor, non_expert_param_bytes=other_bytes,
                   expert_tp=sizes.get("tp", 1))
    return {"axis": ep_axis, "ep": ep, "blocks": {b.module: b.to_json() for b in blocks},
            "router_stats": (list(router_stat_keys) if router_stat_keys is not None else router_stats(global_gm, blocks))
            if global_router_stats else [],
            "capacity_factor": capacity_factor, "global_router_stats": global_router_stats,
            "tokens_per_rank": (tokens or 0) / batch_split, "predicted": cost.summary(),
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


def _tokens_and_dense_bytes(gm: fx.GraphModule, blocks: list[MoEBlock]) -> tuple[int | None, int]:
    """Tokens of the first block at the captured batch, and bytes of the non-expert parameters."""
    g = MoEGraph(gm)
    by_key = {k: n for n, k in g.keys.items()}
    val = by_key[blocks[0].tokens].meta.get("val")
    tokens = _hint(val.shape[0]) if isinstance(val, torch.Tensor) else None
    experts = {n for b in blocks for n in b.expert_params}
    dense = sum(p.numel() * p.element_size() for n, p in gm.named_parameters() if n not in experts)
    return tokens, dense


def search_ep(global_gm: fx.GraphModule, world: int, hardware="h100-sxm", *, other_axes: Mapping[str, int] | None = None,
              memory_budget_bytes: float | None = None, imbalance: float = 1.0,
              capacity_factor: float | None = None) -> list[EPCost]:
    """The ep degrees worth trying for a graph captured at the global batch on `world` ranks
    (with `other_axes` such as {"tp": 2} fixed), cheapest first: the planner's ep dimension."""
    blocks = detect_moe(global_gm)
    if not blocks:
        return []
    tokens, dense = _tokens_and_dense_bytes(global_gm, blocks)
    return rank_ep_degrees(blocks, world, hardware, global_tokens=tokens or 0, imbalance=imbalance,
                           capacity_factor=capacity_factor, non_expert_param_bytes=dense,
                           memory_budget_bytes=memory_budget_bytes, other_axes=other_axes)
