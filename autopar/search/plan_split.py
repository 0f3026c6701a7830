"""How the joint planner's cost model (`search.plan_cost`) cuts a candidate's chain into stages.

`SplitChain` holds prefix sums over one candidate's chain of pipeline units (time, saved
activations and the stage input, the recompute savings and time of whole blocks, model states
with a parameter read on two stages counted on both, gradient buffers, optimizer temporaries)
and splits it into S = pp x v stages: an exact min-max DP over the unit boundaries (vectorised
over (first, last) unit pairs; for long chains in many stages on a band of stage lengths,
certified or redone in full; where pins fix every boundary, that split's stages alone are costed,
the DP's answer without its table), then among the splits within the optimal bottleneck the one with
the least sum of squared stage times, as `search.stages.best_split`. A stage's time includes the
recomputation it needs to fit its memory: whole blocks (`layers.N`) fully recomputed, as few as
fit (the recompute budget per stage; blocks of one range are treated as alike in the DP, which
is exact for a transformer's identical layers; `PlanCostModel.evaluate` then takes the blocks
that free most memory per second of recomputation). With minimise="memory", the split whose
fullest stage needs the least memory.

What the split needs to know of a schedule without building the step's: `in_flight_floor`
(per stage the micro-batches whose activations it holds at once, and its rank: exact for 1F1B
and GPipe, otherwise from the schedule with min(m, 2p) micro-batches, whose warm-up holds as
many; the schedules and their memory walks are `cost.schedule`'s).

node.meta: none (it works on the arrays of `search.plan_tables`). Guarantees: deterministic;
`SplitChain.split` gives the least bottleneck split whose stages fit their limits, or None when
none fits; `in_flight_floor` never exceeds what the schedule holds (tests/unit/test_planner.py
checks it against the schedules).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from autopar.cost.schedule import in_flight_per_stage, small_schedule
from autopar.search.candidate import Candidate
from autopar.search.plan_tables import CATEGORIES, UnitStates

__all__ = ["INF", "SplitChain", "chain_factor", "in_flight_floor"]

INF = math.inf


# ------------------------------------------------------------------------ the split DP
class SplitChain:
    """Prefix sums of one candidate's chain and the vectorised stage DP over it."""

    def __init__(self, F, B, act, cross, hop, rc_save, rc_time, blocks, st: UnitStates, trans, fixed, rc_pin):
        L = len(F)
        self.L = L
        z = np.zeros(1)
        self.PT = np.concatenate([z, np.cumsum(F + B)])
        self.PA = np.concatenate([z, np.cumsum(act)])
        self.PRS = np.concatenate([z, np.cumsum(rc_save)])
        self.PRT = np.concatenate([z, np.cumsum(rc_time)])
        self.PB = np.concatenate([z, np.cumsum(blocks * (rc_save > 0))])
        self.PTR = np.concatenate([z, np.cumsum(trans)])
        self.cat_prefix, self.PS, self.PAD = st.prefix_sums()
        # the states beside activations: during forward and backward a rank holds its parameters'
        # gradients as backward makes them (`param_grad`), not the masters' (made at its end)
        self.PWS = self.PS + np.concatenate([z, np.cumsum(st.walk_grad - st.cat["grads"])])
        self.shared = st.shared
        # parameters no node holds: the whole model's (one stage, units [0, L)), no pipeline stage's
        self.whole = st.whole if st.whole and any(st.whole.values()) else None
        self.cross_in = np.concatenate([[0.0], cross, [0.0]])  # index i: bytes into unit i (i = 0 .. L)
        self.hop = np.concatenate([[0.0], hop, [0.0]])  # index i: p2p at the boundary before unit i
        self.fixed = fixed
        self.rc_pin = rc_pin

    def _rows(self, i: int, j: int) -> list[dict[str, float]]:
        """The parameters kept apart that stage units [i, j) hold: the shared ones with a reader
        there, and `whole` when the stage is the whole model."""
        rows = [row for row, cnt in self.shared if cnt[j] > cnt[i]]
        return rows + [self.whole] if self.whole is not None and i == 0 and j == self.L else rows

    def states_range(self, i: int, j: int) -> float:
        s = self.PS[j] - self.PS[i]
        for row in self._rows(i, j):
            s += sum(row[c] for c in CATEGORIES)
        return float(s)

    def act_states_range(self, i: int, j: int) -> float:
        """`states_range` with the gradients the forward / backward walk holds in place of the
        "grads" category (the masters' gradients are made at the end of backward)."""
        s = self.PWS[j] - self.PWS[i]
        for row in self._rows(i, j):
            s += row["_walk"]
        return float(s)

    def categories(self, i: int, j: int) -> dict[str, float]:
        out = {k: float(p[j] - p[i]) for k, p in self.cat_prefix.items()}
        for row in self._rows(i, j):
            for c in CATEGORIES:
                out[c] += row[c]
        return out

    def adam_range(self, i: int, j: int) -> float:
        s = self.PAD[j] - self.PAD[i]
        for row in self._rows(i, j):
            s += row["_adam"]
        return float(s)

    def _arrays(self, I: np.ndarray, J: np.ndarray) -> dict[str, np.ndarray]:
        """Per-stage quantities of the stages [I, J) (index arrays of one shape, broadcast)."""
        states = self.PS[J] - self.PS[I]
        walk = self.PWS[J] - self.PWS[I]
        adam = self.PAD[J] - self.PAD[I]
        for row, cnt in self.shared:
            has = (cnt[J] - cnt[I]) > 0
            states = states + has * sum(row[c] for c in CATEGORIES)
            walk = walk + has * row["_walk"]
            adam = adam + has * row["_adam"]
        if self.whole is not None:  # one stage over every unit
            has = (I == 0) & (J == self.L)
            states = states + has * sum(self.whole[c] for c in CATEGORIES)
            walk = walk + has * self.whole["_walk"]
            adam = adam + has * self.whole["_adam"]
        return dict(T=self.PT[J] - self.PT[I], A=self.PA[J] - self.PA[I] + self.cross_in[I],
                    RS=self.PRS[J] - self.PRS[I], RT=self.PRT[J] - self.PRT[I], NB=self.PB[J] - self.PB[I],
                    TR=self.PTR[J] - self.PTR[I], states=states, walk_states=walk, adam=adam)

    def _costs(self, mx, valid, S, k_s, s2r, limit, minimise: str, I, J, opt_limit: float) -> list[np.ndarray]:
        """Each stage's cost over the (end, start) pairs: time with the recompute it needs to
        fit its memory limit (`limit[s]`, or one for all; inf where it cannot), or its memory
        after recomputing every block."""
        out = []
        opt_peak = np.maximum(mx["states"] + mx["adam"], mx["states"] + mx["TR"])
        for s in range(S):
            k = float(k_s[s]) if s < len(k_s) else 1.0
            mem0 = mx["walk_states"] + k * mx["A"] + self.fixed
            if minimise == "memory":
                out.append(np.where(valid, np.maximum(mem0 - k * mx["RS"], opt_peak), INF))
                continue
            need = mem0 - (limit[s] if isinstance(limit, (list, tuple, np.ndarray)) else limit)
            with np.errstate(divide="ignore", invalid="ignore"):
                per = np.where(mx["NB"] > 0, k * mx["RS"] / np.maximum(mx["NB"], 1), 0.0)
                n_rc = np.where(need > 0, np.where(per > 0, np.ceil(need / np.where(per > 0, per, 1) - 1e-9), INF), 0.0)
                rc_t = np.where(n_rc > 0, n_rc * mx["RT"] / np.maximum(mx["NB"], 1), 0.0)
            ok = valid & (n_rc <= mx["NB"]) & (opt_peak <= opt_limit)
            t = mx["T"] + rc_t
            if s > 0 and s2r[s - 1] != s2r[s]:
                t = t + self.hop[I]
            if s < S - 1 and s2r[s + 1] != s2r[s]:
                t = t + self.hop[J]
            out.append(np.where(ok, t, INF))
        return out

    def split(self, S: int, k_s, s2r, limit: float | Sequence[float], pins: Sequence[int], minimise: str,
              opt_limit: float | None = None) -> list[int] | None:
        """Stage starts (starts[0] == 0) minimising the bottleneck stage time (then the sum of
        squared stage times), each stage within its `limit` (one per stage, or one for all)
        after its recompute; None if none fits.
        minimise="memory": the split whose fullest stage needs the least memory.

        Long chains cut into many stages are solved on a band of stage lengths (at most
        2 L/S + 3 units) first; that answer is the optimum when no run of more units than the
        band allows is as fast as its bottleneck (a longer stage could not be the bottleneck's
        equal), and otherwise the full DP runs."""
        L = self.L
        cuts = sorted({p for p in pins if p > 0})
        if len(cuts) == S - 1 and S > 1:  # the pins are the split: cost its S stages only, no DP
            return self._pinned(S, k_s, s2r, limit, minimise, [0] + cuts, opt_limit)
        W = 2 * (-(-L // S)) + 3
        if minimise == "time" and not pins and 3 * W < 2 * (L + 1):
            J = np.arange(L + 1)[:, None]
            I = J - np.arange(1, W + 1)[None, :]
            got = self._dp(S, k_s, s2r, limit, minimise, np.maximum(I, 0), J, I >= 0, opt_limit)
            if got is not None:
                starts, opt = got
                longest = float(np.min(self.PT[W + 1:] - self.PT[: L - W]))  # any W+1 consecutive units
                if longest > opt * (1 + 1e-9):
                    return starts
        J = np.arange(L + 1)[:, None]
        I = np.arange(L + 1)[None, :]
        valid = J > I
        if pins:
            cnt = np.zeros(L + 2)
            for p in pins:
                cnt[p + 1:] += 1  # cnt[x] = pins < x
            inner = cnt[np.broadcast_to(J, valid.shape)] - cnt[np.minimum(np.broadcast_to(I, valid.shape) + 1, L + 1)]
            valid &= inner <= 0
        got = self._dp(S, k_s, s2r, limit, minimise, I, J, valid, opt_limit)
        return None if got is None else got[0]

    def _pinned(self, S, k_s, s2r, limit, minimise, starts, opt_limit=None) -> list[int] | None:
        """The one split S - 1 pins allow (a pin at unit 0 constrains nothing): the DP's answer
        when each of its S stages fits, else None, without the (L + 1)^2 table."""
        I = np.array(starts)
        J = np.array(starts[1:] + [self.L])
        mx = self._arrays(I, J)
        costs = self._costs(mx, np.ones(S, dtype=bool), S, k_s, s2r, limit, minimise, I, J,
                            limit if opt_limit is None else opt_limit)
        return starts if all(math.isfinite(costs[s][s]) for s in range(S)) else None

    def _dp(self, S, k_s, s2r, limit, minimise, I, J, valid, opt_limit=None):
        """The two DPs over arrays indexed [end j, option]: the least bottleneck, then among
        splits within it the least sum of squares. Returns (starts, bottleneck) or None."""
        I, J = np.broadcast_arrays(I, J)
        mx = self._arrays(I, J)
        costs = self._costs(mx, valid, S, k_s, s2r, limit, minimise, I, J, limit if opt_limit is None else opt_limit)
        L = self.L
        best = np.full(L + 1, INF)
        best[0] = 0.0
        for s in range(S):
            best = np.maximum(best[I], costs[s]).min(axis=1)
        opt = best[L]
        if not math.isfinite(opt):
            return None
        bound = opt * (1 + 1e-9) + 1e-300
        acc = np.full(L + 1, INF)
        acc[0] = 0.0
        args = []
        for s in range(S):
            c2 = np.where(costs[s] <= bound, costs[s] ** 2 if minimise == "time" else costs[s], INF)
            cand = acc[I] + c2
            pick = cand.argmin(axis=1)
            args.append(I[np.arange(L + 1), pick])
            acc = cand[np.arange(L + 1), pick]
        starts = [0] * S
        j = L
        for s in range(S - 1, -1, -1):
            i = int(args[s][j])
            starts[s] = i
            j = i
        return starts, float(opt)


def in_flight_floor(c: Candidate) -> tuple[Sequence[float], Sequence[int]]:
    """Per stage, how many micro-batches' activations it holds at once (at least: equal in every
    case checked), and its rank, without building the step's schedule: 1F1B runs min(p - s, m)
    forwards on stage s before its first backward, GPipe all m (tests/unit/test_planner.py
    checks these against the schedules)."""
    p, m = c.pp, c.micro
    if c.schedule == "1f1b":
        return [float(min(p - s, m)) for s in range(p)], list(range(p))
    if c.schedule == "gpipe":
        return [float(m)] * p, list(range(p))
    # ZB-H1 (W releases later) and two stages per rank: the peak is reached in the warm-up,
    # whose length does not grow past 2p micro-batches; the schedule with min(m, 2p) of them
    # is small and holds no more
    return _small_in_flight(c.schedule, p, min(m, 2 * p), c.virtual)


@functools.lru_cache(maxsize=256)
def _small_in_flight(name: str, p: int, m: int, v: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    sched = small_schedule(name, p, m, v)
    return tuple(float(k) for k in in_flight_per_stage(sched)), tuple(sched.stage_to_rank)


def chain_factor(m: int, S: int, gamma: float) -> float:
    """c such that c x (sum of stage times) bounds the makespan of any split of a chain into S
    stages on S ranks: stage s cannot finish before the first forward reaches it (at least
    gamma of the earlier stages' time) plus its m micro-batches, so the step is at least
    max_s (gamma x sum_{s'<s} T_s' + m T_s) >= sum_s w_s (...) for weights w >= 0 summing to
    one; choosing w so that every T_s' gets the same coefficient c makes the bound
    independent of the split (m = 1: c = 1 ... for gamma = 1, c = 1 / (1 - ((m-1)/m)^S))."""
    w = [0.0] * S
    acc = 0.0  # sum of w_s for s > s'
    for s in range(S - 1, -1, -1):
        w[s] = (1.0 - gamma * acc) / m
        if w[s] < 0:
            return m / S
        acc += w[s]
    return max(1.0 / acc, m / S)
