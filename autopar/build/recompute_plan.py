"""plan_recompute: what to recompute so that a training step fits a peak-memory budget.

`plan_recompute(gm, budget)` analyses the (local, per-rank, per-stage) graph and builds the
recompute chain model (`search.recompute.build_chain`). By default (method "auto" or
"ladder") it recomputes the shortest prefix of one fixed order of the saveable nodes
(`search.recompute.ladder`: the cheapest seconds per byte freed first, norms and pointwise
activations, then attention, GEMMs last) whose exact memory timeline (`cost.timeline`) fits
the budget: a smaller budget never recomputes less (the plans of two budgets are prefixes of
one list), and the report's gap says what that order costs against the chain model's optimum
(`search.recompute.solve_dp`'s bound). Method "milp" / "dp" solve the model for the cheapest
plan instead (`search.recompute.solve`) and check it with the timeline, lowering the model's
budget by the excess or raising it to buy back recomputation; those answers need not be
monotone in the budget.

Budgets. A float in [0, 1] is a fraction of the range a recompute plan can move the peak:
0 is the peak with every candidate layer fully recomputed, 1 the peak without recomputation
(torch's `activation_memory_budget` normalises the same way). An int, or a float above 1, is
a byte count for the timeline's peak: activations, activation gradients and the parameter
gradients produced during backward (what `memory.liveness` reports; the caller subtracts
parameters, optimizer states and other transients from the device's memory first).

The result is plan data: `Plan.recompute` (module path -> "none" | "full" | "selective") and,
for selective layers, `Plan.extra["recompute_save"]` (module path -> node keys to keep), which
`passes.recompute` carries out.

A recompute pinned on a fixed mesh (`parallelize(..., pins={"recompute": "selective"})`, or
{module path: mode}): `pinned_recompute` reads it as the joint planner does (one mode: every
block; "selective": the nodes the planner keeps).

The loss around the outputs: `plan_loss(global_gm, plan, hardware)` is the one `model.step`
runs for a plan (`cost.loss_memory.loss_model` of the global graph: `CROSS_ENTROPY` on gathered
logits, `VOCAB_PARALLEL` on the shards under `Plan.loss_parallel`), to pass as `loss=`.

It reads `node.meta` only through `cost.analyze` and `passes.recompute`. Guarantees: the
predicted peak (an exact timeline walk of the returned plan) is at most the budget, or a
ValueError says why no plan fits (strict) / the report says so (strict=False).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from autopar.cost.graph import analyze
from autopar.cost.loss_memory import loss_model
from autopar.cost.memory import CROSS_ENTROPY, LossModel
from autopar.passes.plan import Plan
from autopar.cost.timeline import Timeline, regions_for, timeline
from autopar.passes.split_pipeline import pipeline_units
from autopar.search.plan_selective import BLOCK_UNIT, kept_nodes
from autopar.search.recompute import (NO_ACTIVATION, NO_MODULE, ChainModel, Choices, build_chain, ladder,
                                      ladder_choices, model_cost, off_choices, regions_of, solve, solve_dp)


RECOMPUTE_PINS = ("none", "auto", "full", "selective")


def pinned_recompute(global_gm: fx.GraphModule, recompute: str | Mapping[str, str],
                     save: Mapping[str, list] | None = None, hardware: Any = "cpu-gloo") -> tuple[dict, dict]:
    """A recompute pin on a fixed mesh, as the joint planner reads it. One mode: every block (a
    pipeline unit named after a numbered module, layers.3) recomputed "full" or "selective";
    "none" and "auto" recompute nothing here (auto is the planner's choice, or memory_budget=).
    {module path: mode}: as given. A "selective" module without its list in `save` keeps the
    nodes `search.plan_selective.kept_nodes` keeps (the planner's, not the recompute pass's
    default). Returns (Plan.recompute, Plan.extra["recompute_save"])."""
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_PINS:
            raise ValueError(f"recompute={recompute!r}: pin one of {RECOMPUTE_PINS}, or {{module path: mode}}")
        blocks = [u.name for u in pipeline_units(global_gm) if BLOCK_UNIT.search(u.name)]
        if recompute in ("full", "selective") and not blocks:
            raise ValueError(f"recompute={recompute!r}: the model has no repeated blocks (numbered modules such as "
                             f"layers.3) to recompute; pin {{module path: mode}} instead")
        recompute = {b: recompute for b in blocks} if recompute in ("full", "selective") else {}
    save = dict(save or {})
    todo = [m for m, mode in recompute.items() if mode == "selective" and m not in save]
    if todo:
        kept = kept_nodes(global_gm, analyze(global_gm, hardware), todo)
        save.update({m: [n.key for n in kept.get(m, ())] for m in todo})
    return dict(recompute), save


def plan_loss(global_gm: fx.GraphModule, plan: Plan, hardware: Any = "cpu-gloo") -> LossModel:
    """What the loss `model.step` runs on `plan`'s outputs adds to the walk (module docstring)."""
    if not plan.loss_parallel:
        return CROSS_ENTROPY
    return loss_model(analyze(global_gm, hardware), plan)


@dataclass
class RecomputeReport:
    budget_bytes: float
    fraction: float | None  # the budget as given, when it was a fraction
    peak_none: float  # timeline peak without recomputation
    peak_full: float  # timeline peak with every candidate fully recomputed
    predicted_peak: float
    predicted_saved: float  # held for backward at the end of the forward
    recompute_s: float
    recompute_flops: float
    modes: dict[str, str]
    save: dict[str, list[str]]
    solver: dict[str, Any]
    skipped: dict[str, str]  # layers that cannot be checkpointed, and why
    fits: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    timeline: Timeline | None = None

    def apply(self, plan):
        """A copy of `plan` with this decision: Plan.recompute and Plan.extra["recompute_save"]."""
        extra = dict(plan.extra)
        extra["recompute_save"] = {k: list(v) for k, v in self.save.items()}
        return plan.pin(recompute=dict(self.modes), extra=extra)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "timeline"}


