"""ZeRO's communication as the runtime runs it: gradient buckets and ZeRO-3 units, over time.

  grad_buckets(params, bucket_mb, local)   the gradient buckets `runtime.zero_shard.make_buckets`
                                           forms: reverse registration order, the first at most
                                           min(FIRST_BUCKET_MB, bucket_mb), then bucket_mb, a
                                           new one at a dtype change
  bucket_caps(bucket_mb)                   those two caps in bytes
  zero3_units(names)                       parameter -> ZeRO-3 unit, as
                                           `runtime.zero_stage3.default_units` gives it
  bucket_overlap(ready, durations, ...)    the last micro-batch's backward beside the bucket
                                           stream: what the buckets leave exposed, the
                                           compute slowed by contention (`overlap`)
  zero3_events(gc), zero3_payloads(...)    ZeRO-3 on one rank's graph: each unit all-gathered
                                           when first read, re-gathered in backward where
                                           autograd saved one of its parameters; per unit the
                                           gather and reduce-scatter payloads
  zero3_walk(...)                          one micro-batch under ZeRO 3: gathers prefetched one
                                           unit ahead, re-gathers, reduce-scatters after each
                                           unit's backward (none under no_sync: the runtime
                                           reduces only in the step's last micro-batch,
                                           `runtime.program`); the exposed time, the compute
                                           slowed by contention under the collectives in flight

`estimate.estimate` and the planner (`search.plan_tables`, `search.plan_comm`) cost data parallelism
with these: one implementation of each term. Reads no node.meta. Deterministic.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping

from autopar.runtime.zero_shard import FIRST_BUCKET_MB, group_in_buckets

from .graph import GraphCost, ParamInfo
from .overlap import CommStream

__all__ = ["FIRST_BUCKET_MB", "Zero3Events", "Zero3Walk", "bucket_caps", "bucket_overlap", "grad_buckets",
           "zero3_events", "zero3_payloads", "zero3_units", "zero3_walk"]


def bucket_caps(bucket_mb: float) -> tuple[float, float]:
    """Bytes the first gradient bucket and every later one hold at most."""
    return min(FIRST_BUCKET_MB, bucket_mb) * 2**20, bucket_mb * 2**20


def grad_buckets(params: list[ParamInfo], bucket_mb: float, local: Mapping[str, int]) -> list[list[ParamInfo]]:
    """Gradient buckets as the runtime forms them (runtime.zero_shard.group_in_buckets): reverse
    registration order; the first bucket holds at most min(FIRST_BUCKET_MB, bucket_mb), later
    ones bucket_mb (sizes in the parameters' own bytes); a new bucket at a dtype change."""
    return group_in_buckets(params, bucket_mb, lambda p: local[p.name] * p.dtype.itemsize, lambda p: p.dtype)


def zero3_units(names: list[str]) -> dict[str, str]:
    """Parameter name -> the ZeRO-3 unit (module-path prefix, "" for the root) that
    `runtime.zero_stage3.default_units` gives it, read from the names: one unit per top-level
    child, split per element when the child's children are all numbered (ModuleList-like);
    parameters of the root module itself form the root unit."""
    kids: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        if len(parts) > 2:
            kids.setdefault(parts[0], []).append(parts[1])
        elif len(parts) == 2:
            kids.setdefault(parts[0], []).append("")  # a parameter of the child itself
    out = {}
    for n in names:
        parts = n.split(".")
        if len(parts) == 1:
            out[n] = ""
        elif len(parts) > 2 and all(k.isdigit() for k in kids[parts[0]]):
            out[n] = f"{parts[0]}.{parts[1]}"
        else:
            out[n] = parts[0]
    return out


def bucket_overlap(ready: list[float], durations: list[float], bwd_total: float, k: float) -> tuple[float, float]:
    """The last micro-batch's backward beside the gradient-bucket stream (ZeRO 0-2): bucket i
    is issued once the backward's work reaches `ready[i]` (seconds of full-speed work, in
    bucket order; one ready earlier waits behind the previous one anyway) and takes
    `durations[i]`; the compute is slowed by (1 + k) while a bucket is in flight
    (`overlap.CommStream`). Returns (exposed, contention): what the synchronisation adds to
    the backward's `bwd_total` seconds (the slowdown included), and the slowdown alone.
    `estimate` and the planner (`search.plan_rank.RankTables.rank_sync`) both price buckets here."""
    stream = CommStream(k)
    t_c = w_c = 0.0  # the compute's wall time and the backward work done by then
    for when, d in zip(ready, durations):
        if when > w_c:
            t_c = stream.run(t_c, when - w_c) if stream.k > 0 else when
            w_c = when
        stream.issue(t_c, d)
    t_end = stream.run(t_c, bwd_total - w_c) if stream.k > 0 else bwd_total
    contention = t_end - bwd_total
    return max(0.0, stream.free - t_end) + contention, contention


@dataclass
class Zero3Events:
    """ZeRO 3's gathers along one rank's graph (`zero3_events`): event k gathers `units[k]`
    before node `starts[k]` and covers the nodes up to the next event's start; `saved[k]`:
    autograd saved one of the gathered tensors (backward re-gathers the unit)."""

    starts: list[int]
    units: list[str]
    saved: list[bool]
    layers: list[str]
    n_nodes: int

    def segments(self, fwd_t, bwd_t) -> tuple[list[float], list[float], float, float]:
        """Per event its nodes' forward and backward seconds (`fwd_t`, `bwd_t`: per node, in
        graph order), and the seconds of the nodes before the first event."""
        bounds = self.starts + [self.n_nodes]
        seg_f = [float(sum(fwd_t[bounds[k]:bounds[k + 1]])) for k in range(len(self.starts))]
        seg_b = [float(sum(bwd_t[bounds[k]:bounds[k + 1]])) for k in range(len(self.starts))]
        first = self.starts[0] if self.starts else self.n_nodes
        return seg_f, seg_b, float(sum(fwd_t[:first])), float(sum(bwd_t[:first]))


def zero3_events(gc: GraphCost) -> Zero3Events:
    """The gather events of ZeRO 3 on `gc` (see the module docstring): a new event whenever the
    unit of the next parameter read (each read just before its first use) changes; an event is
    `saved` when a node with a backward saves a parameter of its unit read at or after it."""
    n_nodes = len(gc.nodes)
    params = [p for p in gc.params if not p.is_buffer]
    unit = zero3_units([p.name for p in gc.params])
    events: list[tuple[int, str]] = []
    for p in sorted((p for p in params if p.first_use < n_nodes), key=lambda p: p.first_use):
        if not events or events[-1][1] != unit[p.name]:
            events.append((p.first_use, unit[p.name]))
    key_of = {p.key: p for p in params if p.key is not None}
    starts_of: dict[str, list[tuple[int, int]]] = {}  # unit -> [(first node, event index)] in order
    for k, (start, u) in enumerate(events):
        starts_of.setdefault(u, []).append((start, k))
    saved_in = [False] * len(events)
    for n in gc.nodes:
        if not n.has_grad_fn:
            continue
        for key, _nb, _tag in n.saved:
            p = key_of.get(key)
            if p is None or unit[p.name] not in starts_of:
                continue
            seq = starts_of[unit[p.name]]
            j = bisect.bisect_right(seq, (n.index, len(events))) - 1
            if j >= 0:
                saved_in[seq[j][1]] = True
    return Zero3Events([e[0] for e in events], [e[1] for e in events], saved_in,
                       [gc.nodes[start].layer for start, _u in events], n_nodes)


def zero3_payloads(params: list[ParamInfo], dp: int, padded: Mapping[str, int],
                   grad_item: Mapping[str, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Per ZeRO-3 unit: the all-gather payload (this rank's padded rows, in the parameters'
    dtype) and, for a unit with a trainable parameter, the reduce-scatter payload (every rank's
    padded rows at the communicated gradient itemsize)."""
    unit = zero3_units([p.name for p in params])
    by_unit: dict[str, list[ParamInfo]] = {}
    for p in params:
        if not p.is_buffer:
            by_unit.setdefault(unit[p.name], []).append(p)
    gather = {u: float(sum(padded[p.name] * p.dtype.itemsize for p in ps)) for u, ps in by_unit.items()}
    rs = {u: float(dp * sum(padded[p.name] for p in ps) * grad_item[next(p.name for p in ps if p.requires_grad)])
          for u, ps in by_unit.items() if any(p.requires_grad for p in ps)}
    return gather, rs


@dataclass
class Zero3Walk:
    """One micro-batch under ZeRO 3 (`zero3_walk`): seconds the communication adds to its forward,
    to its backward when it reduce-scatters (the step's last micro-batch), and to its backward
    under no_sync (earlier micro-batches: re-gathers only); the slowdown parts of those three;
    and the collectives it issues as (op, phase, payload, seconds, event) in issue order, the
    no_sync backward's apart."""

    fwd: float
    bwd: float
    bwd_accum: float
    slowed: tuple[float, float, float]
    calls: list[tuple[str, str, float, float, int]]
    calls_accum: list[tuple[str, str, float, float, int]]


def zero3_walk(ev: Zero3Events, seg_f, seg_b, pre_f: float, pre_b: float, gather: Mapping[str, float],
               rs: Mapping[str, float], time_of, k: float) -> Zero3Walk:
    """ZeRO 3 on one micro-batch (see the module docstring): forward, gather k issued once
    segment k-1 started (prefetch one ahead), segment k waits for it; backward, in reverse, a
    re-gather before a segment that saved its unit's tensors (issued when the segment after it
    starts, queued behind that segment's reduce-scatter), the unit's reduce-scatter after it
    (none under no_sync). `time_of(op, payload)`: a collective's seconds on the data axis; `k`:
    its link's contention. `estimate` and the planner (`search.plan_rank`) both
    walk ZeRO 3 here."""
    E = len(ev.starts)

    def walk(phase: str, sync: bool) -> tuple[float, float, list]:
        stream = CommStream(k)
        calls: list = []
        slowed = 0.0

        def gather_at(i: int, issue: float) -> float:
            u = ev.units[i]
            d = time_of("all_gather", gather[u])
            calls.append(("all_gather", phase, gather[u], d, i))
            return stream.issue(issue, d)

        def run(t: float, work: float) -> float:
            nonlocal slowed
            if stream.k <= 0:
                return t + work
            end = stream.run(t, work)
            slowed += end - t - work
            return end

        ends = [0.0] * E
        if phase == "forward":
            if E:
                ends[0] = gather_at(0, 0.0)
            t = run(0.0, pre_f)
            for i in range(E):
                t = max(t, ends[i])
                if i + 1 < E:
                    ends[i + 1] = gather_at(i + 1, t)
                t = run(t, seg_f[i])
            return t - pre_f - sum(seg_f), slowed, calls
        t = 0.0
        if E and ev.saved[E - 1]:
            ends[E - 1] = gather_at(E - 1, 0.0)
        for i in reversed(range(E)):
            if ev.saved[i]:
                t = max(t, ends[i])
            start = t
            u = ev.units[i]
            reduces = sync and u in rs
            early = i > 0 and ev.saved[i - 1] and not reduces
            if early:  # nothing queued before it: it overlaps this segment
                ends[i - 1] = gather_at(i - 1, start)
            t = run(t, seg_b[i])
            if reduces:
                d = time_of("reduce_scatter", rs[u])
                stream.issue(t, d)
                calls.append(("reduce_scatter", phase, rs[u], d, i))
            if i > 0 and ev.saved[i - 1] and not early:
                ends[i - 1] = gather_at(i - 1, start)
        t = run(t, pre_b)
        return max(t, stream.free) - pre_b - sum(seg_b), slowed, calls

    f, sf, cf = walk("forward", True)
    b, sb, cb = walk("backward", True)
    ba, sa, ca = walk("backward", False)
    return Zero3Walk(f, b, ba, (sf, sb, sa), cf + cb, cf + ca)
