"""This rank's program from a Plan and the captured graph: the build floor's main job.

`build_rank_program(global_gm, local_gm, plan, mesh, ...)` is what `autopar.parallelize` calls
once it has a plan:

  1. the rank's passes on its copy of the graph (`RANK_PASSES`: device retargeting, the batch
     split, context positions, tensor sharding, context attention, experts, synchronised batch
     norm, random-op marks, ZeRO, fusions), through a PassManager (timed, verified, dumped with
     `AUTOPAR_DUMP`);
  2. with a `memory_budget` and no pinned `plan.recompute`, the recompute choice on that graph
     (build/recompute_plan.py), made on rank 0 for every rank whose rewritten graph has the same
     structure (`build.rank0.graph_signature`; a rank whose graph differs makes its own);
  3. `plan.predicted` from the cost model (build/predict.py);
  4. `build_program`: the stages and the one `runtime.program.Program`.

`build_program(global_gm, local_gm, plan, mesh, ...)` makes the stages and the program. A plan
without pipeline parallelism has one stage, the whole rewritten graph; with pp > 1 the graph is
cut into the schedule's stages (build/pipeline.py `cut_pipeline`) and this rank keeps the ones
the schedule places on it. Either way each stage is recomputed as `plan.recompute` says (the
recompute pass, given only the blocks and the part of the save list the stage holds), and one
`Program` runs them with the plan's data, context and expert axes, ZeRO stage, buckets,
precision options, schedule and tied weights. There is no program kind per strategy: experts
are all-to-alls inside a stage's graph, a pipeline is several stages, and both compose.

Reads and writes node.meta through the passes it runs; writes plan.recompute,
plan.extra["recompute_save"], plan.notes, plan.predicted and (pp > 1) plan.split_points,
plan.schedule and plan.extra["pipeline"].
"""
from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from autopar.build.pipeline import cut_pipeline
from autopar.build.predict import predict, take_pipeline_prediction
from autopar.build.rank0 import graph_signature, on_rank0
from autopar.passes.context_attention import context_attention
from autopar.passes.context_positions import context_positions
from autopar.passes.expert import expert
from autopar.passes.fuse import fuse
from autopar.passes.mark_random import mark_random
from autopar.passes.pass_manager import PassContext, PassManager, PassRecord
from autopar.passes.plan import Plan
from autopar.passes.recompute import node_keys, recompute
from autopar.passes.retarget_device import retarget_device
from autopar.passes.shard import shard
from autopar.passes.split_batch import split_batch
from autopar.passes.sync_batchnorm import sync_batchnorm
from autopar.passes.zero import zero
from autopar.runtime._torch_compat import compile_graph_modules, lazy_graph_module
from autopar.runtime.mesh import Mesh
from autopar.runtime.program import Program

__all__ = ["RANK_PASSES", "build_program", "build_rank_program", "rank_copy"]

# the rewrites that turn the captured graph into this rank's, in order
RANK_PASSES = (retarget_device, split_batch, context_positions, shard, context_attention, expert, sync_batchnorm,
               mark_random, zero, fuse)


