"""The MoE dispatcher: tokens to their experts across the ep axis and back, autograd-aware.

A routing table `expert_index` (N, K) says which expert each (token n, choice k) assignment
goes to; assignment a = n * K + k (row-major over the table). With E experts over an ep axis
of P ranks, rank r holds experts [r * E/P, (r + 1) * E/P) (contiguous blocks).

    r = route(expert_index, E, axis, capacity=None)   # who sends what where (one small
                                                      # all-gather of per-expert counts)
    rows = dispatch(x, r, per="token")                # (M, D): this rank's experts' rows,
                                                      # expert-major; x (N, D) token rows
    w    = dispatch(t, r, per="assignment")           # the same for per-assignment data (N*K, ...)
    ri   = expert_rows(rows, r, i)                    # local expert i's rows
    offs = local_offsets(r, torch.int32)              # cumulative rows per local expert
    ids  = local_expert_ids(r)                        # (M,) local expert of each row
    y    = combine(out_rows, r)                       # (N*K, D) back in assignment order;
                                                      # zeros for dropped assignments
    keep = keep_mask(r)                               # (N, K) bool: assignment kept

Dense experts (every expert on every token, Llama 4): `dense_dispatch(x, axis)` all-gathers
the ep group's token rows (and dense scores), `dense_combine(y, axis)`
reduce-scatters the partial sum over this rank's experts back to its tokens.

Order. Rows of one expert are in *global token-major order*: ep rank j's tokens come after
rank j-1's (the batch is split contiguously over the ep axis, `runtime.program.Program`), and within a
rank in (n, k) row-major order. This is the queue order of a single process running the
whole ep group's batch.

Capacity. `capacity=None` is dropless. With an integer capacity C (slots per expert for the
whole ep group's batch), an assignment is kept iff its position in its expert's queue (the
order above, counted over every rank of the group) is < C — the single-process rule, so a
parallel run drops exactly the assignments one process drops on the same batch with the same
C. `capacity_factor=cf` computes C = min(Ng, ceil(cf * Ng * K / E)), Ng the group's tokens.

Communication (axis size P > 1), all through `collectives` so `COUNTER` sees it:
route: all_gather of E int64 counts (the `autopar::all_gather` op, so a checkpointed block keeps
its output and recompute does not run it again); dispatch: `all_to_all_v` of the kept rows (uneven splits);
combine: `all_to_all_v` back. Backward of each all-to-all is the reverse exchange
(autograd through the `autopar::all_to_all_v` custom op); gathers and scatters are plain
indexing, so gradients reach x, per-assignment data and the experts' parameters exactly.
With axis None or of size 1 nothing is communicated: dispatch / combine are a local
permute / un-permute.

Also here: `grad_avg` / `grad_scale` (identity forward; all-reduce-average over an axis, or a
constant scale, of the gradient), which the expert pass puts on parameter reads. The
program that splits the batch over dp x ep is `runtime.program.Program` (its `ep_axis`).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from . import collectives as C


# --- routing ------------------------------------------------------------------------------
@dataclass
class Route:
    """Who sends which rows where, for one MoE layer on one rank (see the module docstring)."""

    axis: str | None
    ep: int  # ranks on the axis (1: local)
    index: int  # this rank's index on the axis
    n_tokens: int  # N: this rank's tokens
    top_k: int  # K
    n_experts: int  # E (all ranks)
    capacity: int | None  # C for the whole ep group; None: dropless
    order: torch.Tensor  # (M_send,) kept assignment ids, grouped by expert, token-major within
    send_splits: list[int]  # rows to each rank of the axis
    recv_splits: list[int]  # rows from each rank of the axis
    recv_perm: torch.Tensor  # (M_recv,) receive-buffer row of each expert-major row
    local_counts: list[int]  # rows of each local expert, in expert-major order
    keep: torch.Tensor  # (N, K) bool
    counts: list[list[int]]  # [rank][expert] assignments before capacity drops (all ranks)

    @property
    def n_local(self) -> int:
        return self.n_experts // self.ep

    @property
    def first_expert(self) -> int:
        return self.index * self.n_local

    @property
    def rows_received(self) -> int:
        return sum(self.recv_splits)


_RECORD: list | None = None


@contextlib.contextmanager
def recording():
    """Collect every `Route` made inside the block, in call order (tests, load statistics)."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def group_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """min(N, ceil(cf * N * K / E)): the capacity rule of models/moe.py (and GShard)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (None for dropless routing)")
    return min(n_tokens, math.ceil(capacity_factor * n_tokens * top_k / n_experts))


