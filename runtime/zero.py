"""Data parallelism with ZeRO sharding: `make_engine(module, mesh, axis, stage=k, ...)`.

What each stage keeps on a rank of the data-parallel `axis` (k ranks), after
`finish_backward()`; "rows" are this rank's torch.chunk piece of dim 0 of every parameter:

    stage  parameters         gradients                       optimizer state (+ fp32 masters)
    0      full               full, all-reduced (avg)         full
    1      full               full, all-reduced (avg)         rows
    2      full               rows, reduce-scattered in       rows
                              buckets during backward
    3      rows (gathered     rows, reduce-scattered per      rows
           per unit in use)   unit during backward

Communication per step, in payload bytes as `collectives.COUNTER` counts them (P: the
parameters' bytes in the reduce/compute dtype, Pp: the same with every parameter's dim 0
padded to a multiple of k): stage 0 all-reduces P; stages 1-2 reduce (1: all-reduce P,
2: reduce-scatter Pp) then all-gather Pp/k after the step; stage 3 all-gathers Pp/k in
forward, again Pp/k (minus units whose weights backward does not read, such as an
embedding) in backward, and reduce-scatters Pp. A gradient accumulation micro-batch inside
`no_sync()` communicates nothing.

The engine interface (what runtime/program.py calls; every engine has it):

    engine.no_sync()                 context: accumulate gradients locally, send nothing
    engine.finish_backward()         after the last micro-batch's backward: wait for the
                                     reductions, put averaged, unscaled fp32 gradients on the
                                     masters; with fp16, decide whether the step is skipped
    engine.make_optimizer(cls, param_groups=None, **kw) -> ShardedOptimizer
                                     cls over this rank's masters; step() also writes the
                                     result back into the model (cast / all-gather)
    engine.clip_grad_norm_(max_norm, norm_type=2.0) -> total_norm   (global over shards)
    engine.memory_bytes(device=None) -> {"params", "grads", "optimizer"}   bytes on this rank
    engine.memory_report()           the same per device type
    engine.named_shards()            (name, ShardInfo, master) per parameter
    engine.gather_full_state_dict(rank0_only=False) -> full fp32 state dict on the CPU
    engine.load_state_dict_shards(source)   fill only this rank's rows from a mapping,
                                     safetensors handle or callable (name, start, end)
    engine.loss_scale, engine.last_step_skipped, engine.remove()
    engine.before_plain_step(), engine.after_plain_step(), engine.untrained
                                     a plain torch optimizer over the masters (what
                                     `ParallelModel.parameters()` returns) trains as the
                                     wrapper does, and one over tensors the engine does not
                                     train is refused at its first step: runtime/zero_plain_optim.py

Precision: fp64 parameters keep fp64 masters, gradients, reductions and accumulation buffers
at every stage (mixed precision is for fp16/bf16 `param_dtype` only).

Options (keywords of make_engine):
    param_dtype    None | torch.bfloat16 | torch.float16: compute dtype of the model's
                   parameters; masters and optimizer state stay fp32 (mixed precision).
                   Floating inputs of the root forward are cast to it (cast_inputs=False
                   to disable). A captured graph must be captured at this dtype.
    reduce_dtype   dtype of gradient communication (default: param_dtype, else the grad's);
                   separate masters take the reduced gradient in this dtype (an fp32
                   reduction of bf16 gradients reaches fp32 masters unrounded, at every stage)
    loss_scale     "auto" (dynamic for fp16, none otherwise) | "dynamic" | None | a number;
                   init_scale, growth_interval as in torch.amp.GradScaler
    offload        True: masters and optimizer state in CPU memory, the update on the CPU
                   (ZeRO-Offload). On a CPU-only machine that is the same memory: the
                   mechanics (separate fp32 copies on the CPU, cast and copy back after the
                   step) are what runs and is tested.
    init_fn        for a module built on the meta device: (name, full_shape, start, end) ->
                   rows [start, end) of the initial value. Without it, meta parameters are
                   allocated empty and must be filled with load_state_dict_shards. At stage
                   3 only this rank's rows are ever allocated; stages 0-2 hold full
                   parameters by definition. Meta buffers are allocated empty and filled
                   from load_state_dict_shards' source when it names them.
    units          stage 3: list of module-path prefixes, one gathered unit each (default:
                   per top-level child, list-like children per element)
    prefetch       stage 3: gather the next unit while this one computes (default True)

Overlap: every reduction is launched asynchronously from autograd hooks as soon as its
bucket (stages 0-2, `bucket_mb`) or unit (stage 3) has all its gradients, and waited in
`finish_backward()`; stage 3 prefetches the next unit's all-gather.

Gradient accumulation: the program calls `loss.backward()` inside `engine.no_sync()` for
every micro-batch but the last; the loss must already be divided by the number of
micro-batches (the engine averages over ranks, not over micro-batches). Between
micro-batches stages 0-2 keep full local gradients in `.grad` and stage 3 keeps full fp32
gradients of each unit in an accumulation buffer (as FSDP2 does without gradient sync).

Implementation: stages 0-2 in runtime/zero_engine.py, stage 3 (and how it gathers on
both eager modules and exported GraphModules) in runtime/zero_stage3.py, layouts and
reducers in runtime/zero_shard.py, the optimizer wrapper and loss scaler in
runtime/zero_optim.py.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import collectives as C
from .zero_engine import DataParallelEngine, EngineBase, ReplicatedEngine, read_rows
from .zero_optim import DynamicLossScaler, ShardedOptimizer
from .zero_shard import FlatLayout, GradReducer, ScatterReducer, ShardInfo, shard_info
from .zero_stage3 import ShardedEngine, default_units

_COMMON = {"param_dtype", "reduce_dtype", "loss_scale", "init_scale", "growth_interval", "offload",
           "cast_inputs", "init_fn", "model_parallel"}
_STAGE3 = {"units", "prefetch"}


def broadcast_module(module: nn.Module, axis: str, src_index: int = 0) -> None:
    """Make every rank along `axis` hold rank `src_index`'s parameters and buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            C.broadcast_(t.data, axis, src_index)