def plan_recompute(gm: fx.GraphModule, budget: float | int, hardware: Any = "cpu-gloo", *,
                   sizes: Mapping[str, int] | None = None, method: str = "auto", time_limit_s: float = 10.0,
                   recompute_collectives: bool = False, strict: bool = True, loss: LossModel = CROSS_ENTROPY,
                   ) -> tuple[dict[str, str], RecomputeReport]:
    """The cheapest recompute plan (least recomputation time) whose peak fits `budget`.

    Args:
        gm: the graph one rank runs (after sharding and pipeline splitting, before `recompute`).
        budget: a fraction in [0, 1] (float) or a byte count (int, or float > 1); see the module
            docstring.
        hardware: profile (name or Hardware) for recomputation times and kernel choices.
        sizes: symbol values for a dynamic capture ({"b": 8}); default: the example's sizes.
        method: "auto" / "ladder" (the monotone prefix, see the module docstring) | "milp" | "dp"
            (the cheapest plan of the model, `search.recompute.solve`).
        recompute_collectives: allow collectives to run again in backward (default: never).
        strict: raise ValueError when no plan fits (else return the smallest-peak plan and say so).
        loss: what the loss on the graph's outputs adds to the peak (`cost.memory.CROSS_ENTROPY`,
            as `model.step` runs a cross-entropy loss_fn; `GRAPH_ONLY` when the loss is in the graph).

    Returns:
        (Plan.recompute dict, report); `report.save` is Plan.extra["recompute_save"].
    """
    t0 = time.perf_counter()
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or math.isnan(budget) or budget < 0:
        raise ValueError(f"memory budget must be a fraction in [0, 1] (float) or a byte count (int), got {budget!r}")
    gc = analyze(gm, hardware)
    vals = gc.values(sizes)
    chain = build_chain(gm, gc, vals, hardware, recompute_collectives=recompute_collectives, loss=loss)
    none_pk, full_pk = chain.none.peak, chain.full.peak
    fraction = None
    if isinstance(budget, float) and budget <= 1.0:
        fraction = budget
        target = full_pk + budget * max(0.0, none_pk - full_pk)
    else:
        target = float(budget)
    notes: list[str] = []
    if method in ("auto", "ladder"):
        choices, info = _search_ladder(chain, target)
    else:
        choices, info = _search(chain, target, method, time_limit_s)
    fits = choices is not None
    if not fits:
        lowest = min(none_pk, full_pk)
        if strict:
            raise ValueError(
                f"memory_budget={budget!r} ({_gb(target)} for the activation peak) is below the smallest peak a "
                f"recompute plan reaches here ({_gb(lowest)} with every layer recomputed; {_gb(none_pk)} without "
                f"recomputation); raise the budget, shard more (tensor/pipeline parallelism, ZeRO), or use a "
                f"smaller micro-batch")
        choices = {s.name: frozenset() for s in chain.candidates} if full_pk <= none_pk else \
            {s.name: None for s in chain.candidates}
        notes.append(f"no plan fits {_gb(target)}; returned the smallest-peak plan ({_gb(lowest)})")
    modes, save = _plan_data(chain, choices)
    regions = regions_for(gc, modes, save, recompute_collectives=recompute_collectives)
    tl = timeline(gc, regions, vals, hardware=hardware, loss=loss)
    assert {r.name: (r.nodes, r.save) for r in regions} == \
        {r.name: (r.nodes, r.save) for r in regions_of(chain, choices)}, "plan data and regions disagree"
    blocked = {k: v for k, v in chain.skipped.items() if v not in (NO_MODULE, NO_ACTIVATION)}
    if blocked:
        notes.append("not checkpointable: " + "; ".join(f"{k}: {v}" for k, v in sorted(blocked.items())))
    report = RecomputeReport(
        budget_bytes=target, fraction=fraction, peak_none=none_pk, peak_full=full_pk, predicted_peak=tl.peak,
        predicted_saved=tl.saved, recompute_s=tl.recompute_s, recompute_flops=tl.recompute_flops, modes=modes,
        save=save, solver=info, skipped=dict(chain.skipped), fits=fits and tl.peak <= target * (1 + 1e-9),
        seconds=time.perf_counter() - t0, notes=notes, timeline=tl)
    return modes, report


