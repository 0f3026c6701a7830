"""Expert parallelism's collectives on one rank, placed on the nodes of the global graph.

With `plan.extra["expert"]` (search/expert.py `plan_experts`) on an ep axis of P > 1 ranks the
expert pass (passes/expert.py) and the dispatcher (runtime/moe.py) add, per micro-batch, as
`runtime.collectives.COUNTER` counts them:

  per MoE block    route: all_gather of E int64 counts (forward);
                   dispatch: all_to_all of the kept rows x row bytes forward, its reverse
                   backward (per-assignment side data, the sorted idiom's weights, one more
                   each way); combine: all_to_all of the kept rows x
                   row bytes forward, its reverse backward. Kept rows per rank: those
                   `cost.expert_memory.block_rows` gives (N * K dropless, N the rank's tokens;
                   at most E / P x the group's capacity per expert otherwise), the routing
                   taken as balanced (every rank receives what it sends).
  per statistic    of the router (`plan.extra["expert"]["router_stats"]`, a reduction over
                   tokens that the load-balancing loss reads): all_reduce (avg) of it over the
                   dp axis, then ep, then cp with context parallelism (passes/expert.py's batch
                   axes; forward, identity backward);
  per parameter    not an expert's and trainable: `moe.grad_avg`, an all_reduce (avg) over ep
                   of its (tp-local) gradient in backward, when the backward of its first use
                   ends (the pass puts it before the first reader).

All of them block the stream (`cost.estimate` adds their time to the node they sit on; the
planner's one-stage tables, `search.plan_rank`, add the same events to the same nodes). Dense
blocks (every expert on every token: all-gather / reduce-scatter) are not modelled here:
`ep_events` says so in its notes.

Without expert parallelism (P = 1 or no expert entry) the only events are the router
statistics' all-reduces that `plan.extra["router_stats"]` names (`build.plan_complete` writes it
for an MoE model on dp or cp ranks): each averaged over those axes, forward, per micro-batch
(`router_stat_events`; tests/dist/test_cost_counter_micro.py counts them against the runtime).

Reads no node.meta (a GraphCost and the plan entry). Guarantees: with P = 1 or no expert entry,
no events but those statistics'; deterministic order (blocks by module path, then parameters
in graph order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .expert_memory import block_rows
from .graph import GraphCost, ParamInfo

__all__ = ["EPEvent", "EPEvents", "ep_events", "router_stat_events"]


@dataclass(frozen=True)
class EPEvent:
    node: int  # index of the node whose forward (or backward) it blocks
    op: str  # "all_to_all" | "all_gather" | "all_reduce"
    payload: float  # bytes, COUNTER convention
    backward: bool
    axis: str | None = None  # None: the entry's ep axis


@dataclass
class EPEvents:
    axis: str
    events: list[EPEvent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def ep_events(gc: GraphCost, params: list[ParamInfo], plan: Any, ev: Callable[[Any], float],
              local_numel: Mapping[str, int] | None = None, by_key: Mapping[Any, Any] | None = None) -> EPEvents:
    """The expert-parallel collectives of one micro-batch on rank 0 (see the module docstring).
    `params`: the rank's parameters (their dtype as the engine holds them); `local_numel`: each
    parameter's tp-local element count (default: its whole numel); `ev` evaluates a symbolic
    size at the costed sizes; `by_key`: the graph's nodes by key, when the caller has them."""
    entry = (getattr(plan, "extra", None) or {}).get("expert") or {}
    axis = entry.get("axis", "ep") if entry else "ep"
    ep = int((getattr(plan, "mesh", None) or {}).get(axis, 1)) if entry else 1
    out = EPEvents(axis)
    if ep <= 1 or not entry.get("blocks"):
        out.events += router_stat_events(gc, plan, ev, by_key, out.notes)
        return out
    by_key = by_key if by_key is not None else {n.key: n for n in gc.nodes}
    cf = entry.get("capacity_factor")
    experts: set[str] = set()
    for module, b in sorted(entry["blocks"].items()):
        experts |= set(b.get("expert_params", {}))
        if b.get("idiom") == "dense":
            out.notes.append(f"expert block {module} (dense): its all-gather / reduce-scatter over {axis} not costed")
            continue
        router, combine = by_key.get(b.get("router")), by_key.get(b.get("combine"))
        rows = block_rows(gc, b, ep, ev, cf, by_key) if router is not None else None
        if rows is None:
            out.notes.append(f"expert block {module}: token or router node not found; its all-to-alls not costed")
            continue
        row, kept, side = rows.row_bytes, rows.kept, float(b.get("side_row_bytes") or 0)
        at, back = router.index, (combine or router).index
        out.events += [EPEvent(at, "all_gather", float(int(b["n_experts"]) * 8), False),
                       EPEvent(at, "all_to_all", kept * row, False),
                       EPEvent(back, "all_to_all", kept * row, False),
                       EPEvent(back, "all_to_all", kept * row, True),
                       EPEvent(at, "all_to_all", kept * row, True)]
        if side:  # per-assignment data (the sorted idiom's weights) dispatched on its own, and back
            out.events += [EPEvent(at, "all_to_all", kept * side, False), EPEvent(at, "all_to_all", kept * side, True)]
    if entry.get("global_router_stats", True):  # each statistic averaged over dp, ep, cp (forward only)
        mesh = getattr(plan, "mesh", None) or {}
        dp_axis = getattr(plan, "dp_axis", None)
        cp_axis = ((getattr(plan, "extra", None) or {}).get("context") or {}).get("axis")
        axes = [a for a in (dp_axis, axis, cp_axis) if a and int(mesh.get(a, 1)) > 1]
        for k in entry.get("router_stats") or []:
            n = by_key.get(k)
            if n is None or not n.outputs:
                out.notes.append(f"router statistic {k}: not in the graph; its all-reduce not costed")
                continue
            out.events += [EPEvent(n.index, "all_reduce", float(ev(n.outputs[0].nbytes)), False, a) for a in axes]
    n_nodes = len(gc.nodes)
    for p in params:
        if p.is_buffer or not p.requires_grad or p.name in experts or p.first_use >= n_nodes:
            continue
        numel = (local_numel or {}).get(p.name, p.numel)
        out.events.append(EPEvent(p.first_use, "all_reduce", float(numel * p.dtype.itemsize), True))
    return out


def router_stat_events(gc: GraphCost, plan: Any, ev: Callable[[Any], float], by_key: Mapping[Any, Any] | None,
                       notes: list[str]) -> list[EPEvent]:
    """Without expert parallelism: the router statistics `build.plan_complete.router_stats_without_ep`
    names in `plan.extra["router_stats"]` ({"keys": [...], "axes": ["dp", "cp"]}), each all-reduced
    (avg, forward) over every axis of size > 1 in turn, per micro-batch, as `passes/expert.py`
    `_global_router_stats` inserts them. No entry (a plan the planner wrote: build adds it): none."""
    stats = (getattr(plan, "extra", None) or {}).get("router_stats") or {}
    mesh = getattr(plan, "mesh", None) or {}
    axes = [a for a in stats.get("axes") or [] if int(mesh.get(a, 1)) > 1]
    if not axes:
        return []
    by_key = by_key if by_key is not None else {n.key: n for n in gc.nodes}
    events = []
    for k in stats.get("keys") or []:
        n = by_key.get(k)
        if n is None or not n.outputs:
            notes.append(f"router statistic {k}: not in the graph; its all-reduce not costed")
            continue
        events += [EPEvent(n.index, "all_reduce", float(ev(n.outputs[0].nbytes)), False, a) for a in axes]
    return events
