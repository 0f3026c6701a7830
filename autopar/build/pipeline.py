"""Pipeline stages: choose them, cut the graph into them, draw the schedule.

`cut_pipeline(global_gm, local_gm, plan, mesh)` is what `autopar.build.program.build_program`
calls when the mesh has a pp axis larger than one:

  1. the schedule: `plan.schedule` (default "1f1b"), with its stages per rank (2 for "zbv";
     for "interleaved_1f1b" `plan.extra["pp_virtual"]`, default 2, or what complete split
     points imply);
  2. the split: `autopar.search.stages.search_stages` on the captured global graph, costed
     per micro-batch on the plan's hardware, with `plan.split_points` as pins (all of them:
     the user's split is only evaluated, not checked against memory). It fills
     `plan.split_points`, a note, and `plan.extra["pipeline"]` (stage times, memory per
     rank, simulated step time and bubble: what the Gantt chart is drawn from); the per-rank
     memory is then `cost.estimate`'s walk of the chosen split (every schedule: each rank's
     own actions, its virtual stages summed);
  3. the cut: the `split_pipeline` pass on this rank's graph, through a PassManager (timed,
     verified, dumped with `AUTOPAR_DUMP`). With an ep axis the graph it cuts has been through
     the expert pass already (`passes/expert.py`, on the whole per-rank graph: dispatch,
     combine, router statistics averaged over dp and ep, gradient scaling of the parameter
     reads), so each stage's MoE blocks hold this rank's experts and their all-to-alls run over
     the stage's ep group; the cut keeps the expert parameter names
     (`gm.meta["autopar_expert"]`) for the program.

The stages then become parts of the one per-rank `runtime.program.Program`, as a plan without
pp makes one stage of the whole graph (build/program.py).

Stage graphs of other ranks are returned for dumps with their parameters on the meta
device, so they hold no memory. `write_schedule_svg(plan, out_dir)` draws the schedule of a
plan (Gantt chart per rank, `autopar.build.gantt`) and writes its text grid next to it;
`write_stage_graphs` writes every stage's code.

Reads and writes node.meta only through the passes it runs; writes plan.split_points,
plan.schedule (when unset), plan.notes and plan.extra["pipeline"].
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autopar.build.gantt import write_gantt_svg
from autopar.build.rank0 import on_rank0
from autopar.passes.dump import write_graph
from autopar.passes.pass_manager import PassContext, PassManager, PassRecord
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import PipelineInfo, split_pipeline
from autopar.runtime.mesh import Mesh
from autopar.runtime.schedules import SCHEDULES, fuse_backward, make_schedule, simulate

__all__ = ["PipelineCut", "choose_stages", "cut_pipeline", "pipeline_shape", "write_schedule_svg", "write_stage_graphs"]

PP_AXIS = "pp"


def pipeline_shape(plan: Plan) -> tuple[str, int, int]:
    """(schedule name, pp ranks, stages per rank) of a plan; ValueError when they disagree."""
    pp = plan.mesh.get(PP_AXIS, 1)
    name = (plan.schedule or "1f1b").lower().replace("-", "_")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {plan.schedule!r}; choose one of {sorted(SCHEDULES)}")
    given = len(plan.split_points) + 1 if plan.split_points else None
    if name == "zbv":
        v = 2
    elif name == "interleaved_1f1b":
        v = int(plan.extra.get("pp_virtual", 0) or 0)
        if not v:
            v = given // pp if given and given % pp == 0 and given // pp > 1 else 2
    else:
        v = 1
    if given is not None and given > pp * v:
        raise ValueError(f"{len(plan.split_points)} split points make {given} stages, but schedule {name!r} on "
                         f"pp={pp} runs {pp * v} ({v} per rank); give at most {pp * v - 1} split points")
    return name, pp, v


def _hardware(plan: Plan, mesh: Mesh, hardware: Any) -> Any:
    if hardware is not None:
        return hardware
    if plan.extra.get("hardware"):
        return plan.extra["hardware"]
    return "cpu-gloo" if mesh.device_type == "cpu" else "h100-sxm"


def _global_rows(gc, gm: fx.GraphModule) -> int | None:
    for k, v in gc.values().items():
        if str(k) == "b":
            return int(v)
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], int):
            return int(val.shape[0])
    return None


def choose_stages(global_gm: fx.GraphModule, plan: Plan, mesh: Mesh, *, hardware: Any = None,
                  memory_limit: float | None = None):
    """Run the stage search for `plan` (pins = plan.split_points) and record the result in it."""
    from autopar.cost import analyze
    from autopar.cost.loss_memory import loss_model
    from autopar.cost.memory import CROSS_ENTROPY
    from autopar.search.stages import count_chain, layer_costs, search_stages

    name, pp, v = pipeline_shape(plan)
    S = pp * v
    hw = _hardware(plan, mesh, hardware)
    complete = len(plan.split_points) == S - 1
    gc = None
    try:
        gc = analyze(global_gm, hw)
        rows = _global_rows(gc, global_gm)
        per = plan.dp * plan.mesh.get("ep", 1) * plan.n_microbatches  # ep ranks split the batch too
        micro = rows // per if rows and rows % per == 0 else None
        cp = plan.mesh.get("cp", 1)  # each rank's stages run on 1/cp of every sequence
        seq = next((int(v) // cp for k, v in gc.values().items() if str(k) == "s"), None) if cp > 1 else None
        chain = layer_costs(global_gm, hw, gc=gc, microbatch=micro, zero_stage=plan.zero_stage, dp=plan.dp, seq=seq)
    except Exception as e:  # noqa: BLE001 - a graph the cost model cannot cost still gets a split; it is reported
        gc = None
        chain = count_chain(global_gm)
        memory_limit = math.inf if memory_limit is None else memory_limit
        plan.notes.append(f"the cost model could not cost this graph ({type(e).__name__}: {str(e)[:160]}); "
                          "pipeline stages balanced by node count, memory not checked")
    # the plan's loss on the last stage: gathered logits' cross-entropy, or the vocab-parallel one
    loss = loss_model(gc, plan) if gc is not None else CROSS_ENTROPY
    res = search_stages(chain, pp, n_virtual=v, schedule=name, n_microbatches=plan.n_microbatches,
                        memory_limit=math.inf if complete and memory_limit is None else memory_limit,
                        hardware=hw, mesh=plan.mesh, pins=list(plan.split_points), loss=loss)
    if not complete:
        plan.split_points = list(res.split_points)
        plan.notes.extend(res.notes)
    else:
        plan.notes.append(f"pipeline split points pinned: {list(plan.split_points)}; predicted bottleneck "
                          f"{res.bottleneck_s * 1e3:.3g} ms per micro-batch, simulated step {res.step_s * 1e3:.3g} ms")
    plan.extra["pipeline"] = {
        "schedule": name, "n_ranks": pp, "n_virtual": v, "n_microbatches": plan.n_microbatches,
        "stage_units": res.stage_units, "stage_fwd_s": res.stage_fwd_s, "stage_bwd_s": res.stage_bwd_s,
        "p2p_s": res.p2p_s, "stage_time_s": res.stage_time_s, "rank_memory_bytes": res.rank_memory,
        "memory_limit_bytes": res.memory_limit if math.isfinite(res.memory_limit) else None,
        "step_s": res.step_s, "bubble": res.bubble, "hardware": res.hardware, "search_s": round(res.seconds, 3),
        "rank_memory_source": "stage search",
    }  # fmt: skip
    if gc is not None and any(str(k) == "b" for k in gc.values()):  # a static batch: the global graph is not a rank's
        _estimated_rank_memory(gc, plan, hw, name)
    return res


def _estimated_rank_memory(gc, plan: Plan, hw: Any, schedule: str) -> None:
    """Per-rank peak of the chosen split from `cost.estimate` (each rank's stage graph walked
    with its in-flight micro-batches, the loss on the last: the model checked against measured
    step peaks in tests/dist/test_memory_truth.py) in place of the stage search's coarser walk,
    which only chose the split. Every schedule, virtual stages too: each rank's walk follows
    its own actions (`cost.pipeline_memory.rank_peaks`, what the joint planner ranks by)."""
    import dataclasses  # noqa: PLC0415

    from autopar.build.predict import estimated_pipeline  # noqa: PLC0415
    from autopar.cost import estimate  # noqa: PLC0415

    done = estimated_pipeline(plan)  # build.predict estimated this very split already: no second estimate
    if done is not None:
        info = plan.extra["pipeline"]
        info["rank_memory_search_bytes"] = info["rank_memory_bytes"]
        info["rank_memory_bytes"] = [float(x) for x in done["peak_bytes_per_pp_rank"]]
        info["rank_memory_source"] = "cost.estimate"
        return
    try:
        est = estimate(gc, dataclasses.replace(plan, schedule=schedule), hw, batch_is_global=True)
    except Exception as e:  # noqa: BLE001 - the split stands; its memory stays the search's, and says so
        plan.notes.append(f"per-rank pipeline memory from the stage search: cost.estimate failed on the split "
                          f"({type(e).__name__}: {str(e)[:120]})")
        return
    peaks = est.memory.get("peak_per_pp_rank")
    if peaks:
        info = plan.extra["pipeline"]
        info["rank_memory_search_bytes"] = info["rank_memory_bytes"]
        info["rank_memory_bytes"] = [float(x) for x in peaks]
        info["rank_memory_source"] = "cost.estimate"


@dataclass
class PipelineCut:
    """This rank's part of a pipeline cut (`cut_pipeline`): the schedule's name, the stages in
    the whole pipeline, the stage indices this pp rank holds, every stage's graph (other
    ranks' with meta tensors), the cut's facts (tied weights, boundaries) and the pass records."""

    schedule: str
    n_stages: int
    mine: list[int]
    stage_graphs: list[fx.GraphModule]
    info: PipelineInfo
    records: list[PassRecord]
    expert_params: set[str] = field(default_factory=set)


def cut_pipeline(global_gm: fx.GraphModule, local_gm: fx.GraphModule, plan: Plan, mesh: Mesh, *,
                 hardware: Any = None, memory_limit: float | None = None, dump_dir: str | None = None) -> PipelineCut:
    """Choose the stages and cut this rank's graph into them (see the module docstring).

    Args:
        global_gm: the captured graph at the global batch (what the search costs).
        local_gm: this rank's graph after the data-parallel passes (what is cut).
        plan: the Plan; its mesh has a pp axis. Updated in place (split points, notes, extra).
        mesh: the running Mesh.
        hardware, memory_limit: for the search (default: the plan's `extra["hardware"]`, else
            "cpu-gloo" on CPU meshes and "h100-sxm" otherwise; 90 % of its device memory).
        dump_dir: dump directory for the split pass (also `AUTOPAR_DUMP`).
    """
    name, pp, v = pipeline_shape(plan)
    if pp < 2:
        raise ValueError(f"a pipeline cut needs a mesh with a pp axis of size >= 2, got {plan.mesh}")
    if mesh.size(PP_AXIS) != pp:
        raise ValueError(f"the plan's pp={pp} differs from the mesh's {mesh}")
    if plan.schedule is None:
        plan.schedule = "1f1b"
        plan.notes.append("pipeline schedule 1f1b (default; pin `schedule` for gpipe, interleaved_1f1b, zb_h1, zbv)")
    if plan.n_microbatches < pp:
        plan.notes.append(f"only {plan.n_microbatches} micro-batches for {pp} pipeline ranks: most of the step is "
                          f"bubble; use n_microbatches >= {pp}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    _choose_on_rank0(global_gm, plan, mesh, hardware, memory_limit)
    ctx = PassContext(plan=plan, mesh_sizes=dict(mesh.sizes), coords=mesh.coords(rank))
    pm = PassManager([split_pipeline], dump_dir=dump_dir)
    pipe = pm.run(local_gm, ctx, tag=f"rank{rank}_pipeline")
    info: PipelineInfo = pipe.meta["autopar_pipeline"]
    stage_graphs = [getattr(pipe, f"stage{s}") for s in range(info.n_stages)]
    placement = make_schedule(name, pp, pp, v if v > 1 else None)
    mine = placement.stages_of(mesh.coords(rank)[PP_AXIS])
    for s in range(info.n_stages):
        if s not in mine:
            _to_meta(stage_graphs[s])
    if info.tied:
        plan.notes.append("tied weights across stages (one value, gradients summed): "
                          + ", ".join(" = ".join(f"{n}@stage{st}" for st, n in g) for g in info.tied))
    experts = set((pipe.meta.get("autopar_expert") or {}).get("expert_params", ()))  # the expert pass ran before
    return PipelineCut(name, info.n_stages, list(mine), stage_graphs, info, list(pm.records), experts)


def _choose_on_rank0(global_gm, plan: Plan, mesh: Mesh, hardware, memory_limit) -> None:
    """Rank 0 searches and every rank takes its answer, so all ranks cut the same stages
    (an error is raised on every rank: `build.rank0.on_rank0`)."""
    def choose() -> dict[str, Any]:
        n_notes = len(plan.notes)
        choose_stages(global_gm, plan, mesh, hardware=hardware, memory_limit=memory_limit)
        return {"split_points": list(plan.split_points), "notes": plan.notes[n_notes:],
                "pipeline": plan.extra.get("pipeline")}

    got = on_rank0(choose, what="the pipeline stage search")
    if dist.is_initialized() and dist.get_rank() != 0:  # rank 0's plan holds its answer already
        plan.split_points = got["split_points"]
        plan.notes.extend(got["notes"])
        plan.extra["pipeline"] = got["pipeline"]


def _to_meta(gm: nn.Module) -> None:
    """Replace a module's parameters and buffers by meta tensors (its code stays readable)."""
    for mod in gm.modules():
        for n, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, n, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        for n, b in list(mod.named_buffers(recurse=False)):
            mod.register_buffer(n, torch.empty_like(b, device="meta"))


