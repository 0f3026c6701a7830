"""`parallelize_experts`: the older parallelize glue for meshes with an ep axis.

Capture, the tp search (`search.shard_search.search_sharding`), `search.expert.plan_experts`,
the passes split_batch -> shard -> expert -> zero, and an `ExpertProgram`, wrapped as the
`ParallelModel` that `autopar.parallelize` returns. It is from before `autopar.parallelize`
took an ep axis; the public path is `autopar.parallelize(model, autopar.mesh(ep=...))`, and this
file goes once tests/dist/test_expert_parallel.py and benchmarks/bench_expert.py (its only
callers) move to it. It lived in search/expert.py; it builds a program, which is not the
search's job.

Writes no node.meta of its own (the passes do). Errors: ValueError for a mesh with pp, an
example batch that does not divide over dp x ep, or a capture that specialised the batch dim.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.api import ParallelModel
from autopar.capture import capture
from autopar.cost.hardware import default_profile
from autopar.passes.expert import expert
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.shard import shard
from autopar.passes.split_batch import split_batch
from autopar.passes.zero import zero
from autopar.runtime.mesh import planning_group
from autopar.runtime.moe import ExpertProgram
from autopar.search.expert import plan_experts
from autopar.search.shard_search import batch_is_static, search_sharding

__all__ = ["parallelize_experts"]


def parallelize_experts(model, mesh, *, example_inputs, zero_stage: int = 0, capacity_factor: float | None = None,
                        hardware: str | None = None, sync_init: bool = True, dump_dir: str | None = None,
                        bucket_mb: float = 25.0):
    """`autopar.parallelize` for a mesh with an ep axis (and dp, tp): capture, the tp search,
    `plan_experts`, passes split_batch -> shard -> expert -> zero, and an `ExpertProgram`.
    Returns an `autopar.api.ParallelModel` (so `autopar.optimizer` works on it).

    Glue from before `autopar.parallelize` took an ep axis; the public path is
    `autopar.parallelize(model, autopar.mesh(ep=...))`. Kept for tests/dist/test_expert_parallel.py
    and benchmarks/bench_expert.py."""
    sizes = dict(mesh.sizes)
    if sizes.get("pp", 1) > 1:
        raise ValueError("expert parallelism with pipeline parallelism is not wired yet; use a mesh without pp")
    plan = Plan(mesh=sizes, dp_axis="dp" if "dp" in sizes else None, zero_stage=zero_stage, bucket_mb=bucket_mb)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    split = sizes.get("dp", 1) * sizes.get("ep", 1)
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % split:
            raise ValueError(f"the example batch has {t.shape[0]} rows, which does not divide by dp x ep = {split}")
    global_gm = capture(model, args)
    if batch_is_static(global_gm) and split > 1:
        raise ValueError("the capture specialised the batch dim; expert parallelism needs a dynamic batch capture")
    hw = hardware or default_profile(mesh.device_type)
    search_sharding(plan, global_gm, mesh, hw, group=planning_group())
    plan.extra["expert"] = plan_experts(global_gm, mesh, capacity_factor=capacity_factor, hardware=hw,
                                        dp_axis=plan.dp_axis)
    plan.notes += plan.extra["expert"].get("notes", [])
    rank = dist.get_rank() if dist.is_initialized() else 0
    ctx = PassContext(plan=plan, mesh_sizes=sizes, coords=mesh.coords(rank))
    pm = PassManager([split_batch, shard, expert, zero], dump_dir=dump_dir)
    local_gm = pm.run(_rank_copy(global_gm), ctx, tag=f"rank{rank}")
    info = local_gm.meta.get("autopar_expert", {})
    mp = {name: tuple(a for a, p in lay.axes if a != plan.dp_axis and type(p).__name__ == "Shard")
          for name, lay in plan.param_layouts.items()}
    program = ExpertProgram(local_gm, mesh, ep_axis="ep", expert_params=info.get("expert_params", ()),
                            engine_options={"model_parallel": mp},
                            dp_axis=plan.dp_axis, zero_stage=plan.zero_stage, bucket_mb=plan.bucket_mb,
                            in_spec=global_gm.meta.get("autopar_in_spec"),
                            out_spec=global_gm.meta.get("autopar_out_spec"), sync_init=sync_init)
    return ParallelModel(program, plan, local_gm, global_gm, list(pm.records), global_gm.meta.get("autopar_capture", {}))


def _rank_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with its own copy of `gm`'s graph but the same tensors, for the passes to
    rewrite (as `autopar.parallelize` makes its per-rank graph)."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out
