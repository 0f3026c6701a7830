"""Plan a model for a mesh on given hardware without weights: what `autopar plan`, `dump` and
`tune` call.

  capture_meta(source, batch, seq)         the model built and captured on the meta device
  plan_model(source, mesh=.. | world_size=.., hardware=..)  -> PlanResult: the best Plan and
                                           its ranked alternatives, each with predictions
  rank_graph(global_gm, plan, rank)        one rank's rewritten graph (on meta), as
                                           `autopar.parallelize` would run it
  predict(global_gm, plan, hardware)       the cost model's prediction of a plan
  check_plan_fits(model, plan, batch, seq) a plan file against the model it is run with (meta)

Which search runs: the joint planner (`autopar.search.planner.plan_for`) when it imports
(its alternatives come back as summaries: `materialise(result, i)` re-plans one with its
choices pinned to get the complete Plan); otherwise the fallback, which plans each mesh the way `autopar.parallelize` does — the
sharding ILP on the tp axis, the stage DP on the pp axis — and costs every candidate with
`autopar.cost.estimate` on rank 0's rewritten graph (so the tensor-parallel collectives the
shard pass inserts are in the step time). With `world_size` alone the fallback enumerates
meshes pp x dp x tp (tp up to a node's devices) and ZeRO stages; with a mesh it enumerates
the ZeRO stages (and micro-batch counts for pp). Candidates that do not fit the device (or
`memory_limit`) rank after those that do; ties break on the order they were made in.
`PlanResult.planner` says which search ran and why.

With `world_size` the model is captured as `autopar.parallelize` captures it for
`autopar.mesh(world_size=N)`: with a symbolic sequence when context parallelism could be
chosen (`autopar.capture.capture_for_search`), so the joint planner searches cp (ring or
Ulysses) next to tp, pp, dp and ep; a cp plan's rank graphs run the context-parallel passes.
A fixed `--mesh` takes no cp axis (the fallback search does not plan it).

Plans are stamped with what made them in `plan.extra["cli"]` (model, batch, seq, hardware),
which `autopar run` and `verify` read back, and with the captured graph's fingerprint
(`plan.graph`, autopar/build/plan_check.stamp), so that a plan file given to another model
is refused. A fixed mesh is checked against the model before the search
(`plan_check.check_mesh_fits`: an axis that cannot split it is a ValueError naming the
dimension and the sizes that can); an axis of size > 1 left sharding nothing gets a warning
in the best plan's notes. A mesh with an ep axis gets its expert entry
(`plan.extra["expert"]`, as parallelize makes it) and rank graphs run the expert pass.

Reads and writes node.meta only through the passes and searches it calls. Deterministic:
the same inputs give the same plans and the same order.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from autopar.capture import capture
from autopar.cost import Estimate, Hardware, analyze, estimate, load_profile
from autopar.tools.model_source import ModelSource
from autopar.passes.expert import expert
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.shard import shard
from autopar.passes.split_batch import split_batch
from autopar.passes.sync_batchnorm import sync_batchnorm
from autopar.passes.zero import zero
from autopar.runtime.mesh import AXIS_ORDER, Mesh

from autopar.build.plan_check import axis_notes, check_mesh_fits, stamp

KNOWN_AXES = ("pp", "dp", "ep", "tp")


@dataclass
class Candidate:
    plan: Plan
    predicted: dict[str, Any]  # step_s, peak_bytes, capacity_bytes, fits, mfu ... (per rank)
    estimate: Estimate | None = None  # rank 0's, when costed here

    @property
    def step_s(self) -> float:
        return float(self.predicted.get("step_s", math.inf))

    @property
    def peak_bytes(self) -> float:
        return float(self.predicted.get("peak_bytes", math.nan))

    @property
    def fits(self) -> bool:
        return bool(self.predicted.get("fits", True))

    def row(self) -> dict[str, Any]:
        """One line of the alternatives table (JSON-ready)."""
        p = self.plan
        return {"mesh": dict(p.mesh), "zero_stage": p.zero_stage, "n_microbatches": p.n_microbatches,
                "schedule": p.schedule, "split_points": list(p.split_points), "step_s": self.step_s,
                "peak_bytes": self.peak_bytes, "fits": self.fits, "mfu": self.predicted.get("mfu")}


@dataclass
class PlanResult:
    source: ModelSource
    hardware: Hardware
    planner: str  # "joint" | "fallback"
    planner_note: str
    global_gm: fx.GraphModule
    batch: int
    seq: int | None
    candidates: list[Candidate]  # best first
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    report: Any = None  # the joint planner's PlanReport
    world_size: int = 0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self, top: int = 1) -> dict[str, Any]:
        d = {"model": self.source.describe(), "hardware": self.hardware.name, "planner": self.planner,
             "planner_note": self.planner_note, "batch": self.batch, "seq": self.seq,
             "capture": self.global_gm.meta.get("autopar_capture", {}).get("path"),
             "plan": self.best.plan.to_dict(), "predicted": _jsonable(self.best.predicted),
             "alternatives": [_jsonable(c.row()) for c in self.candidates[:max(top, 1)]], "notes": self.notes}
        if self.report is not None and hasattr(self.report, "to_dict"):
            d["planner_report"] = _jsonable(self.report.to_dict())
        return d


# ------------------------------------------------------------------------ parsing
def parse_mesh(text: str) -> dict[str, int]:
    """'dp=8,tp=8' -> {"dp": 8, "tp": 8} in the canonical axis order (pp, dp, ep, tp). Every
    axis the README documents is accepted: pp, dp, ep, tp."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--mesh is empty; write it as name=size pairs, e.g. dp=8,tp=8")
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: each axis is name=size with a positive size, e.g. dp=8,tp=8 "
                             f"(got {part!r})")
        axis = axis.strip()
        if axis not in KNOWN_AXES:
            what = (" (context parallelism: give --world-size instead, and the joint planner puts a cp axis on "
                    "the mesh when the sequence is long enough to pay for it; or run autopar.parallelize on a mesh "
                    "with a cp axis)") if axis == "cp" else ""
            raise ValueError(f"--mesh {text!r}: axis {axis!r} is not one this version runs{what}; the axes are "
                             f"{', '.join(KNOWN_AXES)}")
        if axis in out:
            raise ValueError(f"--mesh {text!r} names axis {axis!r} twice")
        out[axis] = int(size)
    if not out:
        raise ValueError("--mesh is empty; write it as name=size pairs, e.g. dp=8,tp=8")
    out.setdefault("dp", 1)
    return {a: out[a] for a in AXIS_ORDER if a in out}


