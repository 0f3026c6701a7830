"""Plain (non-graph) collective calls over the axes of the active mesh, as the runtime issues
them: gradient buckets, parameter gathers, broadcasts, point-to-point transfers.

Each call numbers and (when `check_collectives` is on) checks itself
(`collective_check.check_call`), counts its payload in `COUNTER`, and names its failure
(`collective_errors`: a timed-out or broken collective raises `CollectiveError` with the op,
the axis, its ranks and where in the step it was; an asynchronous call returns a `NamedWork`
whose `wait()` does the same). The graph ops of runtime/collectives.py use the same calls.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .active_mesh import group_of
from .collective_check import COUNTER, check_call
from .collective_errors import issue

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def reduce_op(name: str):
    try:
        return _REDUCE_OPS[name]
    except KeyError:
        raise ValueError(f"unknown reduce op {name!r}; use one of {sorted(_REDUCE_OPS)}") from None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_(t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `t` over `axis`; returns a work handle when async."""
    rop = reduce_op(op)
    seq = check_call("all_reduce", axis, t.dtype, t.shape)
    COUNTER.record("all_reduce", axis, nbytes(t))
    return issue("all_reduce", dist.all_reduce, t, op=rop, group=group_of(axis), async_op=async_op,
                 axis=axis, seq=seq)


def broadcast_(t: torch.Tensor, axis: str, src_index: int = 0, async_op: bool = False):
    """In-place broadcast from the rank at index `src_index` along `axis`."""
    seq = check_call("broadcast", axis, t.dtype, t.shape, src_index)
    COUNTER.record("broadcast", axis, nbytes(t))
    g = group_of(axis)
    return issue("broadcast", dist.broadcast, t, src=dist.get_global_rank(g, src_index), group=g,
                 async_op=async_op, axis=axis, seq=seq)


def all_gather_into_(out: torch.Tensor, inp: torch.Tensor, axis: str, async_op: bool = False, *,
                     check_extra: int = 0):
    """`out` (k * inp.numel() elements, rank-major) <- every rank's `inp` along `axis`.
    `check_extra`: a rank-invariant argument for the mismatch check's fingerprint."""
    seq = check_call("all_gather", axis, inp.dtype, out.shape, check_extra)
    COUNTER.record("all_gather", axis, nbytes(inp))
    return issue("all_gather", all_gather_single, out, inp, group=group_of(axis), async_op=async_op,
                 axis=axis, seq=seq)


def reduce_scatter_into_(out: torch.Tensor, inp: torch.Tensor, axis: str, op: str = "sum",
                         async_op: bool = False, *, check_extra: int = 0):
    """`out` <- this rank's 1/k (rank-major) of the reduction of every rank's `inp`."""
    rop = reduce_op(op)
    seq = check_call("reduce_scatter", axis, inp.dtype, inp.shape, check_extra)
    COUNTER.record("reduce_scatter", axis, nbytes(inp))
    return issue("reduce_scatter", reduce_scatter_single, out, inp, op=rop, group=group_of(axis),
                 async_op=async_op, axis=axis, seq=seq)


def all_to_all_single_(out: torch.Tensor, inp: torch.Tensor, axis: str, out_splits: list[int] | None = None,
                       in_splits: list[int] | None = None, async_op: bool = False, *,
                       check_shape=None, check_extra: int = 0):
    """Exchange dim-0 rows of `inp` (row counts `in_splits` to each rank) into `out`.
    `check_shape` (default: inp's shape after dim 0): a rank-invariant shape for the check."""
    sig = tuple(inp.shape[1:]) if check_shape is None else check_shape
    seq = check_call("all_to_all", axis, inp.dtype, sig, check_extra)
    COUNTER.record("all_to_all", axis, nbytes(inp))
    return issue("all_to_all", dist.all_to_all_single, out, inp, out_splits, in_splits, group=group_of(axis),
                 async_op=async_op, axis=axis, seq=seq)


def send_(t: torch.Tensor, axis: str, peer: int, tag: int = 0) -> None:
    """Blocking send of `t` to the rank at index `peer` along `axis`."""
    COUNTER.record("send", axis, nbytes(t))
    g = group_of(axis)
    dst = dist.get_global_rank(g, peer)
    issue("send", _send, t.contiguous(), dst, tag, group=g, axis=axis, peer=dst)


def recv_(t: torch.Tensor, axis: str, peer: int, tag: int = 0) -> torch.Tensor:
    """Blocking receive into `t` (contiguous) from the rank at index `peer` along `axis`."""
    COUNTER.record("recv", axis, nbytes(t))
    g = group_of(axis)
    src = dist.get_global_rank(g, peer)
    issue("recv", _recv, t, src, tag, group=g, axis=axis, peer=src)
    return t


def _send(t, dst, tag, group=None, async_op=False):
    dist.send(t, dst=dst, group=group, tag=tag)


def _recv(t, src, tag, group=None, async_op=False):
    dist.recv(t, src=src, group=group, tag=tag)


__all__ = ["reduce_op", "nbytes", "all_gather_single", "reduce_scatter_single", "all_reduce_", "broadcast_",
           "all_gather_into_", "reduce_scatter_into_", "all_to_all_single_", "send_", "recv_"]
