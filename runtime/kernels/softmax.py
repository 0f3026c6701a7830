"""Fused softmax over the last dim.

Torch reference (`softmax_reference`: the oracle and the CPU fallback), an autograd Function
over the Triton kernels in `_triton_softmax.py` (the backward needs only the output), and the
dispatching `softmax`. Any leading shape; arithmetic in fp32; the result is in x's dtype.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import torch

from ._dispatch import acc, as_rows, load_kernels, use_triton


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(acc(x), dim=-1).to(x.dtype)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = load_kernels("softmax").softmax_fwd(as_rows(x))
        ctx.save_for_backward(y)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return load_kernels("softmax").softmax_bwd(as_rows(dy), y).view(ctx.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of `x` (..., N) over its last dim."""
    if x.dim() == 0:
        raise ValueError("softmax: x is a 0-d tensor; pass at least one dim")
    if use_triton("softmax", x):
        return _Softmax.apply(x)
    return softmax_reference(x)