def _search(chain: ChainModel, target: float, method: str, time_limit_s: float) -> tuple[Choices | None, dict]:
    """Solve the chain model, check each answer with the exact timeline, adjust the model's
    budget and keep the cheapest answer that fits."""
    off = {s.name: None for s in chain.candidates}
    info: dict[str, Any] = {"method": "none", "status": "optimal", "cost_s": 0.0, "bound_s": 0.0, "gap": 0.0,
                            "seconds": 0.0, "model_budget": target, "iterations": 0}
    if chain.none.peak <= target:
        return off, info
    gc, vals = chain.gc, chain.values
    best: tuple[float, Choices, dict] | None = None
    model_budget = target
    tried: dict[Any, float] = {}
    raises = 0
    t0 = time.perf_counter()
    for it in range(8):
        sol = solve(chain, model_budget, method=method, time_limit_s=time_limit_s)
        if sol.status == "infeasible":
            break
        key = tuple(sorted((k, tuple(sorted(v)) if v is not None else None) for k, v in sol.choices.items()))
        peak = tried.get(key)
        if peak is None:
            peak = timeline(gc, regions_of(chain, sol.choices), vals, hardware=chain.hardware,
                            keep_points=False, loss=chain.loss).peak
            tried[key] = peak
        record = {"method": sol.method, "status": sol.status, "cost_s": sol.cost_s, "bound_s": sol.bound_s,
                  "gap": sol.gap, "seconds": sol.seconds, "model_budget": model_budget, "iterations": it + 1,
                  "model_peak": sol.model_peak}
        if peak <= target:
            if best is None or sol.cost_s < best[0]:
                best = (sol.cost_s, sol.choices, record)
            slack = target - peak
            if slack <= 0.002 * target or raises >= 2 or sol.cost_s <= 0:
                break
            raises += 1  # the model over-estimated: buy back recomputation with the slack
            model_budget += slack
        elif best is not None:
            break  # a raise went too far: keep the plan that fitted
        else:
            model_budget -= (peak - target) + 1e-6 * target
    if best is None:
        full = {s.name: frozenset() for s in chain.candidates}
        if chain.full.peak <= target:
            cost = model_cost(chain, full)
            info.update(method="full", status="feasible", cost_s=cost, bound_s=0.0, gap=1.0 if cost > 0 else 0.0,
                        iterations=len(tried))
            info["seconds"] = time.perf_counter() - t0
            return full, info
        return None, info
    record = dict(best[2])
    record["seconds"] = time.perf_counter() - t0
    record["iterations"] = len(tried)
    return best[1], record


