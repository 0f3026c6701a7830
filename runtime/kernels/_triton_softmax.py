"""Triton kernels and launchers for softmax over the last dim.

One program per row. A row of at most `MAX_BLOCK` elements is loaded once and kept in
registers; a longer row is read in `MAX_BLOCK` chunks, twice: first for its max and sum with
an online rescaling (forward) or for sum(dy * y) (backward), then to write the result.

    forward:  y = exp(x - max) / sum(exp(x - max))
    backward: dx = y * (dy - sum(dy * y))

Imported only through `_dispatch.load_kernels`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env
from ._triton_common import cast_to

INTERPRETED = interpret_env()
MAX_BLOCK = 8192  # tests lower it to cover the chunked path with small rows


@triton.jit
def _softmax_fwd(X, stride_x, Y, stride_y, N, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + cols, cast_to(e / tl.sum(e, axis=0), Y.dtype.element_ty), mask=cols < N)
    else:
        m = float("-inf")
        d = 0.0
        for start in range(0, N, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < N,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            tl.store(y_row + start + cols, cast_to(tl.exp(x - m) / d, Y.dtype.element_ty),
                     mask=mask)


@triton.jit
def _softmax_bwd(DY, stride_dy, Y, stride_y, DX, stride_dx, N,
                 BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dy_row = DY + row * stride_dy
    y_row = Y + row * stride_y
    dx_row = DX + row * stride_dx
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = cols < N
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=0))
        tl.store(dx_row + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)
    else:
        dot = 0.0
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(dy * y, axis=0)
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + start + cols, cast_to(y * (dy - dot), DX.dtype.element_ty),
                     mask=mask)


def _config(n: int) -> tuple[int, bool, int]:
    block = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK)
    return block, block >= n, (4 if block <= 2048 else 8 if block <= 8192 else 16)


def softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """x: (M, N) rows with a contiguous last dim. Returns softmax over the last dim."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        block, one, warps = _config(N)
        _softmax_fwd[(M,)](x, x.stride(0), y, y.stride(0), N, BLOCK=block, ONE_BLOCK=one,
                           num_warps=warps)
    return y


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    M, N = y.shape
    dx = torch.empty((M, N), dtype=y.dtype, device=y.device)
    if M and N:
        block, one, warps = _config(N)
        _softmax_bwd[(M,)](dy, dy.stride(0), y, y.stride(0), dx, dx.stride(0), N,
                           BLOCK=block, ONE_BLOCK=one, num_warps=warps)
    return dx
