"""Per-rank memory of a pipeline candidate (pp > 1) as `cost.estimate` walks it.

The joint planner's cost model (`plan_cost.PlanCostModel.evaluate`) chooses a pipeline split
on its per-unit tables (`plan_split.SplitChain`); the memory of every rank of the chosen split
then comes from here, which builds the same `cost.pipeline_memory.StageMemory` terms per stage
that `cost.estimate` builds, and combines them with the same function
(`cost.pipeline_memory.rank_peaks`: each rank's own actions in the schedule, GPipe, 1F1B,
interleaved with v stages per rank, ZB-H1, ZBV). tests/unit/test_one_cost_model_pipeline.py
checks the two agree on every pipeline candidate the planner ranks.

Per stage (the nodes `cost.pipeline_memory.stage_of_nodes` puts in it for the split points the
planner writes, `stage_graph`):
  walk        `cost.memory.liveness` of the stage graph at the candidate's rows per micro-batch
              (the loss on the last stage, the held outputs on the others), tp storage
              divisors from the sharding search, the parameter gradients as the planner's
              states give them (`UnitStates.param_grad`): the peak with the gradients made as
              backward makes them, with them preallocated, the forward end and the inputs;
  states      the planner's own per-unit states over the stage (a parameter read on two stages
              held by both, `SplitChain.categories`), its gradient buffers and optimizer step
              temporaries (equal to estimate's `cost.memory.model_states` of the stage's
              parameters);
  ZeRO 3      the two gathered units of the rank's whole graph (`plan_rank.zero3_transient`),
              as estimate counts them.

Recompute inside stages: the blocks the planner recomputes (whole units, "full" or "selective":
`search.plan_selective`) are walked as
estimate walks the Plan's `recompute`: `cost.pipeline_memory.stage_walk` over the stage's
checkpoint regions (`cost.timeline.regions_for`, cut by `stage_regions`), a stage with regions
running one fused backward (no I / W split terms); its recomputed forward's seconds
(`stage_recompute_seconds`: per block, the seconds that walk counts, `cost.timeline.region_recompute`)
are what `plan_cost` adds to the stage's B.

Expert parallelism (ep > 1): rank 0 as estimate walks it, its experts' storages at their
routed rows and their compute on them (`plan_rank.rank_mem_div`, `cost.expert_memory.
ep_compute_divisor`), other ranks' experts without gradients (`ep_param_grad`), ZeRO 3's
gathered units of its own parameters. The recompute choice itself is made on the per-unit model; where
that fits and this walk does not, `plan_cost` evaluates again with the limit lowered by the
difference (its `walk_retry`). A static batch dimension scales the walk linearly with the rows,
as `search.plan_rank` does.

node.meta: read only through `cost.analyze` (the GraphCost); writes nothing. Deterministic;
walks are cached on the model per (tp, rows, cp, stage node range, ZeRO, replicas, ep, m > 1,
recomputed units), and an interior stage of repeated blocks shares the walk of any other of the
same unit structures, recompute, parameter gradients and boundary tensors (`_same_as`,
`_boundary`: the same nodes on the same
shapes walk alike: the 405B planner's stage walks 3316 -> 175, measured 2026-11-26). Candidates
that differ only in ZeRO stage, replicas or ep share a stage's walk where its parameter gradients
are equal (the walk reads those only through them: test_planner's gpt-4l exhaustive enumeration
2283 -> 1381 walks, 2026-11-26).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from autopar.cost.expert_memory import ep_compute_divisor
from autopar.cost.memory import HELD_OUTPUTS
from autopar.cost.pipeline_memory import (StageMemory, rank_peaks, received_grad_bytes, split_backward, stage_graph,
                                          stage_of_nodes, stage_regions, stage_walk)
from autopar.cost.timeline import region_recompute, regions_for
from autopar.search.candidate import Candidate
from autopar.search.plan_selective import selective_keys

__all__ = ["grads_of", "stage_graph_of", "stage_memories", "stage_recompute_seconds", "pipeline_rank_peaks",
           "unit_first_nodes"]


def unit_first_nodes(model: Any) -> list[int]:
    """Per pipeline unit, the first node of the stage it starts when it is a split point (how
    `cost.pipeline_memory.stage_of_nodes` cuts); the last entry is the node count."""
    hit = model._split_cache.get("unit_first_nodes")
    if hit is None:
        stage_of = stage_of_nodes(model.gc, model.unit_names[1:])
        N = len(stage_of)
        firsts, k = [0], 0
        for u in range(1, len(model.unit_names)):
            while k < N and stage_of[k] < u:
                k += 1
            firsts.append(k)
        hit = model._split_cache["unit_first_nodes"] = firsts + [N]
    return hit


def stage_graph_of(model: Any, lo: int, hi: int):
    """The stage holding nodes [lo, hi) of the model's graph (`cost.pipeline_memory.stage_graph`;
    the last stage when hi is the node count), cached."""
    g = model._split_cache.get(("stage_graph", lo, hi))
    if g is None:
        N = len(model.gc.nodes)
        g = stage_graph(model.gc, [0] * lo + [1] * (hi - lo) + [2] * (N - hi), 1)
        model._split_cache[("stage_graph", lo, hi)] = g
    return g


def _regions(model: Any, units: tuple[tuple[str, str], ...], g) -> list:
    """The checkpoint regions of recomputed `units` ((name, mode) pairs: "full", or "selective"
    with the nodes `plan_selective.selective_keys` keeps, as the planner writes them) cut to
    stage graph `g`; each unit's region on the whole graph cached (one per unit and mode)."""
    regions = []
    for name, mode in units:
        hit = model._split_cache.get(("unit_region", name, mode))
        if hit is None:
            save = {name: selective_keys(model, name)} if mode == "selective" else None
            hit = model._split_cache[("unit_region", name, mode)] = regions_for(model.gc, {name: mode}, save)
        regions += hit
    return stage_regions(regions, g)


