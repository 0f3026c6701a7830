"""One-stage plans (pp = 1) priced on the rank's whole graph, as `cost.estimate` prices them.

`RankTables` is a part of `plan_tables.PlanTables` (which inherits it). For a candidate without
a pipeline, the joint planner's cost model (`plan_cost.PlanCostModel.evaluate`) takes these
terms from here, each computed by the function `cost.estimate` calls for it (the one-cost-model
rule: tests/unit/test_one_cost_model.py checks the two agree on every candidate):

  buckets  ZeRO 0-2: the gradient buckets the runtime forms (`cost.zero_comm.grad_buckets`,
           whole parameters, their tp-local sizes in the parameters' dtype), each ready when
           the backward of its parameters' first use ends (per node of the graph, from the
           tables' per-node times), against the last micro-batch's backward
           (`cost.zero_comm.bucket_overlap`); ZeRO 1/2's parameter all-gather per bucket after
           the step.
  ZeRO 3   the runtime's units (`cost.zero_comm.zero3_events`, `zero3_payloads`): every
           micro-batch gathers every unit in forward and re-gathers the saved ones in backward,
           the last one also reduce-scatters (`cost.zero_comm.zero3_walk`).
  memory   the liveness walk with the cross-entropy loss (`cost.memory.liveness`, traced once
           per (tp, cp) at 1 row and at the most rows, each point linear in the rows between):
           the parameter gradients appear as backward makes them in a step of one micro-batch,
           exist throughout with more (`GradProfile`); at the end of backward the gradient
           buffers (or ZeRO 3's two gathered units) and the inputs. With recomputed blocks,
           `cost.timeline` over their checkpointed regions (`rank_recompute`): the peak and the
           recompute time.

Terms without a pipeline only; pipeline plans keep the per-unit model of `plan_comm`. Tensor-
parallel conversions are not in these walks (estimate does not count them; the planner adds
them to the compute, blocking). Expert-parallel plans (ep > 1) keep the per-unit model too.

node.meta: read only through `cost.analyze`, `cost.memory.liveness` and the tables; writes
nothing. Deterministic; every table is cached on the model and depends only on its key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.cost import evaluate
from autopar.cost.memory import CROSS_ENTROPY, liveness, padded_numel, rows_of, tp_local_shape, with_param_dtype
from autopar.cost.overlap import contention_of
from autopar.cost.timeline import regions_for, timeline
from autopar.cost.zero_comm import bucket_overlap, grad_buckets, zero3_events, zero3_payloads, zero3_walk
from autopar.search.candidate import Candidate

__all__ = ["GradProfile", "RankSync", "RankTables"]


@dataclass
class GradProfile:
    """Every point of a liveness walk of one micro-batch: `bytes` without parameter gradients,
    `seen` parameter gradients existing by then, `order` the parameters (index in gc.params; -1:
    a state storage that is none, `extra` its bytes) in the order backward makes their gradients."""

    bytes: np.ndarray
    seen: np.ndarray
    order: np.ndarray
    extra: np.ndarray
    inputs: float

    def peak(self, param_grad: np.ndarray, preallocated: bool) -> float:
        """The walk's peak with `param_grad[i]` bytes of gradient for parameter i: all of them
        throughout when `preallocated` (later micro-batches), else each from its backward on."""
        if preallocated:
            return float(self.bytes.max()) + float(param_grad.sum())
        g = np.where(self.order >= 0, param_grad[np.maximum(self.order, 0)], self.extra)
        cum = np.concatenate([[0.0], np.cumsum(g)])
        return float((self.bytes + cum[self.seen]).max())


@dataclass
class RankSync:
    """The data-parallel terms of a one-stage candidate per step: seconds added to the step
    (exposed, contention included), seconds after the optimizer step (ZeRO 1/2's gather), the
    collectives' total seconds and bytes sent, and the buffers alive at the end of backward."""

    exposed: float
    after: float
    time_s: float
    bytes_sent: float
    transient: float


class RankTables:
    """One-stage tables of `plan_tables.PlanTables` (see the module docstring)."""

    def _rank_params(self, t: int):
        """(parameters at the plan's param dtype, their tp-local shapes at tp = t)."""
        key = ("rank_params", t)
        hit = self._split_cache.get(key)
        if hit is None:
            _reps, _kinds, layouts = self._param_kinds(t)
            params = with_param_dtype(self.gc.params, self.param_dtype)
            mesh = {"dp": 2, "tp": t}  # the dp size does not change a tp-local shape
            shapes = {p.name: tp_local_shape(p, layouts, mesh, "dp") for p in params if not p.is_buffer}
            hit = self._split_cache[key] = (params, shapes)
        return hit

    def _grad_item(self, p) -> int:
        return (self.reduce_dtype or p.dtype).itemsize

    def _rank_buckets(self, t: int, zero: int, R: int):
        """ZeRO 0-2 buckets at tp = t over R ranks: (ready node per bucket, sync payloads, gather
        payloads), as `cost.estimate` forms them."""
        key = ("rank_buckets", t, zero, R)
        hit = self._split_cache.get(key)
        if hit is None:
            params, shapes = self._rank_params(t)
            trainable = [p for p in params if p.requires_grad and not p.is_buffer]
            local = {n: math.prod(rows_of(sh)) for n, sh in shapes.items()}
            padded = {n: padded_numel(sh, R) for n, sh in shapes.items()}
            N = len(self.gc.nodes)
            ready, sync, gather = [], [], []
            for members in grad_buckets(trainable, self.bucket_mb, local):
                ready.append(min(p.first_use if p.first_use < N else 0 for p in members))
                sync.append(float(sum((local[p.name] if zero < 2 else R * padded[p.name]) * self._grad_item(p)
                                      for p in members)))
                gather.append(float(sum(padded[p.name] * p.dtype.itemsize for p in members)))
            hit = self._split_cache[key] = (np.array(ready, dtype=np.int64), sync, gather)
        return hit

    def _zero3(self, t: int, R: int):
        """ZeRO 3 at tp = t over R ranks: (events, gather and reduce-scatter payloads per unit)."""
        key = ("rank_zero3", t, R)
        hit = self._split_cache.get(key)
        if hit is None:
            ev = self._split_cache.get("zero3_events")
            if ev is None:
                ev = self._split_cache["zero3_events"] = zero3_events(self.gc)
            params, shapes = self._rank_params(t)
            padded = {n: padded_numel(sh, R) for n, sh in shapes.items()}
            grad_item = {p.name: self._grad_item(p) for p in params if p.requires_grad and not p.is_buffer}
            gather, rs = zero3_payloads(params, R, padded, grad_item)
            hit = self._split_cache[key] = (ev, gather, rs)
        return hit

    def zero3_transient(self, t: int, R: int) -> float:
        """ZeRO 3's gathered unit and the prefetched one (`cost.estimate`'s transient)."""
        return 2 * R * max(self._zero3(t, R)[1].values(), default=0.0)

    def rank_transient(self, c: Candidate) -> float:
        """The data-parallel buffers alive at the end of backward (`RankSync.transient`)."""
        R = c.replicas
        z = c.zero if R > 1 else 0
        if R < 2 or not self.trainable:
            return 0.0
        if z == 3:
            return self.zero3_transient(c.tp, R)
        return sum(self._rank_buckets(c.tp, z, R)[1]) * (1 + 1 / R if z == 2 else 1)

    def rank_sync(self, c: Candidate, u, link) -> RankSync:
        """The data-parallel terms of one-stage candidate `c` (see the module docstring); `u`:
        its unit costs (`units`), `link`: its data axis' memoised link."""
        R, m = c.replicas, c.micro
        z = c.zero if R > 1 else 0
        if R < 2 or link is None or not self.trainable:
            return RankSync(0.0, 0.0, 0.0, 0.0, 0.0)
        k = contention_of(link)
        if z < 3:
            ready_idx, sync, gather = self._rank_buckets(c.tp, z, R)
            suffix = np.concatenate([np.cumsum(u.node_bwd[::-1])[::-1], [0.0]])  # backward work after node i
            op = "all_reduce" if z < 2 else "reduce_scatter"
            durations = [link.time(op, x) for x in sync]
            exposed, _cont = bucket_overlap(list(suffix[ready_idx]), durations, float(suffix[0]), k)
            after = sum(link.time("all_gather", g) for g in gather) if z >= 1 else 0.0
            sent = sum(link.bytes_sent(op, x) for x in sync) + (sum(link.bytes_sent("all_gather", g) for g in gather)
                                                                  if z >= 1 else 0.0)
            return RankSync(exposed, after, sum(durations) + after, sent, self.rank_transient(c))
        ev, gather, rs = self._zero3(c.tp, R)
        key = ("rank_walk", c.tp, self.rows_per_micro(c), c.cp, R, tuple(c.mesh().items()))
        w = self._split_cache.get(key)
        if w is None:
            seg_f, seg_b, pre_f, pre_b = ev.segments(u.node_fwd, u.node_bwd)
            w = self._split_cache[key] = zero3_walk(ev, seg_f, seg_b, pre_f, pre_b, gather, rs, link.time, k)
        exposed = m * w.fwd + w.bwd + (m - 1) * w.bwd_accum
        calls = [(w.calls, 1), (w.calls_accum, m - 1)]
        t_all = sum(n * sum(d for _o, _p, _x, d, _k in cl) for cl, n in calls)
        sent = sum(n * sum(link.bytes_sent(o, x) for o, _p, x, _d, _k in cl) for cl, n in calls)
        return RankSync(exposed, 0.0, t_all, sent, self.rank_transient(c))

    # ------------------------------------------------------------------ memory
    def grad_profile(self, t: int, rows: int, cp: int = 1) -> GradProfile:
        """The traced liveness walk at tp = t, `rows` per micro-batch, s / cp tokens (see the
        module docstring): exact at 1 row and at the most rows, each point linear in between."""
        hi = self.max_rows
        if not self.symbolic_batch or rows in (1, hi) or hi <= 1:
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            p = self._traced(t, rows if self.symbolic_batch else (self.captured_rows or rows), cp)
            return GradProfile(p.bytes * scale, p.seen, p.order, p.extra * scale, p.inputs * scale)
        a, b = self._traced(t, 1, cp), self._traced(t, hi, cp)
        f = (rows - 1) / (hi - 1)
        return GradProfile(a.bytes + (b.bytes - a.bytes) * f, a.seen, a.order, a.extra, a.inputs + (b.inputs - a.inputs) * f)

    def _traced(self, t: int, rows: int, cp: int) -> GradProfile:
        key = ("traced", t, rows, cp)
        hit = self._split_cache.get(key)
        if hit is None:
            info = self.sharding(t)
            values = self._values(rows, cp)
            tr: list = []
            live = liveness(self.gc, values, param_grad_bytes={}, storage_divisor=info.mem_div, loss=CROSS_ENTROPY,
                            trace=tr)
            order_keys = tr.pop()
            index = {p.key: i for i, p in enumerate(self.gc.params) if p.key is not None}
            st = self.gc.storages
            order = np.array([index.get(k, -1) for k in order_keys], dtype=np.int64)
            extra = np.array([0.0 if k in index else float(evaluate(st[k].nbytes, values)) if k in st else 0.0
                              for k in order_keys])
            hit = self._split_cache[key] = GradProfile(np.array([x for x, _n in tr]),
                                                       np.array([n for _x, n in tr], dtype=np.int64), order, extra,
                                                       float(live.inputs))
        return hit

    def rank_act_peak(self, c: Candidate, rows: int, param_grad: np.ndarray) -> float:
        """The activation walk's peak of a one-stage candidate with its parameter gradients."""
        keyed = self._split_cache.get("keyed")
        if keyed is None:  # estimate counts the gradients of parameters with a storage key
            keyed = self._split_cache["keyed"] = np.array([p.key is not None for p in self.gc.params], dtype=bool)
        return self.grad_profile(c.tp, rows, c.cp).peak(np.where(keyed, param_grad, 0.0), c.micro > 1)

    def rank_recompute(self, c: Candidate, rows: int, units: tuple[str, ...], param_grad: np.ndarray):
        """(peak, recompute seconds per micro-batch) of a one-stage candidate whose `units` are
        recomputed: `cost.timeline` over the checkpointed regions, the walk estimate makes."""
        key = ("rank_rc", c.tp, rows, c.cp, units, c.micro > 1, c.zero, c.replicas, c.ep)
        hit = self._split_cache.get(key)
        if hit is None:
            pg = {p.key: float(g) for p, g in zip(self.gc.params, param_grad) if p.key is not None and p.requires_grad}
            live = timeline(self.gc, regions_for(self.gc, {n: "full" for n in units}), self._values(rows, c.cp),
                            hardware=self.hw, param_grad_bytes=pg, grads_preallocated=c.micro > 1,
                            storage_divisor=self.sharding(c.tp).mem_div, keep_points=False, loss=CROSS_ENTROPY,
                            compute_divisor=self.sharding(c.tp).comp_div)
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            hit = self._split_cache[key] = (float(live.peak) * scale, float(live.recompute_s) * scale)
        return hit
