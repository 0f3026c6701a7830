"""Triton helpers shared by the kernel families: output casts and launch sizes.

Imported only through `_dispatch.load_kernels` (never at package import). `INTERPRETED`
records whether Triton's CPU interpreter was on when the kernels below were decorated, and
`STDLIB_INTERPRETED` whether it was on when triton itself was first imported (triton
decorates `tl.sum` & co. then): interpreted kernels need both.

Why `cast_to` exists: on a GPU, `x.to(tl.bfloat16)` rounds to nearest even, but Triton's
interpreter (checked on triton 3.9) truncates fp32 -> bf16, and its explicit
`fp_downcast_rounding="rtne"` path mis-rounds when the mantissa carries into the exponent.
Under the interpreter we round in integer arithmetic instead, so interpreted results equal
what the GPU computes; on a GPU the branch is compiled away.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._dispatch import interpret_env

INTERPRETED = interpret_env()  # how the kernels of this package are being decorated
# how triton's own library (tl.sum, tl.sigmoid, ...) was decorated when triton was imported
STDLIB_INTERPRETED = type(tl.sigmoid).__name__ == "InterpretedFunction"
_SOFTWARE_BF16_ROUNDING = tl.constexpr(INTERPRETED)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """fp32 `x` -> `dtype`, rounding to nearest even."""
    if _SOFTWARE_BF16_ROUNDING:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


MAX_ROW_BLOCK = 65536  # widest row a one-block row kernel keeps in registers


@functools.lru_cache(maxsize=256)
def row_block(n: int, op: str) -> tuple[int, int]:
    """(BLOCK, num_warps) for kernels that hold one whole row of `n` elements."""
    block = triton.next_power_of_2(max(n, 1))
    if block > MAX_ROW_BLOCK:
        raise ValueError(
            f"{op}: rows of {n} elements exceed the {MAX_ROW_BLOCK} the fused kernel holds; "
            "set AUTOPAR_TRITON=off to use the torch reference for this shape"
        )
    # warps per row width: no register spills in the norm backward kernels at up to 8192
    # (checked with ptxas for sm_90, bf16)
    return block, (4 if block <= 2048 else 8 if block <= 4096 else 16 if block <= 8192 else 32)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_workers(device: torch.device, rows: int) -> tuple[int, int]:
    """(programs, rows per program) for kernels that loop over rows and reduce across them.

    Two programs per SM on a GPU; four under the interpreter (enough to exercise the loop and
    the cross-program reduction, few enough to stay fast).
    """
    if device.type == "cuda":
        target = 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4
    per_program = triton.cdiv(max(rows, 1), min(target, max(rows, 1)))
    return triton.cdiv(max(rows, 1), per_program), per_program
