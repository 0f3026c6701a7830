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
                                  micro-batch's own walk peak and the gradients made so far
                                  (the one walk both `cost.estimate` and the planner use)
  held_peaks(schedule, act)       per rank the most activation bytes held at once, given each
                                  stage's bytes per micro-batch (`walk_peaks` with no walk)
  small_schedule(name, p, m, v)   `make_schedule`, memoised (the planner asks for the same few
                                  small schedules thousands of times)

Reads and writes no node.meta. Deterministic; a schedule returned by `small_schedule` is
shared: do not mutate it.
"""
from __future__ import annotations

import functools
from typing import Sequence

from autopar.runtime.schedules import SCHEDULES, Kind, Schedule, make_schedule, simulate

__all__ = ["Kind", "Schedule", "SCHEDULES", "make_schedule", "simulate", "in_flight_per_stage", "held_peaks",
           "small_schedule", "walk_peaks"]


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
               pending: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most bytes along its actions (each schedule's own timeline).

    A micro-batch of stage s holds `held[s]` bytes from its F until its B (zero-bubble
    schedules: its W, the weight gradients read the saved inputs). At every action of stage s
    the rank holds the other micro-batches in flight, plus the running micro-batch's walk peak:
    `first[s]` until stage s's first backward (I or B) has run, then `later[s]` (its gradients
    exist from then on: a walk with them preallocated), plus `grads[t]` of every other stage t
    of the rank whose first backward has run. Under the zero-bubble schedules a micro-batch
    also holds `pending[s]` from its I until its W (the gradients captured for the weights,
    `runtime.pipeline_split`). Without `first` / `later` / `grads` the peak of a micro-batch is
    what it holds (`held`): the most bytes held at once (`held_peaks`).

    With one stage per rank this is `(k - 1) x held + first` at the first backward, k the
    micro-batches in flight (`in_flight_per_stage`), and `(k' - 1) x held + later` after it.
    """
    first = held if first is None else first
    later = first if later is None else later
    out = []
    for acts in schedule.actions:
        h = best = g_other = 0.0
        made: set[int] = set()
        for a in acts:
            s, kind = a.stage, a.kind
            own = held[s]
            if kind is Kind.F:
                walk = later[s] if s in made else first[s]
                point = h + walk
                h += own
            else:  # the running micro-batch's bytes are in h already: its walk replaces them
                walk = later[s] if s in made else first[s]
                point = h - own + walk
                if pending is not None:
                    if kind is Kind.I:
                        h += pending[s]
                    elif kind is Kind.W:
                        point -= pending[s]
                        h -= pending[s]
                if s not in made and (kind is Kind.B or kind is Kind.I):
                    made.add(s)
                    if grads is not None:
                        g_other += grads[s]
                if kind is Kind.B or kind is Kind.W:
                    h -= own
            if grads is not None and g_other:
                point += g_other - (grads[s] if s in made else 0.0)
            if point > best:
                best = point
        out.append(best)
    return out


def held_peaks(schedule: Schedule, act_s: Sequence[float]) -> list[float]:
    """Per rank, the most activation bytes held along its actions (F adds its stage's
    `act_s[stage]`, B or W releases them): `walk_peaks` with no walk of its own."""
    return walk_peaks(schedule, act_s)


@functools.lru_cache(maxsize=256)
def small_schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """`make_schedule(name, p, m, v)` (v = 1: no virtual stages), memoised."""
    return make_schedule(name, p, m, v if v > 1 else None)