def stage_recompute_seconds(model: Any, c: Candidate, rows: int, units: Sequence[tuple[str, str]]) -> float:
    """Seconds per micro-batch a stage recomputes when its `units` ((name, mode) pairs) are checkpointed: the sum of
    each unit's region (`cost.timeline.region_recompute`, what the stage's walk counts, without
    walking), cached per unit."""
    out = 0.0
    ep = model._ep_of(c)
    for name, mode in units:
        key = ("unit_rc_s", c.tp, rows, c.cp, ep, name, mode)
        hit = model._split_cache.get(key)
        if hit is None:
            (region,) = _regions(model, ((name, mode),), model.gc)
            _f, secs, _n = region_recompute(model.gc, region, model._values(rows, c.cp), hardware=model.hw,
                                            compute_divisor=_compute_divisor(model, c, rows))
            scale = 1.0 if model.symbolic_batch else rows / (model.captured_rows or rows)
            hit = model._split_cache[key] = float(secs) * scale
        out += hit
    return out


def _compute_divisor(model: Any, c: Candidate, rows: int) -> dict:
    """Per node the compute divisor of rank 0: the sharding ILP's at the candidate's tp, with
    ep > 1 its experts at their routed rows (another rank's: not run), as estimate divides."""
    comp = model.sharding(c.tp).comp_div
    ep = model._ep_of(c)
    return comp if ep < 2 else ep_compute_divisor(comp, model.ep_rank(c.tp, rows, ep, 1, c.cp)[0].compute)


