"""The per-rank program: runs the rewritten graph and a training step on one rank.

`Program` holds this rank's graph module (parameters included), the mesh, and the engine
that reduces and shards gradients and optimizer state (`runtime.zero`). `step(batch,
loss_fn)` takes the *global* batch, keeps this rank's part along the data-parallel axis
(dim 0), splits it into micro-batches, runs forward and backward (communicating only on the
last micro-batch), and returns the loss of the whole global batch (the mean over the
data-parallel ranks of their local mean losses, which equals the one-process loss when
`loss_fn` is a mean over the batch).

Mode and random numbers: the module runs inside `self.rng.fork(self.training)` (runtime/rng.py),
so `train()` / `eval()` switch the graph's dropout and batch norm as in PyTorch, and dropout
draws from this rank's model-parallel stream (dp ranks differ, tp peers agree). `evaluate(batch,
loss_fn)` is the no-grad loss of a global batch, averaged over dp like `step`'s.

The runtime knows nothing of plans or graphs beyond "a module to call": the brain decides,
the passes rewrite, this runs. The step labels its parts (`collective_errors.where`: "step 3 >
micro-batch 1/2 backward", "gradient reduction"), so a collective that fails names where.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from ._torch_compat import pytree

from . import collectives as C
from .collective_errors import issue, where
from .context_layout import shard_sequence
from .mesh import Mesh
from .rng import RNGTracker
from .zero import broadcast_module, make_engine
from .zero_optim import LossScaleGroup


class Program(nn.Module):
    def __init__(self, module: nn.Module, mesh: Mesh, *, dp_axis: str | None = "dp", zero_stage: int = 0,
                 bucket_mb: float = 25.0, in_spec=None, out_spec=None, sync_init: bool = True,
                 engine_options: dict | None = None, cp_axis: str | None = None):
        super().__init__()
        self.module = module
        self.mesh = mesh
        self.batch_axis = dp_axis if dp_axis in mesh.sizes else None  # splits dim 0 of the batch
        self.cp_axis = cp_axis if cp_axis and mesh.size(cp_axis) > 1 else None  # splits dim 1: the sequence
        # the ranks that hold the same parameters and different data: gradients, the loss and
        # ZeRO's shards are over all of them (dp and cp joined: runtime.mesh.Mesh.parts)
        self.dp_axis = data_axis(mesh, self.batch_axis, self.cp_axis)
        self.dp = mesh.size(self.dp_axis) if self.dp_axis else 1
        self.in_spec, self.out_spec = in_spec, out_spec
        C.set_active_mesh(mesh)
        if sync_init and self.dp > 1 and dist.is_initialized():
            broadcast_module(module, self.dp_axis)
        self.engine = make_engine(module, mesh, self.dp_axis, zero_stage, bucket_mb, **(engine_options or {}))
        others = [a for a, n in mesh.sizes.items() if n > 1 and a not in mesh.parts(self.dp_axis)] if self.dp_axis \
            else [a for a, n in mesh.sizes.items() if n > 1]
        if self.engine.scaler is not None and others:
            # fp16 loss scaling with tp / ep shards: the inf/NaN verdict agreed over every axis,
            # not the data axis only, or a tp rank whose shard overflowed would skip alone and drift
            LossScaleGroup(self.engine.scaler, [a for a, n in mesh.sizes.items() if n > 1], mesh.device).add(
                self.engine, scales_outputs=True)
        self.steps_run = 0  # training steps so far: failure messages name the step
        self.rng = RNGTracker.for_mesh(mesh, self.dp_axis)  # dropout masks: runtime/rng.py

    # --- forward ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any):
        C.set_active_mesh(self.mesh)
        if self.in_spec is not None:
            flat, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.in_spec:
                raise ValueError(f"inputs do not match the captured structure: got {spec}, captured {self.in_spec}")
        else:
            flat = list(args)
        flat = self.mesh.to_device(flat)  # a CPU batch reaches a GPU program
        with self.rng.fork(self.training):  # dropout / batch norm follow pm.train() / pm.eval()
            out = self.module(*flat)
        if self.out_spec is not None:
            out = pytree.tree_unflatten(list(out), self.out_spec)
        return out

    # --- training step ---------------------------------------------------------------------
    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a global batch: dim 0 of every tensor split over the dp axis,
        and under context parallelism dim 1 (the sequence) over the cp axis, in zigzag chunks;
        on the mesh's device."""
        batch = self.mesh.to_device(batch)
        if self.cp_axis:
            seq = [t.shape[1] for t in pytree.tree_leaves(batch[0] if isinstance(batch, tuple) else batch)
                   if isinstance(t, torch.Tensor) and t.dim() > 1][:1]
            if seq:
                batch = shard_sequence(batch, self.cp_axis, seq[0])
        dp = self.mesh.size(self.batch_axis) if self.batch_axis else 1
        if dp == 1:
            return batch
        idx = self.mesh.local_rank(self.batch_axis)

        def take(t):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            n = t.shape[0]
            if n % dp:
                raise ValueError(f"the global batch has {n} rows, which does not divide by "
                                 f"{self.batch_axis}={dp}; use a batch size that is a multiple of {dp}")
            k = n // dp
            return t[idx * k:(idx + 1) * k]

        return pytree.tree_map(take, batch)

    def step(self, batch: Sequence[Any], loss_fn: Callable, n_microbatches: int = 1) -> torch.Tensor:
        """Forward and backward of one global batch `(inputs, targets)`; returns its loss.

        `inputs` is a tensor, a tuple of the model's positional inputs or a dict of its keyword
        inputs (as captured); `targets` (None when the model computes its own loss) goes to
        `loss_fn(output, targets)`. Gradients are left reduced (and sharded, under ZeRO) for
        the optimizer's `step()`.
        """
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("model.step takes batch=(inputs, targets): inputs a tensor or tuple of "
                             f"the model's inputs, targets what loss_fn needs; got {type(batch).__name__}"
                             + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        inputs, targets = self.local_batch(tuple(batch))
        keyword = isinstance(inputs, Mapping)  # model(**inputs)
        if not keyword and not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        micro = _split_micro((dict(inputs) if keyword else tuple(inputs), targets), n_microbatches)
        self.steps_run += 1
        with where(f"step {self.steps_run}"), self.rng.fork(self.training):
            total = None
            loss_work = None
            for i, (mb_in, mb_tgt) in enumerate(micro):
                last = i == len(micro) - 1
                with where(f"micro-batch {i + 1}/{len(micro)} forward"):
                    out = self(**mb_in) if keyword else self(*mb_in)
                    loss = check_loss(loss_fn(out, mb_tgt))
                scaled = loss / len(micro)
                total = scaled.detach() if total is None else total + scaled.detach()
                if last and self.dp > 1:
                    # average the reported loss over dp while backward runs (issued before any
                    # gradient bucket, so every rank sees the same collective order)
                    total = total.clone()
                    C.COUNTER.record("metric_all_reduce", self.dp_axis, total.numel() * total.element_size())
                    loss_work = issue("loss all_reduce", dist.all_reduce, total, op=dist.ReduceOp.AVG,
                                      group=self.mesh.group(self.dp_axis), async_op=True, axis=self.dp_axis)
                with where(f"micro-batch {i + 1}/{len(micro)} backward"):
                    if last:
                        scaled.backward()
                    else:
                        with self.engine.no_sync():
                            scaled.backward()
            with where("gradient reduction"):
                self.engine.finish_backward()
                if loss_work is not None:
                    loss_work.wait()
        return total

    @torch.no_grad()
    def evaluate(self, batch: Sequence[Any], loss_fn: Callable) -> torch.Tensor:
        """The loss of one global batch `(inputs, targets)` without gradients, in the
        program's mode (`pm.eval()` first for evaluation), averaged over the data-parallel
        ranks as `step` does."""
        return evaluate(self, batch, loss_fn, self.dp_axis)


def evaluate(program: nn.Module, batch: Sequence[Any], loss_fn: Callable, *axes: str | None) -> torch.Tensor:
    """`loss_fn(program(this rank's inputs), its targets)` under no_grad, averaged over `axes`
    (the axes that split the batch); shared by every program kind."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("evaluate takes batch=(inputs, targets): inputs a tensor or tuple of the model's "
                         f"inputs, targets what loss_fn needs; got {type(batch).__name__}"
                         + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    inputs, targets = program.local_batch(tuple(batch))
    with torch.no_grad():
        if isinstance(inputs, Mapping):
            out = program(**inputs)
        else:
            out = program(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        loss = loss_fn(out, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                         + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    loss = loss.detach().clone()
    for axis in axes:
        if axis and program.mesh.size(axis) > 1:
            C.COUNTER.record("metric_all_reduce", axis, loss.numel() * loss.element_size())
            issue("loss all_reduce", dist.all_reduce, loss, op=dist.ReduceOp.AVG,
                  group=program.mesh.group(axis), axis=axis)
    return loss


def data_axis(mesh: Mesh, batch_axis: str | None, cp_axis: str | None) -> str | None:
    """The axis over which ranks hold the same parameters and different data: the batch's
    axis, joined with the context-parallel one when there is one ("dp+cp")."""
    axes = [a for a in mesh.axis_names if a in (batch_axis, cp_axis)]
    return "+".join(axes) if len(axes) > 1 else batch_axis or cp_axis


def check_loss(loss: Any) -> torch.Tensor:
    """`loss` if it is what backward needs (a floating-point scalar tensor that requires
    grad), else a ValueError saying what loss_fn returned and what to return instead."""
    if not isinstance(loss, torch.Tensor):
        hint = " (a transformers output: return out.loss or out[\"loss\"])" if hasattr(loss, "keys") else ""
        raise ValueError(f"loss_fn returned a {type(loss).__name__}, not a tensor; return the loss as a scalar "
                         f"tensor computed from the model's output{hint}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got a tensor of shape {tuple(loss.shape)}; reduce it "
                         "(e.g. loss.mean(), or reduction=\"mean\" in the loss function)")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise ValueError(f"loss_fn returned a {str(loss.dtype).replace('torch.', '')} tensor; a loss must be "
                         "floating point to have gradients")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad (detached, made from .item() or "
                         "under torch.no_grad()), so backward cannot reach the model; compute it from the model's "
                         "output without detaching")
    return loss


def _split_micro(batch, n: int):
    if n == 1:
        return [batch]
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    for s in sizes:
        if s % n:
            raise ValueError(f"the local batch has {s} rows, which does not divide into {n} micro-batches")
    chunks = [t.chunk(n) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * n for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(n)]