def make_engine(module: nn.Module, mesh, axis: str | None, stage: int = 0, bucket_mb: float = 25.0,
                **options) -> EngineBase:
    """The ZeRO engine for `stage` (0-3) over the data-parallel `axis` of `mesh`.

    `axis=None` (or an axis of size 1) means no data parallelism: the engine still does
    mixed precision, clipping and offload, and communicates nothing. See the module
    docstring for the options."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    allowed = _COMMON | (_STAGE3 if stage == 3 else set())
    bad = sorted(set(options) - allowed)
    if bad:
        extra = f"; {sorted(_STAGE3)} need stage=3" if set(bad) & _STAGE3 else ""
        raise ValueError(f"unknown make_engine options {bad} for stage {stage}; valid: {sorted(allowed)}{extra}")
    if axis is None:
        axis = "_none"  # Mesh.size of an absent axis is 1: nothing is communicated
    elif not mesh.has_axis(axis):
        raise ValueError(f"{mesh} has no axis {axis!r}; its axes are {list(mesh.axis_names)}")
    if stage == 3:
        return ShardedEngine(module, mesh, axis, bucket_mb, **options)
    if stage == 0:
        return DataParallelEngine(module, mesh, axis, bucket_mb, **options)
    return ReplicatedEngine(module, mesh, axis, stage, bucket_mb, **options)


__all__ = ["make_engine", "broadcast_module", "EngineBase", "DataParallelEngine", "ReplicatedEngine",
           "ShardedEngine", "ShardedOptimizer", "DynamicLossScaler", "GradReducer", "ScatterReducer",
           "FlatLayout", "ShardInfo", "shard_info", "default_units", "read_rows"]