def recomputing_stages(plan: Plan, stage_units: Sequence[Sequence[str]] | None) -> list[int]:
    """The stages whose units (module paths) hold a module `plan.recompute` checkpoints (a unit
    inside a recomputed module, or one containing it): those a zero-bubble schedule runs fused."""
    rc = [m for m, mode in plan.recompute.items() if mode != "none"]
    if not rc or not stage_units:
        return []

    def inside(u: str, m: str) -> bool:
        return not m or u == m or u.startswith(m + ".") or m.startswith(u + ".")

    return [s for s, units in enumerate(stage_units) if any(inside(u, m) for u in units for m in rc)]


def write_schedule_svg(plan: Plan, out_dir: str) -> list[str]:
    """Draw the plan's pipeline schedule: `schedule.svg` (Gantt chart per rank, simulated with
    the search's per-stage times, or F=1, B=2 without them) and `schedule.txt` (the action
    grid). Returns the files written; none when the plan has no pipeline."""
    if plan.mesh.get(PP_AXIS, 1) < 2:
        return []
    name, pp, v = pipeline_shape(plan)
    sched = make_schedule(name, pp, plan.n_microbatches, v if v > 1 else None)
    info = plan.extra.get("pipeline") or {}
    # under zb_h1 / zbv a stage holding checkpoint regions runs its backward whole at its I and no W
    # (runtime/pipeline.py): draw the schedule that runs
    sched = fuse_backward(sched, recomputing_stages(plan, info.get("stage_units")))
    f, b, p2p = info.get("stage_fwd_s"), info.get("stage_bwd_s"), info.get("p2p_s")
    if f and len(f) == sched.n_stages and b and p2p is not None:
        sim = simulate(sched, f=f, b=b, p2p=p2p)
    else:
        sim = simulate(sched, f=1.0, b=2.0)
    os.makedirs(out_dir, exist_ok=True)
    svg = write_gantt_svg(sim, os.path.join(out_dir, "schedule.svg"))
    txt = os.path.join(out_dir, "schedule.txt")
    with open(txt, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(sched.to_grid())
    return [svg, txt]


def write_stage_graphs(stage_graphs: list[fx.GraphModule], out_dir: str, plan: Plan | None = None) -> list[str]:
    """Write every stage's code as `stage{s}.py` (annotated, deterministic; see passes.dump)."""
    files = []
    units = (plan.extra.get("pipeline") or {}).get("stage_units") if plan is not None else None
    for s, g in enumerate(stage_graphs):
        head = f"pipeline stage {s} of {len(stage_graphs)}"
        if units and s < len(units):
            head += f": units {units[s][0]} .. {units[s][-1]}" if len(units[s]) > 1 else f": unit {units[s][0]}"
        files.append(write_graph(g, os.path.join(out_dir, f"stage{s}.py"), header=head))
    return files
