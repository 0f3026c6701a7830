"""Triton kernels and launchers for cross-entropy over rows of logits.

One program per row, reading the vocab in `MAX_BLOCK_V` chunks, so any vocab size works.

    forward:  m = max(x), logsum = log(sum(exp(x - m))) with an online running max;
              loss_row = (m - x[target]) + logsum, or 0 where target == ignore_index;
              writes loss_row, m and logsum per row in fp32.
    backward: dx = (exp((x - m) - logsum) - onehot(target)) * scale, 0 on ignored rows,
              scale = grad_loss / n_valid read from a 0-d fp32 tensor (no host sync).

m and logsum are kept apart rather than as lse = m + logsum: with logits near 1e4, fp32
rounds lse to ~1e-3, which would be the loss's and every probability's error; x - m is
exact there, so the loss and gradient keep fp32 accuracy at any offset.

The backward may write over its own input (`dx` aliasing `x`): each element is read before
it is written by the same program. The fused linear + cross-entropy uses that to turn a
chunk's logits into their gradient in place.

A target outside [0, V) that is not ignore_index is not checked here (that would need a
host sync): no memory outside the row is read, and its loss is the row's lse.

Imported only through `_dispatch.load_kernels`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env
from ._triton_common import cast_to

INTERPRETED = interpret_env()
MAX_BLOCK_V = 4096  # tests lower it to cover several chunks with a small vocab


@triton.jit
def _ce_fwd(X, stride_x, TARGET, LOSS, ROW_MAX, ROW_LOGSUM, V, ignore_index,
            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    target = tl.load(TARGET + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    d = 0.0
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < V,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    logsum = tl.log(d)
    valid = target != ignore_index
    in_range = valid & (target >= 0) & (target < V)
    x_target = tl.load(x_row + tl.where(in_range, target, 0), mask=in_range,
                       other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, (m - x_target) + logsum, 0.0))
    tl.store(ROW_MAX + row, m)
    tl.store(ROW_LOGSUM + row, logsum)


@triton.jit
def _ce_bwd(X, stride_x, TARGET, ROW_MAX, ROW_LOGSUM, SCALE, DX, stride_dx, V, ignore_index,
            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    target = tl.load(TARGET + row).to(tl.int64)
    scale = tl.where(target != ignore_index, tl.load(SCALE).to(tl.float32), 0.0)
    m = tl.load(ROW_MAX + row)
    logsum = tl.load(ROW_LOGSUM + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp((x - m) - logsum)
        dx = (p - tl.where(start + cols == target, 1.0, 0.0)) * scale
        tl.store(dx_row + start + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)


def _config(v: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(v, 1)), MAX_BLOCK_V)
    return block, (4 if block <= 1024 else 8)


def ce_fwd(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
           loss_rows: torch.Tensor, row_max: torch.Tensor, row_logsum: torch.Tensor) -> None:
    """logits (M, V), last dim contiguous; target (M,). Writes the three (M,) fp32 outputs."""
    M, V = logits.shape
    if M:
        block, warps = _config(V)
        _ce_fwd[(M,)](logits, logits.stride(0), target, loss_rows, row_max, row_logsum, V,
                      ignore_index, BLOCK=block, num_warps=warps)


def ce_bwd(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor,
           row_logsum: torch.Tensor, scale: torch.Tensor, ignore_index: int,
           out: torch.Tensor) -> torch.Tensor:
    """Writes d loss / d logits into `out` (M, V), which may be `logits` itself."""
    M, V = logits.shape
    if M:
        block, warps = _config(V)
        _ce_bwd[(M,)](logits, logits.stride(0), target, row_max, row_logsum, scale, out,
                      out.stride(0), V, ignore_index, BLOCK=block, num_warps=warps)
    return out
