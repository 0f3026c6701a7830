"""Collectives over the axes of the active mesh: counted, checkable, and autograd-aware.

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

Uneven dims follow `torch.chunk`: with n rows over k ranks every rank but the last non-empty
one holds ceil(n/k) rows (`chunk_sizes`). Ops that gather an uneven dim take its global size
`n` (`-1`: even, local size times k), because the local size alone does not determine it.

Every call that communicates — graph op or runtime call such as a gradient bucket — is
recorded in `COUNTER` as (op, axis, payload bytes), so tests and the cost model can compare
what was predicted with what was sent. Payload bytes are the bytes of the tensor handed to
the collective on this rank: the input of all-reduce, reduce-scatter, all-to-all and send,
the local shard (input) of all-gather, the received tensor of recv — including any padding
that uneven sizes need — not the wire bytes of a particular algorithm. `split` communicates
nothing and is not counted.

Mismatch checking: `check_collectives(timeout_s)` (called on every rank, it builds one gloo
check group per axis group) makes every later group collective first pass a monitored
barrier and then compare a fingerprint (per-axis call number, op, dtype, rank-invariant
shape) across the group. A rank that called a different op or shape fails with
`CollectiveMismatchError` naming each rank and its op; a rank that never arrives is named
by the group's first rank within `timeout_s`. PyTorch's own `TORCH_DISTRIBUTED_DEBUG=DETAIL`
also works on gloo (measured: it names both ranks' collectives); without either, gloo runs a
mismatched all-reduce/reduce-scatter pair silently and returns wrong numbers.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import datetime
from collections import Counter as _Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

_ACTIVE_MESH = None
_ACTIVE_RANK: int | None = None


def set_active_mesh(mesh, rank: int | None = None) -> None:
    """Make `mesh` (a runtime.mesh.Mesh) the one whose axes collectives refer to.

    `rank` stands in for `dist.get_rank()` when there is no process group (fake-tensor
    shape propagation of one rank's program while planning); it matters only for uneven dims.
    """
    global _ACTIVE_MESH, _ACTIVE_RANK
    _ACTIVE_MESH, _ACTIVE_RANK = mesh, rank


def active_mesh():
    if _ACTIVE_MESH is None:
        raise RuntimeError("no active mesh: run the program through autopar (or call "
                           "autopar.runtime.collectives.set_active_mesh(mesh)) before using collectives")
    return _ACTIVE_MESH


def group_of(axis: str):
    return active_mesh().group(axis)


def axis_size(axis: str) -> int:
    return active_mesh().size(axis)


def axis_index(axis: str) -> int:
    """This rank's index along `axis` of the active mesh."""
    mesh = active_mesh()
    if _ACTIVE_RANK is not None:
        return mesh.coords(_ACTIVE_RANK).get(axis, 0)
    if not dist.is_initialized():
        raise ValueError(f"axis {axis!r}: this rank's index is unknown without a process group; "
                         "pass rank= to set_active_mesh for shape propagation of uneven dims")
    return mesh.local_rank(axis)


def chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of the k pieces of n items under torch.chunk's convention (ceil(n/k) each, the
    tail short or empty): chunk_sizes(5, 4) == [2, 2, 1, 0]."""
    c = -(-n // k) if k else 0
    return [max(0, min(n, (i + 1) * c) - min(n, i * c)) for i in range(k)]


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, end) of piece i of n items over k ranks (torch.chunk convention)."""
    c = -(-n // k)
    start = min(n, i * c)
    return start, min(n, start + c)


# --- counting and checking ----------------------------------------------------------------
@dataclass
class CollectiveCounter:
    """Calls and payload bytes per (op, axis); `seq` numbers group collectives per axis."""

    calls: _Counter = field(default_factory=_Counter)
    bytes: _Counter = field(default_factory=_Counter)
    seq: _Counter = field(default_factory=_Counter)
    enabled: bool = True

    def record(self, op: str, axis: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[(op, axis)] += 1
            self.bytes[(op, axis)] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        return sum(b for (o, a), b in self.bytes.items() if (op is None or o == op) and (axis is None or a == axis))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{"all_reduce@dp": {"calls": 3, "bytes": 1234}, ...} sorted for stable printing."""
        return {f"{op}@{axis}": {"calls": self.calls[(op, axis)], "bytes": self.bytes[(op, axis)]}
                for (op, axis) in sorted(self.calls)}


COUNTER = CollectiveCounter()


class CollectiveMismatchError(RuntimeError):
    """Ranks of one axis group issued different collectives (or one never arrived)."""


_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool)
_FP_LEN = 10


@dataclass
class _Checker:
    timeout: datetime.timedelta
    groups: dict[str, object]  # axis -> check group containing this rank
    ranks: dict[str, list[int]]  # axis -> global ranks of that group


_CHECKER: _Checker | None = None


def check_collectives(enabled: bool = True, timeout_s: float = 30.0) -> None:
    """Turn the per-call mismatch check on (collective over all ranks: call it everywhere,
    after `set_active_mesh`) or off. Each check costs one monitored barrier and one small
    all-gather per collective on a separate gloo group, so keep it for debugging."""
    global _CHECKER
    if not enabled:
        _CHECKER = None
        return
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    mesh = active_mesh()
    me = dist.get_rank()
    td = datetime.timedelta(seconds=timeout_s)
    groups, ranks = {}, {}
    for axis in mesh.axis_names:
        seen = set()
        for r in range(mesh.world_size):  # new_group is collective: every rank creates every group
            members = tuple(mesh.axis_ranks(axis, r))
            if members in seen:
                continue
            seen.add(members)
            g = dist.new_group(list(members), backend="gloo", timeout=td)
            if me in members:
                groups[axis], ranks[axis] = g, list(members)
    _CHECKER = _Checker(td, groups, ranks)


def _fingerprint(op: str, seq: int, dtype: torch.dtype, shape: Sequence[int], extra: int) -> torch.Tensor:
    dims = list(shape)[:4] + [-1] * (4 - min(4, len(shape)))
    numel = 1
    for s in shape:
        numel *= int(s)
    code = _DTYPES.index(dtype) if dtype in _DTYPES else 99
    return torch.tensor([seq, _OPS.index(op), code, len(shape), numel, *dims, extra], dtype=torch.int64)


def _describe(v: list[int], axis: str) -> str:
    op = _OPS[v[1]] if 0 <= v[1] < len(_OPS) else f"op{v[1]}"
    dtype = _DTYPES[v[2]] if 0 <= v[2] < len(_DTYPES) else "?"
    shape = v[5:5 + min(v[3], 4)]
    return f"{op}@{axis} call #{v[0]} (shape {shape}{'...' if v[3] > 4 else ''}, {dtype}, arg {v[9]})"


def _check(op: str, axis: str, dtype: torch.dtype, sig_shape: Sequence[int], extra: int = 0) -> None:
    seq = COUNTER.seq[axis]
    COUNTER.seq[axis] += 1
    chk = _CHECKER
    if chk is None or axis not in chk.groups:
        return
    g, members = chk.groups[axis], chk.ranks[axis]
    me = dist.get_rank()
    mine = _fingerprint(op, seq, dtype, sig_shape, extra)
    what = f"rank {me}: {_describe(mine.tolist(), axis)}"
    try:
        dist.monitored_barrier(g, timeout=chk.timeout, wait_all_ranks=True)
        allfp = torch.empty(len(members) * _FP_LEN, dtype=torch.int64)
        dist.all_gather_into_tensor(allfp, mine, group=g)
    except RuntimeError as e:
        raise CollectiveMismatchError(
            f"{what}: not every rank of axis {axis!r} (global ranks {members}) reached this collective "
            f"within {chk.timeout.total_seconds():.0f} s; a rank skipped it or stopped issuing collectives. "
            f"gloo says: {str(e).splitlines()[0][:300]}") from None
    rows = allfp.view(len(members), _FP_LEN).tolist()
    if any(r != rows[0] for r in rows):
        # name the ranks that differ from the most common fingerprint
        common = max(rows, key=rows.count)
        odd = [members[i] for i, r in enumerate(rows) if r != common]
        lines = [f"  rank {members[i]} called {_describe(r, axis)}" for i, r in enumerate(rows)]
        raise CollectiveMismatchError(
            f"collectives on axis {axis!r} do not match: rank(s) {odd} differ from the others\n"
            + "\n".join(lines) + f"\n(detected on {what})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def reduce_op(name: str):
    try:
        return _REDUCE_OPS[name]
    except KeyError:
        raise ValueError(f"unknown reduce op {name!r}; use one of {sorted(_REDUCE_OPS)}") from None


# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- plain (non-graph) calls used by the runtime ------------------------------------------
def all_reduce_(t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `t` over `axis`; returns a work handle when async."""
    rop = reduce_op(op)
    _check("all_reduce", axis, t.dtype, t.shape)
    COUNTER.record("all_reduce", axis, _nbytes(t))
    return dist.all_reduce(t, op=rop, group=group_of(axis), async_op=async_op)


def broadcast_(t: torch.Tensor, axis: str, src_index: int = 0, async_op: bool = False):
    """In-place broadcast from the rank at index `src_index` along `axis`."""
    _check("broadcast", axis, t.dtype, t.shape, src_index)
    COUNTER.record("broadcast", axis, _nbytes(t))
    g = group_of(axis)
    return dist.broadcast(t, src=dist.get_global_rank(g, src_index), group=g, async_op=async_op)


def all_gather_into_(out: torch.Tensor, inp: torch.Tensor, axis: str, async_op: bool = False):
    """`out` (k * inp.numel() elements, rank-major) <- every rank's `inp` along `axis`."""
    _check("all_gather", axis, inp.dtype, out.shape)
    COUNTER.record("all_gather", axis, _nbytes(inp))
    return _all_gather_single(out, inp, group=group_of(axis), async_op=async_op)


def reduce_scatter_into_(out: torch.Tensor, inp: torch.Tensor, axis: str, op: str = "sum",
                         async_op: bool = False):
    """`out` <- this rank's 1/k (rank-major) of the reduction of every rank's `inp`."""
    rop = reduce_op(op)
    _check("reduce_scatter", axis, inp.dtype, inp.shape)
    COUNTER.record("reduce_scatter", axis, _nbytes(inp))
    return _reduce_scatter_single(out, inp, op=rop, group=group_of(axis), async_op=async_op)


def all_to_all_single_(out: torch.Tensor, inp: torch.Tensor, axis: str, out_splits: list[int] | None = None,
                       in_splits: list[int] | None = None, async_op: bool = False):
    """Exchange dim-0 rows of `inp` (row counts `in_splits` to each rank) into `out`."""
    _check("all_to_all", axis, inp.dtype, tuple(inp.shape[1:]))
    COUNTER.record("all_to_all", axis, _nbytes(inp))
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group_of(axis), async_op=async_op)


def send_(t: torch.Tensor, axis: str, peer: int, tag: int = 0) -> None:
    """Blocking send of `t` to the rank at index `peer` along `axis`."""
    COUNTER.record("send", axis, _nbytes(t))
    g = group_of(axis)
    dist.send(t.contiguous(), dst=dist.get_global_rank(g, peer), group=g, tag=tag)


def recv_(t: torch.Tensor, axis: str, peer: int, tag: int = 0) -> torch.Tensor:
    """Blocking receive into `t` (contiguous) from the rank at index `peer` along `axis`."""
    COUNTER.record("recv", axis, _nbytes(t))
    g = group_of(axis)
    dist.recv(t, src=dist.get_global_rank(g, peer), group=g, tag=tag)
    return t


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


def _grad_all_reduce_bwd(ctx, grad):
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
    _check("all_gather", axis, x.dtype, out.shape, dim)
    COUNTER.record("all_gather", axis, _nbytes(xs))
    _all_gather_single(out, xs, group=group_of(axis))
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


def _gather_rs_bwd(ctx, grad):
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
    _check("reduce_scatter", axis, x.dtype, xs.shape, dim)
    COUNTER.record("reduce_scatter", axis, _nbytes(xs))
    _reduce_scatter_single(out, xs, op=rop, group=group_of(axis))
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


def _rs_bwd(ctx, grad):
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


def _split_bwd(ctx, grad):
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
    _check("all_to_all", axis, x.dtype, sig, src_dim * 16 + dst_dim)
    COUNTER.record("all_to_all", axis, _nbytes(inp))
    dist.all_to_all_single(out, inp, out_splits, [p.numel() for p in pieces], group=group_of(axis))
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


def _a2a_bwd(ctx, grad):
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


def _a2av_bwd(ctx, grad):
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
