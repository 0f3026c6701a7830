"""The Plan the joint planner writes for its chosen candidate: what `autopar.parallelize` runs.

`write_plan(search, ev, report)`: the mesh (pp, dp, ep, cp, tp axes of size > 1, in the
runtime's order), the dp axis, the ZeRO stage (on dp, or the joined dp+cp axis with context
parallelism), micro-batches, the sharding ILP's layouts and strategies on tp, pipeline split
points, schedule and virtual stages, the recompute set, fusions (the fusion search's choice
unless pinned), with cp the attention exchange the cost model priced (`plan.extra["context"]`,
which `parallelize` runs and `cost.estimate` reads), with ep the experts' entry
(`plan.extra["expert"]`, `search.expert.plan_experts` as `build.plan_complete` would write it:
this rank's experts, the routed rows that `cost.estimate` and the planner price), the precision
that was priced, the loss that was priced (`plan.loss_parallel`, from the "loss_parallel" pin: the
tables' `ShardInfo.loss`), the predictions and the report's reasons as notes.

Reads node.meta only through the cost model's tables; writes none. Deterministic: no timings
in the Plan.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from autopar.cost import load_profile
from autopar.cost.placements import Layout
from autopar.passes.plan import Plan
from autopar.search.candidate import BUCKET_MB, Evaluation, plain
from autopar.search.expert import grouped_expert_layouts
from autopar.search.explain import PlanReport, gib, seconds
from autopar.search.plan_selective import selective_keys

__all__ = ["price_fusions", "unfused", "write_plan"]


def unfused(plan: Plan) -> Plan:
    """A copy of `plan` without its fusions: the plan as the planner ranked it."""
    out = copy.copy(plan)
    out.fusions = []
    return out


def price_fusions(plan: Plan, gm: Any, hw: Any, global_batch: int | None) -> None:
    """`plan.predicted["with_fusions"]`: the planner's step time, peak and MFU moved by what the
    plan's fusions change in `cost.estimate` (the plan fused minus `unfused(plan)`), on a GPU
    profile (a CPU runs the fused calls' torch references: nothing changes there). The ranking
    stays the unfused one; a failure is a note, never an error."""
    if not plan.fusions or hw.device.kind != "cuda":
        return
    from autopar.cost import estimate  # noqa: PLC0415
    from autopar.search.shard_search import batch_is_static  # noqa: PLC0415

    try:
        kw = {} if batch_is_static(gm) else {"global_batch": global_batch} if global_batch else {"batch_is_global": True}
        fused, bare = (estimate(gm, p, hw, **kw) for p in (plan, unfused(plan)))
    except Exception as e:  # noqa: BLE001 - the plan stands; its figures stay the ranking's, and say so
        plan.notes.append(f"fusions not priced in plan.predicted ({type(e).__name__}: {str(e)[:120]})")
        return
    pr = plan.predicted
    step = pr["step_s"] + fused.step_s - bare.step_s
    pr["with_fusions"] = plain({
        "step_s": step, "peak_bytes": pr["peak_bytes"] + fused.memory["peak"] - bare.memory["peak"],
        "mfu": pr["mfu"] * pr["step_s"] / step if pr.get("mfu") and step > 0 else pr.get("mfu"),
        "fusions": list(plan.fusions)})
    plan.notes.append(f"with its fusions ({', '.join(plan.fusions)}): predicted step {seconds(step)}, peak "
                      f"{gib(pr['with_fusions']['peak_bytes'])} (the ranking above is unfused)")


def write_plan(search: Any, ev: Evaluation, report: PlanReport) -> Plan:
    """The Plan `parallelize` runs for the search's chosen evaluation `ev` (see the module
    docstring); `search`: the planner's `_Search` (its model, pins, hardware, limit, notes)."""
    c = ev.candidate
    mesh = c.mesh()
    axes = tuple(mesh)
    plan = Plan(mesh=mesh, dp_axis="dp" if "dp" in mesh else None, zero_stage=c.zero if c.replicas > 1 else 0,
                n_microbatches=c.micro, bucket_mb=float(ev.bucket_mb or search.pins.get("bucket_mb", 25.0)),
                **search.model.precision)  # what was priced is what runs
    plan.loss_parallel = search.model.loss_parallel  # the loss the tables priced (`ShardInfo.loss`)
    if c.tp > 1:
        info = search.model.sharding(c.tp)
        sol = info.solution
        plan.strategies["tp"] = dict(info.strategies)
        for name, p in info.param_placements.items():
            plan.param_layouts[name] = Layout.replicated(axes).replace("tp", p)
        for key, p in info.node_placements.items():
            plan.node_layouts[key] = Layout.replicated(axes).replace("tp", p)
        plan.extra["shard"] = {"tp": {"compute_s": sol.compute_s, "comm_s": sol.comm_s, "gap": sol.gap,
                                      "status": sol.status}}
        plan.notes.append(sol.summary().replace(f", {sol.seconds:.2f} s;", ";"))  # no timings in a plan
    if c.pp > 1:
        plan.schedule = c.schedule
        plan.split_points = list(ev.split_points)
        if c.virtual > 1 and c.schedule == "interleaved_1f1b":
            plan.extra["pp_virtual"] = c.virtual
    if c.cp > 1:  # the exchange the cost model priced: parallelize and cost.estimate read this entry
        entry = copy.deepcopy(search.model.context_entry(c))
        plan.extra["context"] = entry
        plan.notes += entry["notes"]
    if c.ep > 1 and search.model.moe_blocks:  # the experts' entry parallelize runs and cost.estimate reads
        entry = search.model.expert_plan_entry(c)
        plan.extra["expert"] = entry
        plan.notes += entry["notes"]
        grouped_expert_layouts(plan, axes)  # grouped experts: this rank's rows, as build writes them
    if ev.recompute:
        plan.recompute = {u: ev.recompute[u] for u in sorted(ev.recompute, key=search.model.unit_names.index)}
        sel = {u: selective_keys(search.model, u) for u, mode in plan.recompute.items() if mode == "selective"}
        if sel:  # the nodes a selective block keeps, as the planner priced them (`search.plan_selective`)
            plan.extra["recompute_save"] = sel
    elif isinstance(search.recompute, Mapping):
        plan.recompute = dict(search.recompute)
    fus = search.pins.get("fusions")
    plan.fusions = list(fus) if fus is not None else search.planned_fusions(c)
    try:
        load_profile(search.hw.name)
        plan.extra["hardware"] = search.hw.name
    except ValueError:
        pass
    plan.predicted = plain({
        "source": "planner", "hardware": search.hw.name, "step_s": ev.step_s, "tokens_per_s": ev.tokens_per_s,
        "throughput_unit": search.model.tokens_per_row()[1], "mfu": ev.mfu, "peak_bytes": ev.peak_bytes,
        "memory_limit_bytes": search.limit, "fits": ev.feasible, "memory_bytes": dict(ev.memory),
        "bytes_sent_per_axis": {a: v["bytes_sent"] for a, v in ev.comm.items()},
        "comm_per_axis": ev.comm, "compute_s": ev.compute_s, "bubble": ev.bubble, "recompute_s": ev.recompute_s,
        "optimizer_s": ev.optimizer_s, "peak_bytes_per_pp_rank": ev.rank_peaks,
        "compute_dtype": search.model.main_dtype, "offload": search.model.offload,
    })
    plan.notes.append(f"joint planner: {c.label()}, predicted step {seconds(ev.step_s)}, peak "
                      f"{gib(ev.peak_bytes)} of {gib(search.limit)} per rank")
    if ev.bucket_mb is not None:
        plan.notes.append(f"gradient buckets of {ev.bucket_mb:g} MiB: the fastest of {', '.join(f'{b:g}' for b in BUCKET_MB)}"
                          f" MiB for this plan")
    pr = search.model.precision
    plan.notes.append(f"precision priced: parameters and compute {pr['param_dtype'] or 'as captured'}, masters "
                      f"{pr['master_dtype'] or 'none'}, gradient reduction {pr['reduce_dtype'] or 'as the gradients'}"
                      f", optimizer states {pr['optim_dtype'] or 'as the parameters'}"
                      + (", masters and optimizer states offloaded to the host" if pr["offload"] else ""))
    plan.notes += report.reasons()
    return plan