def route(expert_index: torch.Tensor, n_experts: int, axis: str | None = None, capacity: int | None = None,
          capacity_factor: float | None = None) -> Route:
    """Plan the exchange for a routing table `expert_index` (N, K) of expert ids in [0, E).

    `capacity`: slots per expert for the whole ep group's batch (None: dropless);
    `capacity_factor`: compute it from the group's token count instead."""
    if expert_index.dim() != 2:
        raise ValueError(f"expert_index must be (tokens, top_k), got shape {tuple(expert_index.shape)}")
    N, K = expert_index.shape
    E = int(n_experts)
    P = C.axis_size(axis) if axis is not None else 1
    if E % P:
        raise ValueError(f"{E} experts do not divide over {axis}={P}; choose an ep degree that divides {E}")
    me = C.axis_index(axis) if P > 1 else 0
    El = E // P
    flat = expert_index.reshape(-1).long()
    # stable: equal experts keep (n, k) row-major order, i.e. the token-major queue order
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    if counts.numel() != E:
        raise ValueError(f"expert_index holds ids up to {int(flat.max())}, but there are {E} experts")
    if P > 1:
        # through the autopar::all_gather op: a checkpointed block (recompute) keeps its output,
        # so backward's recompute of the block does not run this collective again
        table = C.all_gather(counts.contiguous(), axis, 0).view(P, E).tolist()
    else:
        table = [counts.tolist()]
    if capacity_factor is not None:
        if capacity is not None:
            raise ValueError("give capacity or capacity_factor, not both")
        capacity = group_capacity(N * P, K, E, capacity_factor)
    if capacity is None:
        kept = table
        keep = torch.ones(N * K, dtype=torch.bool, device=flat.device)
    else:
        capacity = int(capacity)
        kept, before = [], [0] * E
        for j in range(P):  # queue positions run over the ranks in order: rank j after rank j-1
            kept.append([max(0, min(table[j][e], capacity - before[e])) for e in range(E)])
            before = [before[e] + table[j][e] for e in range(E)]
        # in `order`, expert e's assignments are rows [start_e, start_e + count_e); keep the first kept_e
        starts = torch.cumsum(counts, 0) - counts
        sorted_e = flat[order]
        pos = torch.arange(order.numel(), device=flat.device) - starts[sorted_e]
        limit = torch.tensor(kept[me], dtype=torch.int64, device=flat.device)[sorted_e]
        mask = pos < limit
        order = order[mask]
        keep = torch.zeros(N * K, dtype=torch.bool, device=flat.device)
        keep[order] = True
    send = [sum(kept[me][r * El:(r + 1) * El]) for r in range(P)]
    recv = [sum(kept[j][me * El:(me + 1) * El]) for j in range(P)]
    # receive buffer: blocks by source rank j, each grouped by local expert i; we want (i, j)
    block_start, pos = {}, 0
    for j in range(P):
        for i in range(El):
            block_start[(j, i)] = pos
            pos += kept[j][me * El + i]
    pieces = [torch.arange(block_start[(j, i)], block_start[(j, i)] + kept[j][me * El + i], device=flat.device)
              for i in range(El) for j in range(P)]
    perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=flat.device)
    local_counts = [sum(kept[j][me * El + i] for j in range(P)) for i in range(El)]
    r = Route(axis if P > 1 else None, P, me, N, K, E, capacity, order, send, recv, perm, local_counts,
              keep.view(N, K), table)
    if _RECORD is not None:
        _RECORD.append(r)
    return r


# --- moving rows --------------------------------------------------------------------------
def dispatch(x: torch.Tensor, r: Route, per: str = "token") -> torch.Tensor:
    """This rank's experts' rows of `x`, expert-major: local expert 0's rows first.

    per="token": x holds one row per token (N, ...), sent once per kept assignment;
    per="assignment": x holds one row per assignment (N * K, ...) or (N, K, ...)."""
    if per == "token":
        if x.size(0) != r.n_tokens:
            raise ValueError(f"dispatch(per='token') needs {r.n_tokens} token rows, got shape {tuple(x.shape)}")
        src = r.order // r.top_k
    elif per == "assignment":
        if x.dim() >= 2 and x.shape[:2] == (r.n_tokens, r.top_k):
            x = x.flatten(0, 1)
        if x.size(0) != r.n_tokens * r.top_k:
            raise ValueError(f"dispatch(per='assignment') needs {r.n_tokens * r.top_k} rows, got {tuple(x.shape)}")
        src = r.order
    else:
        raise ValueError(f"per must be 'token' or 'assignment', got {per!r}")
    rows = x.index_select(0, src)
    if r.axis is not None:
        rows = C.all_to_all_v(rows, r.axis, r.recv_splits, r.send_splits)
    return rows.index_select(0, r.recv_perm)


