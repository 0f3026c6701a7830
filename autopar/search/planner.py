"""Joint planner: one search over every dimension of a plan, for `autopar.parallelize`.

`plan_for(global_gm, world_size, hardware)` returns the Plan with the least predicted step
time whose every rank fits in memory, and a `PlanReport` saying why. The search is
hierarchical:

  outer   enumeration of the discrete choices: the factorisation of the world into
          tp x pp x dp (x ep when the model has MoE blocks and expert parallelism can run; x cp,
          context parallelism, when the graph has attention and a symbolic sequence that 2 cp
          zigzag chunks divide, with pp too, with its exchange: the cheaper of ring and
          Ulysses, `search.plan_context`),
          tp at most the GPUs of a node (tp innermost on the mesh, so its groups share one);
          the ZeRO stage (0-3 when dp > 1); the number of micro-batches (a divisor of the rows
          each dp rank gets); with pp > 1 the schedule (1f1b, interleaved_1f1b, zb_h1, zbv;
          gpipe only when pinned: 1F1B has its time with less memory).
  inner   per tp degree the sharding ILP (`shard_ilp.solve_sharding`: every node's strategy
          on the tp axis, sequence parallelism included; identical layers solved once; cached
          per degree); per candidate the stage DP with each stage's recompute budget and the
          schedule simulator (`plan_cost.PlanCostModel.evaluate`).
  pruning every candidate gets two lower bounds before anything is solved for it: step time
          (its busiest rank's share of compute and optimizer step with every node's work
          divided by tp as if all of it sharded; with one stage per rank also the pipeline's
          fill and drain) and memory (its share of the model states and of one micro-batch's
          activations, recomputed where recompute can run). Candidates are costed in order of
          the time bound; one whose bound is over the best plan found so far cannot be the
          best and is skipped, and so are all after it; one whose memory bound is over the
          limit cannot fit. A pipeline candidate's split gets a second bound before its
          schedule is simulated. A tp degree whose every candidate is pruned never has its ILP
          solved. The bounds are sound for the cost model (tests/unit/test_planner.py checks
          them, and the search against exhaustive enumeration). The top-k alternatives are the
          k best plans the search costed.
  polish  the top plans' pipeline splits are improved by moving each stage boundary by one
          unit while the full prediction (simulated schedule) improves; then, with ZeRO 0-2
          over several replicas and no "bucket_mb" pin, each is costed at every gradient
          bucket size of `BUCKET_MB` and the fastest is kept (written as `Plan.bucket_mb`).

Everything solved is cached: ILPs per tp degree, unit tables per (tp, rows per micro-batch),
model states per (tp, ZeRO, dp); whole results by (graph fingerprint, mesh, hardware, pins,
limits) in memory and, with `cache_dir` (or AUTOPAR_PLAN_CACHE=dir), on disk as JSON
(`search.plan_cache`).

The parts live beside this file: the candidates and their enumeration (`search.candidate`),
their cost model (`search.plan_cost` on `search.plan_tables`), the pins (`search.plan_pins`),
the cache (`search.plan_cache`), the report (`search.explain`), the Plan written for the chosen
candidate (`search.plan_write`). This file runs the search.

Pins (`pins=`): "tp", "pp", "dp", "ep", "cp", "context_method", "mesh" ({axis: size}), "zero_stage",
"n_microbatches", "schedule", "split_points" (unit names where stages start: all of them, or
some and the search places the rest), "recompute" ("none", "full", "selective" or {unit: mode}),
"param_layouts" ({name: Layout or tp placement}: pins for the sharding ILP), "bucket_mb",
"fusions". A pin the mesh cannot satisfy is a ValueError naming it. Optional inner steps:
`search.fusion.plan_fusions(gm, hardware)` when that module exists; expert parallelism when
`passes/expert.py` exists (or `allow={"ep": True}` to plan it without running it).

Precision (`precision=`, Plan fields; missing ones from the model's default recipe,
`passes.plan.default_precision`) is priced by the cost model (`plan_tables`: states at their
dtypes, compute at the compute dtype's peak) and written into the Plan. Offload: True/False as
given; not given, the search runs without it and, only when no plan fits (and the device's
memory is not the host's), again with masters and optimizer states on the host; a note says
which and why.

MoE auxiliary losses (`moe_aux_stats=`): under "global" (the default) a model whose auxiliary
loss reads router statistics is planned with one micro-batch (the runtime refuses more:
`build.plan_check.check_moe_aux_stats`); the report's n_microbatches and pp rows say so.
"micro_batch" plans micro-batches as for any model.

An infeasible request raises ValueError before anything is allocated, naming the plan that
needs the least memory and by how much it misses the limit.

It reads node.meta only through the cost model and the sharding rules; writes nothing.
Deterministic: equal inputs give equal plans (ties broken by the candidate's order).
"""
from __future__ import annotations