def default_batch(world_size: int) -> int:
    """A global batch every factorisation of the world can split: 8, or the world size when larger."""
    return max(8, world_size)


def batch_split(plan: Plan) -> int:
    """Rows one global batch splits into under `plan`: dp x ep x micro-batches."""
    return plan.dp * plan.mesh.get("ep", 1) * plan.n_microbatches


def check_batch_split(batch: int, plan: Plan, what: str = "--batch") -> None:
    """ValueError when `batch` rows do not split under `plan` (naming `what` and a multiple that does)."""
    k = batch_split(plan)
    if batch % k:
        raise ValueError(f"{what} {batch} does not divide by dp x ep x micro-batches = {k} under the plan's mesh "
                         f"{plan.mesh}; use a multiple of {k} (e.g. {k * max(1, -(-batch // k))})")


def check_plan_fits(model_text: str, plan: Plan, batch: int, seq: int | None, small_seq: bool = False) -> None:
    """Capture the model `model_text` names on meta and check that `plan` fits it (every name
    and size it gives; its fingerprint): a ValueError naming what does not fit, before any
    process starts. `small_seq`: with no `seq`, capture at the length `verify` runs at."""
    from autopar.build.plan_check import check_plan_against_graph  # noqa: PLC0415
    from autopar.tools.model_source import resolve  # noqa: PLC0415

    source = resolve(model_text)
    if seq is None and small_seq and source.default_seq:
        seq = min(source.default_seq, 16)
    gm = capture_meta(source, batch, seq if seq is not None else source.default_seq,
                      dynamic_seq=plan.mesh.get("cp", 1) > 1)  # a cp plan runs on a symbolic sequence
    check_plan_against_graph(plan, gm, dict(plan.mesh))