def _stage_walk(model: Any, c: Candidate, rows: int, lo: int, hi: int, param_grad: np.ndarray,
                units: tuple[tuple[str, str], ...] = ()) -> tuple:
    """(first peak, later peak, forward end, inputs, walk gradients, the split backward's terms, the
    gradients received for its outputs, the forward's peak, the recompute seconds) of the stage
    holding nodes [lo, hi) of the graph with `units` ((name, mode) pairs) recomputed, cached."""
    z = c.zero if c.replicas > 1 else 0
    splits = c.schedule in ("zb_h1", "zbv") and not units  # ZB-H1 / ZBV split the backward (I and W)
    key = ("stage_walk", c.tp, rows, c.cp, lo, hi, z, c.replicas, c.ep, c.micro > 1, splits, units)
    hit = model._split_cache.get(key)
    if hit is not None:
        return hit
    gc = model.gc
    N = len(gc.nodes)
    g = stage_graph_of(model, lo, hi)
    ep = model._ep_of(c)
    if ep > 1:  # rank 0's experts whole, other ranks' without gradients
        param_grad = model.ep_param_grad(c.tp, ep, param_grad)
    index = {p.key: i for i, p in enumerate(gc.params) if p.key is not None}
    pg = {p.key: float(param_grad[index[p.key]]) for p in g.params if p.requires_grad and p.key is not None}
    # the walk reads the candidate's ZeRO stage, replicas and ep only through the stage's
    # parameter gradients: candidates that differ there but give equal gradients share it
    same = ("stage_walk_pg", c.tp, rows, c.cp, ep, lo, hi, c.micro > 1, splits, units, tuple(pg.values()))
    hit = model._split_cache.get(same)
    if hit is not None:
        model._split_cache[key] = hit
        return hit
    values = model._values(rows, c.cp)
    div = model.rank_mem_div(c.tp, rows, ep, c.cp)
    loss = model.sharding(c.tp).loss if hi == N else HELD_OUTPUTS  # the last stage's: gathered or vocab-parallel
    w = stage_walk(g, values, param_grad_bytes=pg, storage_divisor=div, loss=loss, later=c.micro > 1,
                   regions=_regions(model, units, g), hardware=model.hw,
                   compute_divisor=_compute_divisor(model, c, rows))
    scale = 1.0 if model.symbolic_batch else rows / (model.captured_rows or rows)
    split = (split_backward(g, values, param_grad_bytes=pg, storage_divisor=div, loss=loss).scaled(scale)
             if lo > 0 and splits else None)  # stage 0: its W is its whole backward; a stage that recomputes: fused
    hit = model._split_cache[key] = (w.first * scale, w.later * scale, w.held * scale, w.inputs * scale, w.walk_grads,
                                     split, 0.0 if hi == N else received_grad_bytes(g, values, div) * scale,
                                     w.fwd_peak * scale, w.recompute_s * scale)
    model._split_cache[same] = hit
    return hit


def _unit_shape(model: Any, tp: int, x: int) -> int:
    """An id per distinct unit structure at tp degree `tp`: units with equal ids (repeated blocks)
    have the same ops, output shapes, dtypes, tp storage divisors and saved tensors, node by node,
    and read parameters of the same shapes."""
    key = ("unit_shape", tp, x)
    hit = model._split_cache.get(key)
    if hit is None:
        firsts = unit_first_nodes(model)
        div = model.sharding(tp).mem_div
        lo, hi = firsts[x], firsts[x + 1]
        sig = (tuple((n.op, n.kind, tuple((str(t.shape), str(t.dtype), div.get(t.key, 1)) for t in n.outputs),
                      tuple((str(nb), tag) for _k, nb, tag in n.saved), len(n.grad_inputs), len(n.uses))
                     for n in model.gc.nodes[lo:hi]),
               tuple((tuple(p.shape), str(p.dtype), p.requires_grad) for p in model.gc.params
                     if lo <= p.first_use < hi))
        ids = model._split_cache.setdefault(("unit_shape_ids", tp), {})
        hit = model._split_cache[key] = ids.setdefault(sig, len(ids))
    return hit


def _boundary(model: Any, i: int, j: int) -> tuple:
    """What the stage of units [i, j) receives and what later stages read of it: the sizes of the
    activations its nodes read from earlier ones, and of those later nodes read from it (a side
    tensor made before the first layer reaches only the stages that read it), cached."""
    key = ("stage_boundary", i, j)
    hit = model._split_cache.get(key)
    if hit is None:
        firsts = unit_first_nodes(model)
        lo, hi = firsts[i], firsts[j]
        st, nodes = model.gc.storages, model.gc.nodes
        recv = {k for n in nodes[lo:hi] for k in n.uses if k in st and not st[k].is_state and st[k].producer < lo}
        later = {k for n in nodes[hi:] for k in n.uses}
        sent = {t.key for n in nodes[lo:hi] for t in n.outputs if t.key in later}
        hit = model._split_cache[key] = (tuple(sorted(str(st[k].nbytes) for k in recv)),
                                         tuple(sorted(str(st[k].nbytes) for k in sent if k in st)))
    return hit


