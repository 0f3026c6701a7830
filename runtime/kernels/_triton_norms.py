"""Triton kernels and launchers for RMSNorm and LayerNorm, each with an optional residual add.

Rows are (M, N) with a contiguous last dim and any row stride. The forward runs one program
per row and keeps the row in registers; it saves the per-row statistics (rstd, and mean for
LayerNorm) in fp32. The backward runs a fixed number of programs that each loop over a band
of rows, write the input gradient, and accumulate their weight / bias gradient in fp32; the
launcher sums those per-program partials (a (programs, N) fp32 buffer) and casts to the
parameter's dtype. All arithmetic is fp32; outputs are rounded once to the input dtype.

Imported only through `_dispatch.load_kernels`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env
from ._triton_common import cast_to, num_workers, row_block

INTERPRETED = interpret_env()


@triton.jit
def _rms_norm_fwd(X, stride_x, R, stride_r, S, stride_s, W, Y, stride_y, RSTD, N, eps,
                  HAS_W: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the input dtype first, and that rounded sum is normalised:
        # the returned sum and the normalised output then describe the same tensor
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_to(x + r, S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, cast_to(y, Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, stride_dy, DS, stride_ds, X, stride_x, W, RSTD, DX, stride_dx, DW_PARTIAL,
                  M, N, rows_per_program,
                  HAS_W: tl.constexpr, HAS_DS: tl.constexpr, BLOCK: tl.constexpr):
    # y = x * rstd * w;  dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 loop: row * stride never wraps
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        if HAS_W:
            g = dy * w
            dw += dy * xhat
        else:
            g = dy
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        if HAS_DS:  # gradient reaching the residual sum directly (add_rms_norm)
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd(X, stride_x, R, stride_r, S, stride_s, W, B, Y, stride_y, MEAN, RSTD, N, eps,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # as in _rms_norm_fwd: normalise the sum rounded to the input dtype
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_to(x + r, S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, cast_to(y, Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd(DY, stride_dy, DS, stride_ds, X, stride_x, W, MEAN, RSTD, DX, stride_dx,
                    DW_PARTIAL, DB_PARTIAL, M, N, rows_per_program,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr,
                    BLOCK: tl.constexpr):
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w, xhat = (x - mean) * rstd
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 loop: row * stride never wraps
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            g = dy * w
            dw += dy * xhat
        else:
            g = dy
        if HAS_B:
            db += dy
        dx = rstd * (g - tl.sum(g, axis=0) / N - xhat * (tl.sum(g * xhat, axis=0) / N))
        if HAS_DS:  # gradient reaching the residual sum directly (add_layer_norm)
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None):
    """x, residual: (M, N). Returns (y, rstd (M,) fp32, sum or None)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    if M == 0:
        return y, rstd, s
    block, warps = row_block(N, "rms_norm")
    r = residual if residual is not None else x  # placeholders for unused pointers
    out_s = s if s is not None else y
    _rms_norm_fwd[(M,)](
        x, x.stride(0), r, r.stride(0), out_s, out_s.stride(0),
        weight if weight is not None else x, y, y.stride(0), rstd, N, eps,
        HAS_W=weight is not None, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=warps,
    )
    return y, rstd, s


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor, ds: torch.Tensor | None = None):
    """dy, x (the normalised input), ds: (M, N). Returns (dx, dweight or None)."""
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    programs, per_program = num_workers(x.device, M)
    dw_partial = torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    if M > 0:
        block, warps = row_block(N, "rms_norm")
        d_s = ds if ds is not None else dy
        _rms_norm_bwd[(programs,)](
            dy, dy.stride(0), d_s, d_s.stride(0), x, x.stride(0),
            weight if weight is not None else x, rstd, dx, dx.stride(0), dw_partial,
            M, N, per_program,
            HAS_W=weight is not None, HAS_DS=ds is not None, BLOCK=block, num_warps=warps,
        )
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dw


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, residual: torch.Tensor | None = None):
    """x, residual: (M, N). Returns (y, mean (M,) fp32, rstd (M,) fp32, sum or None)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    if M == 0:
        return y, mean, rstd, s
    block, warps = row_block(N, "layer_norm")
    r = residual if residual is not None else x  # placeholders for unused pointers
    out_s = s if s is not None else y
    _layer_norm_fwd[(M,)](
        x, x.stride(0), r, r.stride(0), out_s, out_s.stride(0),
        weight if weight is not None else x, bias if bias is not None else x,
        y, y.stride(0), mean, rstd, N, eps,
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK=block, num_warps=warps,
    )
    return y, mean, rstd, s


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                   ds: torch.Tensor | None = None):
    """dy, x (the normalised input), ds: (M, N). Returns (dx, dweight or None, dbias or None)."""
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    programs, per_program = num_workers(x.device, M)
    dw_partial = torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    db_partial = torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    if M > 0:
        block, warps = row_block(N, "layer_norm")
        d_s = ds if ds is not None else dy
        _layer_norm_bwd[(programs,)](
            dy, dy.stride(0), d_s, d_s.stride(0), x, x.stride(0),
            weight if weight is not None else x, mean, rstd,
            dx, dx.stride(0), dw_partial, db_partial, M, N, per_program,
            HAS_W=weight is not None, HAS_B=bias is not None, HAS_DS=ds is not None, BLOCK=block,
            num_warps=warps,
        )
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    db = db_partial.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db
