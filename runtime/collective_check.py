"""Counting and checking collectives: what was sent, and whether every rank sent the same.

Every call that communicates — graph op or runtime call such as a gradient bucket — is
recorded in `COUNTER` as (op, axis, payload bytes), so tests and the cost model can compare
what was predicted with what was sent. Payload bytes are the bytes of the tensor handed to
the collective on this rank: the input of all-reduce, reduce-scatter, all-to-all and send,
the local shard (input) of all-gather, the received tensor of recv — including any padding
that uneven sizes need — not the wire bytes of a particular algorithm. `split` communicates
nothing and is not counted. `COUNTER.seq` numbers the group collectives per axis; error
messages (runtime/collective_errors.py) quote that number.

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

from .active_mesh import active_mesh


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


def check_call(op: str, axis: str, dtype: torch.dtype, sig_shape: Sequence[int], extra: int = 0) -> int:
    """Number this group collective on `axis` (returns its call number) and, when checking is
    on, verify that every rank of the axis group issues the same one. `op` is one of
    all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, barrier; `sig_shape` a
    shape that is equal on every rank; `extra` one more rank-invariant argument."""
    seq = COUNTER.seq[axis]
    COUNTER.seq[axis] += 1
    chk = _CHECKER
    if chk is None or axis not in chk.groups:
        return seq
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
    return seq


__all__ = ["CollectiveCounter", "COUNTER", "CollectiveMismatchError", "check_collectives", "check_call"]
