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
  memory   the liveness walk with the loss (`ShardInfo.loss`: cross-entropy on gathered logits or the
           vocab-parallel loss under `loss_parallel`; `cost.memory.liveness`, traced once
           per (tp, cp) at 1 row and at the most rows, each point linear in the rows between;
           with ep at the rows themselves):
           the parameter gradients appear as backward makes them in a step of one micro-batch,
           exist throughout with more (`GradProfile`); at the end of backward the gradient
           buffers (or ZeRO 3's two gathered units) and the inputs. With recomputed blocks,
           `cost.timeline` over their checkpointed regions (`rank_recompute`): the peak and the
           recompute time.

  experts  ep > 1 (`rank_nodes`, `ep_rank`): rank 0 as `cost.estimate` prices the plan's
           `plan.extra["expert"]` (`expert_plan_entry`, which `search.plan_write` writes):
           other ranks' whole experts gone (parameters, states, gradients, nodes: `ep_dropped`),
           grouped (E, ...) experts cut on ep (`_param_kinds`), the local experts' nodes and the
           slot buffers on their routed rows, balanced routing (`cost.expert_memory.ep_memory`:
           storage scales in the walk, compute factors as node divisors), and the collectives
           the dispatcher and the expert pass add, blocking the nodes they sit on
           (`cost.expert_comm.ep_events`: route counts, dispatch and combine all-to-alls and
           their reverses, router statistics over dp and ep, non-expert gradients over ep).

Terms without a pipeline only, but for the experts' (`rank_nodes`, `rank_mem_div`, `ep_param_grad`,
`ep_dropped`, `rank_ep_comm`), which pipeline candidates take per stage too (`plan_cost`,
`plan_pipeline_memory`, `plan_pipeline_time`); the rest of a pipeline plan keeps the per-unit
model of `plan_comm` to choose its split. Tensor-
parallel conversions are not in these walks (estimate does not count them; the planner adds
them to the compute, blocking).