def combine(y: torch.Tensor, r: Route) -> torch.Tensor:
    """Rows computed by this rank's experts (expert-major, as `dispatch` gave them) back to
    their senders, in assignment order: (N * K, ...), zeros for dropped assignments."""
    if y.size(0) != r.recv_perm.numel():
        raise ValueError(f"combine expects {r.recv_perm.numel()} expert rows (what dispatch delivered), "
                         f"got shape {tuple(y.shape)}")
    inv = torch.empty_like(r.recv_perm)
    inv[r.recv_perm] = torch.arange(r.recv_perm.numel(), device=inv.device)
    rows = y.index_select(0, inv)  # back to (source rank, expert) blocks
    if r.axis is not None:
        rows = C.all_to_all_v(rows, r.axis, r.send_splits, r.recv_splits)
    out = y.new_zeros((r.n_tokens * r.top_k, *y.shape[1:]))
    return out.index_copy(0, r.order, rows)


def expert_rows(rows: torch.Tensor, r: Route, i: int) -> torch.Tensor:
    """Local expert i's rows of a dispatched tensor."""
    start = sum(r.local_counts[:i])
    return rows.narrow(0, start, r.local_counts[i])


def local_offsets(r: Route, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Cumulative row counts of the local experts (grouped-matmul offsets)."""
    return torch.tensor(list(_cumsum(r.local_counts)), dtype=dtype, device=r.order.device)


def local_expert_ids(r: Route) -> torch.Tensor:
    """(M,) int64: the local expert (0 .. E/P - 1) of each dispatched row, expert-major as
    `dispatch` orders them (to gather per-expert rows of this rank's slice of a parameter)."""
    counts = torch.tensor(list(r.local_counts), dtype=torch.int64, device=r.order.device)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=r.order.device), counts)


def keep_mask(r: Route) -> torch.Tensor:
    """(N, K) bool: which of this rank's assignments an expert accepted."""
    return r.keep


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


# --- dense experts: every expert on every token ---------------------------------------------
def dense_dispatch(x: torch.Tensor, axis: str | None) -> torch.Tensor:
    """Every token row of the ep group on every rank, for experts that run on every token: an
    all-gather of dim 0 over `axis` (rank j's rows after rank j-1's, the group's batch order).
    Backward: reduce-scatter (sum), since each rank's experts contribute to every row's gradient.
    Identity with `axis` None or of size 1."""
    if axis is None or C.axis_size(axis) == 1:
        return x
    return torch.ops.autopar.all_gather(x.contiguous(), axis, 0)


def dense_combine(y: torch.Tensor, axis: str | None) -> torch.Tensor:
    """This rank's tokens summed over every rank's experts, from `y`: the group's token rows
    summed over this rank's experts (a partial sum over `axis`): a reduce-scatter (sum) of
    dim 0. Backward: all-gather. Identity with `axis` None or of size 1."""
    if axis is None or C.axis_size(axis) == 1:
        return y
    return torch.ops.autopar.reduce_scatter(y.contiguous(), axis, 0, "sum")


# --- gradient helpers for parameter reads ---------------------------------------------------
class _GradAvg(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        C.all_reduce_(g, ctx.axis, "avg")
        return g, None


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def grad_avg(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; the gradient is averaged over `axis` (all-reduce avg) in backward.
    For a parameter replicated over an axis whose ranks see different tokens (ep)."""
    if C.axis_size(axis) == 1:
        return x
    return _GradAvg.apply(x, axis)


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by `factor` in backward."""
    return _GradScale.apply(x, float(factor))


__all__ = ["Route", "route", "dispatch", "combine", "dense_dispatch", "dense_combine", "expert_rows", "local_offsets",
           "local_expert_ids",
           "keep_mask", "recording", "group_capacity", "grad_avg", "grad_scale"]