def check_mesh_for_model(model_text: str, mesh: Mapping[str, int], batch: int | None, seq: int | None) -> int:
    """Capture the model on meta and check that the fixed `mesh` can split it
    (`plan_check.check_mesh_fits`) and `batch` (dp x ep); returns the batch (a default that
    splits when None). ValueError naming what does not fit."""
    from autopar.tools.model_source import resolve  # noqa: PLC0415

    k = mesh.get("dp", 1) * mesh.get("ep", 1)
    if batch is not None and batch % k:
        raise ValueError(f"--batch {batch} does not divide by dp x ep = {k} on the mesh {_mesh_text(mesh)}; use a "
                         f"multiple of {k} (e.g. {k * max(1, -(-batch // k))})")
    batch = batch or k * max(1, -(-default_batch(math.prod(mesh.values())) // k))
    source = resolve(model_text)
    check_mesh_fits(capture_meta(source, batch, seq if seq is not None else source.default_seq), mesh)
    return batch


# ------------------------------------------------------------------------ capture
def capture_meta(source: ModelSource, batch: int, seq: int | None, *, search_world: int | None = None,
                 dynamic_seq: bool = False) -> fx.GraphModule:
    """Build `source` on the meta device and capture it at (batch, seq) with a dynamic batch dim.

    `search_world`: the capture the joint planner searches `search_world` ranks on, as
    `autopar.parallelize` makes it for `autopar.mesh(world_size=N)`: the sequence symbolic when
    context parallelism could be chosen (`autopar.capture.capture_for_search`; the reason when
    not is in `gm.meta["autopar_capture"]["sequence"]`). `dynamic_seq`: the sequence symbolic
    (a plan with a cp axis runs on such a graph)."""
    from autopar.capture import CaptureError, capture_for_search  # noqa: PLC0415
    from autopar.input_checks import explain_capture_failure  # noqa: PLC0415
    from autopar.runtime.mesh import default_device_type  # noqa: PLC0415

    with torch.device("meta"):
        model = source.build()
    inputs, _ = source.example_batch(batch, seq_len=seq, device="meta")
    try:
        # traced on fake tensors of the device it will run on here (no memory): the same graph the
        # run captures, so a plan's node names fit it (on meta, attention takes other code paths)
        if search_world is not None:
            return capture_for_search(model, inputs, search_world, device=default_device_type())
        return capture(model, inputs, device=default_device_type(), dynamic_seq=dynamic_seq)
    except CaptureError:
        why = explain_capture_failure(model, inputs, name=f"{source.name}'s inputs")
        if why is None:
            raise
        raise ValueError(f"cannot capture {source.text}: {why}") from None


# ------------------------------------------------------------------------ one plan
def _fresh(gm: fx.GraphModule) -> fx.GraphModule:
    import copy

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


def shard_plan(plan: Plan, global_gm: fx.GraphModule, hardware: Hardware) -> None:
    """Fill the plan's tp strategies and layouts as `autopar.parallelize` does (its own code,
    so that a plan made here runs unchanged)."""
    from autopar.search.shard_search import search_sharding

    search_sharding(plan, global_gm, Mesh(dict(plan.mesh)), hardware)


def expert_plan(plan: Plan, global_gm: fx.GraphModule) -> None:
    """Fill plan.extra["expert"] (the MoE blocks and their ep dispatch) as `autopar.parallelize`
    does for a mesh with an ep axis; ValueError when the model has no MoE block or ep does
    not divide its experts."""
    if "expert" in plan.extra or plan.mesh.get("ep", 1) < 2:
        return
    from autopar.search.expert import plan_experts  # noqa: PLC0415

    plan.extra["expert"] = plan_experts(global_gm, dict(plan.mesh), dp_axis=plan.dp_axis,
                                        n_microbatches=plan.n_microbatches)
    plan.notes += plan.extra["expert"].get("notes", [])


def stage_plan(plan: Plan, global_gm: fx.GraphModule, hardware: Hardware, memory_limit: float | None = None) -> None:
    """Choose the pipeline split (plan.split_points, plan.extra["pipeline"]) for a pp mesh."""
    from autopar.build.pipeline import choose_stages

    if plan.schedule is None:
        plan.schedule = "1f1b"
    choose_stages(global_gm, plan, Mesh(dict(plan.mesh)), hardware=hardware, memory_limit=memory_limit)


def rank_graph(global_gm: fx.GraphModule, plan: Plan, rank: int, *, with_recompute: bool = True
               ) -> tuple[fx.GraphModule, list]:
    """Rank `rank`'s rewritten graph (split_batch, the context-parallel passes when the plan has
    a cp axis, shard, expert, zero, and recompute when the plan has it and no pipeline, as
    parallelize runs them) on meta, and the pass records."""
    from autopar.passes.context_attention import context_attention  # noqa: PLC0415
    from autopar.passes.context_positions import context_positions  # noqa: PLC0415

    mesh = Mesh(dict(plan.mesh))
    ctx = PassContext(plan=plan, mesh_sizes=dict(mesh.sizes), coords=mesh.coords(rank))
    pm = PassManager([split_batch, context_positions, shard, context_attention, expert, sync_batchnorm, zero])
    gm = pm.run(_fresh(global_gm), ctx, tag=f"rank{rank}")
    records = list(pm.records)
    if with_recompute and plan.mesh.get("pp", 1) == 1 and any(v != "none" for v in plan.recompute.values()):
        from autopar.passes.recompute import recompute  # noqa: PLC0415 - as parallelize: after the prediction

        rpm = PassManager([recompute])
        gm = rpm.run(gm, ctx, tag=f"rank{rank}_recompute")
        records += rpm.records
    return gm, records


def predict(global_gm: fx.GraphModule, plan: Plan, hardware: Hardware | str, *,
            local_gm: fx.GraphModule | None = None, gc=None) -> tuple[dict[str, Any], Estimate]:
    """The cost model's figures for `plan`: rank 0's rewritten graph costed per micro-batch
    (tensor-parallel collectives included), the pipeline's simulated step when pp > 1."""
    hw = load_profile(hardware)
    if gc is None:
        if local_gm is None:  # before recompute: the cost model sees checkpointed regions as opaque calls
            local_gm, _ = rank_graph(global_gm, plan, 0, with_recompute=False)
        gc = analyze(local_gm, hw)
    est = estimate(gc, plan, hw, batch_is_global=True)
    pred = est.summary()
    pipe = plan.extra.get("pipeline")
    if plan.mesh.get("pp", 1) > 1 and pipe:
        pred.update(step_s=pipe["step_s"], pipeline_bubble=pipe["bubble"],
                    peak_bytes_per_pp_rank=pipe["rank_memory_bytes"])
        pred["peak_bytes"] = max(pipe["rank_memory_bytes"])
        pred["fits"] = pred["peak_bytes"] <= pred["capacity_bytes"]
    for axis, info in plan.extra.get("shard", {}).items():
        pred[f"{axis}_search_comm_s"] = float(info["comm_s"])
    return pred, est


# ------------------------------------------------------------------------ search
def meshes_for(world_size: int, hardware: Hardware, n_units: int) -> list[dict[str, int]]:
    """pp x dp x tp factorisations of `world_size`: tp a power of two up to a node's devices,
    pp at most the number of pipeline units; data parallel first, then more tp, then more pp."""
    out = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= hardware.gpus_per_node and world_size % t == 0):
        for pp in (p for p in range(1, world_size // tp + 1) if (world_size // tp) % p == 0 and p <= n_units):
            dp = world_size // tp // pp
            m = {"pp": pp, "dp": dp, "tp": tp}
            out.append({a: s for a, s in m.items() if s > 1 or a == "dp"})
    return sorted(out, key=lambda m: (m.get("pp", 1), m.get("tp", 1)))


def _fallback(global_gm, meshes, hw, *, batch, zero_stage, n_microbatches, schedule, memory_limit,
              step: Callable[[str], None], moe_aux_stats: str = "global") -> tuple[list[Candidate], list[str]]:
    from autopar.build.plan_check import check_moe_aux_stats, router_stat_keys
    from autopar.passes.split_pipeline import pipeline_units

    cands: list[Candidate] = []
    notes: list[str] = []
    capacity = float(memory_limit) if memory_limit else None
    one_micro = moe_aux_stats == "global" and bool(router_stat_keys(global_gm))  # MoE statistics over the whole batch
    for mesh in meshes:
        pp, dp = mesh.get("pp", 1), mesh.get("dp", 1)
        mbs = [n_microbatches] if n_microbatches else ([2 * pp] if pp > 1 and not one_micro else [1])
        zs = [zero_stage] if zero_stage is not None else ([0, 1, 2, 3] if dp > 1 and pp == 1 else [0])
        for mb in mbs:
            if batch % (dp * mb):
                notes.append(f"mesh {mesh} with {mb} micro-batches skipped: the global batch {batch} does not "
                             f"divide by dp x micro-batches = {dp * mb}")
                continue
            step(f"planning {_mesh_text(mesh)}" + (f", {mb} micro-batches" if pp > 1 else ""))
            base = Plan(mesh=dict(mesh), dp_axis="dp", n_microbatches=mb, schedule=schedule if pp > 1 else None)
            try:
                base.notes += check_moe_aux_stats(base, global_gm, moe_aux_stats)  # refuses mb > 1 under "global"
                if mesh.get("ep", 1) > 1:
                    expert_plan(base, global_gm)
                if mesh.get("tp", 1) > 1:
                    shard_plan(base, global_gm, hw)
                if pp > 1:
                    if len(pipeline_units(global_gm)) < pp:
                        raise ValueError(f"the model has fewer pipeline units than pp={pp}")
                    stage_plan(base, global_gm, hw, memory_limit)
                local, _ = rank_graph(global_gm, base, 0, with_recompute=False)
                gc = analyze(local, hw)
            except ValueError as e:
                notes.append(f"mesh {mesh} skipped: {e}")
                continue
            for z in zs:
                plan = base.pin(zero_stage=z)
                pred, est = predict(global_gm, plan, hw, gc=gc)
                if capacity is not None:
                    pred["fits"] = pred["peak_bytes"] <= capacity
                plan.predicted = _jsonable(pred)
                cands.append(Candidate(plan, pred, est))
    return cands, notes


def _joint_pred(ev: Mapping[str, Any], hw: Hardware) -> dict[str, Any]:
    """A planner Evaluation (as a dict) in the shape of `Estimate.summary()`."""
    comm = ev.get("comm") or {}
    return {"source": "planner", "hardware": hw.name, "step_s": ev["step_s"], "peak_bytes": ev["peak_bytes"],
            "capacity_bytes": float(hw.device.memory_bytes), "memory_limit_bytes": ev.get("limit_bytes"),
            "fits": bool(ev.get("feasible", True)), "mfu": ev.get("mfu"), "compute_s": ev.get("compute_s"),
            "optimizer_s": ev.get("optimizer_s"), "pipeline_bubble": ev.get("bubble") or 0.0,
            "comm_s": sum(v.get("time_s", 0.0) for v in comm.values()),
            "comm_exposed_s": sum(v.get("exposed_s", 0.0) for v in comm.values()),
            "memory_bytes": dict(ev.get("memory") or {})}


def _joint(global_gm, mesh_or_world, hw, *, batch, pins, memory_limit, top,
           moe_aux_stats: str = "global") -> tuple[list[Candidate], Any]:
    """The joint planner's plan and its alternatives. Alternatives come back from the planner
    as summaries; they are Plans here with mesh, ZeRO stage, micro-batches, schedule, split
    points and recompute set, marked `extra["partial"]` until `materialise` re-plans them with
    those as pins (which fills in the sharding)."""
    from autopar.search.planner import plan_for  # noqa: PLC0415 - optional

    plan, report = plan_for(global_gm, mesh_or_world, hw, pins=pins or None, memory_limit=memory_limit,
                            global_batch=batch, top_k=max(top, 1), moe_aux_stats=moe_aux_stats)
    pred = {**_joint_pred(report.chosen, hw), **{k: v for k, v in plan.predicted.items() if k != "source"}}
    cands = [Candidate(plan, pred)]
    for ev in report.alternatives[1:]:
        c = ev["candidate"]
        mesh = {a: int(c[a]) for a in ("pp", "dp", "ep", "cp", "tp") if int(c.get(a, 1)) > 1} or {"dp": 1}
        if "dp" not in mesh:
            mesh = {**({"pp": mesh["pp"]} if "pp" in mesh else {}), "dp": 1,
                    **{a: v for a, v in mesh.items() if a != "pp"}}
        p = Plan(mesh=mesh, dp_axis="dp", zero_stage=int(c["zero_stage"]) if c["dp"] * int(c.get("cp", 1)) > 1 else 0,
                 n_microbatches=int(c["n_microbatches"]), schedule=c["schedule"] if c["pp"] > 1 else None,
                 split_points=list(ev.get("split_points") or []),
                 recompute=dict(ev.get("recompute") or {}))  # unit -> "full" | "selective"
        p.extra["partial"] = ("an alternative as the joint planner summarised it: materialise() re-plans it "
                              "with these choices pinned to fill in its sharding")
        p.extra["joint_pins"] = {k: v for k, v in {
            "tp": c["tp"], "pp": c["pp"], "dp": c["dp"], "ep": c.get("ep", 1), "cp": c.get("cp"),
            "context_method": c.get("context_method") if int(c.get("cp", 1)) > 1 else None, "zero_stage": p.zero_stage,
            "n_microbatches": p.n_microbatches, "schedule": p.schedule,
            "split_points": p.split_points or None}.items() if v is not None}
        p.predicted = _jsonable(_joint_pred(ev, hw))
        cands.append(Candidate(p, dict(p.predicted)))
    return cands, report


def materialise(result: "PlanResult", i: int) -> Plan:
    """Candidate i of `result` as a complete Plan (the joint planner's alternatives are re-planned
    with their choices pinned; other candidates are complete already)."""
    c = result.candidates[i]
    if "partial" not in c.plan.extra:
        return c.plan
    from autopar.search.planner import plan_for  # noqa: PLC0415

    pins = dict(c.plan.extra["joint_pins"])
    plan, _ = plan_for(result.global_gm, result.world_size, result.hardware, pins=pins,
                       global_batch=result.batch, top_k=1,
                       moe_aux_stats=result.candidates[0].plan.extra.get("moe_aux_stats", "global"))
    plan.extra["cli"] = dict(c.plan.extra.get("cli", {}))
    stamp(plan, result.global_gm)
    return plan


def plan_model(source: ModelSource, *, mesh: Mapping[str, int] | None = None, world_size: int | None = None,
               hardware: str | Hardware = "h100-sxm", batch: int | None = None, seq: int | None = None,
               zero_stage: int | None = None, n_microbatches: int | None = None, schedule: str | None = None,
               memory_limit: float | None = None, top: int = 1, planner: str = "auto",
               step: Callable[[str], None] | None = None, global_gm: fx.GraphModule | None = None,
               moe_aux_stats: str = "global", recompute: str | None = None) -> PlanResult:
    """Capture `source` on meta and plan it for `mesh` (or any mesh of `world_size` ranks).

    Args:
        planner: "auto" (the joint planner when importable, else the fallback), "joint",
            "fallback".
        step: called with a line of progress before each stage of the work.
        global_gm: a graph already captured at (batch, seq), to skip capturing again.
        moe_aux_stats: an MoE model's auxiliary statistics, "global" (one micro-batch) or
            "micro_batch" (`autopar.parallelize`'s keyword of the same name).
        recompute: pin the blocks' recompute ("auto", "none", "full", "selective"; the planner's pin).
    """
    step = step or (lambda _msg: None)
    hw = load_profile(hardware)
    if (mesh is None) == (world_size is None):
        raise ValueError("give a mesh (--mesh dp=8,tp=8) or a world size (--world-size 64), one of the two")
    world = math.prod(mesh.values()) if mesh else int(world_size)
    if world < 1:
        raise ValueError(f"the world size must be >= 1, got {world}")
    if mesh:
        k = mesh.get("dp", 1) * mesh.get("ep", 1) * (n_microbatches or 1)
        split = " x ".join(f"{a}={mesh[a]}" for a in ("dp", "ep") if a in mesh) + f" x micro-batches={n_microbatches or 1}"
        if batch is not None and batch % k:
            raise ValueError(f"--batch {batch} does not divide by {split} = {k}; use a multiple of {k} "
                             f"(e.g. {k * max(1, -(-batch // k))})")
        batch = batch or k * max(1, -(-default_batch(world) // k))  # the smallest multiple of k from 8 up
    batch = batch or default_batch(world)
    seq = seq if seq is not None else source.default_seq
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    if global_gm is None:
        step(f"capturing {source.name} on meta (batch {batch}" + (f", seq {seq})" if seq else ")"))
        global_gm = capture_meta(source, batch, seq, search_world=None if mesh else world)  # cp searched for N ranks
    secs["capture_s"] = time.perf_counter() - t0
    if mesh:
        check_mesh_fits(global_gm, mesh)  # an axis that cannot split this model: its dimension, sizes that can
    pins = {k: v for k, v in {"zero_stage": zero_stage, "n_microbatches": n_microbatches,
                              "schedule": schedule, "recompute": recompute}.items() if v is not None}
    t0 = time.perf_counter()
    report, cands, notes = None, [], []
    kind, why = "fallback", ""
    if planner in ("auto", "joint"):
        try:
            import autopar.search.planner  # noqa: F401, PLC0415
            kind = "joint"
        except ImportError as e:
            if planner == "joint":
                raise ValueError(f"--planner joint: autopar.search.planner does not import ({e})") from None
            why = f"autopar.search.planner is not importable ({e})"
    if kind == "joint":
        step("searching with the joint planner")
        try:
            cands, report = _joint(global_gm, dict(mesh) if mesh else world, hw, batch=batch, pins=pins,
                                   memory_limit=memory_limit, top=top, moe_aux_stats=moe_aux_stats)
            note = "joint planner (autopar.search.planner.plan_for): mesh, sharding, stages, ZeRO, recompute at once"
        except ValueError:
            raise  # the request itself is impossible: the planner's message says why
        except Exception as e:  # noqa: BLE001 - a planner bug must not stop planning; it is reported
            if planner == "joint":
                raise
            kind, why = "fallback", f"the joint planner failed ({type(e).__name__}: {str(e)[:200]})"
    if kind != "joint":
        if recompute not in (None, "auto"):
            raise ValueError(f"--recompute {recompute} is a pin of the joint planner; the fallback plans recompute "
                             f"only through parallelize's memory_budget" + (f" ({why})" if why else ""))
        from autopar.passes.split_pipeline import pipeline_units

        meshes = [dict(mesh)] if mesh else meshes_for(world, hw, len(pipeline_units(global_gm)))
        cands, notes = _fallback(global_gm, meshes, hw, batch=batch, zero_stage=zero_stage,
                                 n_microbatches=n_microbatches, schedule=schedule or "1f1b",
                                 memory_limit=memory_limit, step=step, moe_aux_stats=moe_aux_stats)
        what = "the given mesh" if mesh else f"{len(meshes)} meshes of {world} ranks"
        note = (f"fallback: {what} planned as autopar.parallelize does (sharding ILP on tp, stage DP on pp), "
                f"ZeRO stages enumerated, each costed by autopar.cost.estimate"
                + (f"; {why}" if why else ""))
    secs["search_s"] = time.perf_counter() - t0
    if not cands:
        raise ValueError("no plan is possible: " + "; ".join(notes or ["the search returned nothing"]))
    order = sorted(range(len(cands)), key=lambda i: (not cands[i].fits, cands[i].step_s, i))
    cands = [cands[i] for i in order]
    made = {"model": source.text, "batch": batch, "seq": seq, "hardware": hw.name, "planner": kind}
    for c in cands:
        c.plan.extra["cli"] = dict(made)
        stamp(c.plan, global_gm)  # the graph's fingerprint: `run` and `verify` refuse it for another model
    best = cands[0].plan
    if best.mesh.get("ep", 1) > 1 and "partial" not in best.extra:
        expert_plan(best, global_gm)  # so that the plan file runs, and dumps, as parallelize would
    for n in axis_notes(best):
        if n not in best.notes:
            best.notes.append(n)
    if not cands[0].fits:
        notes.append(f"no candidate fits: the best needs {cands[0].peak_bytes / 2**30:.1f} GiB per rank of "
                     f"{cands[0].predicted.get('capacity_bytes', 0) / 2**30:.1f} GiB; use more ranks, pp or ZeRO-3")
    return PlanResult(source, hw, kind, note, global_gm, batch, seq, cands, secs, notes, report, world)


# ------------------------------------------------------------------------ helpers
def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.items())


def _jsonable(x: Any) -> Any:
    """numpy scalars and tuples made plain for json."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and not isinstance(x, torch.Tensor):
        return x.item()
    if isinstance(x, float) and math.isinf(x):
        return None
    return x
