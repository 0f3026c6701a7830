"""Triton kernel and launcher for rotary position embedding (rotate-half convention).

The input is 4-D (B, S1, S2, D) with a contiguous last dim and any other strides, so both
layouts and transposed views run without a copy: for "bhtd" (S1, S2) = (H, T) and the
position is the index along S2; for "bthd" (S1, S2) = (T, H) and it is the index along S1.
Each program rotates BLOCK_R rows (one row = one (b, s1, s2) head vector) in fp32:

    forward:   y1 = x1 c1 - x2 s1        backward:  dx1 = dy1 c1 + dy2 s2
               y2 = x2 c2 + x1 s2                   dx2 = dy2 c2 - dy1 s1

with x = [x1, x2] split in halves and c = cos[t] = [c1, c2], s = sin[t] = [s1, s2]. The
backward is the transposed rotation: the same kernel compiled with BACKWARD=True.

Imported only through `_dispatch.load_kernels`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env
from ._triton_common import cast_to

INTERPRETED = interpret_env()


@triton.jit
def _rope(X, sxb, sx1, sx2, Y, syb, sy1, sy2, COS, SIN, stride_cs, rows, S1, S2, HALF,
          T_ON_S2: tl.constexpr, BACKWARD: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (cols < HALF)[None, :]
    i2 = r % S2
    i1 = (r // S2) % S1
    b = r // (S1 * S2)
    if T_ON_S2:
        t = i2
    else:
        t = i1
    x_row = (b * sxb + i1 * sx1 + i2 * sx2)[:, None] + cols[None, :]
    y_row = (b * syb + i1 * sy1 + i2 * sy2)[:, None] + cols[None, :]
    cs_row = (t * stride_cs)[:, None] + cols[None, :]
    x1 = tl.load(X + x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + cs_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_row + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_row + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + y_row, cast_to(y1, Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_row + HALF, cast_to(y2, Y.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t_on_s2: bool,
         backward: bool = False) -> torch.Tensor:
    """x: (B, S1, S2, D), last dim contiguous; cos, sin: (T, D), last dim contiguous.

    Returns a contiguous (B, S1, S2, D) tensor.
    """
    B, S1, S2, D = x.shape
    y = torch.empty((B, S1, S2, D), dtype=x.dtype, device=x.device)
    rows, half = B * S1 * S2, D // 2
    if rows == 0:
        return y
    block_h = triton.next_power_of_2(half)
    # ~2048 elements a tile at 8 warps: no register spills for head_dim 128 (ptxas, sm_90)
    block_r = max(1, 2048 // block_h) if x.is_cuda else 4
    _rope[(triton.cdiv(rows, block_r),)](
        x, x.stride(0), x.stride(1), x.stride(2), y, y.stride(0), y.stride(1), y.stride(2),
        cos, sin, cos.stride(0), rows, S1, S2, half,
        T_ON_S2=t_on_s2, BACKWARD=backward, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=8,
    )
    return y
