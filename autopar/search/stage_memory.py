"""How a pipeline rank's memory is shared among its stages, and the recompute that makes it fit.

`search.plan_cost.PlanCostModel.evaluate` splits a candidate's chain into S = pp x v stages
with a DP whose memory check is per stage (`search.plan_split.SplitChain.split`). With one
stage per rank the stage's memory is the rank's and the check is exact. With v stages per
rank the rank's memory is their states plus the activations its schedule holds at its worst
point, which the DP cannot see; `stage_budgets` gives each stage its share of the rank:

  "walk"  each stage's share of its rank in the time-balanced split (the DP with no memory
          limit: the even split of a uniform model), the rank's total being its states plus the
          most activations its schedule walk holds at once: that split is admitted exactly when
          its ranks fit by the walk. Not sufficient for other splits: the split the DP then
          gives is checked by the walk (`fit_recompute`).
  "sum"   shares that sum to the rank's limit, with every stage holding its most in-flight
          micro-batches at once (the sum of the stages' peaks bounds the walk's): sufficient.

`freed_bytes` is what a stage's recomputed blocks free (a block keeps its input only, and the
stage's first block keeps none of its own: its input is the stage input, counted with the
stage). `fit_recompute` chooses the recompute of every rank against the schedule's walk
(`cost.schedule.held_peaks`), as few blocks as fit, most bytes per second first
(`choose_recompute`), adding blocks until the walk fits or none are left.

node.meta: none. Deterministic. Guarantees: "sum" budgets, when every stage meets its own,
keep each rank within the limit by the sum bound; `fit_recompute` reports fitting only when
the walk, the gradient buffers and the optimizer step's temporaries of every rank fit.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from autopar.cost.schedule import Schedule, held_peaks

__all__ = ["stage_budgets", "fit_recompute", "choose_recompute", "freed_bytes"]


def stage_budgets(chain, k_s: Sequence[float], s2r: Sequence[int], limit: float, fixed: float, mode: str,
                  small: Schedule | None = None, pins: Sequence[int] = ()) -> tuple[list[float], float]:
    """(per-stage memory limits for the split DP, the limit of a stage's optimizer step).

    Args:
        chain: the candidate's `SplitChain`.
        k_s: per stage, the most micro-batches whose activations it holds at once.
        s2r: per stage, its rank.
        limit: bytes per device; `fixed`: what every rank holds on top (working set, buffers).
        mode: "walk" or "sum" (module docstring).
        small: the schedule whose walk gives each rank's activations held at once ("walk").
        pins: unit indices that start a stage (the reference split keeps them).
    """
    S = len(s2r)
    P = max(s2r) + 1
    v = S // P
    if v == 1:
        return [limit] * S, limit
    if mode == "walk":  # shares of the time-balanced split (no memory limit), walked
        ref = chain.split(S, k_s, s2r, math.inf, pins, "time", math.inf) or [round(i * chain.L / S) for i in range(S)]
        ends = list(ref[1:]) + [chain.L]
        st = [chain.states_range(i, j) for i, j in zip(ref, ends)]
        act = [float(chain.PA[j] - chain.PA[i] + chain.cross_in[i]) for i, j in zip(ref, ends)]
        held = held_peaks(small, act)
    else:  # every stage alike, each holding its most micro-batches at once
        st = [chain.states_range(0, chain.L) / S] * S
        act = [float(chain.PA[-1]) / S] * S
        held = [sum(float(k_s[s]) * act[s] for s in range(S) if s2r[s] == r) for r in range(P)]
    out = [0.0] * S
    for r in range(P):
        mine = [s for s in range(S) if s2r[s] == r]
        den = sum(st[s] for s in mine) + held[r]
        for s in mine:
            w = (st[s] + float(k_s[s]) * act[s]) / den if den > 0 else 1.0 / len(mine)
            out[s] = fixed + (limit - fixed) * w
    return out, (limit if mode == "walk" else limit / v)


def fit_recompute(small: Schedule, starts: Sequence[int], ends: Sequence[int], base_st: Sequence[float],
                  base_a: Sequence[float], k_s: Sequence[float], u, blocks: np.ndarray, chain, trans_u: np.ndarray,
                  fixed: float, limit: float, rc_pin, recompute: Any, minimise: str,
                  act_st: Sequence[float] | None = None) -> tuple[set[int], bool]:
    """(units to recompute, whether every rank then fits) for a split with several stages per
    rank: per rank, blocks chosen against its excess over the limit by the schedule's walk,
    each block counted as freeing its bytes times its stage's in-flight micro-batches (at least
    what it frees at the walk's peak), then the walk again, until every rank fits or no block is
    left to recompute. `act_st`: per stage the states held beside its activations (the
    gradients the walk holds in place of the "grads" category; default `base_st`)."""
    S = len(starts)
    s2r = small.stage_to_rank
    P = max(s2r) + 1
    groups = [[s for s in range(S) if s2r[s] == r] for r in range(P)]
    st_r = [sum(base_st[s] for s in g) for g in groups]
    act_r = [sum((base_st if act_st is None else act_st)[s] for s in g) for g in groups]
    other = [max(st_r[r] + sum(float(trans_u[starts[s]:ends[s]].sum()) for s in g),
                 st_r[r] + sum(chain.adam_range(starts[s], ends[s]) for s in g)) for r, g in enumerate(groups)]
    chosen: set[int] = set()
    while True:
        act = [base_a[s] - freed_bytes(u, chosen, starts[s], ends[s]) for s in range(S)]
        held = held_peaks(small, act)
        grew = False
        for r, g in enumerate(groups):
            excess = act_r[r] + held[r] + fixed - limit
            cand = [(x, float(k_s[s])) for s in g for x in range(starts[s], ends[s]) if x not in chosen]
            new = set(choose_recompute(cand, u, blocks, excess, rc_pin, recompute, minimise)) - chosen
            if new:
                chosen |= new
                grew = True
        if not grew:
            fits = all(max(act_r[r] + held[r] + fixed, other[r]) <= limit * (1 + 1e-9) for r in range(P))
            return chosen, fits


def freed_bytes(u, chosen: set[int], i: int, j: int) -> float:
    """Activation bytes per micro-batch that recomputing the units `chosen` frees in the stage of
    units [i, j): each block's saved bytes but its input (`u.rc_save`); the stage's first block
    keeps no input of its own either, since its input is the stage input, counted once with
    the stage."""
    out = sum(float(u.rc_save[x]) for x in chosen if i <= x < j)
    if i > 0 and i in chosen:
        out += min(float(u.cross[i - 1]), float(u.act[i]) - float(u.rc_save[i]))
    return out


def choose_recompute(cands_in: list[tuple[int, float]], u, blocks: np.ndarray, excess: float, rc_pin, recompute: Any,
                     minimise: str) -> list[int]:
    """Units to recompute among `cands_in` ((unit, micro-batches its stage holds at once)):
    pinned ones, then (auto) as few as free `excess` bytes, most bytes per second first;
    every block when minimising memory. `blocks[x] > 0` marks the repeated blocks (the only
    units recomputed whole); `u`: the candidate's `UnitCosts` (rc_save, rc_time)."""
    cands = [(x, k) for x, k in cands_in if blocks[x] > 0 and u.rc_save[x] > 0]
    if recompute == "none":
        return []
    if recompute in ("full", "selective") or minimise == "memory":
        return [x for x, _k in cands]
    chosen = []
    if rc_pin is not None:
        chosen = [x for x, _k in cands if rc_pin.get(x) is True]
        excess -= sum(k * u.rc_save[x] for x, k in cands if rc_pin.get(x) is True)
        cands = [(x, k) for x, k in cands if x not in rc_pin]
    if excess <= 0:
        return chosen
    cands.sort(key=lambda xk: (-(xk[1] * u.rc_save[xk[0]] / max(u.rc_time[xk[0]], 1e-30)), xk[0]))
    for x, k in cands:
        if excess <= 0:
            break
        chosen.append(x)
        excess -= k * u.rc_save[x]
    return sorted(chosen)
