"""ZeRO stage 3: parameters sharded at rest, gathered one unit at a time (FSDP-style).

Works the same on an ordinary `nn.Module` and on a captured `torch.fx.GraphModule`
(`torch.export.export(...).module()`), because it hooks the one thing both do: read a
parameter as an attribute of its owning module (`self.wq.weight` in eager code,
`getattr(self.layers, "0").attn.wq.weight` for a `get_attr` node).

- At rest, `owner._parameters[name]` holds this rank's rows (an `nn.Parameter`, the fp32
  master under mixed precision, on the CPU with offload), so `named_parameters()`,
  `state_dict()` and the optimizer see shards. The owner's class is swapped for a
  per-instance subclass (as `torch.nn.utils.parametrize` does) with a property per
  parameter; reading it gathers the parameter's *unit* — a group of parameters by
  module-path prefix — with one all-gather, and returns the full tensor.
- Gathered tensors are outputs of `_Unshard`, an autograd Function whose backward receives
  the unit's full gradients, packs them and launches an asynchronous reduce-scatter (or, in
  `no_sync()`, adds them to an fp32 accumulation buffer; fp64 for fp64 parameters, which keep
  fp64 gradients and reductions throughout). `finish_backward()` waits and
  accumulates the reduced rows into the shards' `.grad`.
- Freeing: when another unit is read, the previous unit's full tensors are dropped; the
  root's forward post-hook drops the rest. Tensors that autograd saves for backward and that
  live in a gathered unit are replaced, by saved-tensor hooks installed around the root's
  forward, with a handle (unit, index, size, stride, offset); backward re-gathers the unit
  on first use and frees it when the unit's `_Unshard` backward has run.
- Prefetch: while unit i computes, the all-gather of the next unit in forward order (and in
  backward, the next in the backward order recorded on the first step) is in flight.
- A captured graph reads every parameter at its top; run `autopar.passes.zero.zero(gm)`
  first, which moves each `get_attr` to just before its first use, or all units are alive
  at once (correct, but no memory saved).

Units default to one per top-level child, with list-like children (ModuleList, Sequential,
ModuleDict, or a child whose children are named 0, 1, ...) split per element; parameters
that match no prefix form one more unit. All parameters of a unit share a dtype.
Ranks must read the same units in the same order (the usual SPMD program). Activation
checkpointing re-gathers inside backward without the hooks (correct, not memory-optimal).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import collectives as C
from .offload import host_copy
from .zero_engine import EngineBase, _Slot, read_rows
from .zero_shard import FlatLayout, shard_info


@dataclass
class _Unit:
    uid: int
    prefix: str
    slots: list[_Slot]
    layout: FlatLayout
    dtype: torch.dtype
    fwd: list | None = None  # gathered full tensors (autograd outputs of _Unshard)
    bwd: list | None = None  # re-gathered for backward (plain tensors)
    acc: torch.Tensor | None = None  # fp32 (k * S,) gradient accumulation under no_sync
    live: list = field(default_factory=list)  # weakrefs to the last gathered tensors


@dataclass(frozen=True)
class _Packed:
    uid: int
    idx: int
    size: tuple
    stride: tuple
    offset: int


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, uid, gathered, *shards):
        ctx.engine, ctx.uid = engine, uid
        return tuple(engine._unpack(uid, gathered))

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._unit_backward(ctx.uid, grads)
        return (None, None, None) + (None,) * len(ctx.engine.units[ctx.uid].slots)


MAX_INFLIGHT_REDUCES = 2


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients are accumulated and averaged in fp32, or in fp64 for fp64 parameters."""
    return torch.promote_types(dtype, torch.float32)


def default_units(module: nn.Module) -> list[str]:
    """One prefix per top-level child; list-like children split per element."""
    out = []
    for name, child in module.named_children():
        kids = [n for n, _ in child.named_children()]
        listlike = isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or (
            kids and all(n.isdigit() for n in kids))
        out += [f"{name}.{n}" for n in kids] if listlike and kids else [name]
    return out


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), attr


