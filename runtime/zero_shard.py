"""Shard layouts and bucketed gradient reducers for the ZeRO engines (runtime/zero.py).

A parameter is sharded along dim 0 by `torch.chunk`'s convention (`ShardInfo`): rank i of k
owns rows [start, end), every non-empty piece but the last has `cpad = ceil(rows/k)` rows.
A 0-d parameter counts as one row. Shards are stored unpadded; padding exists only in the
communication buffers of a `FlatLayout`, where every rank contributes `cpad * rest` elements
per parameter, so one all-gather or reduce-scatter moves a whole bucket or unit:

    flat buffer of k * S elements, rank-major:   [rank 0: p0 rows | p1 rows | ...][rank 1: ...]
    S = sum over params of cpad * rest            (rest = product of the dims after dim 0)

`GradReducer` (all-reduce, stages 0-1) and `ScatterReducer` (reduce-scatter, stage 2) group
parameters into buckets of about `bucket_mb` (the first at most 1 MB, as in DDP) in reverse
registration order (roughly the order backward produces gradients), and launch a bucket's
collective asynchronously from the gradient-accumulation hook of its last ready parameter,
so communication of one bucket runs while backward computes the next. Buckets launch strictly in index order on every rank, so
every rank issues the same sequence of collectives. Inside `no_sync()` nothing is sent.

`read_rows(source, name, start, end)` reads one parameter's rows from a state-dict source.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from . import collectives as C
from .offload import to_device


@dataclass(frozen=True)
class ShardInfo:
    """Where one parameter's rows lie: this rank (`index` of `k`) owns rows [start, end)."""

    name: str
    shape: tuple[int, ...]  # the full shape
    k: int
    index: int
    rows: int  # size of dim 0 (1 for a 0-d parameter)
    rest: int  # elements per row
    cpad: int  # rows per rank in communication buffers: ceil(rows / k)
    start: int
    end: int

    @property
    def local_rows(self) -> int:
        return self.end - self.start

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.shape[1:])

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.rest

    @property
    def numel(self) -> int:
        return self.rows * self.rest

    @property
    def padded_numel(self) -> int:
        """This parameter's share of a rank's segment in a flat communication buffer."""
        return self.cpad * self.rest


