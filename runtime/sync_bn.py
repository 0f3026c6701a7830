"""Batch normalisation whose statistics cover the whole batch, not this rank's part of it.

`autopar::sync_batch_norm(x, weight, bias, eps, axes)` (`axes`: mesh axis names joined by
commas) followed by `autopar::update_running_stats(running_mean, running_var, mean, var,
momentum)` is `aten.batch_norm` in training mode over the batch split across `axes` (the mesh axes
along which dim 0 of `x` is sharded): what one process computes on the global batch, as
`nn.SyncBatchNorm` does for DDP.

Forward, per channel: the global mean (one all-reduce of the local sums), then the global
biased variance from the centred squares (a second all-reduce; two passes, so large means do
not cancel digits), the normalisation and the affine map; it also returns the mean, 1/std and
the unbiased variance, which the second op folds into the running statistics in place (as
`aten.batch_norm` does; a mutating op cannot carry autograd, so it is a separate node). Backward: one all-reduce of
(sum dy, sum dy * x_hat) per channel; dx is exact for the sum of every rank's loss, which
the engine's average over dp turns into the gradient of the global mean loss. Weight and
bias gradients are this rank's sums (the engine averages them like any parameter's).

Every rank must hold the same number of rows (the dp split is even). `x` is (N, C, ...).
"""
from __future__ import annotations

import torch

from . import collectives as C


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # bf16/fp16 accumulate in fp32, fp64 stays


def _dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _bcast(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _rows(x: torch.Tensor, axes: str) -> int:
    n = x.numel() // max(x.shape[1], 1)
    for a in filter(None, axes.split(",")):
        n *= C.axis_size(a)
    return n


def _all_reduce(t: torch.Tensor, axes: str) -> torch.Tensor:
    for a in filter(None, axes.split(",")):
        if C.axis_size(a) > 1:
            C.all_reduce_(t, a)
    return t


@torch.library.custom_op("autopar::sync_batch_norm", mutates_args=())
def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    axes: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, invstd, unbiased variance); the last three per channel in fp32 (fp64 for fp64 inputs), not differentiable."""
    n = _rows(x, axes)
    xf = x.to(_acc(x))
    mean = _all_reduce(xf.sum(_dims(x)), axes) / n
    var = _all_reduce((xf - _bcast(mean, x)).pow(2).sum(_dims(x)), axes) / n
    invstd = torch.rsqrt(var + eps)
    y = (xf - _bcast(mean, x)) * _bcast(invstd, x)
    if weight is not None:
        y = y * _bcast(weight.to(xf.dtype), x)
    if bias is not None:
        y = y + _bcast(bias.to(xf.dtype), x)
    return y.to(x.dtype), mean, invstd, var * (n / max(n - 1, 1))


@sync_batch_norm.register_fake
def _(x, weight, bias, eps, axes):
    c = x.shape[1]
    stat = x.new_empty((c,), dtype=_acc(x))
    return torch.empty_like(x), stat, torch.empty_like(stat), torch.empty_like(stat)


@torch.library.custom_op("autopar::update_running_stats", mutates_args=("running_mean", "running_var"))
def update_running_stats(running_mean: torch.Tensor | None, running_var: torch.Tensor | None, mean: torch.Tensor,
                         unbiased_var: torch.Tensor, momentum: float) -> None:
    """running <- (1 - momentum) running + momentum batch, as aten.batch_norm does in training."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)


@update_running_stats.register_fake
def _(running_mean, running_var, mean, unbiased_var, momentum):
    return None


def _setup(ctx, inputs, output):
    x, weight, bias = inputs[0], inputs[1], inputs[2]
    _y, mean, invstd, var = output
    ctx.mark_non_differentiable(mean, invstd, var)
    ctx.axes = inputs[4]
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight, mean, invstd)


def _backward(ctx, dy, _dmean, _dinvstd, _dvar):
    x, weight, mean, invstd = ctx.saved_tensors
    dims = _dims(x)
    xhat = (x.to(_acc(x)) - _bcast(mean, x)) * _bcast(invstd, x)
    dyf = dy.to(xhat.dtype)
    local = torch.stack([dyf.sum(dims), (dyf * xhat).sum(dims)])
    dbias, dweight = local[0].clone(), local[1].clone()
    glob = _all_reduce(local, ctx.axes) / _rows(x, ctx.axes)
    scale = _bcast(invstd, x) * (_bcast(weight.to(xhat.dtype), x) if weight is not None else 1.0)
    dx = scale * (dyf - _bcast(glob[0], x) - xhat * _bcast(glob[1], x))
    gw = dweight.to(weight.dtype) if weight is not None else None
    gb = dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dx.to(x.dtype), gw, gb, None, None


sync_batch_norm.register_autograd(_backward, setup_context=_setup)

__all__ = ["sync_batch_norm", "update_running_stats"]
