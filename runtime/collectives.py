"""Graph collectives over the axes of the active mesh: autograd-aware custom ops, and the one
import point of the runtime's collective layer.

Graph-level collectives are `torch.library` custom ops in the `autopar` namespace, so a
rewritten graph shows them as nodes (`torch.ops.autopar.all_gather(x, "tp", 1, -1)`), fake
tensors propagate through them (their fake kernels read only the active mesh's shape), and
autograd knows their backward. They name a mesh axis, not a process group: the program sets
the active mesh (`set_active_mesh`) before it runs.

The ops and their conjugates (forward placement change; backward)::

    all_reduce(x, axis, op)            P(op) -> R      ; identity            (Megatron "g")
    grad_all_reduce(x, axis)           R -> R identity ; all_reduce(sum)     (Megatron "f")
    reduce_scatter(x, axis, dim, op)   P(op) -> S(dim) ; all_gather_chunk_grad
    all_gather(x, axis, dim, n)        S(dim) -> R     ; reduce_scatter(sum): the output's
                                       gradient is a partial sum (sequence parallelism)
    all_gather_chunk_grad(x, axis, dim, n)
                                       S(dim) -> R     ; this rank's chunk of the gradient:
                                       the output's gradient is replicated
    split(x, axis, dim)                R -> S(dim), local, no communication ; all_gather_chunk_grad
    all_to_all(x, axis, src_dim, dst_dim, n)
                                       S(src_dim) -> S(dst_dim) ; all_to_all back
    all_to_all_v(x, axis, out_splits, in_splits)
                                       uneven exchange of dim-0 rows (MoE dispatch) ; the reverse
    send(x, axis, peer) / recv(like, axis, peer)
                                       point to point along an axis (not differentiable: the
                                       pipeline executor sends gradients back explicitly)

Uneven dims follow `torch.chunk` (`chunk_sizes`). Ops that gather an uneven dim take its
global size `n` (`-1`: even, local size times k), because the local size alone does not
determine it.

The layer, one job a file, every public name re-exported here:
    runtime/active_mesh.py        the active mesh, axis sizes and indices, torch.chunk arithmetic
    runtime/collective_check.py   COUNTER (calls and payload bytes per op and axis) and the
                                  opt-in mismatch check (`check_collectives`)
    runtime/collective_calls.py   the plain calls the runtime issues (`all_reduce_`, ...)
    runtime/collective_errors.py  a failed collective raises `CollectiveError` naming the op,
                                  the axis and its ranks, the step and graph node, and the
                                  ranks that stopped
The graph ops issue their communication through collective_calls, so they are counted,
checked and named the same way; their backward records the forward's graph node.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .active_mesh import (active_mesh, active_mesh_or_none, axis_index, axis_size, chunk_range, chunk_sizes,
                          group_of, set_active_mesh)
from .collective_calls import (all_gather_into_, all_gather_single, all_reduce_, all_to_all_single_, broadcast_,
                               nbytes, recv_, reduce_op, reduce_scatter_into_, reduce_scatter_single, send_)
from .collective_check import COUNTER, CollectiveCounter, CollectiveMismatchError, check_call, check_collectives
from .collective_errors import CollectiveError, NamedWork, graph_node_here, where


# --- shape helpers shared by the real and fake kernels ------------------------------------
def _dim(x: torch.Tensor, dim: int) -> int:
    nd = x.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % nd


def _gathered_size(x: torch.Tensor, axis: str, dim: int, full_size: int) -> int:
    k = axis_size(axis)
    return x.size(dim) * k if full_size < 0 else full_size


def _local_size(n: int, axis: str) -> int:
    k = axis_size(axis)
    if n % k == 0:
        return n // k
    return chunk_sizes(n, k)[axis_index(axis)]


# --- graph ops: custom ops with fake kernels and autograd ----------------------------------
def _backward_of(ctx):
    """Label the backward of a graph collective with its forward's node (failure messages)."""
    node = getattr(ctx, "node", None)
    return where(f"backward of graph node {node}" if node else "backward of a graph collective")


