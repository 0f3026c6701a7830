"""ZeRO's communication as the runtime runs it: gradient buckets and ZeRO-3 units, over time.

  grad_buckets(params, bucket_mb, local)   the gradient buckets `runtime.zero_shard.make_buckets`
                                           forms: reverse registration order, the first at most
                                           min(FIRST_BUCKET_MB, bucket_mb), then bucket_mb, a
                                           new one at a dtype change
  bucket_caps(bucket_mb)                   those two caps in bytes
  zero3_units(names)                       parameter -> ZeRO-3 unit, as
                                           `runtime.zero_stage3.default_units` gives it
  zero3_timeline(...)                      ZeRO-3 on one rank's forward and backward: each unit
                                           all-gathered when first read (prefetched one unit
                                           ahead), re-gathered in backward where autograd saved
                                           one of its parameters, its gradients reduce-
                                           scattered after its backward; the exposed time,
                                           the compute slowed by contention under the
                                           collectives in flight (`overlap`)

`estimate.estimate` and the planner's tables (`search.plan_tables`) cost data parallelism with
these. Reads no node.meta. Deterministic.
"""
from __future__ import annotations

import bisect
from typing import Mapping

from autopar.runtime.zero_shard import FIRST_BUCKET_MB, group_in_buckets

from .graph import GraphCost, ParamInfo
from .overlap import CommStream

__all__ = ["FIRST_BUCKET_MB", "bucket_caps", "grad_buckets", "zero3_units", "zero3_timeline"]


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


def zero3_timeline(gc: GraphCost, fwd_t, bwd_t, al, algorithm, dp, grad_item, padded, add_comm, layer_comm):
    """ZeRO-3 (see the module docstring): gather events in forward order, each followed by its
    segment of nodes; backward walks the events in reverse, re-gathering before a segment whose
    nodes saved parameters of its unit and reduce-scattering after it; the compute slowed by
    the link's contention while a collective is in flight (`overlap.CommStream`). Returns (fwd
    exposed, bwd exposed, comm time, transient bytes, compute slowdown): the exposed times are
    what the communication adds to the step, the slowdown included."""
    n_nodes = len(gc.nodes)
    params = [p for p in gc.params if not p.is_buffer]
    unit = zero3_units([p.name for p in gc.params])
    by_unit: dict[str, list[ParamInfo]] = {}
    for p in params:
        by_unit.setdefault(unit[p.name], []).append(p)
    gather = {u: float(sum(padded[p.name] * p.dtype.itemsize for p in ps)) for u, ps in by_unit.items()}
    trainable_units = {u for u, ps in by_unit.items() if any(p.requires_grad for p in ps)}
    rs = {u: float(dp * sum(padded[p.name] for p in ps) * grad_item[next(p.name for p in ps if p.requires_grad)])
          for u, ps in by_unit.items() if u in trainable_units}

    # gather events: (first node of the segment, unit), a new one whenever the unit changes
    events: list[tuple[int, str]] = []
    for p in sorted((p for p in params if p.first_use < n_nodes), key=lambda p: p.first_use):
        if not events or events[-1][1] != unit[p.name]:
            events.append((p.first_use, unit[p.name]))
    bounds = [e[0] for e in events] + [n_nodes]
    seg_fwd = [sum(fwd_t[i] for i in range(bounds[k], bounds[k + 1])) for k in range(len(events))]
    seg_bwd = [sum(bwd_t[i] for i in range(bounds[k], bounds[k + 1])) for k in range(len(events))]
    pre_fwd = sum(fwd_t[i] for i in range(bounds[0])) if events else sum(fwd_t)
    pre_bwd = sum(bwd_t[i] for i in range(bounds[0])) if events else sum(bwd_t)
    # which events' gathered tensors autograd saved: a node saving a parameter saves the
    # tensor of the latest gather of its unit at or before that node
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
    layer_of = [gc.nodes[start].layer for start, _u in events]
    total = slowed = 0.0
    stream = CommStream(al.contention)  # the compute slowed by (1 + k) while a collective is in flight

    def gather_at(k: int, issue: float, phase: str) -> float:
        nonlocal total
        u = events[k][1]
        d = al.time("all_gather", gather[u], algorithm)
        total += d
        add_comm("all_gather", al.axis, phase, gather[u], d, 0.0)
        layer_comm[layer_of[k]] = layer_comm.get(layer_of[k], 0.0) + d
        return stream.issue(issue, d)

    def run(t: float, work: float) -> float:
        nonlocal slowed
        if stream.k <= 0:
            return t + work
        end = stream.run(t, work)
        slowed += end - t - work
        return end

    # forward: gather k is issued once segment k-1 started (prefetch), segment k waits for it
    E = len(events)
    ends = [0.0] * E
    if E:
        ends[0] = gather_at(0, 0.0, "forward")
    t = run(0.0, pre_fwd)
    for k in range(E):
        t = max(t, ends[k])
        if k + 1 < E:
            ends[k + 1] = gather_at(k + 1, t, "forward")
        t = run(t, seg_fwd[k])
    fwd_exp = t - pre_fwd - sum(seg_fwd)
    # backward, in reverse: re-gather before a segment that needs it (issued when the segment
    # after it starts, queued behind that segment's reduce-scatter), reduce-scatter after it
    t = 0.0
    stream = CommStream(al.contention)  # backward on a clock of its own, from 0
    if E and saved_in[E - 1]:
        ends[E - 1] = gather_at(E - 1, 0.0, "backward")
    for k in reversed(range(E)):
        if saved_in[k]:
            t = max(t, ends[k])
        start = t
        u = events[k][1]
        early = k > 0 and saved_in[k - 1] and u not in trainable_units
        if early:  # nothing queued before it: it overlaps this segment
            ends[k - 1] = gather_at(k - 1, start, "backward")
        t = run(t, seg_bwd[k])
        if u in trainable_units:
            d = al.time("reduce_scatter", rs[u], algorithm)
            stream.issue(t, d)
            total += d
            add_comm("reduce_scatter", al.axis, "backward", rs[u], d, 0.0)
            layer_comm[layer_of[k]] = layer_comm.get(layer_of[k], 0.0) + d
        if k > 0 and saved_in[k - 1] and not early:
            ends[k - 1] = gather_at(k - 1, start, "backward")
    t = run(t, pre_bwd)
    bwd_exp = max(t, stream.free) - pre_bwd - sum(seg_bwd)
    transient = 2 * dp * max(gather.values(), default=0.0)  # the gathered unit and the prefetched one
    return fwd_exp, bwd_exp, total, transient, slowed
