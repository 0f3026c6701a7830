"""The data-parallel communication terms of the joint planner's cost model (`search.plan_cost`)
for pipeline plans, per pipeline unit (one-stage plans take `search.plan_rank`'s, which are
`cost.estimate`'s).

`dp_sync`: a rank's gradient synchronisation after its last backward (ZeRO 0/1 all-reduce, 2
reduce-scatter, in buckets as the runtime forms them, each once its gradients are ready;
ZeRO 1/2's parameter all-gather after the step); `zero3_exposed`: ZeRO 3's gathers and
reduce-scatters not hidden behind the unit computation; `buckets`: per-unit gradients in
buckets of the runtime's sizes. With context parallelism the link is the joined dp+cp axis'
(`search.plan_context`), where gradients and ZeRO shards live. Overlap is not free: the compute
beside a collective in flight runs (1 + k) times slower, k the link's contention
(`cost.overlap`, as `cost.estimate` applies it), and the exposed terms include that slowdown.

Pure functions of the tables' arrays: no node.meta. Deterministic.
"""
from __future__ import annotations

import numpy as np

from autopar.cost.overlap import CommStream, contention_of, overlap_extra
from autopar.search.candidate import Candidate
from autopar.search.plan_tables import UnitStates

__all__ = ["buckets", "dp_sync", "zero3_exposed"]


def dp_sync(mine, starts, ends, B_s, B_u, end_r: float, st: UnitStates, dp_link, z: int, c: Candidate,
            bucket_bytes: tuple[float, float]) -> tuple[float, float, float, float]:
    """(exposed, after the step, time, bytes sent) of a rank's data-parallel gradient sync (its
    stages `mine`, its last backward ending at `end_r`), on the dp (with cp: dp+cp) link:
    buckets as the runtime forms them (reverse order, the first at most FIRST_BUCKET_MB,
    then bucket_mb), each synchronised once its last gradient is ready, one after another;
    ZeRO 1/2's parameter all-gather after the step. ZeRO 3's comm is in the unit times."""
    if c.replicas < 2 or dp_link is None:
        return 0.0, 0.0, 0.0, 0.0
    if z == 3:
        t = b = 0.0
        for s in mine:
            for x in range(starts[s], ends[s]):
                if st.gather[x] > 0:
                    t += c.micro * (2 * dp_link.time("all_gather", float(st.gather[x]))
                                    + dp_link.time("reduce_scatter", float(st.grad_payload[x])))
                    b += c.micro * (2 * dp_link.bytes_sent("all_gather", float(st.gather[x]))
                                    + dp_link.bytes_sent("reduce_scatter", float(st.grad_payload[x])))
        return 0.0, 0.0, t, b
    op = "all_reduce" if z < 2 else "reduce_scatter"
    last = min(mine)  # the rank's stage whose backward ends last (the lowest)
    t0 = end_r - B_s[last]
    ready_at: list[tuple[float, float, float]] = []
    for s in sorted(mine, reverse=True):
        if s != last:  # earlier virtual stages: ready when the last one's backward starts
            for x in range(ends[s] - 1, starts[s] - 1, -1):
                ready_at.append((t0, float(st.grad_payload[x]), float(st.gather[x])))
    ready = t0
    for x in range(ends[last] - 1, starts[last] - 1, -1):
        ready += B_u[x]
        ready_at.append((ready, float(st.grad_payload[x]), float(st.gather[x])))
    # the backward beside the reduction stream, slowed by the link's contention while a bucket
    # is in flight (`cost.overlap.CommStream`); `when` is a point of the backward's work
    stream = CommStream(contention_of(dp_link), free=t0)
    t_c = w_c = t0  # the compute's wall time, and the work done by then (as a full-speed time)
    after, t_all, b_all = 0.0, 0.0, 0.0
    for when, payload, gpay, n in buckets(ready_at, bucket_bytes):
        if when > w_c:
            t_c = stream.run(t_c, when - w_c) if stream.k > 0 else when
            w_c = when
        d = dp_link.time(op, payload)
        stream.issue(t_c, n * d)  # n equal buckets ready together go one after another
        t_all += n * d
        b_all += n * dp_link.bytes_sent(op, payload)
        if z >= 1 and gpay > 0:
            g = n * dp_link.time("all_gather", gpay)
            after += g
            t_all += g
            b_all += n * dp_link.bytes_sent("all_gather", gpay)
    end_c = stream.run(t_c, end_r - w_c) if stream.k > 0 else end_r  # the backward's end, slowed
    return max(0.0, stream.free - end_c) + (end_c - end_r), after, t_all, b_all


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


def buckets(ready: list[tuple[float, float, float]], caps: tuple[float, float]):
    """Per-unit gradients (ready, sync, gather payloads) in buckets of caps[0] bytes, then caps[1];
    yields (ready, payload, gather payload, count): `count` equal buckets in a row, as one run."""
    cap = caps[0]
    cur_t, cur_p, cur_g = 0.0, 0.0, 0.0
    for when, p, g in ready:
        if p <= 0:
            continue
        while p > 0:
            if cur_p == 0 and cap == caps[1] and p >= 2 * cap:  # whole buckets of this unit, as one run
                n = int(p // cap) - 1  # the last whole one goes through the general path below
                share = g * (cap / p)
                yield when, cap, share, n
                p -= n * cap
                g -= n * share
                continue
            room = cap - cur_p
            take = min(p, room) if cur_p > 0 or p <= cap else cap
            frac = take / p
            cur_p += take
            cur_g += g * frac
            cur_t = when
            p -= take
            g -= g * frac
            if cur_p >= cap * (1 - 1e-12):
                yield cur_t, cur_p, cur_g, 1
                cur_p = cur_g = 0.0
                cap = caps[1]
    if cur_p > 0:
        yield cur_t, cur_p, cur_g, 1