@torch.library.custom_op("autopar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, axis: str, op: str = "sum") -> torch.Tensor:
    """P(op) -> R along `axis`. Backward: identity (the gradient of a replicated value
    is the same on every rank, and is the gradient of each summand)."""
    out = x.clone()
    all_reduce_(out, axis, op)
    return out


@all_reduce.register_fake
def _(x, axis, op="sum"):
    return torch.empty_like(x)


def _all_reduce_bwd(ctx, grad):
    return grad, None, None


all_reduce.register_autograd(_all_reduce_bwd)


@torch.library.custom_op("autopar::grad_all_reduce", mutates_args=())
def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient in backward. Placed where a
    replicated tensor feeds computation whose gradients are partial sums over `axis`."""
    return x.clone()


@grad_all_reduce.register_fake
def _(x, axis):
    return torch.empty_like(x)


def _grad_all_reduce_setup(ctx, inputs, output):
    ctx.axis = inputs[1]
    ctx.node = graph_node_here()


def _grad_all_reduce_bwd(ctx, grad):
    with _backward_of(ctx):
        return all_reduce(grad.contiguous(), ctx.axis, "sum"), None


grad_all_reduce.register_autograd(_grad_all_reduce_bwd, setup_context=_grad_all_reduce_setup)


def _gather_impl(x: torch.Tensor, axis: str, dim: int, full_size: int) -> torch.Tensor:
    dim = _dim(x, dim)
    k = axis_size(axis)
    n = _gathered_size(x, axis, dim, full_size)
    sizes = chunk_sizes(n, k)
    me = axis_index(axis)
    if x.size(dim) != sizes[me]:
        raise ValueError(f"all_gather on axis {axis!r}: rank index {me} holds {x.size(dim)} of dim {dim}, "
                         f"but a dim of {n} over {k} ranks gives it {sizes[me]} (torch.chunk convention); "
                         "pass the global size of the dim as full_size")
    cpad = sizes[0]
    xs = x.movedim(dim, 0)
    if xs.size(0) != cpad:  # pad this rank's piece to the common chunk size
        pad = xs.new_zeros((cpad - xs.size(0), *xs.shape[1:]))
        xs = torch.cat([xs, pad])
    xs = xs.contiguous()
    out = xs.new_empty((k * cpad, *xs.shape[1:]))
    all_gather_into_(out, xs, axis, check_extra=dim)
    return out[:n].movedim(0, dim).contiguous()


def _gather_fake(x, axis, dim, full_size=-1):
    dim = _dim(x, dim)
    shape = list(x.shape)
    shape[dim] = _gathered_size(x, axis, dim, full_size)
    return x.new_empty(shape)


@torch.library.custom_op("autopar::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, axis: str, dim: int, full_size: int = -1) -> torch.Tensor:
    """S(dim) -> R along `axis`. Backward: reduce-scatter (sum) — use it where the
    gradient arriving at the replicated output is a partial sum over `axis` (sequence
    parallelism: the all-gather before a column-parallel linear). `full_size`: global size
    of `dim` when it does not divide evenly (-1: local size times the axis size)."""
    return _gather_impl(x, axis, dim, full_size)


all_gather.register_fake(_gather_fake)


def _gather_setup(ctx, inputs, output):
    ctx.axis, ctx.dim = inputs[1], _dim(inputs[0], inputs[2])
    ctx.node = graph_node_here()


def _gather_rs_bwd(ctx, grad):
    with _backward_of(ctx):
        return reduce_scatter(grad.contiguous(), ctx.axis, ctx.dim, "sum"), None, None, None


all_gather.register_autograd(_gather_rs_bwd, setup_context=_gather_setup)


@torch.library.custom_op("autopar::all_gather_chunk_grad", mutates_args=())
def all_gather_chunk_grad(x: torch.Tensor, axis: str, dim: int, full_size: int = -1) -> torch.Tensor:
    """S(dim) -> R along `axis`. Backward: this rank's torch.chunk piece of the gradient —
    use it where the gradient arriving at the output is replicated (the same on every rank),
    e.g. gathering a sharded activation that feeds replicated computation."""
    return _gather_impl(x, axis, dim, full_size)


all_gather_chunk_grad.register_fake(_gather_fake)


def _chunk_bwd(ctx, grad):
    with _backward_of(ctx):
        return split(grad.contiguous(), ctx.axis, ctx.dim), None, None, None


all_gather_chunk_grad.register_autograd(_chunk_bwd, setup_context=_gather_setup)


@torch.library.custom_op("autopar::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, axis: str, dim: int, op: str = "sum") -> torch.Tensor:
    """P(op) -> S(dim) along `axis`: the reduction over the axis, of which this rank keeps
    its torch.chunk piece of `dim`. Backward: all-gather (the gradient of this rank's piece
    is needed, whole, by every summand)."""
    dim = _dim(x, dim)
    rop = reduce_op(op)
    k = axis_size(axis)
    n = x.size(dim)
    sizes = chunk_sizes(n, k)
    cpad = sizes[0]
    xs = x.movedim(dim, 0)
    if k * cpad != n:
        xs = torch.cat([xs, xs.new_zeros((k * cpad - n, *xs.shape[1:]))])
    xs = xs.contiguous()
    out = xs.new_empty((cpad, *xs.shape[1:]))
    reduce_scatter_into_(out, xs, axis, op, check_extra=dim)
    return out[:sizes[axis_index(axis)]].movedim(0, dim).contiguous()


@reduce_scatter.register_fake
def _(x, axis, dim, op="sum"):
    dim = _dim(x, dim)
    shape = list(x.shape)
    shape[dim] = _local_size(x.size(dim), axis)
    return x.new_empty(shape)


def _rs_setup(ctx, inputs, output):
    x = inputs[0]
    ctx.axis, ctx.dim = inputs[1], _dim(x, inputs[2])
    ctx.n = x.size(ctx.dim)
    ctx.node = graph_node_here()


def _rs_bwd(ctx, grad):
    with _backward_of(ctx):
        return all_gather_chunk_grad(grad.contiguous(), ctx.axis, ctx.dim, ctx.n), None, None, None


reduce_scatter.register_autograd(_rs_bwd, setup_context=_rs_setup)


@torch.library.custom_op("autopar::split", mutates_args=())
def split(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """R -> S(dim) along `axis`: this rank's torch.chunk piece, no communication.
    Backward: all-gather of the gradient pieces (the conjugate of all_gather_chunk_grad)."""
    dim = _dim(x, dim)
    start, end = chunk_range(x.size(dim), axis_size(axis), axis_index(axis))
    return x.narrow(dim, start, end - start).clone(memory_format=torch.contiguous_format)


@split.register_fake
def _(x, axis, dim):
    dim = _dim(x, dim)
    shape = list(x.shape)
    shape[dim] = _local_size(x.size(dim), axis)
    return x.new_empty(shape)


def _split_setup(ctx, inputs, output):
    x = inputs[0]
    ctx.axis, ctx.dim = inputs[1], _dim(x, inputs[2])
    ctx.n = x.size(ctx.dim)
    ctx.node = graph_node_here()


def _split_bwd(ctx, grad):
    with _backward_of(ctx):
        return all_gather_chunk_grad(grad.contiguous(), ctx.axis, ctx.dim, ctx.n), None, None


split.register_autograd(_split_bwd, setup_context=_split_setup)


def _a2a_sizes(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int, full_size: int):
    if src_dim == dst_dim:
        raise ValueError(f"all_to_all needs two different dims, got src_dim == dst_dim == {src_dim}")
    k = axis_size(axis)
    n_src = x.size(src_dim) * k if full_size < 0 else full_size
    return chunk_sizes(n_src, k), chunk_sizes(x.size(dst_dim), k)


@torch.library.custom_op("autopar::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int, full_size: int = -1) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim) along `axis`: every rank sends its torch.chunk piece r of
    `dst_dim` to rank r and concatenates what it receives along `src_dim`. `full_size`:
    global size of `src_dim` when uneven (-1: local size times the axis size).
    Backward: the all-to-all back (S(dst_dim) -> S(src_dim))."""
    src_dim, dst_dim = _dim(x, src_dim), _dim(x, dst_dim)
    src_sizes, dst_sizes = _a2a_sizes(x, axis, src_dim, dst_dim, full_size)
    me = axis_index(axis)
    if x.size(src_dim) != src_sizes[me]:
        raise ValueError(f"all_to_all on axis {axis!r}: rank index {me} holds {x.size(src_dim)} of dim {src_dim}, "
                         f"expected {src_sizes[me]}; pass the global size of dim {src_dim} as full_size")
    pieces = []
    start = 0
    for r in range(len(dst_sizes)):
        pieces.append(x.narrow(dst_dim, start, dst_sizes[r]).contiguous().reshape(-1))
        start += dst_sizes[r]
    inp = torch.cat(pieces)
    shapes = []
    for r in range(len(src_sizes)):
        s = list(x.shape)
        s[dst_dim], s[src_dim] = dst_sizes[me], src_sizes[r]
        shapes.append(s)
    out_splits = [int(torch.Size(s).numel()) for s in shapes]
    out = inp.new_empty(sum(out_splits))
    sig = list(x.shape)
    sig[src_dim] = sum(src_sizes)
    all_to_all_single_(out, inp, axis, out_splits, [p.numel() for p in pieces], check_shape=sig,
                       check_extra=src_dim * 16 + dst_dim)
    return torch.cat([o.view(s) for o, s in zip(out.split(out_splits), shapes)], dim=src_dim)


@all_to_all.register_fake
def _(x, axis, src_dim, dst_dim, full_size=-1):
    src_dim, dst_dim = _dim(x, src_dim), _dim(x, dst_dim)
    k = axis_size(axis)
    shape = list(x.shape)
    shape[src_dim] = x.size(src_dim) * k if full_size < 0 else full_size
    shape[dst_dim] = _local_size(x.size(dst_dim), axis)
    return x.new_empty(shape)


def _a2a_setup(ctx, inputs, output):
    x = inputs[0]
    ctx.axis, ctx.src, ctx.dst = inputs[1], _dim(x, inputs[2]), _dim(x, inputs[3])
    ctx.n_dst = x.size(ctx.dst)
    ctx.node = graph_node_here()


def _a2a_bwd(ctx, grad):
    with _backward_of(ctx):
        return all_to_all(grad.contiguous(), ctx.axis, ctx.dst, ctx.src, ctx.n_dst), None, None, None, None


all_to_all.register_autograd(_a2a_bwd, setup_context=_a2a_setup)


@torch.library.custom_op("autopar::all_to_all_v", mutates_args=())
def all_to_all_v(x: torch.Tensor, axis: str, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Uneven exchange of dim-0 rows along `axis` (MPI's alltoallv; MoE token dispatch):
    rows [sum(in_splits[:r]), +in_splits[r]) go to rank r; out_splits[r] rows arrive from
    rank r. Backward: the same exchange with the splits swapped."""
    if len(out_splits) != axis_size(axis) or len(in_splits) != axis_size(axis):
        raise ValueError(f"all_to_all_v on axis {axis!r} of size {axis_size(axis)} got {len(in_splits)} input "
                         f"and {len(out_splits)} output splits; give one per rank")
    if sum(in_splits) != x.size(0):
        raise ValueError(f"all_to_all_v: in_splits {list(in_splits)} sum to {sum(in_splits)} but x has "
                         f"{x.size(0)} rows")
    xc = x.contiguous()
    out = xc.new_empty((sum(out_splits), *x.shape[1:]))
    all_to_all_single_(out, xc, axis, list(out_splits), list(in_splits))
    return out


@all_to_all_v.register_fake
def _(x, axis, out_splits, in_splits):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _a2av_setup(ctx, inputs, output):
    ctx.axis, ctx.out_splits, ctx.in_splits = inputs[1], list(inputs[2]), list(inputs[3])
    ctx.node = graph_node_here()


def _a2av_bwd(ctx, grad):
    with _backward_of(ctx):
        return all_to_all_v(grad.contiguous(), ctx.axis, ctx.in_splits, ctx.out_splits), None, None, None


all_to_all_v.register_autograd(_a2av_bwd, setup_context=_a2av_setup)


@torch.library.custom_op("autopar::send", mutates_args=())
def send(x: torch.Tensor, axis: str, peer: int, tag: int = 0) -> None:
    """Send `x` to the rank at index `peer` along `axis` (blocking; no gradient)."""
    send_(x, axis, peer, tag)


@send.register_fake
def _(x, axis, peer, tag=0):
    return None


has_side_effect(torch.ops.autopar.send.default)  # keep it through dead-code elimination


@torch.library.custom_op("autopar::recv", mutates_args=())
def recv(like: torch.Tensor, axis: str, peer: int, tag: int = 0) -> torch.Tensor:
    """A new tensor shaped like `like`, received from the rank at index `peer` along
    `axis` (blocking; no gradient)."""
    return recv_(torch.empty_like(like, memory_format=torch.contiguous_format), axis, peer, tag)


@recv.register_fake
def _(like, axis, peer, tag=0):
    return torch.empty_like(like)


has_side_effect(torch.ops.autopar.recv.default)


__all__ = [
    # graph ops
    "all_reduce", "grad_all_reduce", "all_gather", "all_gather_chunk_grad", "reduce_scatter", "split",
    "all_to_all", "all_to_all_v", "send", "recv",
    # re-exported from active_mesh, collective_calls, collective_check, collective_errors
    "set_active_mesh", "active_mesh", "active_mesh_or_none", "group_of", "axis_size", "axis_index",
    "chunk_sizes", "chunk_range", "reduce_op", "nbytes", "all_gather_single", "reduce_scatter_single",
    "all_reduce_", "broadcast_", "all_gather_into_", "reduce_scatter_into_", "all_to_all_single_", "send_",
    "recv_", "COUNTER", "CollectiveCounter", "CollectiveMismatchError", "check_call", "check_collectives",
    "CollectiveError", "NamedWork", "graph_node_here", "where",
]
