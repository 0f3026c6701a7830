"""Fused gated and biased activations: SwiGLU, GeGLU (erf / tanh), bias + GeLU.

    swiglu(a, b)            = silu(a) * b
    geglu(a, b, approx)     = gelu(a, approximate=approx) * b
    bias_gelu(x, b, approx) = gelu(x + b, approximate=approx), b broadcast over the last dim

Each op has a torch reference (`<op>_reference`: the numerical oracle and the CPU fallback),
an autograd Function over the Triton kernels in `_triton_activations.py` (forward and
backward, including the bias gradient), and a public function that dispatches (see
`_dispatch.use_triton`). Arithmetic is fp32 in both paths; results are in the input dtype.
`approximate` is "none" (erf) or "tanh", as in `torch.nn.functional.gelu`.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import acc, as_rows, check_last_dim, check_same, load_kernels, use_triton

_GELU_ACT = {"none": "gelu", "tanh": "gelu_tanh"}


def _check_approximate(op: str, approximate: str) -> str:
    if approximate not in _GELU_ACT:
        raise ValueError(f"{op}: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return _GELU_ACT[approximate]


# ---------------------------------------------------------------------------- references


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (F.silu(acc(a)) * acc(b)).to(a.dtype)


def geglu_reference(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return (F.gelu(acc(a), approximate=approximate) * acc(b)).to(a.dtype)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor,
                        approximate: str = "none") -> torch.Tensor:
    return F.gelu(acc(x) + acc(bias), approximate=approximate).to(x.dtype)


# ---------------------------------------------------------------------------- autograd


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, act):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        ctx.act = act
        return load_kernels("activations").glu_fwd(a, b, act)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = load_kernels("activations").glu_bwd(dy.contiguous(), a, b, ctx.act)
        return da, db, None


class _BiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, act):
        x2, bias = as_rows(x).contiguous(), bias.contiguous()
        ctx.save_for_backward(x2, bias)
        ctx.act, ctx.shape = act, x.shape
        return load_kernels("activations").bias_act_fwd(x2, bias, act).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dy2 = as_rows(dy).contiguous()
        dx, dbias = load_kernels("activations").bias_act_bwd(dy2, x2, bias, ctx.act)
        return dx.view(ctx.shape), dbias, None


# ---------------------------------------------------------------------------- public


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for `a`, `b` of the same shape and dtype."""
    check_same("swiglu", a, b, "a (gate) and b (up)")
    if use_triton("swiglu", a, b):
        return _GLU.apply(a, b, "silu")
    return swiglu_reference(a, b)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(a) * b for `a`, `b` of the same shape and dtype."""
    act = _check_approximate("geglu", approximate)
    check_same("geglu", a, b, "a (gate) and b (up)")
    if use_triton("geglu", a, b):
        return _GLU.apply(a, b, act)
    return geglu_reference(a, b, approximate)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) for `x` (..., N) and `bias` (N,)."""
    act = _check_approximate("bias_gelu", approximate)
    check_last_dim("bias_gelu", "bias", bias, x.shape[-1])
    if use_triton("bias_gelu", x, bias):
        return _BiasAct.apply(x, bias, act)
    return bias_gelu_reference(x, bias, approximate)