import copy
import heapq
import importlib.util
import math
import os
import time
from typing import Any, Iterable, Mapping

import torch.fx as fx

from autopar.cost import load_profile
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import brief_names
from autopar.search.candidate import (BUCKET_MB, Candidate, Evaluation, candidates, has_router_stats,
                                      one_micro_batch, plain)
from autopar.search.explain import (DIMENSIONS, PlanReport, context_rows, dimension_rows, gib, recompute_rows, seconds,
                                   sequence_parallel_rows)
from autopar.search.plan_cache import PLANNER_VERSION, cache_key, disk_get, disk_put, graph_fingerprint
from autopar.search.plan_cost import PlanCostModel
from autopar.search.plan_pins import normalise_pins, world_size
from autopar.search.plan_write import price_fusions, write_plan

__all__ = ["plan_for", "PlanReport", "candidates", "graph_fingerprint", "RUNTIME_SUPPORT", "PLANNER_VERSION",
           "clear_cache"]

DEFAULT_HEADROOM = 0.9  # of the device's memory, as the stage search: workspace and fragmentation

# What the runtime can carry out today; the planner plans only such plans unless `allow` says
# otherwise (plans are data: planning beyond the runtime is how large configurations are studied).
RUNTIME_SUPPORT = {
    "ep": importlib.util.find_spec("autopar.passes.expert") is not None,
    "recompute_with_pp": True,  # build/program.py runs the recompute pass stage by stage
    "zero_with_tied_pp": True,  # runtime/pipeline_tied.py sums tied gradients on the engines' masters
    "ep_with_pp": True,  # the pipelined Program splits the batch over dp x ep (tests/dist/test_ep_pipeline.py)
    # the expert pass keeps its nodes in their block, so a block is one checkpoint region; its
    # collectives are kept, not re-run (tests/dist/test_moe_context_recompute.py)
    "recompute_with_ep": True,
    # a checkpoint region allows one backward: under zb_h1 / zbv a stage holding regions runs its
    # backward whole at its I, no W (runtime/pipeline.py; tests/dist/test_zero_bubble_recompute.py)
    "recompute_with_split_backward": True,
    "cp": True,  # context parallelism (ring / Ulysses) on dp, ZeRO and tp: tests/dist/test_context_parallel.py
    # the stages are cut after the cp passes, each holds its layers' exchange (tests/dist/test_pipeline_context.py)
    "cp_with_pp": True,
    # dropless routing: each rank dispatches its chunk's tokens as rows (tests/dist/test_moe_context_recompute.py);
    # a capacity is refused (passes/context_routing.py: drops depend on the whole batch's token order)
    "cp_with_ep": True,
}
SPLIT_BACKWARD = ("zb_h1", "zbv")

_MEMO: dict[str, tuple[dict, dict]] = {}


def clear_cache() -> None:
    _MEMO.clear()


