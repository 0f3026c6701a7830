"""Compute overlapped with communication, under contention: how long both take together.

On a GPU a collective is a kernel too: NCCL's kernels take SMs and memory bandwidth while they
run, so compute overlapped with them runs slower (Lee et al. 2025, "Characterizing Compute-
Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114,
https://arxiv.org/abs/2507.03114: GPT and Llama layers on 4 A100 / H100 / MI250 / MI210,
compute 18.9 % slower on average while overlapped, 40.0 % at most). A profile states that
slowdown as `contention` k per kind of link (`Hardware.contention_for`, carried by
`comm.AxisLink.contention`); the model here is a fluid one: while a collective is in flight,
compute progresses at 1 / (1 + k) of its full rate; outside, at its full rate. Communication
itself is taken as not slowed by the compute.

  overlap_extra(work, busy, k)   compute of `work` seconds (full speed) beside a collective of
                                 `busy` seconds started with it: the time both take beyond
                                 `work`, max(busy - work, busy k / (1 + k)): exposed = busy -
                                 work (1 + k) when the slowed compute is shorter, else only
                                 the slowdown of the compute the collective overlapped
  slowdown(work, busy, k)        the compute's own stretch, k min(work, busy / (1 + k)) (the
                                 collective does not block it: pipeline point-to-point)
  CommStream                     one communication stream beside one compute stream: `issue`
                                 queues a collective (FIFO, from a ready time), `run` advances
                                 the compute by some work from a wall time, slowed wherever
                                 the stream is busy (the bucketed gradient reduction of
                                 `estimate` and `search.plan_comm.dp_sync`, ZeRO-3's timeline
                                 in `zero_comm`)

With k = 0 every function returns what plain overlap gives (max(busy, work), t + work),
computed the same way as before contention existed, so CPU figures do not move.

Reads no node.meta. Pure and deterministic.
"""
from __future__ import annotations

import bisect

__all__ = ["CommStream", "contention_of", "overlap_extra", "slowdown"]


def contention_of(link) -> float:
    """The contention k of a link object: an `AxisLink`'s, or the one a memoising wrapper
    holds (`.al`); 0 for None."""
    if link is None:
        return 0.0
    k = getattr(link, "contention", None)
    if k is None:
        k = getattr(getattr(link, "al", None), "contention", 0.0)
    return float(k or 0.0)


def overlap_extra(work: float, busy: float, k: float) -> float:
    """Seconds that `work` seconds of compute and a `busy`-second collective started together
    take beyond `work`: the collective's exposed part, or the compute's slowdown under it.
    k = 0: max(0, busy - work)."""
    if busy <= 0:
        return 0.0
    if k <= 0:
        return max(0.0, busy - work)
    return max(busy - work, busy * k / (1.0 + k))


def slowdown(work: float, busy: float, k: float) -> float:
    """The stretch of `work` seconds of compute that a `busy`-second transfer overlaps from its
    start (the transfer never blocks the compute): k x the work done while it runs."""
    if k <= 0 or busy <= 0 or work <= 0:
        return 0.0
    return k * min(work, busy / (1.0 + k))


class CommStream:
    """A communication stream beside a compute stream (see the module docstring). Collectives
    run one after another in the order issued; the compute is slowed by (1 + k) wherever one
    is in flight."""

    def __init__(self, k: float, free: float = 0.0):
        self.k = float(k)
        self.free = free  # when the last collective issued ends
        self._starts: list[float] = []
        self._ends: list[float] = []

    def issue(self, ready: float, d: float) -> float:
        """Queue a collective of `d` seconds that may start at `ready`; returns its end."""
        start = max(ready, self.free)
        self.free = start + d
        if self.k > 0 and d > 0:
            if self._ends and start <= self._ends[-1]:  # back to back: one busy interval
                self._ends[-1] = self.free
            else:
                self._starts.append(start)
                self._ends.append(self.free)
        return self.free

    def run(self, t: float, work: float) -> float:
        """The wall time at which `work` seconds of compute started at `t` ends."""
        if self.k <= 0 or work <= 0:
            return t + work
        i = bisect.bisect_right(self._ends, t)
        slow = 1.0 + self.k
        while i < len(self._ends):
            s, e = self._starts[i], self._ends[i]
            if s > t:  # full speed up to the next busy interval
                if work <= s - t:
                    return t + work
                work -= s - t
                t = s
            cap = (e - t) / slow  # the work done before this interval ends
            if work <= cap:
                return t + work * slow
            work -= cap
            t = e
            i += 1
        return t + work
