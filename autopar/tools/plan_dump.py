"""Write everything about a plan into a folder, without weights: what `autopar dump` does.

  plan.json             the chosen Plan (editable; `autopar run --plan` and `verify` read it)
  plan_report.json      predictions and the ranked alternatives (machine-readable)
  report.txt            the tables `autopar plan` prints
  report.html           one self-contained page (autopar.tools.html_report): graph with placements,
                        stage map, recompute and fusion decisions, memory per rank, Gantt chart
  estimate.json         rank 0's cost-model estimate (per layer, per collective)
  graph_captured.py     the captured global graph
  rank{r}_program.py    rank r's rewritten graph (split_batch, shard, zero; for pp the stage
                        graphs it runs), by default one rank per distinct program: ranks that
                        differ only in their dp index run the same code (ranks.txt maps every
                        rank to its file); all_ranks=True writes one per rank
  stage{s}.py           pipeline stages (pp > 1)
  schedule.svg / .txt   the pipeline schedule as a Gantt chart and as the action grid (pp > 1)

Graphs are rewritten on the meta device: a 70B model dumps in the memory of its graph.
Reads node.meta through the passes it runs; writes files only. Deterministic: the same plan
gives byte-identical files (timings only in the first header line of graph files).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch.fx as fx

from autopar.cost import analyze, estimate
from autopar.build.gantt import gantt_svg
from autopar.tools.html_report import ReportInput, render_html
from autopar.passes.dump import graph_text, write_graph
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import pipeline_units, split_pipeline
from autopar.build.pipeline import pipeline_shape, write_schedule_svg
from autopar.tools.planning import PlanResult, _jsonable, rank_graph
from autopar.tools.plan_view import mesh_text, plan_text
from autopar.runtime.mesh import Mesh
from autopar.runtime.schedules import make_schedule, simulate

MAX_MEMORY_ROWS = 32


def _ranks(plan: Plan, all_ranks: bool) -> tuple[list[int], dict[int, int]]:
    """(ranks to write, every rank -> the written rank that runs its code)."""
    mesh = Mesh(dict(plan.mesh))
    rep: dict[int, int] = {}
    first: dict[tuple, int] = {}
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        sig = (r,) if all_ranks else tuple((a, i) for a, i in c.items() if a != plan.dp_axis)
        rep[r] = first.setdefault(sig, r)
    return sorted(set(rep.values())), rep


def write_dump(result: PlanResult, out_dir: str, *, all_ranks: bool = False, top: int = 5,
               step: Callable[[str], None] | None = None) -> list[str]:
    """Write the dump of `result`'s best plan into `out_dir` (see the module docstring)."""
    step = step or (lambda _m: None)
    os.makedirs(out_dir, exist_ok=True)
    plan, hw, gm = result.best.plan, result.hardware, result.global_gm
    files: list[str] = []
    if plan.mesh.get("pp", 1) > 1 and not plan.extra.get("pipeline"):
        from autopar.tools.planning import stage_plan  # the joint planner keeps no schedule data: evaluate its split

        stage_plan(plan, gm, hw)

    def put(name: str, text: str) -> None:
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        files.append(path)

    put("plan.json", plan.to_json() + "\n")
    put("plan_report.json", json.dumps(_jsonable(result.to_dict(top)), indent=2) + "\n")
    put("report.txt", plan_text(result, top) + "\n")
    files.append(write_graph(gm, os.path.join(out_dir, "graph_captured.py"),
                             header=f"{result.source.name} captured by "
                                    f"{gm.meta.get('autopar_capture', {}).get('path')} on meta; global shapes"))
    mesh = Mesh(dict(plan.mesh))
    written, rep = _ranks(plan, all_ranks)
    pp = plan.mesh.get("pp", 1)
    sched = None
    if pp > 1:
        name, _pp, v = pipeline_shape(plan)
        sched = make_schedule(name, pp, plan.n_microbatches, v if v > 1 else None)
    graphs: dict[int, fx.GraphModule] = {}
    stage_text: dict[int, str] = {}
    for k, r in enumerate(written):
        step(f"rewriting rank {r} ({k + 1}/{len(written)})")
        local, records = rank_graph(gm, plan, r)
        graphs[r] = local
        coords = mesh.coords(r)
        head = "\n".join(rec.header() for rec in records) or "no pass changed the graph"
        same = sorted(x for x, y in rep.items() if y == r)
        head = f"rank {r} coords {coords}; the same code runs on ranks {_span(same)}\n{head}"
        if sched is None:
            files.append(write_graph(local, os.path.join(out_dir, f"rank{r}_program.py"), header=head))
            continue
        ctx = PassContext(plan=plan, mesh_sizes=dict(mesh.sizes), coords=coords)
        pipe = PassManager([split_pipeline]).run(local, ctx, tag=f"rank{r}_pipeline")
        mine = sched.stages_of(coords["pp"])
        texts = []
        for s in mine:
            g = getattr(pipe, f"stage{s}")
            text = graph_text(g, header=f"stage {s} of {sched.n_stages}")
            texts.append(text)
            if all(c == 0 for a, c in coords.items() if a != "pp"):
                stage_text.setdefault(s, text)
        put(f"rank{r}_program.py", f"# {head.replace(chr(10), chr(10) + '# ')}\n# runs stages {mine}\n"
            + "\n".join(texts))
    for s in sorted(stage_text):
        put(f"stage{s}.py", stage_text[s])
    put("ranks.txt", "".join(f"rank {r} coords {mesh.coords(r)} -> rank{rep[r]}_program.py\n"
                             for r in range(mesh.world_size)))
    files += write_schedule_svg(plan, out_dir)

    # the estimate of rank 0, and memory per written rank (per pp rank for pipelines)
    step("costing the ranks")
    est0 = result.best.estimate
    if est0 is None:
        est0 = estimate(analyze(graphs[0], hw), plan, hw, batch_is_global=True)
    put("estimate.json", est0.to_json() + "\n")
    memory: list[tuple[str, dict[str, float]]] = []
    pipe_info = plan.extra.get("pipeline") or {}
    for r in written[:MAX_MEMORY_ROWS]:
        c = mesh.coords(r)
        label = f"rank {r} " + mesh_text({a: i for a, i in c.items() if a != plan.dp_axis or len(c) == 1})
        if sched is not None and pipe_info.get("rank_memory_bytes"):
            peak = float(pipe_info["rank_memory_bytes"][c["pp"]])
            memory.append((label, {"unsplit": peak, "peak": peak}))
        else:
            e = est0 if r == 0 else estimate(analyze(graphs[r], hw), plan, hw, batch_is_global=True)
            memory.append((label, dict(e.memory)))
    notes = [result.planner_note] + list(result.notes) + list(plan.notes) + list(est0.notes)
    if sched is not None:
        notes.append("memory per pipeline rank: the stage search's peak (states and in-flight activations) "
                     "is drawn as one bar; its split by kind is not modelled per stage yet")
    gantt = ""
    if sched is not None:
        f, b, p2p = pipe_info.get("stage_fwd_s"), pipe_info.get("stage_bwd_s"), pipe_info.get("p2p_s")
        sim = simulate(sched, f=f, b=b, p2p=p2p) if f and b and p2p is not None else simulate(sched)
        gantt = gantt_svg(sim)
    from autopar.cost.estimate_report import fold_layers

    layers = [(name if n == 1 else f"{name} (x{n})", rep_.fwd_s, rep_.bwd_s, rep_.comm_s, rep_.saved_bytes)
              for name, rep_, n in fold_layers(est0.layers)
              if rep_.fwd_s or rep_.bwd_s or rep_.comm_s or rep_.saved_bytes]
    pred = result.best.predicted
    facts = [("model", result.source.describe()), ("hardware", f"{hw.name}: {hw.description}"),
             ("mesh", mesh_text(plan.mesh)), ("planner", result.planner_note),
             ("global batch", f"{result.batch}" + (f" x sequence {result.seq}" if result.seq else "")),
             ("predicted step time", f"{float(pred.get('step_s', 0)) * 1e3:.3f} ms"),
             ("predicted MFU", f"{pred['mfu']:.1%}" if isinstance(pred.get("mfu"), (int, float)) else "?"),
             ("predicted peak memory per rank", f"{float(pred.get('peak_bytes', 0)) / 2**30:.3f} GiB of "
                                                f"{float(pred.get('capacity_bytes', 0)) / 2**30:.1f} GiB")]
    page = render_html(ReportInput(
        title=f"autopar plan: {result.source.name} on {mesh_text(plan.mesh)} ({hw.name})", plan=plan,
        predicted=pred, facts=facts, rank_graph=graphs[0], units=[u.name for u in pipeline_units(gm)],
        memory=memory, capacity=float(hw.device.memory_bytes), gantt_svg=gantt,
        alternatives=[c.row() for c in result.candidates[:top]], layers=layers,
        collectives=[(c.op, c.axis, c.phase, c.calls, c.payload_bytes, c.time_s) for c in est0.comm],
        notes=notes))
    put("report.html", page)
    return files


def _span(ranks: list[int]) -> str:
    if len(ranks) <= 6:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:4]))}, ... {ranks[-1]} ({len(ranks)} ranks)"