node.meta: read only through `cost.analyze`, `cost.memory.liveness` and the tables; writes
nothing. Deterministic; every table is cached on the model and depends only on its key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from autopar.cost import evaluate
from autopar.cost.expert_comm import EPEvents, ep_events
from autopar.cost.expert_memory import EPMemory, ep_compute_divisor, ep_memory
from autopar.cost.node_time import NodeTimer
from autopar.cost.memory import liveness, padded_numel, rows_of, tp_local_shape, with_param_dtype
from autopar.cost.comm import axis_links
from autopar.cost.overlap import contention_of
from autopar.cost.placements import Layout, Replicate, Shard
from autopar.cost.timeline import regions_for, timeline
from autopar.cost.zero_comm import bucket_overlap, grad_buckets, zero3_events, zero3_payloads, zero3_walk
from autopar.search.candidate import Candidate, router_stat_keys
from autopar.search.plan_context import MemoLink
from autopar.search.plan_selective import selective_keys

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

    def _param_kinds(self, t: int, ep: int = 1):
        """Parameters grouped by what their states depend on (shape, dtype, trainable, buffer,
        tp placement, the ep cut of grouped experts): the 80 blocks of a 70B model have a dozen
        kinds. Returns (representatives, kind index per parameter, layouts: tp, and with ep > 1
        S(0) on ep for grouped experts, as `search.expert.grouped_expert_layouts` writes them)."""
        key = ("kinds", t, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            info = self.sharding(t)
            layouts = {n: Layout.of({"tp": p}) for n, p in info.param_placements.items()}
            if ep > 1:
                for n in self.grouped_expert_params:
                    layouts[n] = Layout.of({"tp": info.param_placements.get(n, Replicate()), "ep": Shard(0)})
            reps, index, kinds = [], {}, []
            for p in self.gc.params:
                k = (tuple(p.shape), p.numel, p.dtype, p.requires_grad, p.is_buffer, str(layouts.get(p.name)))
                if k not in index:
                    index[k] = len(reps)
                    reps.append(p)
                kinds.append(index[k])
            hit = self._split_cache[key] = (reps, kinds, layouts)
        return hit

    @property
    def slot_expert_params(self) -> set[str]:
        """Parameters of whole experts (slots blocks): rank 0 holds E / ep experts' of them."""
        return {n for b in self.moe_blocks if b.idiom == "slots" for n in b.expert_params}

    @property
    def grouped_expert_params(self) -> set[str]:
        """Grouped (E, ...) expert parameters (sorted, dense blocks): cut on ep along dim 0."""
        return {n for b in self.moe_blocks if b.idiom != "slots" for n in b.expert_params}

    def _rank_params(self, t: int, ep: int = 1):
        """(parameters at the plan's param dtype, their local shapes at tp = t, ep)."""
        key = ("rank_params", t, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            _reps, _kinds, layouts = self._param_kinds(t, ep)
            params = with_param_dtype(self.gc.params, self.param_dtype)
            mesh = {"dp": 2, "tp": t, "ep": ep}  # the dp size does not change a tp-local shape
            shapes = {p.name: tp_local_shape(p, layouts, mesh, "dp") for p in params if not p.is_buffer}
            hit = self._split_cache[key] = (params, shapes)
        return hit

    def _grad_item(self, p) -> int:
        return (self.reduce_dtype or p.dtype).itemsize

    def _rank_buckets(self, t: int, zero: int, R: int, ep: int = 1):
        """ZeRO 0-2 buckets at tp = t over R ranks (of this rank's parameters under ep): (ready
        node per bucket, sync payloads, gather payloads), as `cost.estimate` forms them."""
        key = ("rank_buckets", t, zero, R, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            params, shapes = self._rank_params(t, ep)
            gone = self.ep_dropped(t, ep)
            trainable = [p for p in params if p.requires_grad and not p.is_buffer and p.name not in gone]
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

    def _zero3(self, t: int, R: int, ep: int = 1):
        """ZeRO 3 at tp = t over R ranks (this rank's parameters under ep): (events, gather and
        reduce-scatter payloads per unit)."""
        key = ("rank_zero3", t, R, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            ev = self._split_cache.get("zero3_events")
            if ev is None:
                ev = self._split_cache["zero3_events"] = zero3_events(self.gc)
            params, shapes = self._rank_params(t, ep)
            gone = self.ep_dropped(t, ep)
            params = [p for p in params if p.name not in gone]
            padded = {n: padded_numel(sh, R) for n, sh in shapes.items()}
            grad_item = {p.name: self._grad_item(p) for p in params if p.requires_grad and not p.is_buffer}
            gather, rs = zero3_payloads(params, R, padded, grad_item)
            hit = self._split_cache[key] = (ev, gather, rs)
        return hit

    def zero3_transient(self, t: int, R: int, ep: int = 1) -> float:
        """ZeRO 3's gathered unit and the prefetched one (`cost.estimate`'s transient)."""
        return 2 * R * max(self._zero3(t, R, ep)[1].values(), default=0.0)

    def rank_transient(self, c: Candidate) -> float:
        """The data-parallel buffers alive at the end of backward (`RankSync.transient`)."""
        R = c.replicas
        z = c.zero if R > 1 else 0
        if R < 2 or not self.trainable:
            return 0.0
        ep = self._ep_of(c)
        if z == 3:
            return self.zero3_transient(c.tp, R, ep)
        return sum(self._rank_buckets(c.tp, z, R, ep)[1]) * (1 + 1 / R if z == 2 else 1)

    def rank_sync(self, c: Candidate, u, link) -> RankSync:
        """The data-parallel terms of one-stage candidate `c` (see the module docstring); `u`:
        its unit costs (`units`), `link`: its data axis' memoised link."""
        R, m = c.replicas, c.micro
        z = c.zero if R > 1 else 0
        if R < 2 or link is None or not self.trainable:
            return RankSync(0.0, 0.0, 0.0, 0.0, 0.0)
        k = contention_of(link)
        ep = self._ep_of(c)
        node_fwd, node_bwd = self.rank_nodes(c, u)
        if z < 3:
            ready_idx, sync, gather = self._rank_buckets(c.tp, z, R, ep)
            suffix = np.concatenate([np.cumsum(node_bwd[::-1])[::-1], [0.0]])  # backward work after node i
            op = "all_reduce" if z < 2 else "reduce_scatter"
            durations = [link.time(op, x) for x in sync]
            exposed, _cont = bucket_overlap(list(suffix[ready_idx]), durations, float(suffix[0]), k)
            after = sum(link.time("all_gather", g) for g in gather) if z >= 1 else 0.0
            sent = sum(link.bytes_sent(op, x) for x in sync) + (sum(link.bytes_sent("all_gather", g) for g in gather)
                                                                  if z >= 1 else 0.0)
            return RankSync(exposed, after, sum(durations) + after, sent, self.rank_transient(c))
        ev, gather, rs = self._zero3(c.tp, R, ep)
        key = ("rank_walk", c.tp, self.rows_per_micro(c), c.cp, R, tuple(c.mesh().items()))
        w = self._split_cache.get(key)
        if w is None:
            seg_f, seg_b, pre_f, pre_b = ev.segments(node_fwd, node_bwd)
            w = self._split_cache[key] = zero3_walk(ev, seg_f, seg_b, pre_f, pre_b, gather, rs, link.time, k)
        exposed = m * w.fwd + w.bwd + (m - 1) * w.bwd_accum
        calls = [(w.calls, 1), (w.calls_accum, m - 1)]
        t_all = sum(n * sum(d for _o, _p, _x, d, _k in cl) for cl, n in calls)
        sent = sum(n * sum(link.bytes_sent(o, x) for o, _p, x, _d, _k in cl) for cl, n in calls)
        return RankSync(exposed, 0.0, t_all, sent, self.rank_transient(c))

    # ------------------------------------------------------------------ expert parallelism
    def _ep_of(self, c: Candidate) -> int:
        return c.ep if c.ep > 1 and self.moe_blocks else 1

    def expert_entry(self) -> dict:
        """What `cost.estimate` reads of `plan.extra["expert"]` (`search.expert.plan_experts`
        writes the same blocks): every MoE block, the model's own capacity rule."""
        hit = self._split_cache.get("expert_entry")
        if hit is None:
            hit = self._split_cache["expert_entry"] = {
                "axis": "ep", "capacity_factor": None, "global_router_stats": True,
                "blocks": {b.module: b.to_json() for b in self.moe_blocks},
                "router_stats": list(router_stat_keys(self))}
        return hit

    def expert_plan_entry(self, c: Candidate) -> dict:
        """`plan.extra["expert"]` of candidate `c`: `search.expert.plan_experts` called as
        `build.plan_complete` calls it (its blocks are `expert_entry`'s)."""
        from autopar.search.expert import plan_experts  # noqa: PLC0415  (expert imports the cost tables' floor)

        mesh = c.mesh()
        mine = self.expert_entry()
        entry = plan_experts(self.gm, mesh, dp_axis="dp" if "dp" in mesh else None, n_microbatches=c.micro,
                             blocks=self.moe_blocks, router_stat_keys=mine["router_stats"])
        assert all(entry[k] == v for k, v in mine.items()), "the planner priced another entry"
        return entry

    def ep_rank(self, t: int, rows: int, ep: int, dp: int = 1, cp: int = 1) -> tuple[EPMemory, EPEvents]:
        """Rank 0 under ep at tp = t, `rows` per micro-batch: its parameters, storage and compute
        scales (`cost.expert_memory.ep_memory`) and its collectives (`cost.expert_comm.ep_events`),
        the functions `cost.estimate` calls."""
        key = ("ep_rank", t, rows, ep, dp, cp)
        hit = self._split_cache.get(key)
        if hit is None:
            params, shapes = self._rank_params(t, ep)
            layouts = self._param_kinds(t, ep)[2]
            extra = {"expert": self.expert_entry(), **({"context": {"axis": "cp"}} if cp > 1 else {})}
            plan = SimpleNamespace(extra=extra, mesh={"dp": dp, "ep": ep, "cp": cp}, param_layouts=layouts,
                                   dp_axis="dp")
            values = self._values(rows, cp)
            memo: dict = {}

            def ev(x):  # identical blocks repeat the same sizes: evaluate each once
                r = memo.get(x)
                if r is None:
                    r = memo[x] = evaluate(x, values)
                return r

            by_key = self._split_cache.get("nodes_by_key")
            if by_key is None:
                by_key = self._split_cache["nodes_by_key"] = {n.key: n for n in self.gc.nodes}
            epm = ep_memory(self.gc, params, plan, ev, by_key)
            local = {n: math.prod(rows_of(sh)) for n, sh in shapes.items()}
            hit = self._split_cache[key] = (epm, ep_events(self.gc, epm.params, plan, ev, local, by_key))
        return hit

    def ep_dropped(self, t: int, ep: int) -> set[str]:
        """Names of the parameters rank 0 does not hold under ep (other ranks' experts)."""
        if ep < 2 or not self.moe_blocks:
            return set()
        key = ("ep_dropped", t, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            kept = {p.name for p in self.ep_rank(t, 1, ep)[0].params}
            hit = self._split_cache[key] = {p.name for p in self.gc.params} - kept
        return hit

    def ep_param_grad(self, t: int, ep: int, param_grad: np.ndarray) -> np.ndarray:
        """`param_grad` (expert parameters' divided by ep, `states`) as rank 0 holds them: its
        experts' whole, other ranks' none (`cost.estimate`'s walk)."""
        gone = self.ep_dropped(t, ep)
        slots = self.slot_expert_params  # whole per expert; grouped ones are cut on ep in `states` already
        mult = np.array([0.0 if p.name in gone else float(ep) if p.name in slots else 1.0 for p in self.gc.params])
        return param_grad * mult

    def rank_nodes(self, c: Candidate, u) -> tuple[np.ndarray, np.ndarray]:
        """Per node (forward, backward) seconds of rank 0 running `c`: the tables' (`u`), with
        ep > 1 every expert node at its routed rows (another rank's expert: 0) and the expert
        collectives blocking the nodes they sit on, as `cost.estimate` times them."""
        ep = self._ep_of(c)
        if ep < 2:
            return u.node_fwd, u.node_bwd
        rows = self.rows_per_micro(c)
        key = ("ep_nodes", c.tp, rows, c.cp, tuple(c.mesh().items()))
        hit = self._split_cache.get(key)
        if hit is None:
            epm, eve = self.ep_rank(c.tp, rows, ep, c.dp, c.cp)
            f, b = u.node_fwd.copy(), u.node_bwd.copy()
            timer = NodeTimer(self.hw, self._values(rows, c.cp), compute_dtype=self.compute_dtype)
            comp = self.sharding(c.tp).comp_div
            for i, k in epm.compute.items():
                f[i], b[i] = timer.node(self.gc.nodes[i], comp.get(i, 1) / k) if k > 0 else (0.0, 0.0)
            links = self.raw_links(c)
            for e in eve.events:
                (b if e.backward else f)[e.node] += links[e.axis or eve.axis].time(e.op, e.payload)
            hit = self._split_cache[key] = (f, b)
        return hit

    def rank_ep_units(self, c: Candidate, fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-unit `fwd`, `bwd` of a one-stage ep candidate: the tables' plus what `rank_nodes`
        changes on each unit's nodes."""
        u = self.units(c.tp, self.rows_per_micro(c), c.cp)
        f, b = self.rank_nodes(c, u)
        unit = np.asarray(self.node_unit, dtype=np.int64)
        return (fwd + np.bincount(unit, weights=f - u.node_fwd, minlength=self.L),
                bwd + np.bincount(unit, weights=b - u.node_bwd, minlength=self.L))

    def raw_links(self, c: Candidate) -> dict:
        """`links(c)`, with cp the mesh's own dp axis in place of the joined dp+cp one (the
        router statistics' all-reduces run on each axis, as `cost.estimate` prices them)."""
        if c.cp < 2:
            return self.links(c)
        key = ("raw_links", tuple(c.mesh().items()))
        hit = self._split_cache.get(key)
        if hit is None:
            raw = axis_links(self.hw, c.mesh())
            hit = self._split_cache[key] = {**self.links(c), **({"dp": MemoLink(raw["dp"])} if "dp" in raw else {})}
        return hit

    def rank_mem_div(self, t: int, rows: int, ep: int = 1, cp: int = 1) -> dict:
        """Storage divisors of rank 0: the sharding ILP's at tp = t, with ep > 1 this rank's
        experts' storages scaled to their routed rows (as `cost.estimate` scales them)."""
        div = self.sharding(t).mem_div
        if ep < 2 or not self.moe_blocks:
            return div
        div = dict(div)
        for k, f in self.ep_rank(t, rows, ep, 1, cp)[0].scale.items():
            div[k] = div.get(k, 1) / f if f > 0 else math.inf
        return div

    def rank_ep_floor(self, c: Candidate, rows: int, fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per-unit `fwd`, `bwd` (`optimistic_units`: every node's work / tp) without the nodes
        whose work ep changes (`EPMemory.compute`): a floor of `rank_ep_units` needing no ILP."""
        if self._ep_of(c) < 2:
            return fwd, bwd
        key = ("ep_compute_nodes", c.ep)  # which nodes ep changes: the same at any rows
        nodes = self._split_cache.get(key)
        if nodes is None:
            nodes = self._split_cache[key] = sorted(self.ep_rank(1, rows, c.ep)[0].compute)
        if not nodes:
            return fwd, bwd
        timer = NodeTimer(self.hw, self._values(rows, c.cp), compute_dtype=self.compute_dtype)
        f, b = np.zeros(self.L), np.zeros(self.L)
        for i in nodes:
            nf, nb = timer.node(self.gc.nodes[i], c.tp)
            f[self.node_unit[i]] += nf
            b[self.node_unit[i]] += nb
        return fwd - f, bwd - b

    def rank_ep_comm(self, c: Candidate, units: set[int] | None = None) -> tuple[float, float]:
        """(seconds, bytes sent) of rank 0's expert collectives per micro-batch (`rank_nodes`), on
        the nodes of `units` only when given (a pipeline rank's stages)."""
        eve = self.ep_rank(c.tp, self.rows_per_micro(c), c.ep, c.dp, c.cp)[1]
        links = self.raw_links(c)
        mine = [e for e in eve.events if (e.axis or eve.axis) == eve.axis  # the router statistics' dp part aside
                and (units is None or self.node_unit[e.node] in units)]
        return (sum(links[eve.axis].time(e.op, e.payload) for e in mine),
                sum(links[eve.axis].bytes_sent(e.op, e.payload) for e in mine))

    # ------------------------------------------------------------------ memory
    def grad_profile(self, t: int, rows: int, cp: int = 1, ep: int = 1) -> GradProfile:
        """The traced liveness walk at tp = t, `rows` per micro-batch, s / cp tokens (see the
        module docstring): exact at 1 row and at the most rows, each point linear in between.
        With ep > 1 the walk of this rank's experts on their routed rows (`cost.expert_memory`),
        traced at `rows` itself where a block has a capacity (its ceiling is not linear in the
        rows)."""
        hi = self.max_rows
        capacity = ep > 1 and any(b.idiom == "slots" and not b.dropless for b in self.moe_blocks)
        if capacity or not self.symbolic_batch or rows in (1, hi) or hi <= 1:
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            p = self._traced(t, rows if self.symbolic_batch else (self.captured_rows or rows), cp, ep)
            return GradProfile(p.bytes * scale, p.seen, p.order, p.extra * scale, p.inputs * scale)
        a, b = self._traced(t, 1, cp, ep), self._traced(t, hi, cp, ep)
        f = (rows - 1) / (hi - 1)
        return GradProfile(a.bytes + (b.bytes - a.bytes) * f, a.seen, a.order, a.extra, a.inputs + (b.inputs - a.inputs) * f)

    def _traced(self, t: int, rows: int, cp: int, ep: int = 1) -> GradProfile:
        if ep > 1 and not self.ep_rank(t, rows, ep, 1, cp)[0].scale:  # no storage ep changes (grouped experts): ep 1's walk
            ep = 1
        key = ("traced", t, rows, cp, ep)
        hit = self._split_cache.get(key)
        if hit is None:
            values = self._values(rows, cp)
            div = self.rank_mem_div(t, rows, ep, cp)
            tr: list = []
            live = liveness(self.gc, values, param_grad_bytes={}, storage_divisor=div, loss=self.sharding(t).loss,
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
        ep = self._ep_of(c)
        if ep > 1:
            param_grad = self.ep_param_grad(c.tp, ep, param_grad)
        return self.grad_profile(c.tp, rows, c.cp, ep).peak(np.where(keyed, param_grad, 0.0), c.micro > 1)

    def rank_recompute(self, c: Candidate, rows: int, units: tuple[tuple[str, str], ...], param_grad: np.ndarray):
        """(peak, recompute seconds per micro-batch) of a one-stage candidate whose `units` ((name,
        mode) pairs, `search.plan_selective`) are recomputed: `cost.timeline` over the checkpointed
        regions, the walk estimate makes."""
        key = ("rank_rc", c.tp, rows, c.cp, units, c.micro > 1, c.zero, c.replicas, c.ep)
        hit = self._split_cache.get(key)
        if hit is None:
            if self._ep_of(c) > 1:
                param_grad = self.ep_param_grad(c.tp, c.ep, param_grad)
            pg = {p.key: float(g) for p, g in zip(self.gc.params, param_grad) if p.key is not None and p.requires_grad}
            regions = self._split_cache.get(("regions", units))
            if regions is None:  # the same blocks recomputed at other sizes: one set of regions
                save = {n: selective_keys(self, n) for n, mode in units if mode == "selective"}
                regions = self._split_cache[("regions", units)] = regions_for(self.gc, dict(units), save)
            live = timeline(self.gc, regions, self._values(rows, c.cp),
                            hardware=self.hw, param_grad_bytes=pg, grads_preallocated=c.micro > 1,
                            storage_divisor=self.rank_mem_div(c.tp, rows, self._ep_of(c), c.cp), keep_points=False,
                            loss=self.sharding(c.tp).loss,
                            compute_divisor=ep_compute_divisor(self.sharding(c.tp).comp_div, self.ep_rank(
                                c.tp, rows, self._ep_of(c), 1, c.cp)[0].compute if self._ep_of(c) > 1 else {}))
            scale = 1.0 if self.symbolic_batch else rows / (self.captured_rows or rows)
            hit = self._split_cache[key] = (float(live.peak) * scale, float(live.recompute_s) * scale)
        return hit
