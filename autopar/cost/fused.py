"""What autopar's fused kernels cost: cost and saved-tensor rules for the fused calls.

The fusion pass (passes/fuse.py) replaces matched ops by one call of a fused kernel
(`runtime.kernels.KERNELS`: rms_norm, swiglu, rope, linear_cross_entropy, ...). Importing this
module registers, under each fused call's `op_name`, a cost rule (one op: its inputs read, its
outputs written; linear_cross_entropy's GEMMs as matmul FLOPs, its backward recomputing the
logits) and a saved-tensor rule (what the kernel's autograd Function saves), so that
`cost.analyze` costs a fused graph without fallbacks (`register_fused_cost_rules`).

It also names, for the fusion search, the dtypes the kernels take (`SUPPORTED_DTYPES`) and how
linear_cross_entropy chunks its rows (`default_chunk_rows`), both the kernels' own (re-exported
from runtime/kernels: `search/` reads the engine only through the cost model).

Reads and writes no node.meta. Registering twice registers the same rules again (idempotent).
"""
from __future__ import annotations

import functools
from typing import Any

from autopar.runtime.kernels import KERNELS
from autopar.runtime.kernels._dispatch import SUPPORTED_DTYPES
from autopar.runtime.kernels.cross_entropy import default_chunk_rows

from .ops import OpCost, op_name, register as register_op
from .saved import New, register as register_saved
from .tensors import Call, dtype_name

__all__ = ["register_fused_cost_rules", "SUPPORTED_DTYPES", "default_chunk_rows"]


def register_fused_cost_rules() -> None:
    """Cost (one op: its inputs read, outputs written; linear_cross_entropy's GEMMs as matmul
    FLOPs, its backward recomputing the logits) and saved-tensor rules (what each kernel's
    autograd Function saves) for the fused calls, under their `op_name`s."""
    for kernel, k in KERNELS.items():
        name = op_name(k.fused)
        register_op(name)(functools.partial(_fused_cost, kernel))
        register_saved(name)(functools.partial(_fused_saved, kernel))


def _first_float(c: Call) -> str:
    return next((dtype_name(t.dtype) for t in c.ins if t.is_float), "fp32")


def _rows(t) -> Any:
    return t.numel / t.shape[-1] if t is not None and t.dim else 1


def _fused_cost(kernel: str, c: Call) -> OpCost:
    if kernel == "linear_cross_entropy":
        x, w = c.t(0), c.t(1)
        mm = 2 * _rows(x) * x.shape[-1] * w.shape[0]
        grads = sum(1 for t in (x, w) if t.rg)
        return OpCost(flops=mm, bwd_flops=mm * (1 + grads) if grads else 0, other_flops=5 * _rows(x) * w.shape[0],
                      bytes_read=c.in_bytes(), bytes_written=c.out_bytes(), kind="matmul", dtype=_first_float(c))
    return OpCost(other_flops=8 * max(c.out_numel(), c.ins[0].numel if c.ins else 0), bytes_read=c.in_bytes(),
                  bytes_written=c.out_bytes(), kind="vector", dtype=_first_float(c))


def _fused_saved(kernel: str, c: Call, kernels) -> list:
    x = c.t(0)
    if kernel in ("rms_norm", "layer_norm"):
        per = 4 if kernel == "rms_norm" else 8
        return [x, c.t(1), c.t(2) if kernel == "layer_norm" else None, New("stats", _rows(x) * per)]
    if kernel in ("add_rms_norm", "add_layer_norm"):
        per = 4 if kernel == "add_rms_norm" else 8
        return [c.outs[0], *c.ins[2:], New("stats", _rows(x) * per)]
    if kernel in ("swiglu", "geglu", "bias_gelu"):
        return list(c.ins)
    if kernel == "rope":
        return list(c.ins[1:])
    if kernel == "softmax":
        return [c.outs[0]]
    if kernel == "cross_entropy":
        return [x, c.t(1), New("stats", _rows(x) * 8)]
    if kernel == "linear_cross_entropy":
        return [*c.ins, New("stats", _rows(x) * 8)]
    raise AssertionError(f"no saved-tensor rule for kernel {kernel!r}")


register_fused_cost_rules()