def rank_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with its own copy of `gm`'s graph and module tree but the same tensors:
    passes rewrite it and swap its parameters for shards without touching `gm` (kept as the
    captured global graph) or using memory for a second copy of the weights."""
    out = lazy_graph_module(gm, copy.deepcopy(gm.graph))  # code generated once the passes are done
    out.meta.update(gm.meta)
    return out


def build_rank_program(global_gm: fx.GraphModule, local_gm: fx.GraphModule, plan: Plan, mesh: Mesh, *,
                       hardware: Any, memory_budget: float | int | None = None, sync_init: bool = True,
                       dump_dir: str | None = None, engine_options: dict | None = None,
                       global_cost: Any = None
                       ) -> tuple[Program, fx.GraphModule, list[fx.GraphModule], list[PassRecord]]:
    """Steps 1-4 of the module docstring. Returns (program, this rank's rewritten graph, the
    pipeline's stage graphs (empty without pp), the pass records). `global_cost`: the cost
    analysis of `global_gm` when the caller made one (build/plan_complete.py), for the prediction."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ctx = PassContext(plan=plan, mesh_sizes=dict(mesh.sizes), coords=mesh.coords(rank),
                      options={"device": mesh.device})
    if plan.fusions:  # the split points the fuse pass sees (a split chosen at the cut comes later)
        plan.extra["fusion_split_points"] = list(plan.split_points)
    pm = PassManager(list(RANK_PASSES), dump_dir=dump_dir)
    local_gm = pm.run(local_gm, ctx, tag=f"rank{rank}")
    if memory_budget is not None and not plan.recompute:  # a pinned plan.recompute wins
        sig = graph_signature(local_gm)
        got = on_rank0(lambda: _choose_recompute(global_gm, local_gm, plan, hardware, memory_budget, sig),
                       what="the recompute choice")
        if got["signature"] != sig:  # this rank's graph differs from rank 0's: its own choice
            got = _choose_recompute(global_gm, local_gm, plan, hardware, memory_budget, sig)
        plan.recompute, plan.extra["recompute_save"] = got["modes"], got["save"]
        plan.notes.append(got["note"])
    predict(plan, global_gm, local_gm, hardware, cost=global_cost)  # before recompute (regions are opaque)
    options = {"model_parallel": {name: tuple(a for a, p in lay.axes if a != plan.dp_axis and
                                              type(p).__name__ == "Shard")
                                  for name, lay in plan.param_layouts.items()}, **(engine_options or {})}
    program, stage_graphs, records = build_program(global_gm, local_gm, plan, mesh, sync_init=sync_init,
                                                   hardware=hardware, dump_dir=dump_dir, engine_options=options)
    if plan.mesh.get("pp", 1) > 1:
        take_pipeline_prediction(plan)  # estimate() costs one stage; the pipeline's own figures replace it
    return program, local_gm, stage_graphs, list(pm.records) + records