# ------------------------------------------------------------------------ entry point
def plan_for(global_gm: fx.GraphModule, world_size_or_mesh_sizes: int | Mapping[str, int], hardware: Any = "h100-sxm",
             *, pins: Mapping[str, Any] | None = None, memory_limit: float | None = None,
             global_batch: int | None = None, top_k: int = 5, optimizer: Any = "adamw",
             cache_dir: str | None = None, allow: Mapping[str, bool] | None = None, gc=None,
             precision: Mapping[str, Any] | None = None, moe_aux_stats: str = "global") -> tuple[Plan, PlanReport]:
    """The best plan for `global_gm` on a mesh of the given size, and why.

    Args:
        global_gm: the captured graph at the global batch (`autopar.capture`).
        world_size_or_mesh_sizes: ranks (the planner factorises them), or axis sizes
            ({"dp": 4, "tp": 2}: the mesh is fixed and the rest is searched).
        hardware: cost-model profile name, path or Hardware.
        pins: parts of the plan fixed by the user (see the module docstring).
        memory_limit: bytes per device every rank must stay under (default 90 % of the
            device's memory).
        global_batch: rows per step (default: the captured batch).
        top_k: alternatives to keep and report.
        optimizer: for the model-state accounting ("adamw", "sgd", ...).
        cache_dir: also cache results as JSON files here (default $AUTOPAR_PLAN_CACHE).
        allow: override RUNTIME_SUPPORT flags ({"ep": True, "recompute_with_pp": True}).
        gc: `cost.analyze(global_gm, hardware)` when the caller has it.
        precision: the Plan's precision fields to plan for (`passes.plan.precision_fields(name,
            offload)`); fields left out follow the model's default recipe
            (`passes.plan.default_precision`: bf16-mixed for a bf16 model), as parallelize runs
            it. "offload": True or False is kept; missing or None lets the planner decide: it
            plans without offload and, only when no plan fits, again with masters and optimizer
            states offloaded to the host. The chosen fields are written into the Plan.
        moe_aux_stats: "global" (an MoE model with router statistics gets one micro-batch) or
            "micro_batch" (see the module docstring; `autopar.parallelize`'s keyword).

    Returns:
        (plan, report): the Plan (mesh, dp axis, ZeRO stage, layouts and strategies on tp,
        split points, schedule, micro-batches, recompute, fusions, predictions, notes; the
        report's dict in plan.extra["planner"]) and the PlanReport.

    Raises:
        ValueError: pins the mesh cannot satisfy, or no plan fits the memory limit (naming
        the smallest shortfall).
    """
    t0 = time.perf_counter()
    hw = load_profile(hardware)
    pins = normalise_pins(pins, world_size_or_mesh_sizes)
    world = world_size(world_size_or_mesh_sizes)
    limit = float(memory_limit) if memory_limit is not None else DEFAULT_HEADROOM * float(hw.device.memory_bytes)
    if moe_aux_stats not in ("global", "micro_batch"):
        raise ValueError(f"moe_aux_stats={moe_aux_stats!r} is not a mode; use 'global' or 'micro_batch'")
    support = {**RUNTIME_SUPPORT, **(allow or {}), "moe_aux_stats": moe_aux_stats}
    prec = dict(precision or {})
    key = cache_key(global_gm, world, hw, pins, limit, global_batch, top_k, optimizer, {**support, "precision": prec})
    cache_dir = cache_dir or os.environ.get("AUTOPAR_PLAN_CACHE")
    hit = _MEMO.get(key) or disk_get(cache_dir, key)
    if hit is not None:  # copies: a caller's edits (notes, extra) never reach the cache or another caller
        plan = Plan.from_dict(copy.deepcopy(hit[0]))
        report = PlanReport.from_dict(copy.deepcopy(hit[1]))
        report.search = {**report.search, "cached": True, "seconds": time.perf_counter() - t0}
        return plan, report
    decide = prec.get("offload") is None
    search = _Search(global_gm, hw, world, pins, limit, global_batch, top_k, optimizer, support, gc,
                     {**prec, "offload": bool(prec.get("offload"))})
    try:
        plan, report = search.run()
        if decide and search.model.trainable and hw.device.kind != "cpu":
            plan.notes.append(f"offload: not chosen: the plan fits in device memory without it (peak "
                              f"{gib(plan.predicted['peak_bytes'])} of {gib(limit)}); host copies and a CPU optimizer "
                              "step would only slow the step")
    except ValueError as e:
        # offload frees device memory only where the device's memory is not the host's
        if not (decide and search.model.trainable and hw.device.kind != "cpu" and "fits the memory limit" in str(e)):
            raise
        # no plan fits on the device: masters and optimizer states on the host (ZeRO-Offload)
        search2 = _Search(global_gm, hw, world, pins, limit, global_batch, top_k, optimizer, support,
                          search.model.gc, {**prec, "offload": True}, shared=search.model)
        try:
            plan, report = search2.run()
        except ValueError as e2:
            raise ValueError(f"{e2} (with masters and optimizer states offloaded to the host; without offload: {e})") \
                from None
        copies, step = search2.model.offload_seconds(plan)
        plan.notes.append(f"offload: chosen, because no plan fits in device memory without it ({e}); with masters "
                          f"and optimizer states in host memory the plan needs {gib(plan.predicted['peak_bytes'])} "
                          f"of {gib(limit)}, for {seconds(copies)} of host<->device copies and a {seconds(step)} CPU "
                          "optimizer step per step")
        report.notes = (report.notes + [plan.notes[-1]])[:20]
    report.search["seconds"] = time.perf_counter() - t0
    if has_router_stats(search.model):  # parallelize(plan=plan) carries out the mode it was planned for
        plan.extra["moe_aux_stats"] = moe_aux_stats
    plan.extra["planner"] = _stored(report)
    _MEMO[key] = copy.deepcopy((plan.to_dict(), report.to_dict()))  # nothing shared with the returned plan
    disk_put(cache_dir, key, _MEMO[key])
    return plan, report


