"""The data-parallel communication terms of the joint planner's cost model (`search.plan_cost`)
for pipeline plans, per pipeline unit (one-stage plans take `search.plan_rank`'s, which are
`cost.estimate`'s).

`dp_sync`: a rank's gradient synchronisation after its last backward (ZeRO 0/1 all-reduce, 2
reduce-scatter, in buckets as the runtime forms them, each once its gradients are ready;
ZeRO 1/2's parameter all-gather after the step), per unit by `cost.pipeline_time.dp_sync`, the
function `cost.estimate` calls for a pipeline per node; `zero3_exposed`: ZeRO 3's gathers and
reduce-scatters not hidden behind the unit computation; `buckets` (re-exported from
`cost.pipeline_time`): per-unit gradients in buckets of the runtime's sizes. With context parallelism the link is the joined dp+cp axis'
(`search.plan_context`), where gradients and ZeRO shards live. Overlap is not free: the compute
beside a collective in flight runs (1 + k) times slower, k the link's contention
(`cost.overlap`, as `cost.estimate` applies it), and the exposed terms include that slowdown.

Pure functions of the tables' arrays: no node.meta. Deterministic.
"""
from __future__ import annotations

import numpy as np

from autopar.cost.overlap import contention_of, overlap_extra
from autopar.cost.pipeline_time import buckets, dp_sync as pipeline_dp_sync
from autopar.search.candidate import Candidate
from autopar.search.plan_tables import UnitStates

__all__ = ["buckets", "dp_sync", "stage_payloads", "zero3_exposed"]


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


def dp_sync(mine, starts, ends, B_s, B_u, end_r: float, st: UnitStates, dp_link, z: int, c: Candidate,
            bucket_bytes: tuple[float, float], windows=None, payloads=None) -> tuple[float, float, float, float]:
    """(exposed, after the step, time, bytes sent) of a rank's data-parallel gradient sync (its
    stages `mine`, each reduced as its last gradient action, `windows[s]`, makes them; its last
    action ending at `end_r`), on the dp (with cp: dp+cp) link, per pipeline unit:
    `cost.pipeline_time.dp_sync`, the function `cost.estimate` calls per node. `payloads`: the
    split's (`stage_payloads`), or the units' own."""
    pay, gat = payloads if payloads is not None else (st.grad_payload, st.gather)
    return pipeline_dp_sync(mine, starts, ends, B_s, B_u, end_r, pay, gat, dp_link, z, c.replicas,
                            c.micro, bucket_bytes, windows)


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
