"""Triton kernels and launchers for SwiGLU, GeGLU and bias + GeLU.

GLUs are elementwise over flat contiguous tensors. Bias + GeLU's forward is elementwise too
(the bias is gathered by column); its backward tiles (rows x columns), each program looping
over a band of rows for one column block, so the bias gradient is accumulated in fp32
registers and written as one partial per program; the launcher sums the partials.

`ACT` selects the activation: "silu", "gelu" (erf) or "gelu_tanh". The tanh GeLU is computed
as x * sigmoid(2u) (u = sqrt(2/pi) (x + 0.044715 x^3)), which equals 0.5 x (1 + tanh(u))
exactly and needs no tanh in `tl`.

Imported only through `_dispatch.load_kernels`. Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env
from ._triton_common import cast_to, num_workers

INTERPRETED = interpret_env()
ELEMENTWISE_BLOCK = 1024


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(f(x), f'(x)) in fp32; the compiler drops f' where it is unused."""
    if ACT == "silu":
        s = tl.sigmoid(x)
        f = x * s
        df = s + f * (1.0 - s)
    elif ACT == "gelu_tanh":
        # 2 * sqrt(2 / pi) = 1.5957691216057308; 3 * 0.044715 = 0.134145
        s = tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        f = x * s
        df = s + 1.5957691216057308 * x * s * (1.0 - s) * (1.0 + 0.134145 * x * x)
    else:  # "gelu", erf form
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        f = x * cdf
        df = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # + x * pdf(x)
    return f, df


@triton.jit
def _glu_fwd(A, B, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    f, _ = _act_and_grad(a, ACT)
    tl.store(Y + offs, cast_to(f * b, Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(DY, A, B, DA, DB, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    # y = f(a) * b:  da = dy * b * f'(a),  db = dy * f(a)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    f, df = _act_and_grad(a, ACT)
    tl.store(DA + offs, cast_to(dy * b * df, DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, cast_to(dy * f, DB.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_fwd(X, BIAS, Y, n, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(BIAS + offs % N, mask=mask, other=0.0).to(tl.float32)
    f, _ = _act_and_grad(x, ACT)
    tl.store(Y + offs, cast_to(f, Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd(DY, X, BIAS, DX, DB_PARTIAL, M, N, rows_per_program,
                  ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y = f(x + bias):  dx = dy * f'(x + bias),  dbias = sum over rows of dx (in fp32)
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid_m.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        _, df = _act_and_grad(x, ACT)
        dx = dy * df  # zero where masked, since dy is
        tl.store(DX + offs, cast_to(dx, DX.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    tl.store(DB_PARTIAL + pid_m * N + cols, db, mask=col_mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, ELEMENTWISE_BLOCK),)


def glu_fwd(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """a, b: contiguous, same shape. Returns act(a) * b."""
    y = torch.empty_like(a)
    if a.numel():
        _glu_fwd[_grid(a.numel())](a, b, y, a.numel(), ACT=act, BLOCK=ELEMENTWISE_BLOCK,
                                   num_warps=4)
    return y


def glu_bwd(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act: str):
    """Returns (da, db)."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        _glu_bwd[_grid(a.numel())](dy, a, b, da, db, a.numel(), ACT=act,
                                   BLOCK=ELEMENTWISE_BLOCK, num_warps=4)
    return da, db


def bias_act_fwd(x: torch.Tensor, bias: torch.Tensor, act: str) -> torch.Tensor:
    """x: contiguous (M, N), bias (N,). Returns act(x + bias)."""
    y = torch.empty_like(x)
    if x.numel():
        _bias_act_fwd[_grid(x.numel())](x, bias, y, x.numel(), x.shape[-1], ACT=act,
                                        BLOCK=ELEMENTWISE_BLOCK, num_warps=4)
    return y


def bias_act_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, act: str):
    """dy, x: contiguous (M, N). Returns (dx, dbias)."""
    M, N = x.shape
    dx = torch.empty_like(x)
    programs, per_program = num_workers(x.device, M)
    db_partial = torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    if x.numel():
        block_n = min(triton.next_power_of_2(N), 256)
        block_m = 8 if x.is_cuda else 4  # 8 x 256 at 4 warps: 112 registers, no spills
        grid = (programs, triton.cdiv(N, block_n))
        _bias_act_bwd[grid](dy, x, bias, dx, db_partial, M, N, per_program, ACT=act,
                            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return dx, db_partial.sum(0).to(bias.dtype)
