"""The data-parallel communication terms of the joint planner's cost model (`search.plan_cost`)
for pipeline plans (one-stage plans take `search.plan_rank`'s, which are `cost.estimate`'s).

`dp_sync`: a rank's gradient synchronisation after its last backward (ZeRO 0/1 all-reduce, 2
reduce-scatter, in buckets as the runtime forms them, each once its gradients are ready;
ZeRO 1/2's parameter all-gather after the step), by `cost.pipeline_time.dp_sync` over the
pieces `cost.estimate` gives it (`node_pieces`): per node of each stage's graph (its input-free
and tied copies included), the node's backward seconds and the payloads of the parameters
it is the stage's first reader of. Per unit (as before 2026-11-27) a unit's gradients were
ready only when its whole backward had run, and a stage syncing in several buckets issued them
later than estimate (89.47 against 88.53 ms on a pp 2 x dp 32 GPT at 25 MiB).

`zero3_exposed`: ZeRO 3's gathers and reduce-scatters not hidden behind the unit computation;
`buckets` (re-exported from `cost.pipeline_time`): gradients in buckets of the runtime's sizes.
With context parallelism the link is the joined dp+cp axis' (`search.plan_context`), where
gradients and ZeRO shards live. Overlap is not free: the compute
beside a collective in flight runs (1 + k) times slower, k the link's contention
(`cost.overlap`, as `cost.estimate` applies it), and the exposed terms include that slowdown.

Pure functions of the tables' arrays: no node.meta. Deterministic.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from autopar.cost.overlap import contention_of, overlap_extra
from autopar.cost.pipeline_memory import held_states
from autopar.cost.pipeline_time import buckets, dp_sync as pipeline_dp_sync, rank_pieces
from autopar.search.candidate import Candidate
from autopar.search.plan_pipeline_memory import stage_graph_of, unit_first_nodes
from autopar.search.plan_tables import UnitStates

__all__ = ["buckets", "dp_sync", "node_pieces", "stage_payloads", "zero3_exposed"]


def stage_payloads(st: UnitStates, starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Per unit, the gradient-sync and gather payloads of a split at unit `starts`, with every
    stage's own copy of a parameter read on several stages (a tied embedding: each stage's
    engine buckets and syncs its copy, as estimate counts each stage's parameters) at the
    stage's first unit that reads it; `st.grad_payload` / `st.gather` hold it once."""
    pay, gat = st.grad_payload.copy(), st.gather.copy()
    for row, cnt in st.shared:
        total = cnt[-1]
        for i, j in zip(starts, ends):
            if cnt[j] > cnt[i]:  # a reader in this stage
                first = int(np.searchsorted(cnt[1:], cnt[i] + 1))  # its first reader unit in [i, j)
                if not cnt[j] == total:  # the last reader's stage holds it already (grad_payload)
                    pay[first] += row["_grad"]
                if cnt[i] > 0:  # the first reader's stage holds it already (gather)
                    gat[first] += row["_gather"]
    return pay, gat


