"""What a pipeline schedule costs: the engine's schedules, dry-run, and the activations they hold.

The schedules themselves are the runtime's (`runtime.schedules`: `make_schedule` builds a
schedule's per-rank action lists, `simulate` dry-runs them with per-stage forward, backward
and point-to-point times). This file is the cost model's view of them, and the one place
`search/` reads them from (the search never imports the runtime): the schedule vocabulary
(`Kind`, `Schedule`, `SCHEDULES`, `make_schedule`, `simulate`, re-exported) and the memory a
schedule implies, walked along each rank's actions:

  in_flight_per_stage(schedule)   per stage the most micro-batches whose activations it holds
                                  at once (F adds one, its B or W releases it)
  walk_peaks(schedule, held, ...) per rank the most bytes along its actions: the micro-batches
                                  held (F adds one, its B or W releases it) plus the running
                                  micro-batch's own walk peak and the gradients made so far;
                                  under ZB-H1 / ZBV the split backward's I and W as they run
                                  (`cost.split_backward_memory`) (the one walk both
                                  `cost.estimate` and the planner use)
  held_peaks(schedule, act)       per rank the most activation bytes held at once, given each
                                  stage's bytes per micro-batch (`walk_peaks` with no walk)
  small_schedule(name, p, m, v)   `make_schedule`, memoised (the planner asks for the same few
                                  small schedules thousands of times)
  fuse_backward(schedule, stages) what ZB-H1 / ZBV run when `stages` hold checkpoint regions
                                  (one backward each): their I a full B, no W (runtime/pipeline.py);
                                  price and walk that schedule, not the split one

Reads and writes no node.meta. Deterministic; a schedule returned by `small_schedule` is
shared: do not mutate it.
"""
from __future__ import annotations

import functools
from typing import Sequence

from autopar.runtime.schedules import SCHEDULES, Kind, Schedule, fuse_backward, make_schedule, simulate

__all__ = ["Kind", "Schedule", "SCHEDULES", "fuse_backward", "make_schedule", "simulate", "in_flight_per_stage",
           "held_peaks", "small_schedule", "walk_peaks"]


def in_flight_per_stage(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches whose activations it holds at once (F done, its B or
    W not yet), following each rank's action order."""
    peak = [0] * schedule.n_stages
    for acts in schedule.actions:
        held: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                held[a.stage] -= 1
    return peak


def walk_peaks(schedule: Schedule, held: Sequence[float], first: Sequence[float] | None = None,
               later: Sequence[float] | None = None, grads: Sequence[float] | None = None,
               split: Sequence | None = None, recv: Sequence[tuple[float, float]] | None = None,
               fwd: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most bytes along its actions (each schedule's own timeline).

    A micro-batch of stage s holds `held[s]` bytes from its F until its B (zero-bubble
    schedules: its W). F and B: the rank holds the other micro-batches in flight plus the
    running micro-batch's walk peak: `first[s]` until stage s's first backward has run, then
    `later[s]` (its gradients exist from then on: a walk with them preallocated), plus
    `grads[t]` of every other stage t of the rank whose gradients exist.

    Zero-bubble schedules (`split[s]`: the `cost.split_backward_memory.SplitBackward` of a
    stage whose backward is split, with `i_rise`, `pending`, `w_rise`; None for a stage that
    runs its whole backward in W, stage 0): I frees nothing, so it peaks at everything held plus `i_rise[s]`, and leaves
    `pending[s]` (the captured gradients) until the micro-batch's W, which peaks at everything
    held plus `w_rise[s]` and makes the stage's gradients (its first W); the micro-batch is
    released after its W. A stage with `split[s]` None: I is empty, W is a full backward (B).

    `fwd[s]`: the most a micro-batch holds during its F (its forward walk); without it an F is
    charged the micro-batch's whole walk (`first` / `later`).

    `recv[s]` = (bytes of stage s's inputs, bytes of its outputs' gradients) as received from
    another rank: the runtime posts the receive of the next action's message before the
    current action computes (`runtime.pipeline`), so every point also holds that buffer.

    Without `first` / `later` / `grads` the peak of a micro-batch is what it holds (`held`):
    the most bytes held at once (`held_peaks`). With one stage per rank and no split this is
    `(k - 1) x held + first` at the first backward, k the micro-batches in flight
    (`in_flight_per_stage`), and `(k' - 1) x held + later` after it.
    """
    first = held if first is None else first
    later = first if later is None else later
    out = []
    for acts in schedule.actions:
        h = best = g_made = 0.0  # g_made: the gradients of the rank's stages that exist
        made: set[int] = set()
        for k, a in enumerate(acts):
            s, kind = a.stage, a.kind
            own = held[s]
            sp = split[s] if split is not None else None
            walk = later[s] if s in made else first[s]
            g_other = g_made - (grads[s] if grads is not None and s in made else 0.0)
            if kind is Kind.F:
                point = h + fwd[s] + g_made if fwd is not None else h + walk + g_other
                h += own
            elif sp is not None and kind is Kind.I:
                point = h + sp.i_rise + g_made
                h += sp.pending
            elif sp is not None and kind is Kind.W:
                if s not in made:
                    made.add(s)
                    g_made += grads[s] if grads is not None else 0.0
                point = h + sp.w_rise + g_made
                h -= sp.pending + own
            elif kind is Kind.I:  # a stage whose inputs need no gradient: W is its whole backward
                point = h + g_made
            else:  # B, or the W of such a stage: its walk replaces the running micro-batch's bytes
                point = h - own + walk + g_other
                if s not in made:
                    made.add(s)
                    g_made += grads[s] if grads is not None else 0.0
                h -= own
            if recv is not None and k + 1 < len(acts):
                point += _ahead(schedule, acts[k + 1], recv)
            if point > best:
                best = point
        out.append(best)
    return out


def _ahead(schedule: Schedule, nxt, recv: Sequence[tuple[float, float]]) -> float:
    """Bytes of the receive buffer that action `nxt` consumes, when it comes from another rank."""
    s, r = nxt.stage, schedule.stage_to_rank[nxt.stage]
    if nxt.kind is Kind.F and s > 0 and schedule.stage_to_rank[s - 1] != r:
        return recv[s][0]
    if nxt.kind in (Kind.B, Kind.I) and s + 1 < schedule.n_stages and schedule.stage_to_rank[s + 1] != r:
        return recv[s][1]
    return 0.0


def held_peaks(schedule: Schedule, act_s: Sequence[float]) -> list[float]:
    """Per rank, the most activation bytes held along its actions (F adds its stage's
    `act_s[stage]`, B or W releases them): `walk_peaks` with no walk of its own."""
    return walk_peaks(schedule, act_s)


@functools.lru_cache(maxsize=256)
def small_schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """`make_schedule(name, p, m, v)` (v = 1: no virtual stages), memoised."""
    return make_schedule(name, p, m, v if v > 1 else None)