def shard_info(name: str, shape: Sequence[int], k: int, index: int) -> ShardInfo:
    shape = tuple(int(s) for s in shape)
    rows = shape[0] if shape else 1
    rest = 1
    for s in shape[1:]:
        rest *= s
    start, end = C.chunk_range(rows, k, index) if rows else (0, 0)
    return ShardInfo(name, shape, k, index, rows, rest, -(-rows // k), start, end)


class FlatLayout:
    """Packing of several parameters into one rank-major flat communication buffer."""

    def __init__(self, infos: Sequence[ShardInfo], k: int):
        self.infos = list(infos)
        self.k = k
        self.offsets = []
        off = 0
        for info in self.infos:
            self.offsets.append(off)
            off += info.padded_numel
        self.S = off  # elements per rank

    def _seg(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        info, off = self.infos[i], self.offsets[i]
        return buf.view(self.k, self.S)[:, off:off + info.padded_numel].view(self.k, info.cpad, info.rest)

    def pack_shards(self, shards: Sequence[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """(S,) buffer of this rank's rows of every parameter, zero-padded."""
        buf = torch.zeros(self.S, dtype=dtype, device=device)
        for info, off, t in zip(self.infos, self.offsets, shards):
            if info.local_numel:  # an offloaded shard crosses in its own dtype (async when pinned)
                buf[off:off + info.local_numel].copy_(to_device(t, buf.device).reshape(-1))
        return buf

    def unpack_full(self, gathered: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Copy the full parameters out of a gathered (k * S,) buffer into `outs`."""
        for i, (info, out) in enumerate(zip(self.infos, outs)):
            if not info.numel:
                continue
            seg = self._seg(gathered, i)
            o = out.reshape(info.rows, info.rest)
            nfull, rem = divmod(info.rows, info.cpad)
            if nfull:
                o[:nfull * info.cpad].view(nfull, info.cpad, info.rest).copy_(seg[:nfull])
            if rem:
                o[nfull * info.cpad:].copy_(seg[nfull, :rem])

    def pack_full(self, fulls: Sequence[torch.Tensor | None], dtype: torch.dtype, device,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """(k * S,) buffer of full tensors (None: zeros) in rank-major order; with `out`,
        add into it instead (gradient accumulation)."""
        accumulate = out is not None
        buf = out if accumulate else torch.zeros(self.k * self.S, dtype=dtype, device=device)
        for i, (info, t) in enumerate(zip(self.infos, fulls)):
            if t is None or not info.numel:
                continue
            seg = self._seg(buf, i)
            g = t.reshape(info.rows, info.rest)
            nfull, rem = divmod(info.rows, info.cpad)
            if nfull:
                src = g[:nfull * info.cpad].view(nfull, info.cpad, info.rest)
                seg[:nfull].add_(src) if accumulate else seg[:nfull].copy_(src)
            if rem:
                src = g[nfull * info.cpad:]
                seg[nfull, :rem].add_(src) if accumulate else seg[nfull, :rem].copy_(src)
        return buf

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of every parameter as views of an (S,) buffer."""
        return [flat[off:off + info.local_numel].view(info.local_shape)
                for info, off in zip(self.infos, self.offsets)]


FIRST_BUCKET_MB = 1.0


def group_in_buckets(items: Sequence, bucket_mb: float, nbytes, dtype) -> list[list]:
    """`items` in reverse order, grouped about `bucket_mb` each (`nbytes(item)` bytes), one
    `dtype(item)` per bucket. As in DDP, the first bucket (the first gradients backward
    produces) holds at most min(1 MB, bucket_mb), so that communication starts early. The
    runtime's buckets and the cost model's (cost/zero_comm.py) are both formed here."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    cap = int(min(FIRST_BUCKET_MB, bucket_mb) * 2**20)
    buckets: list[list] = []
    cur: list = []
    size = 0
    for p in reversed(list(items)):
        nb = nbytes(p)
        if cur and (size + nb > cap or dtype(p) != dtype(cur[0])):
            buckets.append(cur)
            cur, size = [], 0
            cap = int(bucket_mb * 2**20)
        cur.append(p)
        size += nb
    if cur:
        buckets.append(cur)
    return buckets


def make_buckets(params: Sequence[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """The gradient buckets of `params` (see `group_in_buckets`)."""
    return group_in_buckets(params, bucket_mb, lambda p: p.numel() * p.element_size(), lambda p: p.dtype)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    state: object = None  # what the launch returned, until completion


class _BucketReducer:
    """Hook plumbing shared by the reducers: readiness, in-order launch, no_sync."""

    def __init__(self, params: Sequence[nn.Parameter], axis: str, bucket_mb: float):
        self.axis = axis
        self.params = [p for p in params if p.requires_grad]
        self.buckets = [_Bucket(b) for b in make_buckets(self.params, bucket_mb)]
        self._bucket_of = {id(p): bi for bi, b in enumerate(self.buckets) for p in b.params}
        self._sync = True
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; nothing is communicated inside."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @property
    def pending(self) -> bool:
        return self._next > 0 or any(b.ready for b in self.buckets)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        b.ready.add(id(p))
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            b.state = self._launch(self._next, b)
            self._next += 1

    def finish(self) -> None:
        """Launch what is left (parameters that got no gradient count as zeros), wait for
        every bucket in order and complete it."""
        if not self._sync:
            return
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            b.state = self._launch(self._next, b)
            self._next += 1
        for bi, b in enumerate(self.buckets):
            self._complete(bi, b)
            b.state = None
            b.ready.clear()
        self._next = 0

    def _launch(self, bi: int, b: _Bucket):
        raise NotImplementedError

    def _complete(self, bi: int, b: _Bucket) -> None:
        raise NotImplementedError


def read_rows(source, name: str, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of parameter `name` from a state-dict source: a mapping of tensors
    (or of lazily sliceable objects such as safetensors' `get_slice`), an object with
    `get_slice(name)` (safetensors `safe_open`), or a callable `(name, start, end) -> rows`."""
    if callable(source) and not isinstance(source, Mapping):
        return source(name, start, end)
    if hasattr(source, "get_slice") and not isinstance(source, Mapping):
        v = source.get_slice(name)
    else:
        if name not in source:
            raise KeyError(name)
        v = source[name]
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        v = v.reshape(1)
    return v[start:end]


class GradReducer(_BucketReducer):
    """Bucketed asynchronous all-reduce (average) of gradients over `axis`.

    After `finish()`, every parameter's `.grad` on every rank of the axis equals the average
    over the axis of the local gradients (a parameter that got no gradient counts as zero,
    as in DDP with find_unused_parameters). `reduce_dtype` (default: the gradient's dtype)
    is the dtype on the wire; `on_reduced(param, grad)`, when given, sees each averaged
    gradient in that dtype before `.grad` gets its copy in the parameter's dtype."""

    def __init__(self, params: Sequence[nn.Parameter], axis: str, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None,
                 on_reduced: Callable[[nn.Parameter, torch.Tensor], None] | None = None):
        super().__init__(params, axis, bucket_mb)
        self.reduce_dtype = reduce_dtype
        self.on_reduced = on_reduced

    def _launch(self, bi, b):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            flat = flat.to(self.reduce_dtype)
        return flat, C.all_reduce_(flat, self.axis, "avg", async_op=True)

    def _complete(self, bi, b):
        flat, work = b.state
        work.wait()
        off = 0
        for p in b.params:
            n = p.numel()
            g = flat[off:off + n].view_as(p)
            if self.on_reduced is not None:
                self.on_reduced(p, g)
            if p.grad is None:
                p.grad = g.to(p.dtype, copy=True)
            else:
                p.grad.copy_(g)
            off += n


class ScatterReducer(_BucketReducer):
    """Bucketed asynchronous reduce-scatter of full gradients into this rank's rows (ZeRO-2).

    At launch the bucket's gradients are packed into a `FlatLayout` buffer and the full
    `.grad`s are freed; at `finish()` each bucket's reduced rows (averaged over the axis) are
    handed to `on_shard(params, row_views)` in bucket order."""

    def __init__(self, params: Sequence[nn.Parameter], infos: dict[int, ShardInfo], axis: str, k: int,
                 on_shard: Callable[[list[nn.Parameter], list[torch.Tensor]], None], bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__(params, axis, bucket_mb)
        self.k = k
        self.on_shard = on_shard
        self.reduce_dtype = reduce_dtype
        self.layouts = [FlatLayout([infos[id(p)] for p in b.params], k) for b in self.buckets]

    def _launch(self, bi, b):
        layout = self.layouts[bi]
        p0 = b.params[0]
        dtype = self.reduce_dtype or p0.dtype
        inp = layout.pack_full([p.grad for p in b.params], dtype, p0.device)
        for p in b.params:
            p.grad = None  # the full gradient is not kept (ZeRO-2)
        out = torch.empty(layout.S, dtype=dtype, device=p0.device)
        return inp, out, C.reduce_scatter_into_(out, inp, self.axis, "sum", async_op=True)

    def _complete(self, bi, b):
        inp, out, work = b.state
        work.wait()
        out.div_(self.k)
        self.on_shard(b.params, self.layouts[bi].shard_views(out))