def node_pieces(model: Any, c: Candidate, u, st: UnitStates, starts: Sequence[int], ends: Sequence[int]
                ) -> tuple[list[int], list[int], list[float], list[float], list[float]]:
    """(first piece per stage, its end, backward seconds per piece, gradient payload per piece,
    gather payload per piece) of `c` split at unit `starts`, one piece per node of each stage's
    graph, as `cost.pipeline_time.estimate_pipeline_step` hands them to `dp_sync`: the node's
    backward (with ep rank 0's, `rank_nodes`) with half the tensor-parallel conversions it
    consumes (`UnitCosts.node_tp`); each parameter the stage holds (with ep rank 0's experts, whole)
    at its first reader (`rank_pieces`), with its payload on this rank (`st.pay_of`)."""
    key = (u, st, c, tuple(starts), tuple(ends))  # every rank of one evaluation asks for the same
    last = model.__dict__.get("_node_pieces_last")  # one entry: it holds u, st, c, so no id is reused
    if last is not None and all(a is b for a, b in zip(last[0][:3], key[:3])) and last[0][3:] == key[3:]:
        return last[1]
    _nf, nb = model.rank_nodes(c, u)
    firsts = unit_first_nodes(model)
    ep = model._ep_of(c)
    gone = model.ep_dropped(c.tp, ep)
    # rank 0's whole experts of slots blocks (`st` holds each at 1 / ep: E / ep of them on a rank;
    # here the other ranks' are gone), grouped (E, ...) ones already cut on ep (`ep_param_grad`)
    whole = model.slot_expert_params if ep > 1 else set()
    graphs = []
    for i, j in zip(starts, ends):
        g = stage_graph_of(model, firsts[i], firsts[j])
        graphs.append(dataclasses.replace(g, params=[p for p in g.params if p.name not in gone]) if gone else g)
    tp = u.node_tp
    back = [float(nb[n.index]) + (float(tp[n.index]) / 2 if tp is not None else 0.0) for g in graphs for n in g.nodes]
    pay, gat = rank_pieces(graphs, [g.nodes[0].index for g in graphs], held_states(model.gc),
                           lambda p: st.pay_of[p.name][0] * (ep if p.name in whole else 1),
                           lambda p: st.pay_of[p.name][1] * (ep if p.name in whole else 1))
    lo, at = [], 0
    for g in graphs:
        lo.append(at)
        at += len(g.nodes)
    model.__dict__["_node_pieces_last"] = (key, (lo, lo[1:] + [at], back, pay, gat))
    return model.__dict__["_node_pieces_last"][1]


def dp_sync(model: Any, u, mine, starts, ends, B_s, end_r: float, st: UnitStates, dp_link, z: int, c: Candidate,
            windows=None) -> tuple[float, float, float, float]:
    """(exposed, after the step, time, bytes sent) of a rank's data-parallel gradient sync (its
    stages `mine` of `c` split at unit `starts`, each reduced as its last gradient action,
    `windows[s]`, makes them; its last action ending at `end_r`), on the dp (with cp: dp+cp)
    link: `cost.pipeline_time.dp_sync` over `node_pieces`, as `cost.estimate` calls it."""
    if c.replicas < 2 or dp_link is None:  # nothing to sync (as pipeline_dp_sync answers): no pieces needed
        return 0.0, 0.0, 0.0, 0.0
    lo, hi, back, pay, gat = node_pieces(model, c, u, st, starts, ends)
    return pipeline_dp_sync(mine, lo, hi, B_s, back, end_r, pay, gat, dp_link, z, c.replicas, c.micro,
                            model.bucket_bytes, windows)


def zero3_exposed(fwd: np.ndarray, bwd: np.ndarray, st: UnitStates, al) -> tuple[np.ndarray, np.ndarray]:
    """ZeRO-3 communication not hidden behind compute, per unit and micro-batch: forward,
    unit x gathered while unit x-1 computes; backward, gathered again while x+1's backward
    runs, its gradients reduce-scattered on the same stream; the compute beside them slowed by
    the link's contention (`cost.overlap.overlap_extra`). `al`: the dp (dp+cp) link."""
    L = len(fwd)
    f_exp, b_exp = np.zeros(L), np.zeros(L)
    if al is None:
        return f_exp, b_exp
    g = np.array([al.time("all_gather", float(x)) if x > 0 else 0.0 for x in st.gather])
    rs = np.array([al.time("reduce_scatter", float(x)) if x > 0 else 0.0 for x in st.grad_payload])
    k = contention_of(al)
    for x in range(L):
        prev = fwd[x - 1] if x > 0 else 0.0
        f_exp[x] = overlap_extra(prev, g[x], k)
        nxt = bwd[x + 1] if x + 1 < L else 0.0
        b_exp[x] = overlap_extra(nxt, g[x] + (rs[x + 1] if x + 1 < L else 0.0), k)
    b_exp[0] += rs[0]
    return f_exp, b_exp
