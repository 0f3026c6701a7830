"""The user's entry points: `mesh`, `parallelize`, `optimizer`.

`parallelize(model, mesh, example_inputs=...)` captures the model (autopar.capture), decides
a Plan (today: data parallel over the whole mesh, with the ZeRO stage and bucket size given
or pinned; the joint planner replaces this default as it lands), runs the passes that carry
the plan out (passes.pass_manager), and wraps the per-rank program of this rank
(runtime.program) as a `ParallelModel` that trains with `step()` and shows its plan and
dumps.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from autopar.runtime._torch_compat import pytree

from autopar.build.materialize import has_meta_tensors, materialize, open_weights
from autopar.build.model_tensors import model_tensors, shape_only_copy
from autopar.build.plan_check import (axis_notes, check_mesh_fits, check_micro_batches, check_moe_aux_stats,
                                      check_plan_against_graph, stamp)
from autopar.capture import CaptureError, capture, capture_for_search
from autopar.cost.hardware import default_profile
from autopar.input_checks import check_captured_graph, check_example_inputs, check_step_batch, explain_capture_failure
from autopar.passes.dump import write_graph
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.context_attention import context_attention
from autopar.passes.context_positions import context_positions
from autopar.passes.expert import expert
from autopar.passes.fuse import fuse
from autopar.passes.mark_random import mark_random
from autopar.passes.plan import Plan
from autopar.passes.recompute import recompute
from autopar.passes.retarget_device import retarget_device
from autopar.passes.shard import shard
from autopar.passes.split_batch import split_batch
from autopar.passes.sync_batchnorm import sync_batchnorm
from autopar.passes.zero import zero
from autopar.runtime.mesh import Mesh, make_mesh, planning_group
from autopar.runtime.placement import Layout, Replicate, Shard
from autopar.runtime.program import Program
from autopar.runtime.zero_plain_optim import named_masters
from autopar.search.context import plan_context
from autopar.search.fusion import search_fusions
from autopar.search.shard_search import SHARD_AXES, batch_is_static, search_sharding


def mesh(world_size: int | None = None, *, device_mesh=None, device_type: str | None = None, **axes: int) -> Mesh:
    """A device mesh: `autopar.mesh(world_size=64)` (parallelize's joint planner chooses its
    axes), `autopar.mesh(dp=8, tp=4, pp=2)`, a `DeviceMesh`, or (no arguments) the world of the
    running torchrun job."""
    m = make_mesh(world_size, device_mesh=device_mesh, device_type=device_type, **axes)
    if world_size is not None and device_mesh is None and not axes:
        m.searched = True  # only a size: parallelize lets the joint planner factorise it
    return m


class ParallelModel(nn.Module):
    """A model parallelised for one rank: call it, `step()` it, read `plan`, `dump()` it."""

    def __init__(self, program: Program, plan: Plan, graph, global_graph, records, capture_info):
        super().__init__()
        self.program = program
        self._plan = plan
        self.graph_module = graph
        self.__dict__["global_graph"] = global_graph  # not a submodule: its tensors are the user's model's
        self.pass_records = records
        self.capture_info = capture_info

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    @property
    def engine(self):
        return self.program.engine

    def forward(self, *args, **kwargs):
        return self.program(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The tensors this program trains, under the model's parameter names: the parameters
        (ZeRO-0), this rank's rows of them (ZeRO-1/2; fp32 copies under mixed precision or
        offload), this rank's shards (ZeRO-3). `torch.optim.AdamW(pm.parameters())` therefore
        trains as `autopar.optimizer(pm, torch.optim.AdamW)` does (fp16 overflow steps skipped
        too; clip with `pm.engine.clip_grad_norm_`: runtime/zero_plain_optim.py), and an optimizer over
        tensors the program does not train (the original module's parameters under ZeRO-3)
        raises ValueError at its first step. The module's own tensors stay reachable as
        `pm.program.module.named_parameters()`."""
        for name, t in named_masters(self.engine, remove_duplicate=remove_duplicate):
            yield (f"{prefix}.{name}" if prefix else name), t

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient the program holds (model-side and on what it trains)."""
        self.engine.zero_grad(set_to_none)

    def step(self, batch, loss_fn, n_microbatches: int | None = None) -> torch.Tensor:
        n = n_microbatches or self._plan.n_microbatches
        check_micro_batches(self._plan, n)  # MoE auxiliary statistics over the global batch: one micro-batch
        check_step_batch(batch, self.global_graph, self.mesh, dp_axis=self._plan.dp_axis, n_microbatches=n)
        return self.program.step(batch, loss_fn, n)

    def evaluate(self, batch, loss_fn) -> torch.Tensor:
        """The loss of one global batch `(inputs, targets)` without gradients, averaged over the
        data-parallel ranks as `step` does. Call `pm.eval()` first to evaluate as
        `model.eval()` would (dropout off, batch norm on its running statistics, untouched):
        `pm.train()` / `pm.eval()` switch every program kind (runtime/rng.py)."""
        check_step_batch(batch, self.global_graph, self.mesh, dp_axis=self._plan.dp_axis, n_microbatches=1)
        return self.program.evaluate(batch, loss_fn)

    def manual_seed(self, seed: int) -> None:
        """Re-seed the program's dropout streams (runtime/rng.py; give every rank the same seed):
        dp ranks and pp stages still draw different masks, tp peers the same on replicated tensors."""
        self.program.rng.manual_seed(seed)

    def plan_text(self) -> str:
        from autopar.search.plan_text import plan_text

        return plan_text(self)

    def dump(self, out_dir: str) -> list[str]:
        """Write the plan (plan.json), this rank's rewritten graph, the captured global graph,
        the pass log and a text report into `out_dir`. Returns the files written."""
        from autopar.search.plan_text import plan_text

        os.makedirs(out_dir, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        files = []
        p = os.path.join(out_dir, "plan.json")
        if rank == 0:
            with open(p, "w") as f:
                f.write(self._plan.to_json() + "\n")
            files.append(p)
            files.append(write_graph(self.global_graph, os.path.join(out_dir, "graph_captured.py"),
                                     header=f"captured by {self.capture_info.get('path')}; global shapes"))
            rp = os.path.join(out_dir, "report.txt")
            with open(rp, "w") as f:
                f.write(plan_text(self) + "\n")
            files.append(rp)
            lp = os.path.join(out_dir, "passes.json")
            with open(lp, "w") as f:
                json.dump([{"pass": r.name, "ms": round(r.ms, 3), "nodes_before": r.nodes_before,
                            "nodes_after": r.nodes_after, "collectives_added": dict(r.collectives_added),
                            "changed": r.changed} for r in self.pass_records], f, indent=2)
            files.append(lp)
            from autopar.pipeline_build import write_schedule_svg, write_stage_graphs  # noqa: PLC0415

            files += write_schedule_svg(self._plan, out_dir)
            files += write_stage_graphs(self.__dict__.get("stage_graphs", []), out_dir, self._plan)
        header = "\n".join(r.header() for r in self.pass_records) or "no pass changed the graph"
        files.append(write_graph(self.graph_module, os.path.join(out_dir, f"rank{rank}_program.py"),
                                 header=f"rank {rank} coords {self.mesh.coords(rank)}\n{header}"))
        return files


def parallelize(model: nn.Module, mesh: Mesh | Any = None, *, example_inputs: Any, plan: Plan | None = None,
                pins: dict | None = None, zero_stage: int | None = None, bucket_mb: float | None = None,
                n_microbatches: int | None = None, leaf_modules: Iterable[str] = (),
                dump_dir: str | None = None, sync_init: bool = True, hardware: str | None = None,
                memory_budget: float | int | None = None, memory_limit: float | None = None,
                weights: Any = None, strict_weights: bool = True, precision: str | None = None,
                offload: bool | None = None, context_method: str = "auto",
                moe_aux_stats: str | None = None) -> ParallelModel:
    """Make `model` train on `mesh`.

    Args:
        model: the nn.Module (same seed and weights on every rank, or they are broadcast from
            data-parallel rank 0 when `sync_init`).
        mesh: an autopar Mesh, a DeviceMesh, or None for the running job's world (all dp).
        example_inputs: a global batch of inputs to capture with: a tensor, a tuple of the
            positional inputs, or a dict of keyword inputs (`model(**batch)`, e.g. a
            transformers batch with `labels`); `model.step` then takes the same form.
        plan: a full Plan to carry out; `pins` fixes some of its fields instead.
        zero_stage, bucket_mb, n_microbatches: shortcuts for the same pins.
        leaf_modules: submodules to keep opaque at capture.
        dump_dir: write dumps of every pass here (also `AUTOPAR_DUMP=dir`).
        hardware: the cost-model profile the search plans for ("h100-sxm", "cpu-gloo", a
            path ...); default: the profile of the mesh's device type. Planning for the
            target cluster while running on a CPU mesh is how plans are debugged.
        memory_budget: per-rank activation peak budget for activation recomputation: a
            fraction in [0, 1] (0 = every layer fully recomputed, 1 = no recomputation) or
            bytes; decides `plan.recompute` unless that is pinned.
        memory_limit: bytes per device for the joint planner (used with a mesh given only by its
            world size, `autopar.mesh(world_size=N)`); default 90 % of the hardware's memory.
        weights: where the values come from. The model may be built on the meta device
            (`with torch.device("meta"): model = build()`): each rank then allocates only what
            its plan keeps and fills it from `weights`: a `.safetensors` file, a Hugging Face
            checkpoint directory, a `.pt` file or a state dict (each rank reads only its
            slices), or `autopar.ModuleInit(seed)` — the default for a meta model — the modules'
            own initialization, equal to one process's `torch.manual_seed(seed); build()`.
            Given with a real model, the source overwrites its values.
        strict_weights: a parameter the source lacks is an error (False: keep its value).
        precision: "fp32" | "bf16" (pure: parameters, gradients, optimizer states and gradient
            reduction all in that dtype; the model must already be in it) | "bf16-mixed" /
            "fp16-mixed" (16-bit compute, fp32 masters and optimizer states, fp32 gradient
            reduction; fp16 with dynamic loss scaling). Default None: a model whose trained
            parameters are all bf16 (fp16) trains "bf16-mixed" ("fp16-mixed"), as Megatron and
            DeepSpeed do, unless the plan sets its precision fields; any other model trains in
            its own dtype, pure. Pass precision="bf16" for pure bf16 AdamW. Written into the
            Plan's precision fields (`passes.plan.precision_fields`), which the engine and
            `plan.predicted` both read; pins / a given plan's fields are overridden by it.
            A mixed recipe on a wider model (fp32 under "bf16-mixed") captures the 16-bit program
            the engine runs (parameters and floating inputs cast, buffers kept: capture.py
            `compute_dtype`), so the model's `.to()` / `type_as` casts hold; masters stay fp32.
        offload: True keeps masters and optimizer states in CPU memory and steps there
            (ZeRO-Offload; any ZeRO stage). Default None: the plan's `offload` (False).
        context_method: on a mesh with a `cp` axis (context parallelism: each rank holds a
            zigzag chunk of every sequence), how attention sees the whole sequence: "ring"
            (K/V blocks around the ring, overlapped), "ulysses" (all-to-all to heads and back)
            or "auto" (the cost model's choice; `plan.extra["context"]` says why). On
            `autopar.mesh(world_size=N)` the joint planner searches cp itself: token-id inputs
            are captured with a symbolic sequence (capture.py `capture_for_search`) unless cp
            cannot apply, which the plan's cp note then says (images, no attention, ...).
        moe_aux_stats: how an MoE model's auxiliary losses (load balancing, router z-loss) see
            the batch: "global" (default; None keeps a given plan's `plan.extra["moe_aux_stats"]`)
            computes their router statistics as one process over the global batch (averaged over
            dp, ep and cp), so n_microbatches > 1 (pipelines, gradient accumulation) is refused
            before the first step and the joint planner plans one micro-batch; "micro_batch"
            computes them per micro-batch (Megatron's recipe), named in plan.notes. Recorded in
            `plan.extra["moe_aux_stats"]` for models with router statistics.
    """
    from autopar.passes.plan import engine_options as precision_options  # noqa: PLC0415
    from autopar.passes.plan import precision_fields  # noqa: PLC0415

    precision_pins = precision_fields(precision, offload)  # an unknown precision fails before any work
    if mesh is None:
        mesh = make_mesh()
    elif not isinstance(mesh, Mesh):
        mesh = make_mesh(device_mesh=mesh)
    if dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise ValueError(f"{mesh} has {mesh.world_size} ranks but the job has world size "
                         f"{dist.get_world_size()}; choose axis sizes whose product is {dist.get_world_size()}")
    check_example_inputs(example_inputs, mesh, plan, n_microbatches=(pins or {}).get("n_microbatches", n_microbatches))
    plan_given = plan is not None
    on_meta = has_meta_tensors(model)
    if on_meta:
        sync_init = False  # every rank fills its own pieces from the same source: nothing to broadcast
    weights = open_weights(weights, model, strict=strict_weights)  # a source that does not fit fails here
    run_device = mesh.device if on_meta else None  # a meta model is traced on fake tensors of this device
    fusions_pinned = plan is not None or "fusions" in (pins or {})
    kwargs = dict(example_inputs) if isinstance(example_inputs, Mapping) else {}  # model(**batch), as in HF
    args = () if kwargs else tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)

    # mixed precision on a wider model: capture the 16-bit program the engine runs (capture.py)
    cast_to = _cast_dtype(precision_pins.get("param_dtype") if precision_pins.get("master_dtype") else None, model)

    def _capture(a, kw, search_world: int | None = None):
        """Capture at the plan's compute dtype; for the joint planner (`search_world` ranks) with a
        symbolic sequence when cp could be chosen (`capture_for_search`), else as the mesh needs."""
        opts = dict(example_kwargs=kw, leaf_modules=leaf_modules, device=run_device, compute_dtype=cast_to)
        try:
            if search_world is not None:
                return capture_for_search(model, a, search_world, cp=_cp_may_be_searched(pins), **opts)
            return capture(model, a, dynamic_seq=mesh.size("cp") > 1, **opts)
        except CaptureError:
            why = explain_capture_failure(model, example_inputs)
            if why is None:
                raise
            raise why from None

    global_gm = None
    if plan is None and getattr(mesh, "searched", False):  # autopar.mesh(world_size=N): the joint planner
        global_gm = _capture(args, kwargs, search_world=mesh.world_size)  # the sequence symbolic when cp may pay
        plan, mesh = _joint_plan(global_gm, mesh, (args, kwargs), pins, zero_stage, bucket_mb, n_microbatches, hardware,
                                 memory_limit, precision_pins,  # offload None: the planner decides
                                 moe_aux_stats or "global")
        pins = zero_stage = bucket_mb = n_microbatches = None  # they are in the plan
        fusions_pinned = True  # so are the fusions (chosen by the planner)
    plan = _default_plan(mesh, plan, pins, zero_stage, bucket_mb, n_microbatches)
    if precision is None and plan.param_dtype is None and plan.master_dtype is None:
        trained = {p.dtype for p in model.parameters() if p.is_floating_point() and p.requires_grad}
        if trained in ({torch.bfloat16}, {torch.float16}):  # 16-bit weights: fp32 masters by default
            default = "bf16-mixed" if trained == {torch.bfloat16} else "fp16-mixed"
            precision_pins = {**precision_fields(default), **precision_pins}
    if precision_pins:
        plan = plan.pin(**precision_pins)
    precision_engine = precision_options(plan, {p.dtype for p in model.parameters() if p.is_floating_point()})
    dp = plan.dp * mesh.size("ep")  # the batch is split over dp x ep
    check_example_inputs(example_inputs, mesh, plan)
    cast_to = _cast_dtype(precision_engine.get("param_dtype"), model)  # the plan's compute dtype, mixed
    if global_gm is None or global_gm.meta.get("autopar_capture", {}).get("compute_dtype") != _dtype_name(cast_to):
        global_gm = _capture(args, kwargs)
    check_captured_graph(global_gm, example_inputs)
    plan.notes += check_moe_aux_stats(plan, global_gm, moe_aux_stats)  # refuses micro-batches under "global"
    if plan_given:
        plan.notes += check_plan_against_graph(plan, global_gm, mesh)
    else:
        if not getattr(mesh, "searched", False):
            check_mesh_fits(global_gm, mesh)
        stamp(plan, global_gm)
    if mesh.size("cp") > 1 and "context" not in plan.extra:
        plan.extra["context"] = plan_context(global_gm, dict(mesh.sizes), context_method, hardware or _hardware(mesh))
        plan.notes += plan.extra["context"]["notes"]
    local_gm = _fresh(global_gm)
    if dp > 1 and batch_is_static(global_gm):
        # the capture specialised the batch dim (e.g. the model reshapes with a literal batch):
        # capture again at the local micro-batch size for the per-rank program
        k = dp * plan.n_microbatches
        local_args, local_kwargs = pytree.tree_map(
            lambda t: t[: t.shape[0] // k] if isinstance(t, torch.Tensor) and t.dim() else t, (args, kwargs))
        local_gm = _fresh(_capture(local_args, local_kwargs))
        plan.notes.append(f"batch dim captured static; per-rank program captured at {k}x smaller batch")
    rank = dist.get_rank() if dist.is_initialized() else 0
    search_sharding(plan, global_gm, mesh, hardware or _hardware(mesh), group=planning_group())
    if mesh.size("ep") > 1 and (memory_budget is not None or any(v != "none" for v in plan.recompute.values())):
        raise ValueError(f"activation recomputation with expert parallelism (ep={mesh.size('ep')}) is not wired yet: "
                         "after the expert pass the blocks hold the token dispatch, and the recompute search finds no "
                         "block it can checkpoint (it would silently recompute nothing); drop memory_budget (and "
                         "plan.recompute), or give the ep ranks to dp with ZeRO-3 to save memory instead")
    if mesh.size("pp") > 1 and plan.schedule in ("zb_h1", "zbv") and (
            memory_budget is not None or any(v != "none" for v in plan.recompute.values())):
        raise ValueError(f"activation recomputation with the {plan.schedule!r} schedule does not run yet: it computes "
                         "input and weight gradients in two backward passes, and a checkpointed region allows one; "
                         "use schedule '1f1b' or 'interleaved_1f1b' with memory_budget, or drop memory_budget")
    if mesh.size("ep") > 1 and "expert" not in plan.extra:
        from autopar.search.expert import plan_experts  # noqa: PLC0415

        plan.extra["expert"] = plan_experts(global_gm, mesh, dp_axis=plan.dp_axis, n_microbatches=plan.n_microbatches,
                                            hardware=hardware or _hardware(mesh))
        plan.notes += plan.extra["expert"]["notes"]
    if mesh.size("ep") > 1:
        _grouped_expert_layouts(plan, mesh)
    else:
        _router_stats_without_ep(plan, global_gm, mesh)
    if fusions_pinned:
        from autopar.passes.rules.fusion_table import selection  # noqa: PLC0415

        selection(plan.fusions)  # a bad entry is a ValueError here, not a PassError
    else:
        static = batch_is_static(global_gm)
        search_fusions(plan, local_gm if static else global_gm, hardware or _hardware(mesh),
                        1 if static else dp * plan.n_microbatches)
    plan.notes += [n for n in axis_notes(plan) if n not in plan.notes]
    ctx = PassContext(plan=plan, mesh_sizes=dict(mesh.sizes), coords=mesh.coords(rank),
                      options={"device": mesh.device})
    pm = PassManager([retarget_device, split_batch, context_positions, shard, context_attention, expert,
                      sync_batchnorm, mark_random, zero, fuse], dump_dir=dump_dir)
    local_gm = pm.run(local_gm, ctx, tag=f"rank{rank}")
    if memory_budget is not None and not plan.recompute:  # a pinned plan.recompute wins
        from autopar.recompute_plan import plan_recompute  # noqa: PLC0415

        _modes, rec = plan_recompute(local_gm, memory_budget, hardware or _hardware(mesh))
        plan.recompute, plan.extra["recompute_save"] = rec.modes, rec.save
        plan.notes.append(f"recompute for memory_budget={memory_budget!r}: "
                          + (", ".join(f"{k} {v}" for k, v in rec.modes.items() if v != "none") or "nothing")
                          + f"; peak {rec.predicted_peak / 2**20:.1f} MiB of {rec.budget_bytes / 2**20:.1f}, "
                          f"recompute {rec.recompute_s * 1e3:.2f} ms, gap {rec.solver['gap']:.1%}")
    _predict(plan, global_gm, local_gm, mesh, hardware or _hardware(mesh))  # before recompute (regions are opaque)
    records, stage_graphs = list(pm.records), []
    engine_options = {"model_parallel": {name: tuple(a for a, p in lay.axes if a != plan.dp_axis and
                                                     type(p).__name__ == "Shard")
                                         for name, lay in plan.param_layouts.items()}, **precision_engine}
    if any(v != "none" for v in plan.recompute.values()) and mesh.size("pp") == 1:  # pp: per stage, in build_pipeline
        rpm = PassManager([recompute], dump_dir=dump_dir)
        local_gm = rpm.run(local_gm, ctx, tag=f"rank{rank}_recompute")
        records += rpm.records
    if mesh.size("pp") > 1:
        from autopar.pipeline_build import build_pipeline  # noqa: PLC0415

        program, stage_graphs, pp_records = build_pipeline(global_gm, local_gm, plan, mesh, sync_init=sync_init,
                                                           hardware=hardware, dump_dir=dump_dir,
                                                           engine_options=engine_options)
        records += pp_records
        if "pipeline" in plan.extra:  # estimate() costs one stage; the pipeline's own prediction replaces its time
            pipe = plan.extra["pipeline"]
            target = plan.predicted["estimate"] if plan.predicted.get("source") == "planner" else plan.predicted
            target.update(step_s=pipe["step_s"], pipeline_bubble=pipe["bubble"],
                          peak_bytes_per_pp_rank=pipe["rank_memory_bytes"], peak_bytes=max(pipe["rank_memory_bytes"]),
                          peak_bytes_source=pipe.get("rank_memory_source", "stage search"))
    elif mesh.size("ep") > 1:
        from autopar.runtime.moe import ExpertProgram  # noqa: PLC0415

        program = ExpertProgram(local_gm, mesh, ep_axis="ep",
                                expert_params=local_gm.meta["autopar_expert"]["expert_params"],
                                dp_axis=plan.dp_axis, zero_stage=plan.zero_stage, bucket_mb=plan.bucket_mb,
                                in_spec=global_gm.meta.get("autopar_in_spec"),
                                out_spec=global_gm.meta.get("autopar_out_spec"), sync_init=sync_init,
                                engine_options=engine_options)
    else:
        program = Program(local_gm, mesh, dp_axis=plan.dp_axis, zero_stage=plan.zero_stage, bucket_mb=plan.bucket_mb,
                          in_spec=global_gm.meta.get("autopar_in_spec"),
                          out_spec=global_gm.meta.get("autopar_out_spec"), sync_init=sync_init,
                          engine_options=engine_options, cp_axis=plan.extra.get("context", {}).get("axis"))
    if on_meta or weights is not None:
        report = materialize(program.engine, mesh, model, weights, **model_tensors(global_gm, plan),
                             strict=strict_weights)
        plan.notes.append(report.note())
    global_gm.meta["autopar_state_keys"] = list(model.state_dict().keys())  # what save_pretrained writes
    if not on_meta:  # the description keeps shapes, not the user's full tensors: shards can free them
        described = shape_only_copy(global_gm)
        if described is None:
            plan.notes.append("the captured graph did not deep-copy: pm.global_graph keeps the model's own tensors")
        else:
            global_gm = described
    pmodel = ParallelModel(program, plan, local_gm, global_gm, records, global_gm.meta.get("autopar_capture", {}))
    if getattr(model, "config", None) is not None:
        pmodel.__dict__["config"] = model.config  # written as config.json by save_pretrained
    pmodel.__dict__["stage_graphs"] = stage_graphs
    return pmodel


def _router_stats_without_ep(plan, global_gm, mesh) -> None:
    """An MoE model split over data ranks without expert parallelism: its load-balancing
    statistics (router reductions over tokens, `search.expert_detect.router_stats`) are
    averaged over the axes that split the tokens, so the auxiliary loss is the global batch's
    (the expert pass does it with ep; `passes/expert.py` reads `plan.extra["router_stats"]`)."""
    axes = [a for a in (plan.dp_axis, "cp") if a and mesh.size(a) > 1]
    if not axes or "router_stats" in plan.extra:  # with pp too: the expert pass runs before the stage cut
        return
    if not any(n.op == "call_function" and n.target is torch.ops.aten.topk.default for n in global_gm.graph.nodes):
        return
    from autopar.search.expert_detect import router_stats  # noqa: PLC0415

    keys = router_stats(global_gm)
    if keys:
        plan.extra["router_stats"] = {"keys": keys, "axes": axes}
        plan.notes.append(f"MoE router statistics ({len(keys)} reductions over tokens) averaged over "
                          f"{' and '.join(axes)}: the load-balancing loss is the global batch's"
                          + (f", per micro-batch ({plan.n_microbatches})" if plan.n_microbatches > 1 else ""))


def _grouped_expert_layouts(plan: Plan, mesh: Mesh) -> None:
    """Grouped expert parameters (transformers' fused (E, ...) experts) keep this rank's experts'
    rows: record the ep cut of dim 0 so checkpoints and exports describe the program."""
    for b in plan.extra["expert"]["blocks"].values():
        if b["idiom"] not in ("sorted", "dense"):
            continue
        for name in b["expert_params"]:
            base = plan.param_layouts.get(name) or Layout.replicated(tuple(mesh.sizes))
            if "ep" not in dict(base.axes):
                base = Layout(base.axes + (("ep", Replicate()),))
            plan.param_layouts[name] = base.replace("ep", Shard(0))

def optimizer(model: ParallelModel, cls: type, **kwargs: Any):
    """The optimizer for a parallelised model: `cls` over this rank's (possibly sharded) state,
    with global gradient clipping (`model.engine.clip_grad_norm_`) and fp16 loss scaling.
    `cls(model.parameters(), ...)` also trains (model.parameters() are what the program
    trains); an optimizer over the original module's parameters is refused at its first step."""
    if not isinstance(model, ParallelModel):
        raise TypeError("autopar.optimizer takes the model returned by autopar.parallelize; for a plain "
                        f"module use {getattr(cls, '__name__', cls)}(module.parameters()) directly")
    return model.engine.make_optimizer(cls, **kwargs)


def sampler(dataset, mesh: Mesh, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
    """A `DistributedSampler` over the mesh's dp axis: ranks that share a dp index (tensor or
    pipeline peers) read the same samples; different dp indices read disjoint ones.
    Use it when each rank loads its own part; `model.step` also accepts the global batch."""
    from torch.utils.data import DistributedSampler

    dp, ep = mesh.size("dp"), mesh.size("ep")  # expert parallel ranks read different samples too
    index = (mesh.local_rank("dp") if dp > 1 else 0) * ep + (mesh.local_rank("ep") if ep > 1 else 0) \
        if dist.is_initialized() else 0
    return DistributedSampler(dataset, num_replicas=dp * ep, rank=index, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


# --- helpers -----------------------------------------------------------------------------
def _default_plan(mesh: Mesh, plan, pins, zero_stage, bucket_mb, n_microbatches) -> Plan:
    others = {a: s for a, s in mesh.sizes.items() if a not in ("dp", "pp", "ep", "cp") + SHARD_AXES and s > 1}
    if plan is None:
        if others:
            raise ValueError(f"{mesh} has axes {others}; this version parallelises over dp, tp, pp, ep and cp. "
                             "Use autopar.mesh(dp=N, tp=M, pp=K, ep=E, cp=C)")
        plan = Plan(mesh=dict(mesh.sizes), dp_axis="dp" if "dp" in mesh.sizes else None)
        if mesh.size("dp") > 1:
            plan.notes.append(f"data parallel over dp={mesh.size('dp')}: the batch is split along dim 0")
    elif plan.mesh != dict(mesh.sizes):
        raise ValueError(f"the plan is for mesh {plan.mesh} but the mesh is {dict(mesh.sizes)}")
    shortcut = {k: v for k, v in {"zero_stage": zero_stage, "bucket_mb": bucket_mb,
                                  "n_microbatches": n_microbatches}.items() if v is not None}
    all_pins = {**(pins or {}), **shortcut}
    return plan.pin(**all_pins) if all_pins else plan


def _hardware(mesh: Mesh) -> str:
    return default_profile(mesh.device_type)


def _joint_plan(global_gm, mesh: Mesh, args, pins, zero_stage, bucket_mb, n_microbatches, hardware, memory_limit,
                precision=None, moe_aux_stats: str = "global"):
    """Rank 0 plans and broadcasts: every rank carries out the same plan or raises the same error."""
    from autopar.search.planner import plan_for  # noqa: PLC0415

    all_pins = {**(pins or {}), **{k: v for k, v in {"zero_stage": zero_stage, "bucket_mb": bucket_mb,
                                                     "n_microbatches": n_microbatches}.items() if v is not None}}
    rows = next((t.shape[0] for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.dim()), None)
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            plan, _report = plan_for(global_gm, mesh.world_size, hardware or _hardware(mesh), pins=all_pins,
                                     memory_limit=memory_limit, global_batch=rows, precision=precision,
                                     moe_aux_stats=moe_aux_stats)
            box = [plan.to_json()]
        except ValueError as e:
            box = [{"error": str(e)}]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=planning_group())
    if isinstance(box[0], dict):
        raise ValueError(box[0]["error"])
    plan = Plan.from_json(box[0])
    return plan, make_mesh(device_type=mesh.device_type, **plan.mesh)


def _cast_dtype(param_dtype, model: nn.Module) -> torch.dtype | None:
    """The dtype to capture `model` at: a mixed plan's compute dtype ("bf16" or torch.bfloat16)
    when some floating parameter is not in it (the engine casts them), else None (as it is)."""
    from autopar.passes.plan import torch_dtype  # noqa: PLC0415

    dt = torch_dtype(param_dtype) if isinstance(param_dtype, str) else param_dtype
    if dt is None or all(p.dtype == dt for p in model.parameters() if p.is_floating_point()):
        return None
    return dt


def _dtype_name(dt: torch.dtype | None) -> str | None:
    return None if dt is None else str(dt).replace("torch.", "")


def _cp_may_be_searched(pins) -> bool:
    """False when the pins fix cp at 1 (a "cp" pin, or a pinned mesh without a cp axis)."""
    pins = pins or {}
    if "cp" in pins:
        return pins["cp"] != 1
    return "mesh" not in pins or (pins["mesh"] or {}).get("cp", 1) != 1


def _fresh(gm):
    """A GraphModule with its own copy of `gm`'s graph and module tree but the same tensors:
    passes rewrite it and swap its parameters for shards without touching `gm` (kept as the
    captured global graph) or using memory for a second copy of the weights."""
    import copy  # noqa: PLC0415

    import torch.fx as fx  # noqa: PLC0415

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


def _predict(plan: Plan, global_gm, local_gm, mesh: Mesh, hardware: str) -> None:
    """Fill plan.predicted from the cost model when it is available, for the hardware the plan
    was made for. Sizes are per rank: the global graph with the batch split over dp x
    micro-batches, or the per-rank capture when the batch dim was captured static. The global
    graph has no tensor-parallel collectives: their time, as the sharding search priced it,
    is added to the step (they block the ops that wait for them) and to the communication."""
    try:
        from autopar.cost import estimate as cost_estimate  # noqa: PLC0415
    except ImportError:
        return
    planned = plan.predicted if plan.predicted.get("source") == "planner" else None
    try:
        if batch_is_static(global_gm):
            predicted = cost_estimate(local_gm, plan, hardware).summary()
        else:
            predicted = cost_estimate(global_gm, plan, hardware, batch_is_global=True).summary()
        for axis, info in plan.extra.get("shard", {}).items():
            t = float(info["comm_s"]) * plan.n_microbatches  # the search prices one micro-batch
            predicted[f"{axis}_comm_s"] = t
            for k in ("step_s", "comm_s", "comm_exposed_s"):
                if k in predicted:
                    predicted[k] += t
    except Exception as e:  # noqa: BLE001 - a prediction failure must not stop training; it is reported
        predicted = {"error": f"{type(e).__name__}: {e}"}
    plan.predicted = {**planned, "estimate": predicted} if planned is not None else predicted