class ShardedEngine(EngineBase):
    """ZeRO stage 3 over `axis`: see the module docstring. Extra options: `units` (list of
    module-path prefixes), `prefetch` (bool, default True)."""

    stage = 3

    def __init__(self, module: nn.Module, mesh, axis: str, bucket_mb: float = 25.0, *,
                 units: list[str] | None = None, prefetch: bool = True, **options):
        super().__init__(module, mesh, axis, bucket_mb, **options)
        self.prefetch = prefetch
        self._materialize_buffers()
        distinct = self._distinct_params()
        prefixes = list(units) if units is not None else default_units(module)
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"units {prefixes} name a prefix twice")

        def unit_of(name: str) -> str:
            best = ""
            for pre in prefixes:
                if (name == pre or name.startswith(pre + ".")) and len(pre) > len(best):
                    best = pre
            return best

        members: dict[str, list[_Slot]] = {pre: [] for pre in prefixes}
        members[""] = []
        for name, p, aliases in distinct:
            info = shard_info(name, p.shape, self.k, self.index)
            rows = self._initial_rows(name, p, info, info.start, info.end)
            mdev = self.master_device or (self.device if p.is_meta else p.device)
            mdt = self._master_dtype(p)
            if rows is None:  # pinned when offloaded next to a GPU (mdev is then the CPU)
                data = torch.empty(info.local_shape, dtype=mdt, device=mdev, pin_memory=self._pin)
            elif self.offload:
                data = host_copy(rows.reshape(info.local_shape), mdt, pin=self._pin)
            else:
                data = rows.reshape(info.local_shape).to(mdev, mdt, copy=True)
            shard = nn.Parameter(data, requires_grad=p.requires_grad)
            self.untrained[id(p)] = (weakref.ref(p), name, "under ZeRO-3 the program trains this rank's shards, "
                                     "which replaced them in the module: they get no gradient")
            slot = _Slot(name, info, shard, shard, aliases)
            self.slots.append(slot)
            members[unit_of(name)].append(slot)
        if units is not None:
            empty = [pre for pre in prefixes if not members[pre]]
            if empty:
                raise ValueError(f"units {empty} match no parameter; prefixes are module paths such as "
                                 f"{distinct[0][0].rpartition('.')[0]!r}")
        self.units: list[_Unit] = []
        for pre in prefixes + [""]:
            slots = members[pre]
            if not slots:
                continue
            dts = {self._compute_dtype(s) for s in slots}
            if len(dts) > 1:
                raise ValueError(f"unit {pre or '<root>'!r} mixes parameter dtypes {sorted(map(str, dts))}; "
                                 "split it with the units= option so that each unit has one dtype")
            self.units.append(_Unit(len(self.units), pre, slots,
                                    FlatLayout([s.info for s in slots], self.k), dts.pop()))
        for u in self.units:
            for idx, s in enumerate(u.slots):
                for n in [s.name, *s.aliases]:
                    owner, attr = _owner(module, n)
                    owner._parameters[attr] = s.param
                    self._install_property(owner, attr, u.uid, idx)

        self._sync = True
        self._current: int | None = None
        self._prefetched: dict[int, tuple] = {}
        self._pending: list[tuple] = []
        self._ptrs: dict[int, tuple] = {}
        self._fwd_order: list[int] = []
        self._fwd_order_done = False
        self._bwd_order: list[int] = []
        self._bwd_order_done = False
        self._saved_hooks = None
        self.stats = {"max_live_units": 0, "gathers": 0}
        self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._install_root_hooks()

    # --- construction ------------------------------------------------------------------
    def _compute_dtype(self, s: _Slot) -> torch.dtype:
        if self.param_dtype is not None and s.param.is_floating_point():
            return self.param_dtype
        return s.param.dtype

    def _install_property(self, owner: nn.Module, attr: str, uid: int, idx: int) -> None:
        cls = type(owner)
        if not cls.__dict__.get("_autopar_zero3", False):
            cls = type(cls.__name__, (cls,), {"_autopar_zero3": True})
            owner.__class__ = cls
        setattr(cls, attr, property(lambda mod: self._fetch(uid, idx)))

    # --- gathering ---------------------------------------------------------------------
    def _launch_gather(self, uid: int, async_op: bool):
        u = self.units[uid]
        flat = u.layout.pack_shards([s.param.detach() for s in u.slots], u.dtype, self.device)
        if self.k == 1:
            return flat, flat, None
        out = torch.empty(self.k * u.layout.S, dtype=u.dtype, device=self.device)
        self.stats["gathers"] += 1
        return out, flat, C.all_gather_into_(out, flat, self.axis, async_op=async_op)

    def _gathered(self, uid: int) -> torch.Tensor:
        if uid in self._prefetched:
            out, _, work = self._prefetched.pop(uid)
        else:
            out, _, work = self._launch_gather(uid, async_op=False)
        if work is not None:
            work.wait()
        return out

    def _prefetch(self, uid: int) -> None:
        u = self.units[uid]
        if self.prefetch and uid not in self._prefetched and u.fwd is None and u.bwd is None:
            self._prefetched[uid] = self._launch_gather(uid, async_op=True)

    def _drop_prefetches(self) -> None:
        for out, flat, work in self._prefetched.values():
            if work is not None:
                work.wait()
        self._prefetched.clear()

    def _unpack(self, uid: int, gathered: torch.Tensor) -> list[torch.Tensor]:
        u = self.units[uid]
        fulls = [torch.empty(s.info.shape, dtype=u.dtype, device=self.device) for s in u.slots]
        u.layout.unpack_full(gathered, fulls)
        return fulls

    def _note_live(self, u: _Unit, tensors) -> None:
        u.live = [weakref.ref(t) for t in tensors]
        n = sum(1 for v in self.units if any(r() is not None for r in v.live))
        self.stats["max_live_units"] = max(self.stats["max_live_units"], n)

    def _fetch(self, uid: int, idx: int) -> torch.Tensor:
        u = self.units[uid]
        if u.fwd is None:
            if self._current is not None and self._current != uid:
                self.units[self._current].fwd = None
            gathered = self._gathered(uid)
            out = _Unshard.apply(self, uid, gathered, *[s.param for s in u.slots])
            u.fwd = [out] if isinstance(out, torch.Tensor) else list(out)
            for i, t in enumerate(u.fwd):
                if t.numel():
                    ptr = t.untyped_storage().data_ptr()
                    entry = (uid, i, None)
                    entry = (uid, i, weakref.ref(t, lambda _, p=ptr, e=entry: self._forget(p, e)))
                    self._ptrs[ptr] = entry
            self._note_live(u, u.fwd)
            if not self._fwd_order_done and uid not in self._fwd_order:
                self._fwd_order.append(uid)
            order = self._fwd_order if self._fwd_order_done else [v.uid for v in self.units]
            if uid in order:
                pos = order.index(uid)
                if pos + 1 < len(order):
                    self._prefetch(order[pos + 1])
        self._current = uid
        return u.fwd[idx]

    def _forget(self, ptr: int, entry) -> None:
        cur = self._ptrs.get(ptr)
        if cur is not None and cur[0] == entry[0] and cur[1] == entry[1] and cur[2]() is None:
            del self._ptrs[ptr]

    def _release_fwd(self) -> None:
        for u in self.units:
            u.fwd = None
        self._current = None

    # --- forward hooks and saved tensors -------------------------------------------------
    def _pre_forward(self, mod, args):
        self._release_fwd()
        if torch.is_grad_enabled() and self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack_saved)
            self._saved_hooks.__enter__()

    def _post_forward(self, mod, args, out):
        self._release_fwd()
        self._drop_prefetches()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self._fwd_order:
            self._fwd_order_done = True
        return None

    def _pack(self, t: torch.Tensor):
        if not self._ptrs or t.numel() == 0:
            return t
        try:
            e = self._ptrs.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return t
        if e is None:
            return t
        full = e[2]()
        if full is None or full.dtype != t.dtype or full.device != t.device:
            return t
        return _Packed(e[0], e[1], tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _unpack_saved(self, p):
        if not isinstance(p, _Packed):
            return p
        return self._bwd_full(p.uid)[p.idx].as_strided(p.size, p.stride, p.offset)

    def _bwd_full(self, uid: int) -> list[torch.Tensor]:
        u = self.units[uid]
        if u.bwd is None:
            u.bwd = self._unpack(uid, self._gathered(uid))
            self._note_live(u, u.bwd)
            if not self._bwd_order_done and uid not in self._bwd_order:
                self._bwd_order.append(uid)
            if self._bwd_order_done and uid in self._bwd_order:
                pos = self._bwd_order.index(uid)
                if pos + 1 < len(self._bwd_order):
                    self._prefetch(self._bwd_order[pos + 1])
        return u.bwd

    # --- backward ------------------------------------------------------------------------
    def _unit_backward(self, uid: int, grads) -> None:
        u = self.units[uid]
        u.bwd = None
        grads = [g if s.trainable else None for g, s in zip(grads, u.slots)]
        if not any(g is not None for g in grads):
            return
        if not self._sync:
            u.acc = u.layout.pack_full(grads, _acc_dtype(u.dtype), self.device, out=u.acc)
            return
        rdt = self.reduce_dtype or u.dtype
        if u.acc is not None:
            buf = u.layout.pack_full(grads, _acc_dtype(u.dtype), self.device, out=u.acc).to(rdt)
            u.acc = None
        else:
            buf = u.layout.pack_full(grads, rdt, self.device)
        if self.k == 1:
            self._pending.append((uid, buf, buf, None))
            return
        out = torch.empty(u.layout.S, dtype=rdt, device=self.device)
        self._pending.append((uid, buf, out, C.reduce_scatter_into_(out, buf, self.axis, "sum", async_op=True)))
        # a unit's full gradients live until its reduce-scatter is done: keep at most
        # MAX_INFLIGHT_REDUCES in flight (FSDP2 does the same), or backward would hold the
        # whole model's gradients at once
        while len(self._pending) > MAX_INFLIGHT_REDUCES:
            self._complete(*self._pending.pop(0))

    def no_sync(self):
        @contextlib.contextmanager
        def ctx():
            old, self._sync = self._sync, False
            try:
                yield
            finally:
                self._sync = old
        return ctx()

    def _has_pending(self) -> bool:
        return bool(self._pending)

    def _complete(self, uid: int, buf, out, work) -> None:
        """Wait for one unit's reduce-scatter and add its rows to the shards' gradients."""
        if work is not None:
            work.wait()
        red = out.to(_acc_dtype(out.dtype))  # fp32, or fp64 for an fp64 model: never narrower
        if self.k > 1:
            red = red.div_(self.k) if red is not out else red.div(self.k)
        for s, v in zip(self.units[uid].slots, self.units[uid].layout.shard_views(red)):
            if not s.trainable:
                continue
            if s.master.grad is None:
                s.master.grad = self._grad_stage.to_host(id(s.master), v, s.master)
            else:
                self._grad_stage.wait()
                s.master.grad.add_(v.to(s.master.device, s.master.dtype))

    def _reduce(self) -> None:
        while self._pending:
            self._complete(*self._pending.pop(0))
        for u in self.units:
            u.bwd = None
        self._drop_prefetches()
        if self._bwd_order:
            self._bwd_order_done = True

    def _write_back(self) -> None:
        pass  # the shards are the masters: the next gather reads the updated values

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for u in self.units:
            u.acc = None

    def _tensors(self):
        d = super()._tensors()
        d["grads"] += [u.acc for u in self.units if u.acc is not None]
        return d

    def _load_slot(self, s: _Slot, source) -> None:
        rows = read_rows(source, s.name, s.info.start, s.info.end)
        with torch.no_grad():
            s.param.copy_(rows.reshape(s.info.local_shape))

    def reset_stats(self) -> None:
        self.stats = {"max_live_units": 0, "gathers": 0}