def _stored(report: PlanReport) -> dict[str, Any]:
    """The report as the plan keeps it: without timings, so that plan.json is the same
    from run to run."""
    d = plain(report.to_dict())
    d["search"] = {k: v for k, v in d["search"].items() if k not in ("seconds", "ilp_seconds", "cached")}
    return d


# ------------------------------------------------------------------------ the search
class _Search:
    def __init__(self, gm, hw, world, pins, limit, global_batch, top_k, optimizer, support, gc, precision=None,
                 shared: PlanCostModel | None = None):
        self.gm, self.hw, self.world, self.pins, self.limit = gm, hw, world, pins, limit
        self.top_k = max(1, int(top_k))
        self.support = support
        self.notes: list[str] = []
        self.model = PlanCostModel(gm, hw, world, global_batch=global_batch, optimizer=optimizer,
                                   param_pins=pins.get("param_layouts"), gc=gc,
                                   bucket_mb=float(pins.get("bucket_mb", 25.0)), precision=precision,
                                   loss_parallel=bool(pins.get("loss_parallel")))
        if shared is not None:  # the same graph and hardware: the sharding ILPs and unit tables carry over
            self.model.share_tables(shared)
        self.split_pins = list(pins.get("split_points") or [])
        bad = [p for p in self.split_pins if p not in self.model.unit_names]
        if bad:
            raise ValueError(f"pinned split points {bad} are not pipeline units of this model; a stage can start at "
                             f"one of: {brief_names(self.model.unit_names[1:])}")
        self.recompute = pins.get("recompute", "auto")
        self.records: dict[str, dict[Any, dict[str, Any]]] = {d: {} for d in DIMENSIONS}
        self.stats = {"candidates": 0, "evaluated": 0, "pruned_bound": 0, "no_fit": 0, "ilp_failed": []}
        self.bad_tp: dict[int, str] = {}
        self.one_micro = one_micro_batch(self.model, support)  # MoE aux losses over the global batch
        self._fusions: dict[int, list[str]] = {}  # rows split -> planned fusions (write_plan per candidate)
        self._bucket_models: dict[float, PlanCostModel] = {}  # bucket MiB -> the model at that size (`_polish_buckets`)

    # --- bookkeeping per dimension value, for the explanations ----------------------------------
    def _rec(self, c: Candidate) -> Iterable[dict[str, Any]]:
        for dim, v in c.dims().items():
            if (dim == "schedule" and c.pp == 1) or dim not in self.records:  # the method: in the cp rows
                continue
            yield self.records[dim].setdefault(v, {})

    def _note_fit(self, ev: Evaluation) -> None:
        for r in self._rec(ev.candidate):
            if r.get("best_step") is None or ev.step_s < r["best_step"]:
                r.update(best_step=ev.step_s, best_label=ev.candidate.label(), best_peak=ev.peak_bytes)

    def _note_need(self, c: Candidate, need: float, at_least: bool) -> None:
        for r in self._rec(c):
            if r.get("min_need") is None or need < r["min_need"]:
                r.update(min_need=need, min_need_label=("at least, " if at_least else "") + c.label(),
                         need_exact=not at_least)
            if at_least:  # a bound: remember the most promising candidates to cost exactly for the report
                cands = r.setdefault("_need_cands", [])
                cands.append((need, c))
                cands.sort(key=lambda x: (x[0], x[1]))
                del cands[2:]

    def _exact_needs(self) -> None:
        """For a dimension value none of whose candidates fits, the memory its most promising
        candidates need at least (memory-minimising split, every block recomputed where
        recompute can run), so that the report names a real shortfall."""
        done: dict[Candidate, float] = {}
        for recs in self.records.values():
            for r in recs.values():
                cands = r.pop("_need_cands", [])
                if r.get("best_step") is not None or r.get("bound") is not None or r.get("need_exact"):
                    continue
                for _lb, c in cands:
                    if c not in done:
                        ev = self._evaluate(c, minimise="memory", memory_only=True) if c.tp not in self.bad_tp else None
                        done[c] = ev.peak_bytes if ev is not None else math.inf
                    if done[c] < math.inf and (not r.get("need_exact") or done[c] < r["min_need"]):
                        r.update(min_need=done[c], min_need_label=c.label(), need_exact=True)

    def _note_bound(self, c: Candidate, lb: float) -> None:
        for r in self._rec(c):
            if r.get("bound") is None or lb < r["bound"]:
                r["bound"] = lb

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> tuple[Plan, PlanReport]:
        t_start = time.perf_counter()
        model, limit, k = self.model, self.limit, self.top_k
        cands = candidates(model, self.world, self.pins, self.support)
        if not cands:
            raise ValueError(self._no_candidates_message())
        self.stats["candidates"] = len(cands)
        # phase A: bounds that need no ILP (every node's work divided by tp)
        scored = []
        for c in cands:
            lb_t, lb_m = self.model_optimistic(c)
            if lb_m > limit:
                self.stats["no_fit"] += 1
                self._note_need(c, lb_m, True)
                continue
            scored.append((lb_t, c))
        scored.sort(key=lambda x: (x[0], x[1]))
        top: list[tuple[float, int, Evaluation]] = []  # the k best costed, max-heap by step (negated)
        best_step = math.inf  # the incumbent: a candidate whose bound is over it cannot be the best
        order = 0
        # a good incumbent early prunes most of the rest: first, per tp degree, the candidate
        # with the least bound that has no pipeline (whose bound is nearly its time), then the
        # bound order (which the seeds do not change: they are costed again at no cost)
        seeds: dict[int, tuple[float, Candidate]] = {}
        for lb_a, c in scored:
            if c.pp == 1 and c.tp not in seeds:
                seeds[c.tp] = (lb_a, c)
        seen: set[Candidate] = set()
        for pos, (lb_a, c) in enumerate(sorted(seeds.values()) + scored):
            if c in seen:
                continue
            seen.add(c)
            if lb_a >= best_step and pos >= len(seeds):
                for lb_rest, rest in scored[pos - len(seeds):]:  # every later one is bounded out too
                    if rest not in seen:
                        self.stats["pruned_bound"] += 1
                        self._note_bound(rest, lb_rest)
                break
            if c.tp in self.bad_tp:
                continue
            try:
                lb_t, lb_m = model.lower_bounds(c, self._may_recompute(c))
            except Exception as e:  # noqa: BLE001 - a tp degree the ILP cannot solve is skipped, and said so
                self._ilp_failed(c.tp, e)
                continue
            if lb_m > limit:
                self.stats["no_fit"] += 1
                self._note_need(c, lb_m, True)
                continue
            if lb_t >= best_step:
                self.stats["pruned_bound"] += 1
                self._note_bound(c, lb_t)
                continue
            ev = self._evaluate(c, cutoff=best_step)
            if ev is None:
                continue
            if ev.pruned:
                self.stats["pruned_bound"] += 1
                self._note_bound(c, ev.step_s)
                continue
            self.stats["evaluated"] += 1
            if not ev.feasible:
                self.stats["no_fit"] += 1
                self._note_need(c, ev.peak_bytes, bool(ev.notes and "lower bound" in ev.notes[0]))
                continue
            self._note_fit(ev)
            best_step = min(best_step, ev.step_s)
            order += 1
            heapq.heappush(top, (-ev.step_s, -order, ev))
            if len(top) > k:
                heapq.heappop(top)
        if not top:
            raise ValueError(self._infeasible_message())
        best = sorted((e for _s, _o, e in top), key=lambda e: (e.step_s, e.candidate))
        best = self._polish_buckets(self._polish(best))
        for ev in best:
            self._note_fit(ev)
        chosen = best[0]
        report = self._report(chosen, best, time.perf_counter() - t_start)
        plan = write_plan(self, chosen, report)
        price_fusions(plan, self.gm, self.hw, self.model.global_batch)
        return plan, report

    def model_optimistic(self, c: Candidate) -> tuple[float, float]:
        return self.model.optimistic_bounds(c, self._may_recompute(c))

    def _may_recompute(self, c: Candidate) -> bool:
        if self.recompute == "none" or (c.ep > 1 and not self.support.get("recompute_with_ep")):
            return False
        if c.pp > 1 and c.schedule in SPLIT_BACKWARD and not self.support.get("recompute_with_split_backward"):
            return False
        return c.pp == 1 or bool(self.support.get("recompute_with_pp")) or self.recompute in ("full", "selective") \
            or isinstance(self.recompute, Mapping)

    def _evaluate(self, c: Candidate, pins: list[str] | None = None, minimise: str = "time",
                  cutoff: float | None = None, memory_only: bool = False,
                  model: PlanCostModel | None = None) -> Evaluation | None:
        rc = self.recompute
        if c.pp > 1 and not self.support.get("recompute_with_pp") and rc == "auto":
            rc = "none"
        if c.pp > 1 and c.schedule in SPLIT_BACKWARD and not self.support.get("recompute_with_split_backward") \
                and rc != "none":
            if rc != "auto":  # recompute was asked for: this schedule cannot carry it out
                self.notes.append(f"{c.label()}: recompute with {c.schedule} (a split backward) does not run yet")
                return None
            rc = "none"
        try:
            return (model or self.model).evaluate(c, self.limit, pins=self.split_pins if pins is None else pins,
                                                  recompute=rc, minimise=minimise, cutoff=cutoff,
                                                  memory_only=memory_only)
        except ValueError as e:
            self.notes.append(f"{c.label()}: {e}")
            return None

    def _ilp_failed(self, t: int, e: Exception) -> None:
        self.bad_tp[t] = f"{type(e).__name__}: {e}"
        self.stats["ilp_failed"].append(t)
        self.notes.append(f"tp={t} skipped: the sharding search failed ({type(e).__name__}: {str(e)[:200]})")

    def _polish(self, best: list[Evaluation]) -> list[Evaluation]:
        """Move each pipeline boundary of the top plans (those within 3% of the best) by one
        unit while the full prediction improves (the DP balances stage times; the simulated
        schedule is the objective), 40 predictions at most."""
        budget = 40
        out = []
        names = self.model.unit_names
        for ev in best:
            cur = ev
            improved = cur.candidate.pp > 1 and len(self.split_pins) < cur.candidate.n_stages - 1 \
                and cur.step_s <= best[0].step_s * 1.03
            while improved and budget > 0:
                improved = False
                starts = [names.index(p) for p in cur.split_points]
                for s in range(len(starts)):
                    for delta in (-1, 1):
                        new = list(starts)
                        new[s] += delta
                        lo = new[s - 1] if s > 0 else 0
                        hi = new[s + 1] if s + 1 < len(new) else len(names)
                        if not lo < new[s] < hi or any(names[x] in self.split_pins for x in starts if x not in new):
                            continue
                        budget -= 1
                        alt = self._evaluate(cur.candidate, pins=[names[x] for x in new])
                        if alt is not None and alt.feasible and alt.step_s < cur.step_s * (1 - 1e-9):
                            cur, improved = alt, True
                            break
                    if improved or budget <= 0:
                        break
            out.append(cur)
        return sorted(out, key=lambda e: (e.step_s, e.candidate))

    def _polish_buckets(self, best: list[Evaluation]) -> list[Evaluation]:
        """The gradient bucket size of the top plans with ZeRO 0-2 over more than one replica
        (unless pinned): each costed again, with its split, at every size of `BUCKET_MB`; the
        fastest that fits is kept. Many small buckets pay a collective's latency each (a ring's
        steps over many nodes), few large ones start late and leave more exposed."""
        if "bucket_mb" in self.pins:
            return best
        out = []
        for ev in best:
            cur, c = ev, ev.candidate
            if c.replicas > 1 and c.zero < 3:
                for mb in BUCKET_MB:
                    if mb == self.model.bucket_mb:
                        continue
                    model = self._bucket_models.get(mb) or self._bucket_models.setdefault(mb, self.model.with_buckets(mb))
                    alt = self._evaluate(c, pins=list(cur.split_points), model=model)
                    if alt is not None and alt.feasible and alt.step_s < cur.step_s * (1 - 1e-9):
                        cur = alt
                        cur.bucket_mb = mb
            out.append(cur)
        return sorted(out, key=lambda e: (e.step_s, e.candidate))

    # --- failure messages -----------------------------------------------------------------------
    def _no_candidates_message(self) -> str:
        m, pins = self.model, self.pins
        fixed = ", ".join(f"{k}={v}" for k, v in pins.items() if k in ("tp", "pp", "dp", "ep", "cp", "zero_stage",
                                                                         "n_microbatches", "schedule", "split_points",
                                                                         "context_method"))
        return (f"no plan of {self.world} ranks matches the pins {fixed}: tp x pp x dp x ep x cp must equal "
                f"{self.world}, "
                f"tp at most {m.hw.gpus_per_node} (GPUs per node), pp at most {m.L} (pipeline units), dp x ep x "
                f"micro-batches must divide the global batch of {m.global_batch} rows, interleaved schedules need "
                f"micro-batches divisible by pp"
                + ("; an MoE model whose auxiliary loss reads router statistics runs one micro-batch under "
                   "moe_aux_stats='global' (pass moe_aux_stats='micro_batch' for per-micro-batch statistics)"
                   if self.one_micro and pins.get("n_microbatches", 1) > 1 else "")
                + (f"; cp={pins['cp']} runs on a sequence of {m.seq_len()} tokens that "
                   f"{2 * pins['cp']} zigzag chunks divide, Ulysses only where the query heads per tp rank divide by cp"
                   + (f" ({m.context_refusal()})" if m.context_refusal() else "")
                   if pins.get("cp", 1) > 1 else "")
                + ". Change or drop a pin")

    def _infeasible_message(self) -> str:
        """Find the plan that needs the least memory (every block recomputed, the split that
        minimises the fullest stage) and say how far it is over the limit."""
        cands = sorted(self.model_candidates_all(), key=lambda c: self.model_optimistic(c)[1])[:40]
        best: Evaluation | None = None
        for c in cands:
            if c.tp in self.bad_tp:
                continue
            try:
                self.model.sharding(c.tp)
            except Exception as e:  # noqa: BLE001
                self._ilp_failed(c.tp, e)
                continue
            ev = self._evaluate(c, minimise="memory")
            if ev is not None and (best is None or ev.peak_bytes < best.peak_bytes):
                best = ev
        lim = gib(self.limit)
        if best is None:
            return (f"no plan of {self.world} ranks of {self.hw.name} fits {lim} per rank and none could be costed"
                    + (f" ({'; '.join(self.notes[:3])})" if self.notes else ""))
        rc = " with every block recomputed" if best.recompute else ""
        return (f"no plan of {self.world} ranks of {self.hw.name} fits the memory limit of {lim} per rank: the plan "
                f"that needs the least, {best.candidate.label()}{rc}, needs {gib(best.peak_bytes)} on its fullest rank "
                f"({gib(best.peak_bytes - self.limit)} over; model states {gib(_states(best))}, activations "
                f"{gib(best.memory.get('activations', 0.0))}). Use more devices, a larger memory_limit, a smaller "
                "global batch, or pin fewer dimensions")

    def model_candidates_all(self) -> list[Candidate]:
        return candidates(self.model, self.world, self.pins, self.support)

    # --- report and plan ------------------------------------------------------------------------
    def _report(self, chosen: Evaluation, best: list[Evaluation], seconds_: float) -> PlanReport:
        self._exact_needs()
        dims = {}
        for dim in DIMENSIONS:
            vals = self.records[dim]
            if not vals:
                continue
            dims[dim] = dimension_rows(vals, chosen.candidate.dims()[dim] if not (dim == "schedule" and
                                       chosen.candidate.pp == 1) else None, chosen.step_s, self.limit, dim)
        dims["sequence_parallel"] = sequence_parallel_rows(self.model, chosen)
        dims["recompute"] = recompute_rows(self.model, chosen, self.recompute, self.limit)
        if "cp" in dims:
            dims["cp"] = context_rows(self.model, chosen, dims["cp"])
        if self.one_micro:
            _one_micro_rows(dims)
        unit = self.model.tokens_per_row()[1]
        as_dict = []
        for e in best:
            d = e.to_dict()
            d["throughput_unit"] = unit
            as_dict.append(d)
        chosen_d = dict(as_dict[0])
        self.stats.update(seconds=seconds_, ilp_seconds=round(self.model.ilp_seconds, 3),
                          tp_solved=sorted(self.model._shard), cached=False)
        return PlanReport(chosen=chosen_d, alternatives=as_dict, dimensions=dims, search=dict(self.stats),
                          hardware=self.hw.name, memory_limit=self.limit, world_size=self.world, notes=self.notes[:20])


    def planned_fusions(self, c: Candidate) -> list[str]:
        """The fusion search's choice for the chosen plan's per-rank batch, on the planner's own
        analysis of the graph (one `cost.analyze`, not a second)."""
        from autopar.search.fusion import plan_fusions  # noqa: PLC0415

        split = c.dp * c.ep * c.micro
        hit = self._fusions.get(split)  # the choice depends on the graph and the rows per rank only
        if hit is not None:
            return list(hit)
        try:
            names, _ = plan_fusions(self.gm, self.hw, batch_split=split, gc=self.model.gc)
        except Exception as e:  # noqa: BLE001 - an optional inner step: reported, not fatal
            self.notes.append(f"fusion search failed ({type(e).__name__}: {str(e)[:160]}); no fusions planned")
            return []
        self._fusions[split] = [str(n) for n in names]
        return list(self._fusions[split])


_ONE_MICRO = ("the MoE auxiliary losses read router statistics, which moe_aux_stats='global' computes over the "
              "global batch: micro-batches would compute them per micro-batch (moe_aux_stats='micro_batch' allows it)")


def _one_micro_rows(dims: dict[str, list[dict[str, Any]]]) -> None:
    """Say in the report why no plan has micro-batches (and pipelines only one): `_ONE_MICRO`."""
    dims.setdefault("n_microbatches", []).append({"value": "2+", "status": "refused", "step_s": None, "label": None,
                                                  "peak_bytes": None, "reason": f"not planned: {_ONE_MICRO}"})
    for r in dims.get("pp", []):
        if r["status"] != "chosen" and r["value"] != 1:
            r["reason"] = f"{r['reason']} (with one micro-batch only: {_ONE_MICRO})"


def _states(ev: Evaluation) -> float:
    return sum(ev.memory.get(k, 0.0) for k in ("params", "grads", "master", "optimizer", "buffers"))
