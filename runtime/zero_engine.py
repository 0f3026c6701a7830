"""The ZeRO engine machinery common to every stage, and the engine for stages 0-2 (full
parameters on every rank). The overview, the per-stage promises and the option list are in
runtime/zero.py; stage 3 is in runtime/zero_stage3.py.

An engine keeps one `_Slot` per distinct parameter: its name (and tied aliases), its
`ShardInfo` (this rank's rows, torch.chunk convention along dim 0), the model parameter
forward uses, and the *master*: the tensor the optimizer steps. Masters are fp32 under mixed
precision and live on the CPU with offload; otherwise they share storage with the model
parameter (stage 0: the parameter itself; stages 1-2: a view of this rank's rows of it), so
they cost no memory.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from . import collectives as C
from . import zero_plain_optim
from .collective_errors import where
from .grad_norm import local_norm_parts, reduce_norm_parts
from .offload import GradStage, host_copy, optimizer_kwargs, to_device
from .zero_optim import DynamicLossScaler, ShardedOptimizer, loss_scale_hooks, unscale_and_check
from .zero_optim import map_tensors as _map_tensors
from .zero_shard import FlatLayout, GradReducer, ScatterReducer, ShardInfo, make_buckets, read_rows, shard_info

_FLOAT16 = (torch.float16, torch.bfloat16)


@dataclass
class _Slot:
    name: str
    info: ShardInfo
    param: nn.Parameter  # what the module holds: the full parameter (stages 0-2) or the shard (stage 3)
    master: torch.Tensor  # what the optimizer steps: this rank's rows (or all rows at stage 0)
    aliases: list[str] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class EngineBase:
    """Mixed precision, loss scaling, clipping, the optimizer wrapper, memory accounting and
    state-dict helpers; subclasses implement the gradient reduction and the write-back."""

    stage: int = -1

    def __init__(self, module: nn.Module, mesh, axis: str, bucket_mb: float = 25.0, *,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 loss_scale: str | float | None = "auto", init_scale: float = 2.0**16, growth_interval: int = 2000,
                 offload: bool = False, cast_inputs: bool = True, init_fn: Callable | None = None,
                 model_parallel: dict[str, tuple[str, ...]] | None = None):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {param_dtype}")
        self.module, self.mesh, self.axis, self.bucket_mb = module, mesh, axis, bucket_mb
        # parameter name -> other mesh axes it is sharded over (tensor parallelism): their
        # pieces of the gradient norm are summed over those axes, replicated ones counted once
        self.model_parallel = {k: tuple(v) for k, v in (model_parallel or {}).items()}
        self.k = mesh.size(axis)
        self.index = mesh.local_rank(axis) if self.k > 1 else 0
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype
        self.mixed = param_dtype in _FLOAT16
        self.offload = offload
        self.device = mesh.device
        self.master_device = torch.device("cpu") if offload else None  # None: next to the parameter
        # offloaded masters and their gradients in pinned host memory when a GPU computes
        self._pin = offload and self.device.type == "cuda"
        self._grad_stage = GradStage(self._pin)
        if loss_scale == "auto":
            loss_scale = "dynamic" if param_dtype == torch.float16 else None
        if loss_scale == "dynamic":
            self.scaler = DynamicLossScaler(init_scale, growth_interval=growth_interval)
        elif loss_scale is None:
            self.scaler = None
        elif isinstance(loss_scale, (int, float)) and loss_scale > 0:
            self.scaler = DynamicLossScaler(float(loss_scale), dynamic=False)
        else:
            raise ValueError(f"loss_scale must be 'auto', 'dynamic', None or a positive number, got {loss_scale!r}")
        self.cast_inputs = cast_inputs
        self.init_fn = init_fn
        self.optimizer: ShardedOptimizer | None = None
        self.slots: list[_Slot] = []
        self._grads_ready = False
        self._skip_step = False
        self.last_step_skipped = False
        # a pipeline rank's stages share one scaler and one agreed inf check (zero_optim.LossScaleGroup);
        # only the last stage scales its outputs' gradients (the others receive them scaled)
        self.scale_group = None
        self.scales_outputs = True
        self.loss_scaled = False  # the program multiplied this backward's fp32 loss by the scale (zero_optim)
        self._hooks: list = []
        # id -> (weakref, name, why) of tensors a plain optimizer must not step (zero_plain_optim)
        self.untrained: dict[int, tuple] = {}
        self.plain_stepped = False  # a plain optimizer stepped since the last forward
        self._hooks.append(module.register_forward_pre_hook(lambda *_: setattr(self, "plain_stepped", False)))
        zero_plain_optim.register(self)

    # --- construction helpers ----------------------------------------------------------
    def _distinct_params(self) -> list[tuple[str, nn.Parameter, list[str]]]:
        seen: dict[int, tuple[str, nn.Parameter, list[str]]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                seen[id(p)][2].append(name)
            else:
                seen[id(p)] = (name, p, [])
        if not seen:
            raise ValueError(f"{type(self.module).__name__} has no parameters to train")
        return list(seen.values())

    def _replace_param(self, name: str, aliases: list[str], p: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
        """A meta parameter cannot take real data in place (`p.data = ...` refuses the change
        of tensor type): a new Parameter replaces it under every name it has."""
        new = nn.Parameter(data, requires_grad=p.requires_grad)
        for n in [name, *aliases]:
            prefix, _, attr = n.rpartition(".")
            owner = self.module.get_submodule(prefix) if prefix else self.module
            owner._parameters[attr] = new
        return new

    def _master_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.mixed else p.dtype

    def _materialize_buffers(self) -> None:
        for mod in self.module.modules():
            for n, b in list(mod._buffers.items()):
                if b is not None and b.is_meta:
                    mod._buffers[n] = torch.empty_like(b, device=self.device)

    def _initial_rows(self, name: str, p: torch.Tensor, info: ShardInfo, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the initial value: from init_fn on a meta parameter, else p."""
        if p.is_meta:
            if self.init_fn is None:
                return None
            rows = self.init_fn(name, torch.Size(info.shape), start, end)
            want = (end - start, *info.shape[1:]) if info.shape else (end - start,)
            if tuple(rows.shape) != want:
                raise ValueError(f"init_fn({name!r}, {tuple(info.shape)}, {start}, {end}) returned shape "
                                 f"{tuple(rows.shape)}; it must return rows [start, end): shape {want}")
            return rows
        return p.detach().reshape(info.rows, *info.shape[1:])[start:end] if info.shape else p.detach().reshape(1)[start:end]

    def _install_root_hooks(self) -> None:
        if self.mixed and self.cast_inputs:
            dt = self.param_dtype

            def cast(mod, args, kwargs):
                f = lambda t: t.to(dt) if t.is_floating_point() else t
                return _map_tensors(args, f), _map_tensors(kwargs, f)

            self._hooks.append(self.module.register_forward_pre_hook(cast, with_kwargs=True))
        if self.scaler is not None:
            self._hooks += loss_scale_hooks(self)

    def remove(self) -> None:
        """Detach the engine's hooks (the module keeps its current, possibly sharded, state)."""
        zero_plain_optim.unregister(self)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- the engine interface ----------------------------------------------------------
    def no_sync(self):
        raise NotImplementedError

    def _reduce(self) -> None:
        """Finish gradient communication; leave each trainable master's .grad set."""
        raise NotImplementedError

    def _write_back(self) -> None:
        """After the optimizer step: bring the updated masters into the model."""
        raise NotImplementedError

    def _has_pending(self) -> bool:
        """Whether a reduction was launched (or is due) since the last finish_backward."""
        return True

    def finish_backward(self) -> None:
        """Wait for gradient communication of the last micro-batch and put the averaged,
        unscaled gradients on the masters (what the optimizer and clipping see). Calling it
        again before the next step does nothing unless another backward launched work."""
        if not self.grads_pending:
            return
        if self.scale_group is not None:  # with the other stages of this pipeline rank
            self.scale_group.finish_backward()
            return
        found = self.unscale_local()
        if self.scaler is not None:
            if self.k > 1:
                flag = torch.tensor([1.0 if found else 0.0], device=self.device)
                C.all_reduce_(flag, self.axis, "max")
                found = bool(flag.item() > 0)
            self.scaler.update(found)
        self.settle(found)

    @property
    def grads_pending(self) -> bool:
        """Whether a backward left gradients that `finish_backward` has not settled yet."""
        return not self._grads_ready or self._has_pending()

    def unscale_local(self) -> bool:
        """Finish this engine's reduction and divide its master gradients by the loss scale;
        whether any of them holds inf or NaN (this rank's engine only: not agreed with peers)."""
        self._reduce()
        self._grad_stage.wait()  # offloaded gradients: their host copies are complete from here on
        if self.scaler is None:
            return False
        return unscale_and_check([s.master.grad for s in self.slots if s.master.grad is not None], self.scaler.scale)

    def settle(self, skip: bool) -> None:
        """The step's agreed verdict: the next optimizer step runs, or is skipped (an overflow)."""
        self._skip_step = bool(skip)
        self._grads_ready = True

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def make_optimizer(self, cls, param_groups: list[dict] | None = None, **kwargs) -> ShardedOptimizer:
        """`cls(**kwargs)` over this rank's masters. `param_groups`: optional list of dicts
        whose "params" are parameter names or the module's parameter objects (as given by
        `module.named_parameters()` after the engine was made), other keys as in torch."""
        by_name = {}
        for s in self.slots:
            for n in [s.name, *s.aliases]:
                by_name[n] = s
        by_obj = {id(s.param): s for s in self.slots}
        if param_groups is None:
            groups = [{"params": [s.master for s in self.slots if s.trainable]}]
        else:
            groups = []
            for g in param_groups:
                ms = []
                for p in g["params"]:
                    s = by_name.get(p) if isinstance(p, str) else by_obj.get(id(p))
                    if s is None:
                        raise ValueError(f"param_groups names {p if isinstance(p, str) else type(p).__name__!r}, "
                                         f"which is not a parameter of this module; use names from "
                                         f"module.named_parameters(), e.g. {self.slots[0].name!r}")
                    ms.append(s.master)
                groups.append({**g, "params": ms})
        if self.device.type == "cuda":  # torch's fused update where it has one (on the CPU too, offloaded)
            kwargs = optimizer_kwargs(cls, kwargs, [m for g in groups for m in g["params"]])
        self.optimizer = ShardedOptimizer(self, cls, groups, **kwargs)
        return self.optimizer

    def _optimizer_step(self, optim: torch.optim.Optimizer):
        if not self._grads_ready:
            self.finish_backward()
        self.last_step_skipped = self._skip_step
        if not self._skip_step:
            optim.step()
            with where("optimizer step"):
                self._write_back()
        else:
            self.zero_grad(True)
        self._grads_ready = False
        return None

    def before_plain_step(self) -> None:
        """A plain torch optimizer over the masters steps next (runtime/zero_plain_optim.py)."""
        if not self._grads_ready and not self.plain_stepped:
            self.finish_backward()
        if self._skip_step:  # fp16 overflow: the optimizer skips masters without a gradient
            for s in self.slots:
                s.master.grad = None

    def after_plain_step(self) -> None:
        """Bring the updated masters into the model; drop the model-side gradients they used."""
        self.last_step_skipped = self._skip_step
        if not self._skip_step:
            with where("optimizer step"):
                self._write_back()
        for s in self.slots:
            if s.param is not s.master:
                s.param.grad = None
        self._grads_ready, self.plain_stepped = False, True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.slots:
            for t in (s.param, s.master):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.zero_()
        self._grads_ready = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the master gradients so that their global norm (over every shard of the
        axis) is at most `max_norm`; returns the norm before clipping (fp32; fp64 for fp64 masters)."""
        if not self._grads_ready:
            self.finish_backward()
        norm_type = float(norm_type)

        def live(axes):
            return tuple(a for a in axes if self.mesh.size(a) > 1)

        parts: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for sl in self.slots:
            if sl.master.grad is not None:
                parts.setdefault(live(self.model_parallel.get(sl.name, ())), []).append(sl.master.grad)
        grads = [g for gs in parts.values() for g in gs]
        dev = grads[0].device if grads else self.device
        # one part per distinct set of model-parallel axes, taken from the (rank-independent)
        # model_parallel map so that every rank makes the same reductions in the same order
        keys = [()] + sorted({live(v) for v in self.model_parallel.values()} - {()})
        acc = torch.float64 if any(sl.master.dtype == torch.float64 for sl in self.slots) else torch.float32
        t = local_norm_parts(parts, keys, norm_type, acc, self.device)
        inf = norm_type == float("inf")
        total = reduce_norm_parts(t, keys, inf, self.axis if self.stage >= 1 and self.k > 1 else None)
        total = (total if inf else total.pow(1.0 / norm_type)).to(dev)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def named_shards(self) -> Iterator[tuple[str, ShardInfo, torch.Tensor]]:
        """(name, ShardInfo, master) per distinct parameter: the master holds rows
        [info.start, info.end) of the parameter (all rows at stage 0), its .grad the
        averaged gradient of those rows after finish_backward()."""
        for s in self.slots:
            yield s.name, s.info, s.master

    # --- memory ------------------------------------------------------------------------
    def _tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held per category; subclasses add their own (accumulation buffers)."""
        params = [s.param for s in self.slots]
        grads = [t.grad for s in self.slots for t in (s.param, s.master) if t.grad is not None]
        opt = [s.master for s in self.slots]
        if self.optimizer is not None:
            for st in self.optimizer.optim.state.values():
                opt += [v for v in st.values() if torch.is_tensor(v)]
        return {"params": params, "grads": grads, "optimizer": opt}

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes held on this rank per category and device type, each storage counted once
        and in the first category that holds it (params, then grads, then optimizer): a
        master that shares storage with its parameter costs nothing extra."""
        seen: set[tuple[str, int]] = set()
        out: dict[str, dict[str, int]] = {}
        for cat, tensors in self._tensors().items():
            per = out.setdefault(cat, {})
            for t in tensors:
                if t.numel() == 0:
                    continue
                st = t.untyped_storage()
                key = (str(t.device), st.data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                per[t.device.type] = per.get(t.device.type, 0) + st.nbytes()
        return out

    def memory_bytes(self, device: str | None = None) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes this rank holds now (on `device` type, or
        all). Shards are stored unpadded, so summed over the ranks of the axis a sharded
        category equals the full model's bytes exactly; padding to ceil(rows/k) exists only
        in transient communication buffers. "optimizer" includes fp32 master copies when they
        are separate tensors (mixed precision or offload), as in the ZeRO paper's accounting."""
        rep = self.memory_report()
        return {cat: sum(v for d, v in rep.get(cat, {}).items() if device is None or d == device)
                for cat in ("params", "grads", "optimizer")}

    # --- state dicts -------------------------------------------------------------------
    def _gather_rows(self, s: _Slot, rows: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's rows (collective over the axis)."""
        if self.k == 1 or self.stage == 0:
            return rows.reshape(s.info.shape)
        layout = FlatLayout([s.info], self.k)
        dev = self.device
        flat = layout.pack_shards([rows], rows.dtype, dev)
        out = torch.empty(self.k * layout.S, dtype=rows.dtype, device=dev)
        C.all_gather_into_(out, flat, self.axis)
        full = torch.empty(s.info.shape, dtype=rows.dtype, device=dev)
        layout.unpack_full(out, [full])
        return full

    def gather_full_state_dict(self, rank0_only: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The full model state dict (parameters from the fp32 masters, then persistent
        buffers), on the CPU. Collective: call it on every rank of the axis. With
        `rank0_only`, other ranks return {}; each parameter is gathered one at a time, so at
        most one full parameter is held beyond the result."""
        me0 = self.index == 0
        sd: dict[str, torch.Tensor] = {}
        for s in self.slots:
            full = self._gather_rows(s, s.master.detach().to(self.device))
            if rank0_only and not me0:
                continue
            t = full.to("cpu", dtype or full.dtype).clone()
            for n in [s.name, *s.aliases]:
                sd[n] = t
        if rank0_only and not me0:
            return {}
        param_names = {n for s in self.slots for n in [s.name, *s.aliases]}
        for n, v in self.module.state_dict().items():
            if n not in param_names:
                sd[n] = v.detach().to("cpu").clone()
        return sd

    def load_state_dict_shards(self, source, strict: bool = True) -> None:
        """Fill parameters (and the buffers it names) from `source`, reading only the rows
        this rank keeps: a mapping name -> tensor (or lazily sliceable object), a safetensors
        `safe_open` handle, or a callable `(name, start, end) -> rows`. Local: no collective."""
        missing = []
        for s in self.slots:
            try:
                self._load_slot(s, source)
            except KeyError:
                missing.append(s.name)
        for mod_name, mod in self.module.named_modules():
            for n, b in mod._buffers.items():
                full = f"{mod_name}.{n}" if mod_name else n
                if b is None:
                    continue
                try:
                    v = source[full] if isinstance(source, Mapping) else None
                except KeyError:
                    v = None
                if v is not None:
                    with torch.no_grad():
                        b.copy_(v)
        if missing and strict:
            raise ValueError(f"the state-dict source has no entry for {missing}; pass strict=False to "
                             "leave them as they are")

    def _load_slot(self, s: _Slot, source) -> None:
        raise NotImplementedError


class ReplicatedEngine(EngineBase):
    """Stages 0-2: every rank holds the full parameters (in `param_dtype`).

    stage 0: bucketed all-reduce of gradients; full optimizer state (data parallel).
    stage 1: the same all-reduce (p.grad is the full averaged gradient, as in stage 0); the
             optimizer steps this rank's rows only; an all-gather per bucket after the step.
    stage 2: bucketed reduce-scatter during backward into this rank's rows; full gradients
             are freed as soon as their bucket is packed; the same all-gather after the step.
    """

    def __init__(self, module: nn.Module, mesh, axis: str, stage: int, bucket_mb: float = 25.0, **options):
        super().__init__(module, mesh, axis, bucket_mb, **options)
        if stage not in (0, 1, 2):
            raise ValueError(f"ReplicatedEngine handles stages 0-2, got {stage}")
        self.stage = stage
        k_shard, i_shard = (1, 0) if stage == 0 else (self.k, self.index)
        self._materialize_buffers()
        for name, p, aliases in self._distinct_params():
            info = shard_info(name, p.shape, k_shard, i_shard)
            if p.is_meta:
                full = self._initial_rows(name, p, info, 0, info.rows)
                data = torch.empty(p.shape, dtype=p.dtype, device=self.device) if full is None else full.to(self.device, p.dtype).reshape(p.shape)
                p = self._replace_param(name, aliases, p, data)
            separate = self.mixed or self.offload
            if separate:
                mdev = self.master_device or p.device
                rows = p.detach().reshape(info.rows, *info.shape[1:])[info.start:info.end] if info.shape else p.detach().reshape(1)
                master = nn.Parameter(host_copy(rows, self._master_dtype(p), pin=self._pin) if self.offload
                                      else rows.to(mdev, self._master_dtype(p), copy=True), requires_grad=p.requires_grad)
            elif stage == 0:
                master = p
            else:
                rows = p.data.reshape(info.rows, *info.shape[1:])[info.start:info.end] if info.shape else p.data.reshape(1)
                master = nn.Parameter(rows, requires_grad=p.requires_grad)  # shares p's storage
            if self.param_dtype is not None and p.dtype != self.param_dtype and p.is_floating_point():
                p.data = p.data.to(self.param_dtype)
            if master is not p:
                why = ("the program steps separate master copies of them" if separate else f"under ZeRO-{stage} the "
                       f"program steps this rank's rows of them{'; reduce-scatter frees their gradients' if stage == 2 else ''}")
                self.untrained[id(p)] = (weakref.ref(p), name, why)
            self.slots.append(_Slot(name, info, p, master, aliases))
        self._separate = self.mixed or self.offload
        trainable = [s.param for s in self.slots if s.trainable]
        self._infos = {id(s.param): s.info for s in self.slots}
        self._slot_of = {id(s.param): s for s in self.slots}
        self.reducer = None
        if self.k > 1 and trainable:
            if stage in (0, 1):
                # separate masters take their rows from the reduced buffer (the reduce dtype),
                # not from .grad after its cast back to the parameter's dtype
                self.reducer = GradReducer(trainable, axis, bucket_mb, self.reduce_dtype,
                                           self._on_reduced if self._separate else None)
            else:
                self.reducer = ScatterReducer(trainable, self._infos, axis, self.k, self._on_shard_grads,
                                              bucket_mb, self.reduce_dtype)
        self._gather_layouts = []
        if stage >= 1 and self.k > 1:
            for b in make_buckets(trainable, bucket_mb):
                self._gather_layouts.append(([self._slot_of[id(p)] for p in b],
                                             FlatLayout([self._infos[id(p)] for p in b], self.k)))
        self._install_root_hooks()

    def no_sync(self):
        return self.reducer.no_sync() if self.reducer else contextlib.nullcontext()

    def _has_pending(self) -> bool:
        return self.reducer is not None and self.reducer.pending

    def remove(self) -> None:
        super().remove()
        if self.reducer is not None:
            self.reducer.remove()

    def _on_shard_grads(self, params: list[nn.Parameter], views: list[torch.Tensor]) -> None:
        for p, v in zip(params, views):
            m = self._slot_of[id(p)].master
            if m.grad is None and self.offload:
                m.grad = self._grad_stage.to_host(id(m), v, m)
                continue
            self._grad_stage.wait()
            g = v.to(m.device, m.dtype)
            if m.grad is None:
                m.grad = g.clone() if g.data_ptr() == v.data_ptr() else g
            else:
                m.grad.add_(g)

    def _on_reduced(self, p: nn.Parameter, g: torch.Tensor) -> None:
        s = self._slot_of[id(p)]
        i = s.info
        s.master.grad = self._grad_stage.to_host(
            id(s.master), g.reshape(i.rows, *i.shape[1:])[i.start:i.end] if i.shape else g.reshape(1), s.master)

    def _reduce(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
        if (self.stage == 2 or self._separate) and self.reducer is not None:
            return  # the reducer wrote the masters' gradients
        for s in self.slots:
            g = s.param.grad
            if g is None or s.master is s.param:
                continue
            i = s.info
            rows = g.reshape(i.rows, *i.shape[1:])[i.start:i.end] if i.shape else g.reshape(1)
            if self._separate:
                s.master.grad = self._grad_stage.to_host(id(s.master), rows, s.master)
            else:
                s.master.grad = rows  # a view: stage 1 keeps the full gradient anyway

    def _write_back(self) -> None:
        with torch.no_grad():
            if self.stage == 0 or self.k == 1:
                if self._separate:
                    for s in self.slots:  # offloaded masters: one async copy, the cast on the device
                        s.param.copy_(to_device(s.master, s.param.device).reshape(s.param.shape))
                return
            works = []
            for slots, layout in self._gather_layouts:
                p0 = slots[0].param
                flat = layout.pack_shards([s.master for s in slots], p0.dtype, p0.device)
                out = torch.empty(self.k * layout.S, dtype=p0.dtype, device=p0.device)
                works.append((slots, layout, out, C.all_gather_into_(out, flat, self.axis, async_op=True)))
            for slots, layout, out, work in works:  # copy out one bucket while the next arrives
                work.wait()
                layout.unpack_full(out, [s.param.data for s in slots])

    def _load_slot(self, s: _Slot, source) -> None:
        full = read_rows(source, s.name, 0, s.info.rows)
        with torch.no_grad():
            s.param.copy_(full.reshape(s.param.shape))
            if s.master is not s.param and (self._separate or self.stage == 0):
                i = s.info
                rows = full.reshape(i.rows, *i.shape[1:])[i.start:i.end] if i.shape else full.reshape(1)
                s.master.copy_(rows.reshape(s.master.shape))


class DataParallelEngine(ReplicatedEngine):
    """ZeRO stage 0: replicated parameters and optimizer, bucketed gradient all-reduce."""

    def __init__(self, module: nn.Module, mesh, axis: str, bucket_mb: float = 25.0, **options):
        super().__init__(module, mesh, axis, 0, bucket_mb, **options)