def build_program(global_gm: fx.GraphModule, local_gm: fx.GraphModule, plan: Plan, mesh: Mesh, *,
                  sync_init: bool = True, hardware: Any = None, memory_limit: float | None = None,
                  dump_dir: str | None = None, engine_options: dict | None = None
                  ) -> tuple[Program, list[fx.GraphModule], list[PassRecord]]:
    """This rank's `Program` over its stages (see the module docstring).

    Args:
        global_gm: the captured graph at the global batch (what a pipeline's stage search costs).
        local_gm: this rank's graph after the rank's passes.
        plan: the Plan; updated in place by a pipeline cut (split points, notes, extra).
        mesh: the running Mesh.
        sync_init: start the ranks equal (broadcast from dp index 0, shared parameters from ep 0).
        hardware, memory_limit: for a pipeline's stage search (build/pipeline.py).
        dump_dir: dump directory for the cut and recompute passes (also `AUTOPAR_DUMP`).
        engine_options: extra `make_engine` options (model-parallel names, precision).

    Returns:
        (program, stage_graphs, records): stage_graphs has every stage of a pipeline (other
        ranks' with meta tensors; empty without pp), records the cut's and recompute's passes.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    records: list[PassRecord] = []
    if mesh.size("pp") > 1:
        cut = cut_pipeline(global_gm, local_gm, plan, mesh, hardware=hardware, memory_limit=memory_limit,
                           dump_dir=dump_dir)
        graphs, mine, records = list(cut.stage_graphs), cut.mine, list(cut.records)
        pipeline = dict(n_stages=cut.n_stages, schedule=cut.schedule, tied=cut.info.tied)
        experts = cut.expert_params
    else:
        graphs, mine, pipeline = [local_gm], [0], {}
        experts = set((local_gm.meta.get("autopar_expert") or {}).get("expert_params", ()))
    for s in mine:
        graphs[s] = _recompute_stage(graphs[s], plan, mesh, rank, s if pipeline else None, dump_dir, records)
    stages = {s: graphs[s] for s in mine}
    for g in stages.values():  # lazy graphs (rank_copy, the cut): their code once, before hooks wrap them
        compile_graph_modules(g)
    program = Program(stages, mesh, dp_axis=plan.dp_axis, cp_axis=plan.extra.get("context", {}).get("axis"),
                      ep_axis=_ep_axis(plan, mesh),
                      expert_params=sorted(n for m in stages.values() for n, _ in m.named_parameters() if n in experts),
                      zero_stage=plan.zero_stage, bucket_mb=plan.bucket_mb, engine_options=engine_options,
                      in_spec=global_gm.meta.get("autopar_in_spec"), out_spec=global_gm.meta.get("autopar_out_spec"),
                      sync_init=sync_init, n_microbatches=plan.n_microbatches, shard_one_rank=False, **pipeline)
    if plan.zero_stage and program.zero_stage != plan.zero_stage:
        plan.notes.append(f"zero_stage={plan.zero_stage} over one data-parallel rank runs as plain data parallelism: "
                          "there is nothing to shard, and the engine would only copy (as cost.estimate prices dp = 1)")
    if pipeline:
        program.info = cut.info
    return program, graphs if pipeline else [], records


def _recompute_stage(gm: fx.GraphModule, plan: Plan, mesh: Mesh, rank: int, stage: int | None, dump_dir,
                     records: list[PassRecord]) -> fx.GraphModule:
    """`gm` with the recompute pass run for the blocks of `plan.recompute` it holds, with their
    part of the save list (a block a pipeline cut splits has the rest on another stage; a node
    this rank's passes replaced drops out: cp's attention exchange, a collective the region keeps
    anyway, in place of the global graph's attention)."""
    if not any(m != "none" for m in plan.recompute.values()):
        return gm
    here = dict(plan.recompute)
    if stage is not None:
        mods = {getattr(n.meta.get("autopar"), "module", "") or "" for n in gm.graph.nodes
                if n.op == "call_function"}
        here = {m: v for m, v in plan.recompute.items()
                if v != "none" and any(x == m or x.startswith(m + ".") for x in mods)}
        if not here:
            return gm
    keys = set(node_keys(gm).values())
    save = {m: [k for k in v if k in keys] for m, v in (plan.extra.get("recompute_save") or {}).items() if m in here}
    ctx = PassContext(plan=plan.pin(recompute=here, extra={**plan.extra, "recompute_save": save}),
                      mesh_sizes=dict(mesh.sizes), coords=mesh.coords(rank))
    rpm = PassManager([recompute], dump_dir=dump_dir)
    out = rpm.run(gm, ctx, tag=f"rank{rank}_recompute" if stage is None else f"rank{rank}_stage{stage}_recompute")
    records += rpm.records
    return out


def _choose_recompute(global_gm: fx.GraphModule, local_gm: fx.GraphModule, plan: Plan, hardware: Any,
                      memory_budget: float | int, signature: str) -> dict[str, Any]:
    """The recompute plan for `memory_budget` on this rank's rewritten graph, as plain data (rank 0
    computes it for every rank whose graph has the same `signature`)."""
    from autopar.build.recompute_plan import plan_loss, plan_recompute  # noqa: PLC0415

    _modes, rec = plan_recompute(local_gm, memory_budget, hardware, loss=plan_loss(global_gm, plan, hardware))
    note = (f"recompute for memory_budget={memory_budget!r}: "
            + (", ".join(f"{k} {v}" for k, v in rec.modes.items() if v != "none") or "nothing")
            + f"; peak {rec.predicted_peak / 2**20:.1f} MiB of {rec.budget_bytes / 2**20:.1f}, "
            f"recompute {rec.recompute_s * 1e3:.2f} ms, gap {rec.solver['gap']:.1%}")
    return {"signature": signature, "modes": dict(rec.modes), "save": rec.save, "note": note}


def _ep_axis(plan: Plan, mesh: Mesh) -> str | None:
    """The expert-parallel axis the expert pass split the experts over (None: no ep)."""
    axis = (plan.extra.get("expert") or {}).get("axis", "ep")
    return axis if mesh.sizes.get(axis, 1) > 1 and plan.extra.get("expert") else None
