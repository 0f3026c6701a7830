"""ZeRO 3 inside a pipeline candidate's stages, as `cost.estimate` prices it (pp > 1).

The joint planner's cost model (`plan_cost.PlanCostModel.evaluate`) chooses a pipeline split on
its per-unit tables, where ZeRO 3's exposed gathers and reduce-scatters are a per-unit
estimate (`plan_comm.zero3_exposed`); the chosen split's stage times then take ZeRO 3 from here:
per stage `cost.pipeline_time.stage_zero3` (the function `cost.estimate` calls) on the stage's
graph (`cost.pipeline_memory.stage_graph`, as `plan_pipeline_memory` builds it) with the nodes'
seconds as estimate times them (`PlanTables.units(...).node_fwd`, `node_bwd`) and the rank's
ZeRO-3 unit payloads (`plan_rank`'s; with ep rank 0's nodes and parameters, `rank_nodes`,
`ep_dropped`): every micro-batch gathers (forward) and re-gathers the
saved units (backward), the stage's last backward alone reduce-scatters, as the pipeline
runtime runs its stage engines (`runtime.pipeline`: no_sync but for the last backward).

`stage_node_shift`: the planner's unit tables charge an input-free node (a rotary table, a
causal mask) to the first unit that reads it; each stage runs its own copy of every one its
nodes read (`cost.pipeline_time.stage_run_nodes`, which estimate sums): per stage, the seconds of
the copies it runs beyond its units' tables, less those its tables hold that it does not run.

node.meta: read only through `cost.analyze` (the GraphCost); writes nothing. Deterministic;
cached on the model per (tp, rows, cp, replicas, ep, stage node range).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from autopar.cost.overlap import contention_of
import numpy as np

from autopar.cost.pipeline_time import add_stage_terms, stage_run_nodes, stage_zero3
from autopar.search.candidate import Candidate
from autopar.search.plan_pipeline_memory import stage_graph_of, unit_first_nodes

__all__ = ["pipeline_zero3", "stage_node_shift", "zero3_stage_times"]


def _shift_nodes(model: Any, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(nodes stage units [i, j) runs that its unit tables do not hold, nodes they hold that it
    does not run), cached per unit range."""
    key = ("shift_nodes", i, j)
    hit = model._split_cache.get(key)
    if hit is None:
        firsts = unit_first_nodes(model)
        run = set(stage_run_nodes(model.gc, firsts[i], firsts[j]))
        table = {k for k, u in enumerate(model.node_unit) if i <= u < j}
        hit = model._split_cache[key] = (np.array(sorted(run - table), dtype=np.int64),
                                          np.array(sorted(table - run), dtype=np.int64))
    return hit


def stage_node_shift(model: Any, c: Candidate, u, starts: Sequence[int], ends: Sequence[int]
                     ) -> tuple[list[float], list[float]]:
    """Per stage of `c` split at unit `starts`: (forward, backward) seconds per micro-batch that
    its run nodes add to its units' sums (see the module docstring); the nodes' seconds as the
    tables time them (with ep, rank 0's: `rank_nodes`), with the tensor-parallel conversions
    each consumes (`UnitCosts.node_tp`)."""
    nf, nb = model.rank_nodes(c, u)
    tp = u.node_tp if u.node_tp is not None else np.zeros(len(nf))  # conversions: half forward, half backward
    out_f, out_b = [], []
    for i, j in zip(starts, ends):
        extra, missing = _shift_nodes(model, i, j)
        conv = float(tp[extra].sum() - tp[missing].sum()) / 2
        out_f.append(float(nf[extra].sum() - nf[missing].sum()) + conv)
        out_b.append(float(nb[extra].sum() - nb[missing].sum()) + conv)
    return out_f, out_b


def pipeline_zero3(model: Any, c: Candidate, rows: int, starts: Sequence[int], ends: Sequence[int], u,
                   link) -> list[tuple[float, float, float]] | None:
    """Per stage of `c` split at unit `starts`: (forward, no_sync backward, the last backward's
    extra) ZeRO-3 seconds per micro-batch (`cost.pipeline_time.stage_zero3`); None without
    ZeRO 3 over replicas or without a data-parallel link. `u`: the candidate's `UnitCosts`."""
    R = c.replicas
    if c.zero != 3 or R < 2 or link is None:
        return None
    ep = model._ep_of(c)
    _ev, gather, rs = model._zero3(c.tp, R, ep)
    node_f, node_b = model.rank_nodes(c, u)  # with ep: rank 0's experts on their routed rows, its collectives
    gone = model.ep_dropped(c.tp, ep)  # other ranks' experts: not this rank's parameters
    firsts = unit_first_nodes(model)
    k = contention_of(link)
    out = []
    for i, j in zip(starts, ends):
        lo, hi = firsts[i], firsts[j]
        key = ("stage_zero3", c.tp, rows, c.cp, R, tuple(c.mesh().items()), lo, hi)
        hit = model._split_cache.get(key)
        if hit is None:
            g = stage_graph_of(model, lo, hi)
            if gone:
                g = dataclasses.replace(g, params=[p for p in g.params if p.name not in gone])
            hit = model._split_cache[key] = stage_zero3(g, node_f, node_b, gather, rs, link.time, k)
        out.append(hit)
    return out


def zero3_stage_times(model: Any, c: Candidate, rows: int, starts: Sequence[int], ends: Sequence[int], u, link,
                      F_s: list[float], B_s: list[float], f0, b0, rc_s: Sequence[float], one: bool, shift=None):
    """(F_s, B_s, per-stage ZeRO-3 terms or None): with ZeRO 3 on a pipeline (`pipeline_zero3`),
    per stage its forward and backward seconds per micro-batch from its units' (`f0`, `b0`, with
    their tensor-parallel conversions), the input-free copies it runs (`shift`, from
    `stage_node_shift`), its recompute (`rc_s`) and ZeRO 3's walk
    (`cost.pipeline_time.add_stage_terms`); otherwise `F_s`, `B_s` as given."""
    z3 = None if one else pipeline_zero3(model, c, rows, starts, ends, u, link)
    if z3 is None:
        return F_s, B_s, None
    sf, sb = shift if shift is not None else ([0.0] * len(starts), [0.0] * len(starts))
    F_s = [float(f0[i:j].sum()) + x for i, j, x in zip(starts, ends, sf)]
    B_s = [float(b0[i:j].sum()) + x + rc for i, j, x, rc in zip(starts, ends, sb, rc_s)]
    add_stage_terms(F_s, B_s, None, z3)
    return F_s, B_s, z3