def _same_as(model: Any, c: Candidate, rows: int, i: int, j: int, rc: tuple[str, ...], param_grad) -> tuple | None:
    """A key shared by the interior stages (neither the first nor the last, repeated blocks only) of
    the same unit structures, recompute, parameter gradients and boundary tensors (`_boundary`):
    their walks are equal (the same nodes on the same shapes), so one is walked for all."""
    if i == 0 or j >= len(model.unit_names) or not all(model.blocks[x] > 0 for x in range(i, j)):
        return None
    firsts = unit_first_nodes(model)
    pg = tuple(float(param_grad[k]) for k, p in enumerate(model.gc.params) if firsts[i] <= p.first_use < firsts[j])
    return ("stage_walk_same", c.tp, rows, c.cp, c.zero if c.replicas > 1 else 0, c.replicas, c.ep, c.micro > 1,
            c.schedule in ("zb_h1", "zbv"), tuple(_unit_shape(model, c.tp, x) for x in range(i, j)), rc, pg,
            _boundary(model, i, j))


def stage_memories(model: Any, c: Candidate, rows: int, starts: Sequence[int], ends: Sequence[int], st, chain,
                   trans_u: np.ndarray, recomputed: Mapping[int, str] | None = None) -> list[StageMemory]:
    """Every stage's `StageMemory` of candidate `c` split at unit `starts` (see the module
    docstring); `st`: its `UnitStates`, `chain`: its `SplitChain`, `trans_u`: per-unit
    gradient buffer bytes, `recomputed`: the units recomputed, each with its mode ("full" or "selective")."""
    firsts = unit_first_nodes(model)
    out = []
    for i, j in zip(starts, ends):
        cats = chain.categories(i, j)
        recomputed = recomputed or {}
        units = tuple((model.unit_names[x], recomputed[x]) for x in range(i, j) if x in recomputed)
        same = _same_as(model, c, rows, i, j, tuple(recomputed.get(x, "") for x in range(i, j)), st.param_grad)
        walk = model._split_cache.get(same) if same is not None else None
        if walk is None:
            walk = _stage_walk(model, c, rows, firsts[i], firsts[j], st.param_grad, units)
            if same is not None:
                model._split_cache[same] = walk
        first, later, held, inputs, walk_grads, split, out_grads, fwd_peak, rc_s = walk
        out.append(StageMemory(persistent=cats["params"] + cats["master"] + cats["optimizer"] + cats["buffers"],
                               grads=cats["grads"], walk_grads=walk_grads, first=first, later=later, held=held,
                               inputs=inputs, transient=float(trans_u[i:j].sum()), step_temp=chain.adam_range(i, j),
                               split=split, out_grads=out_grads, fwd_peak=fwd_peak, recompute_s=rc_s))
    return out


def pipeline_rank_peaks(model: Any, c: Candidate, sched, rows: int, starts: Sequence[int], ends: Sequence[int], st,
                        chain, trans_u: np.ndarray, rank_cats: list[dict] | None = None,
                        recomputed: Mapping[int, str] | None = None) -> list[float]:
    """Peak bytes per pipeline rank of `c` split at `starts` under schedule `sched` (already
    fused where stages recompute, `cost.schedule.fuse_backward`) with the units `recomputed`
    (`cost.pipeline_memory.rank_peaks`, the function `cost.estimate` calls); written into
    each rank's `rank_cats[r]["peak"]` when given. The recompute choice is still made on the
    per-unit model; where that model fits and this walk does not,
    `plan_cost.PlanCostModel.evaluate` evaluates the split again with the limit lowered by the
    difference (its `walk_retry`), so the plan recomputes what the walk adds."""
    z3 = model.zero3_transient(c.tp, c.replicas, model._ep_of(c)) if c.zero == 3 and c.replicas > 1 else 0.0
    peaks = rank_peaks(sched, stage_memories(model, c, rows, starts, ends, st, chain, trans_u, recomputed), z3)
    for cats, pk in zip(rank_cats or [], peaks):
        cats["peak"] = pk
    return peaks


def grads_of(st) -> float:
    """All parameter gradient bytes of `UnitStates` `st`: a pipeline rank's walk may peak before
    its backward made them, so the memory bounds of `plan_cost` leave them out of the states
    that add to the activations."""
    return float(st.total["grads"])