def _search_ladder(chain: ChainModel, target: float) -> tuple[Choices | None, dict]:
    """The shortest prefix of the recompute ladder (`search.recompute.ladder`: norms, pointwise,
    attention, GEMMs; the cheapest per byte first) whose exact timeline peak fits `target`.
    Group boundaries are scanned in order (the first that fits, exactly); inside that group
    (one node kind over identical layers) a bisection. A smaller target therefore never
    recomputes less (the plans of two targets are prefixes of one list). The model's optimum
    at `target` (`solve_dp`'s bound) is reported as the bound, so the gap says what the order
    costs against the cheapest plan the chain model knows."""
    t0 = time.perf_counter()
    groups = ladder(chain)
    flat = [x for g in groups for x in g]
    ends = list(itertools.accumulate(len(g) for g in groups))
    gc, vals = chain.gc, chain.values
    peaks: dict[int, float] = {0: chain.none.peak}

    def peak(k: int) -> float:
        if k not in peaks:
            peaks[k] = timeline(gc, regions_of(chain, ladder_choices(chain, flat[:k])), vals,
                                hardware=chain.hardware, keep_points=False, loss=chain.loss).peak
        return peaks[k]

    info: dict[str, Any] = {"method": "ladder", "status": "feasible", "cost_s": 0.0, "bound_s": 0.0, "gap": 0.0,
                            "seconds": 0.0, "model_budget": target, "iterations": 0, "steps": 0,
                            "ladder_steps": len(flat)}
    if peak(0) <= target:
        info["seconds"] = time.perf_counter() - t0
        return off_choices(chain), info
    lo = 0
    k = None
    for end in ends:
        if peak(end) <= target:
            hi = end  # the first boundary that fits; bisect the group before it
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if peak(mid) <= target:
                    hi = mid
                else:
                    lo = mid
            k = hi
            break
        lo = end
    info["iterations"] = len(peaks)
    if k is None:
        info.update(status="infeasible", seconds=time.perf_counter() - t0)
        return None, info
    choices = ladder_choices(chain, flat[:k])
    cost = model_cost(chain, choices)
    bound = solve_dp(chain, target).bound_s if cost > 0 else 0.0
    bound = min(bound, cost)
    info.update(cost_s=cost, bound_s=bound, gap=0.0 if cost <= 0 else (cost - bound) / cost, steps=k,
                seconds=time.perf_counter() - t0)
    return choices, info


def _plan_data(chain: ChainModel, choices: Choices) -> tuple[dict[str, str], dict[str, list[str]]]:
    modes: dict[str, str] = {}
    save: dict[str, list[str]] = {}
    for s in chain.candidates:
        kept = choices.get(s.name)
        if kept is None:
            modes[s.name] = "none"
        elif not kept:
            modes[s.name] = "full"
        else:
            modes[s.name] = "selective"
            save[s.name] = [it.key for it in s.items if it.index in kept]
    return modes, save


def _gb(x: float) -> str:
    return f"{x / 2**30:.3g} GiB" if x >= 2**28 else f"{x / 2**20:.3g} MiB"
