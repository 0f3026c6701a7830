"""What a pipeline schedule costs: the engine's schedules, dry-run, and the activations they hold.

The schedules themselves are the runtime's (`runtime.schedules`: `make_schedule` builds a
schedule's per-rank action lists, `simulate` dry-runs them with per-stage forward, backward
and point-to-point times). This file is the cost model's view of them, and the one place
`search/` reads them from (the search never imports the runtime): the schedule vocabulary
(`Kind`, `Schedule`, `SCHEDULES`, `make_schedule`, `simulate`, re-exported) and the memory a
schedule implies, walked along each rank's actions:

  in_flight_per_stage(schedule)   per stage the most micro-batches whose activations it holds
                                  at once (F adds one, its B or W releases it)
  held_peaks(schedule, act)       per rank the most activation bytes held at once, given each
                                  stage's bytes per micro-batch
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
           "small_schedule"]


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


def held_peaks(schedule: Schedule, act_s: Sequence[float]) -> list[float]:
    """Per rank, the most activation bytes held along its actions (F adds its stage's
    `act_s[stage]`, B or W releases them)."""
    out = []
    for acts in schedule.actions:
        held = best = 0.0
        for a in acts:
            if a.kind is Kind.F:
                held += act_s[a.stage]
                if held > best:
                    best = held
            elif a.kind is Kind.B or a.kind is Kind.W:
                held -= act_s[a.stage]
        out.append(best)
    return out


@functools.lru_cache(maxsize=256)
def small_schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """`make_schedule(name, p, m, v)` (v = 1: no virtual stages), memoised."""
    return make_schedule(name, p, m, v if v > 1 else None)
