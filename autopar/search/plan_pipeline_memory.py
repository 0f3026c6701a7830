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

Not modelled here (the planner keeps its per-unit memory): recompute inside stages (estimate
costs a pipeline without it), expert parallelism (estimate's expert accounting differs), and
a split whose walk is over the memory limit where the per-unit model fits and recompute is
allowed (the recompute choice does not use the walk yet: `pipeline_rank_peaks`). A static batch dimension scales the walk linearly with the rows, as
`search.plan_rank` does.

node.meta: read only through `cost.analyze` (the GraphCost); writes nothing. Deterministic;
walks are cached on the model per (tp, rows, cp, stage node range, ZeRO, replicas, ep, m > 1).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from autopar.cost.memory import HELD_OUTPUTS, liveness
from autopar.cost.pipeline_memory import (StageMemory, forward_peak, rank_peaks, received_grad_bytes, split_backward,
                                          stage_graph, stage_of_nodes)
from autopar.search.candidate import Candidate

__all__ = ["grads_of", "stage_graph_of", "stage_memories", "pipeline_rank_peaks", "unit_first_nodes"]


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


def _stage_walk(model: Any, c: Candidate, rows: int, lo: int, hi: int, param_grad: np.ndarray) -> tuple:
    """(first peak, later peak, forward end, inputs, walk gradients, the split backward's terms, the
    gradients received for its outputs, the forward's peak) of the stage holding nodes [lo, hi) of the graph, cached."""
    z = c.zero if c.replicas > 1 else 0
    splits = c.schedule in ("zb_h1", "zbv")  # ZB-H1 / ZBV split the backward (I and W)
    key = ("stage_walk", c.tp, rows, c.cp, lo, hi, z, c.replicas, c.ep, c.micro > 1, splits)
    hit = model._split_cache.get(key)
    if hit is not None:
        return hit
    gc = model.gc
    N = len(gc.nodes)
    g = stage_graph_of(model, lo, hi)
    index = {p.key: i for i, p in enumerate(gc.params) if p.key is not None}
    pg = {p.key: float(param_grad[index[p.key]]) for p in g.params if p.requires_grad and p.key is not None}
    values = model._values(rows, c.cp)
    div = model.sharding(c.tp).mem_div
    loss = model.sharding(c.tp).loss if hi == N else HELD_OUTPUTS  # the last stage's: gathered or vocab-parallel
    trace: list = []  # its forward part is the F's peak (`forward_peak`)
    first = liveness(g, values, param_grad_bytes=pg, storage_divisor=div, loss=loss, trace=trace)
    later = liveness(g, values, param_grad_bytes=pg, grads_preallocated=True, storage_divisor=div,
                     loss=loss).peak if c.micro > 1 else first.peak
    scale = 1.0 if model.symbolic_batch else rows / (model.captured_rows or rows)
    split = (split_backward(g, values, param_grad_bytes=pg, storage_divisor=div, loss=loss).scaled(scale)
             if lo > 0 and splits else None)  # stage 0: its W is its whole backward
    hit = model._split_cache[key] = (float(first.peak) * scale, float(later) * scale, float(first.forward_end) * scale,
                                     float(first.inputs) * scale, float(first.param_grads), split,
                                     0.0 if hi == N else received_grad_bytes(g, values, div) * scale,
                                     forward_peak(g, values, storage_divisor=div, loss=loss, trace=trace) * scale)
    return hit


def stage_memories(model: Any, c: Candidate, rows: int, starts: Sequence[int], ends: Sequence[int], st, chain,
                   trans_u: np.ndarray) -> list[StageMemory]:
    """Every stage's `StageMemory` of candidate `c` split at unit `starts` (see the module
    docstring); `st`: its `UnitStates`, `chain`: its `SplitChain`, `trans_u`: per-unit
    gradient buffer bytes."""
    firsts = unit_first_nodes(model)
    out = []
    for i, j in zip(starts, ends):
        cats = chain.categories(i, j)
        first, later, held, inputs, walk_grads, split, out_grads, fwd_peak = _stage_walk(model, c, rows, firsts[i],
                                                                                         firsts[j], st.param_grad)
        out.append(StageMemory(persistent=cats["params"] + cats["master"] + cats["optimizer"] + cats["buffers"],
                               grads=cats["grads"], walk_grads=walk_grads, first=first, later=later, held=held,
                               inputs=inputs, transient=float(trans_u[i:j].sum()), step_temp=chain.adam_range(i, j),
                               split=split, out_grads=out_grads, fwd_peak=fwd_peak))
    return out


def pipeline_rank_peaks(model: Any, c: Candidate, sched, rows: int, starts: Sequence[int], ends: Sequence[int], st,
                        chain, trans_u: np.ndarray, rank_cats: list[dict] | None = None) -> list[float]:
    """Peak bytes per pipeline rank of `c` split at `starts` under schedule `sched`
    (`cost.pipeline_memory.rank_peaks`, the function `cost.estimate` calls); written into
    each rank's `rank_cats[r]["peak"]` when given. The recompute choice is still made on the
    per-unit model; where that model fits without recompute and this walk does not,
    `plan_cost.PlanCostModel.evaluate` evaluates the split again with the limit lowered by the
    difference (its `walk_retry`), so the plan recomputes what the walk adds."""
    z3 = model.zero3_transient(c.tp, c.replicas) if c.zero == 3 and c.replicas > 1 else 0.0
    peaks = rank_peaks(sched, stage_memories(model, c, rows, starts, ends, st, chain, trans_u), z3)
    for cats, pk in zip(rank_cats or [], peaks):
        cats["peak"] = pk
    return peaks


def grads_of(st) -> float:
    """All parameter gradient bytes of `UnitStates` `st`: a pipeline rank's walk may peak before
    its backward made them, so the memory bounds of `plan_cost` leave them out of the states
    that add to the activations."""
    return float(st.total["grads"])
