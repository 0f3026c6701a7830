"""The user's entry points: `mesh`, `parallelize`, `optimizer`, `sampler`.

`parallelize(model, mesh, example_inputs=...)` composes the floors below it:
capture (autopar/capture.py) -> the plan (the joint planner, autopar/search/planner.py, on
`autopar.mesh(world_size=N)`; otherwise the mesh's own axes with the pins given) -> the plan
completed for this mesh and graph (autopar/build/plan_complete.py: tp sharding, experts,
context exchange, fusions) -> this rank's program (autopar/build/program.py: the rank's passes,
recompute, the prediction, the stages and one `runtime.program.Program`) -> the tensors this
rank keeps (autopar/build/materialize.py, for a model on meta or given `weights`), wrapped as a
`ParallelModel` that trains with `step()` and shows its plan and dumps.

Work whose answer is the same on every rank (the mesh and MoE checks, the searches, the
prediction) is done on rank 0 and broadcast (autopar/build/rank0.py), with its error raised on
every rank. Once the program is built the captured graph only describes the model: its
parameters and buffers become meta tensors in place (`pm.global_graph`).
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
from autopar.build.model_tensors import make_shape_only, model_tensors, shape_only_copy
from autopar.build.plan_complete import complete_plan
from autopar.build.program import build_rank_program, rank_copy
from autopar.build.recompute_plan import pinned_recompute
from autopar.build.rank0 import on_rank0
from autopar.build.plan_check import (check_mesh_fits, check_micro_batches, check_moe_aux_stats,
                                      check_plan_against_graph, stamp)
from autopar.capture import CaptureError, capture, capture_for_search
from autopar.cost.hardware import default_profile
from autopar.input_checks import check_captured_graph, check_example_inputs, check_step_batch, explain_capture_failure
from autopar.passes.dump import write_graph
from autopar.passes.plan import Plan
from autopar.runtime.mesh import Mesh, make_mesh, planning_group
from autopar.runtime.program import Program
from autopar.runtime.zero_plain_optim import named_masters
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
            from autopar.build.pipeline import write_schedule_svg, write_stage_graphs  # noqa: PLC0415

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
                moe_aux_stats: str | None = None, loss_parallel: bool | None = None) -> ParallelModel:
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
        loss_parallel: True keeps a language model's logits sharded over the vocabulary on tp
            (the head's weight pinned S(0) there unless placed otherwise: passes/vocab_head.py)
            and `step` / `evaluate` given `autopar.cross_entropy` as loss_fn compute the loss
            on the shards (two small all-reduces, runtime/vocab_loss.py) instead of gathering
            them; any other loss_fn gets the gathered logits as before. Recorded as
            `plan.loss_parallel`, which `plan.predicted` prices. Default None: the plan's own.
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
        lp_pin = {"loss_parallel": True} if loss_parallel is True else {}  # the planner prices the vocab-parallel loss
        plan, mesh = _joint_plan(global_gm, mesh, (args, kwargs), {**(pins or {}), **lp_pin}, zero_stage, bucket_mb,
                                 n_microbatches, hardware,
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
    if plan.recompute and not plan_given:  # a recompute pin, read as the joint planner reads it
        plan.recompute, save = pinned_recompute(global_gm, plan.recompute, plan.extra.get("recompute_save"),
                                                hardware or _hardware(mesh))
        if save:
            plan.extra["recompute_save"] = save
    plan.notes += _moe_aux_stats_on_rank0(plan, global_gm, moe_aux_stats)  # refuses micro-batches under "global"
    if plan_given:
        plan.notes += check_plan_against_graph(plan, global_gm, mesh)
    else:
        if not getattr(mesh, "searched", False):
            if mesh.size("ep") > 1:  # an MoE detection (seconds on a large graph): rank 0's verdict everywhere
                on_rank0(lambda: check_mesh_fits(global_gm, mesh), what="the mesh check")
            else:
                check_mesh_fits(global_gm, mesh)
        stamp(plan, global_gm)
    if loss_parallel is not None:
        if not isinstance(loss_parallel, bool):
            raise ValueError(f"loss_parallel must be True or False, got {loss_parallel!r}")
        plan.loss_parallel = loss_parallel
        if loss_parallel and mesh.size("tp") > 1 and "tp" not in plan.strategies:  # the head pinned before the search
            from autopar.passes.vocab_head import pin_vocab_parallel  # noqa: PLC0415

            note, head_pin = pin_vocab_parallel(plan, global_gm, "tp", mesh.size("tp"))
            plan.notes.append(note)
            if head_pin and mesh.size("ep") == 1:  # the head's output sharded too (with ep: complete_plan's pins)
                search_sharding(plan, global_gm, mesh, hardware or _hardware(mesh), group=planning_group(),
                                node_pins={"tp": head_pin})
    local_gm = rank_copy(global_gm)
    if dp > 1 and batch_is_static(global_gm):
        # the capture specialised the batch dim (e.g. the model reshapes with a literal batch):
        # capture again at the local micro-batch size for the per-rank program
        k = dp * plan.n_microbatches
        local_args, local_kwargs = pytree.tree_map(
            lambda t: t[: t.shape[0] // k] if isinstance(t, torch.Tensor) and t.dim() else t, (args, kwargs))
        local_gm = rank_copy(_capture(local_args, local_kwargs))
        plan.notes.append(f"batch dim captured static; per-rank program captured at {k}x smaller batch")
    global_cost = complete_plan(plan, global_gm, local_gm, mesh, hardware=hardware or _hardware(mesh),
                                context_method=context_method, fusions_pinned=fusions_pinned)
    program, local_gm, stage_graphs, records = build_rank_program(
        global_gm, local_gm, plan, mesh, hardware=hardware or _hardware(mesh), memory_budget=memory_budget,
        sync_init=sync_init, dump_dir=dump_dir, engine_options=precision_engine, global_cost=global_cost)
    if on_meta or weights is not None:
        report = materialize(program.engine, mesh, model, weights, **model_tensors(global_gm, plan),
                             strict=strict_weights)
        plan.notes.append(report.note())
    global_gm.meta["autopar_state_keys"] = list(model.state_dict().keys())  # what save_pretrained writes
    if not on_meta and not make_shape_only(global_gm):  # in place: from here on nothing runs the captured graph
        # the description keeps shapes, not the user's full tensors: shards can free them
        described = shape_only_copy(global_gm)
        if described is None:
            plan.notes.append("the captured graph did not deep-copy: pm.global_graph keeps the model's own tensors")
        else:
            global_gm = described
    if mesh.size("pp") > 1:  # the stages hold this rank's parameters; the rank program's graph keeps shapes only,
        local_gm = shape_only_copy(local_gm) or local_gm  # not the other stages' weights (measured: 0.17-0.29 MiB, gpt-tiny)
    pmodel = ParallelModel(program, plan, local_gm, global_gm, records, global_gm.meta.get("autopar_capture", {}))
    if getattr(model, "config", None) is not None:
        pmodel.__dict__["config"] = model.config  # written as config.json by save_pretrained
    pmodel.__dict__["stage_graphs"] = stage_graphs
    return pmodel


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
    plan = Plan.from_json(on_rank0(lambda: plan_for(
        global_gm, mesh.world_size, hardware or _hardware(mesh), pins=all_pins, memory_limit=memory_limit,
        global_batch=rows, precision=precision, moe_aux_stats=moe_aux_stats)[0].to_json(), what="the joint planner"))
    return plan, make_mesh(device_type=mesh.device_type, **plan.mesh)


def _moe_aux_stats_on_rank0(plan: Plan, global_gm, mode: str | None) -> list[str]:
    """`check_moe_aux_stats` (the MoE router statistics' detection: seconds on a large graph) on
    rank 0; every rank takes its verdict (`plan.extra["moe_aux_stats"]`, notes) or its error."""
    def check() -> dict[str, Any]:
        notes = check_moe_aux_stats(plan, global_gm, mode)
        return {"notes": notes, "mode": plan.extra.get("moe_aux_stats")}

    if not any(n.op == "call_function" and n.target is torch.ops.aten.topk.default for n in global_gm.graph.nodes):
        return check_moe_aux_stats(plan, global_gm, mode)  # no router: nothing to detect, no broadcast
    got = on_rank0(check, what="the MoE auxiliary statistics' check")
    if got["mode"] is None:
        plan.extra.pop("moe_aux_stats", None)
    else:
        plan.extra["moe_aux_stats"] = got["mode"]
    return got["notes"]


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
