"""Fused normalisations: RMSNorm, LayerNorm, and residual add + RMSNorm / LayerNorm.

Each op has a torch reference (`<op>_reference`: the numerical oracle and the CPU fallback),
an autograd Function over the Triton kernels in `_triton_norms.py` (forward and backward,
input and weight / bias gradients), and a public function that dispatches between them
(see `_dispatch.use_triton`). Normalisation is over the last dim; any leading shape is
flattened to rows. Statistics and arithmetic are fp32 in both paths; outputs are returned in
the input's dtype, parameter gradients in the parameter's dtype.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import torch

from ._dispatch import acc, as_rows, check_last_dim, check_same, load_kernels, use_triton

# ---------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 (fp64 for fp64)."""
    xf = acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim, computed in fp32 (fp64 for fp64)."""
    xf = acc(x)
    w = weight.to(xf.dtype) if weight is not None else None
    b = bias.to(xf.dtype) if bias is not None else None
    return torch.nn.functional.layer_norm(xf, x.shape[-1:], w, b, eps).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor | None = None,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + residual in the input dtype."""
    s = x + residual
    return s, rms_norm_reference(s, weight, eps)


def add_layer_norm_reference(x: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                             eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, layer_norm(s)) with s = x + residual in the input dtype."""
    s = x + residual
    return s, layer_norm_reference(s, weight, bias, eps)


# ---------------------------------------------------------------------------- autograd


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        k = load_kernels("norms")
        x2, weight = as_rows(x), _contiguous(weight)
        y, rstd, _ = k.rms_norm_fwd(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = load_kernels("norms").rms_norm_bwd(as_rows(dy), x2, weight, rstd)
        return dx.view(ctx.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        k = load_kernels("norms")
        weight = _contiguous(weight)
        y, rstd, s = k.rms_norm_fwd(as_rows(x), weight, eps, residual=as_rows(residual))
        ctx.save_for_backward(s, weight, rstd)
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)  # an unused sum gets no zero-filled gradient
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the sum was used
            return ds, ds, None, None
        ds2 = as_rows(ds) if ds is not None else None
        dx, dw = load_kernels("norms").rms_norm_bwd(as_rows(dy), s, weight, rstd, ds=ds2)
        dx = dx.view(ctx.shape)
        # the same tensor for x and residual: autograd copies it before accumulating into two
        # leaves' .grad, so they never alias (checked in tests)
        return dx, dx, dw, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        k = load_kernels("norms")
        x2, weight, bias = as_rows(x), _contiguous(weight), _contiguous(bias)
        y, mean, rstd, _ = k.layer_norm_fwd(x2, weight, bias, eps)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = load_kernels("norms").layer_norm_bwd(as_rows(dy), x2, weight, bias, mean,
                                                          rstd)
        return dx.view(ctx.shape), dw, db, None


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        k = load_kernels("norms")
        weight, bias = _contiguous(weight), _contiguous(bias)
        y, mean, rstd, s = k.layer_norm_fwd(as_rows(x), weight, bias, eps,
                                            residual=as_rows(residual))
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)  # an unused sum gets no zero-filled gradient
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:  # only the sum was used
            return ds, ds, None, None, None
        ds2 = as_rows(ds) if ds is not None else None
        dx, dw, db = load_kernels("norms").layer_norm_bwd(as_rows(dy), s, weight, bias, mean,
                                                          rstd, ds=ds2)
        dx = dx.view(ctx.shape)
        return dx, dx, dw, db, None  # one tensor for both: see _AddRMSNorm.backward


# ---------------------------------------------------------------------------- public


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (..., N) with an optional weight (N,)."""
    check_last_dim("rms_norm", "weight", weight, x.shape[-1])
    if use_triton("rms_norm", x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of `x` (..., N) with optional weight and bias (N,)."""
    check_last_dim("layer_norm", "weight", weight, x.shape[-1])
    check_last_dim("layer_norm", "bias", bias, x.shape[-1])
    if use_triton("layer_norm", x, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, in one pass.

    Returns:
        (s, y): s = x + residual (the new residual stream, in the input dtype) and
        y = rms_norm(s, weight, eps).
    """
    check_same("add_rms_norm", x, residual, "x and residual")
    check_last_dim("add_rms_norm", "weight", weight, x.shape[-1])
    if use_triton("add_rms_norm", x, residual, weight):
        return _AddRMSNorm.apply(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then LayerNorm, in one pass.

    Returns:
        (s, y): s = x + residual (in the input dtype) and y = layer_norm(s, weight, bias, eps).
    """
    check_same("add_layer_norm", x, residual, "x and residual")
    check_last_dim("add_layer_norm", "weight", weight, x.shape[-1])
    check_last_dim("add_layer_norm", "bias", bias, x.shape[-1])
    if use_triton("add_layer_norm", x, residual, weight, bias):
        return _AddLayerNorm.apply(x, residual, weight, bias, eps)
    return add_layer_norm_reference(x, residual, weight, bias, eps)
