"""The optimizer side of the ZeRO engines: a wrapper over the user's `torch.optim` class, and
dynamic loss scaling for fp16.

`ShardedOptimizer` builds the user's optimizer class over the engine's *master* tensors —
this rank's fp32 rows of every parameter (stages 1-3), or the full parameters (stage 0) —
and on `step()` lets the engine finish any pending reduction, skip the update when fp16
gradients overflowed, and write the updated masters back into the model (cast, all-gather or
nothing, by stage). It is a `torch.optim.Optimizer` (LR schedulers accept it) whose
`param_groups` and `state` are the inner optimizer's. Any optimizer whose update is
elementwise in the parameter (SGD, Adam, AdamW, Adagrad, RMSprop, ...) gives the same result
as on one process; one whose update depends on the parameter's shape (Adafactor's row/column
statistics) sees only the local rows.

`DynamicLossScaler` follows torch.amp.GradScaler's rule: scale the gradients by S, skip the
step and multiply S by `backoff_factor` when any gradient is inf/NaN (decided over the whole
axis), multiply S by `growth_factor` after `growth_interval` clean steps. The engine applies
S by scaling the gradient that enters the model's outputs (`ScaleGrad`), which equals
scaling the loss, so `loss.backward()` is written as without scaling.

`LossScaleGroup` is loss scaling for the stages of a pipeline: one scaler shared by the
engines of a rank's stages, only the last stage scaling its outputs' gradients (the gradients
the earlier stages receive through the pipeline are already scaled), each engine unscaling its
own gradients, and one inf/NaN verdict agreed (max of a flag) over every mesh axis that holds
other gradients (pp, dp, and tp / ep / cp where present) before any stage steps or skips, so
that every rank updates the scale identically.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import weakref

import torch

from . import collectives as C
from .zero_plain_optim import MANAGED


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True):
        if init_scale <= 0 or growth_factor < 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"bad loss scaler settings init_scale={init_scale}, growth_factor={growth_factor}, "
                             f"backoff_factor={backoff_factor}, growth_interval={growth_interval}; need "
                             "init_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.dynamic = growth_interval, dynamic
        self._good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self._good_steps = 0
            if self.dynamic:
                self.scale *= self.backoff_factor
            return
        self._good_steps += 1
        if self.dynamic and self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self._good_steps, self.skipped_steps = sd["scale"], sd["good_steps"], sd["skipped_steps"]


class LossScaleGroup:
    """One loss scale for the engines of a pipeline rank's stages (see the module docstring).

    Args:
        scaler: the shared `DynamicLossScaler` (equal settings and state on every rank).
        axes: the mesh axes the inf/NaN flag is agreed over, in the same order on every rank.
        device: where the flag lives (the mesh's device).
    """

    def __init__(self, scaler: DynamicLossScaler, axes: list[str], device):
        self.scaler, self.axes, self.device = scaler, list(axes), device
        self.engines: list = []

    def add(self, engine, scales_outputs: bool) -> None:
        """Let `engine` use the shared scaler and this group's verdict; `scales_outputs`: it is
        the last stage (its outputs' gradients are scaled; the others arrive scaled)."""
        engine.scaler, engine.scale_group, engine.scales_outputs = self.scaler, self, scales_outputs
        self.engines.append(engine)

    def finish_backward(self) -> None:
        """Every engine's reduction and unscale, one agreed verdict, one scale update. Every rank
        runs it once per step (the pipeline executor finishes every stage after its schedule)."""
        todo = [e for e in self.engines if e.grads_pending]
        if not todo:
            return
        found = False
        for e in todo:  # every engine unscales, whatever an earlier one found
            found = e.unscale_local() or found
        flag = torch.tensor([1.0 if found else 0.0], device=self.device)
        for axis in self.axes:
            C.all_reduce_(flag, axis, "max")
        found = bool(flag.item() > 0)
        self.scaler.update(found)
        for e in self.engines:
            e.settle(found)


def map_tensors(obj, fn):
    """`obj` with `fn` applied to every tensor in it (tuples, namedtuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*[map_tensors(o, fn) for o in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def loss_scale_hooks(engine) -> list:
    """The module hooks of an engine with a loss scaler: its outputs' gradient multiplied by the
    scale (`ScaleGrad`, when `engine.scales_outputs`: under a pipeline only the last stage), and a
    refusal of a training forward while the last step's unscaled gradients wait unused (the next
    backward's scaled ones would land on them and be unscaled together). Read at each forward
    through a weak reference, so a `LossScaleGroup` can swap the scaler in.

    Where the scale goes: `runtime.program.Program` multiplies an fp32 (or wider) loss by the
    scale before its backward, as `torch.amp.GradScaler` does, and sets `engine.loss_scaled`;
    `ScaleGrad` then passes the outputs' gradient through. Scaling the 16-bit outputs' gradient
    instead rounds the loss's gradient to 16 bits first: a mean over N tokens makes each logit's
    gradient ~1/N, which fp16 flushes to zero (131k tokens: 92 % error in the worst tensor, helper-33,
    2026-11-26). Only a 16-bit loss (whose own gradient, the scale, would overflow fp16) and an
    engine driven by hand are scaled at the outputs."""
    ref = weakref.ref(engine)

    def unconsumed(mod, args, kwargs):
        eng = ref()
        if eng is not None and eng._grads_ready and torch.is_grad_enabled() and mod.training and any(
                sl.master.grad is not None for sl in eng.slots):
            raise ValueError("a training forward under fp16 loss scaling while the last step's gradients are "
                             "settled (unscaled, overflow checked) and not yet used: accumulating them with the next "
                             "step's scaled ones would unscale them twice. Call the optimizer's step() or zero_grad() "
                             "between steps; accumulate over a larger batch with n_microbatches instead")

    def scale_out(mod, args, out):
        eng = ref()
        if eng is None or eng.scaler is None or not eng.scales_outputs:
            return out
        return map_tensors(out, lambda t: ScaleGrad.apply(t, ref) if t.is_floating_point() and t.requires_grad
                           else t)

    return [engine.module.register_forward_pre_hook(unconsumed, with_kwargs=True),
            engine.module.register_forward_hook(scale_out)]


def loss_scale_factor(engine, loss: torch.Tensor) -> float:
    """What the program multiplies `loss` by before its backward: the engine's loss scale when
    the engine has a scaler and the loss is fp32 or wider (`engine.loss_scaled` is then set, so
    the outputs' `ScaleGrad` passes their gradient through), else 1 (a 16-bit loss: the outputs
    carry the scale). See `loss_scale_hooks` for why the loss and not the outputs."""
    if engine is None or getattr(engine, "scaler", None) is None:
        return 1.0
    wide = loss.dtype in (torch.float32, torch.float64)
    engine.loss_scaled = wide
    return float(engine.scaler.scale) if wide else 1.0


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by the engine's current scale, unless the
    program scaled the loss itself (`engine.loss_scaled`)."""

    @staticmethod
    def forward(ctx, x, engine_ref):
        ctx.engine_ref = engine_ref
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        eng = ctx.engine_ref()
        if eng is None or eng.scaler is None or getattr(eng, "loss_scaled", False):
            return grad, None
        return grad * eng.scaler.scale, None


def unscale_and_check(grads: list[torch.Tensor], scale: float) -> bool:
    """Divide `grads` by `scale` in place; True when any of them holds inf or NaN."""
    found = False
    inv = 1.0 / scale
    for g in grads:
        if not found and not bool(torch.isfinite(g).all()):
            found = True
        g.mul_(inv)
    return found


class ShardedOptimizer(torch.optim.Optimizer):
    """`cls` over the engine's master tensors. Use `step()`, `zero_grad()`, `param_groups`,
    `state_dict()` / `load_state_dict()` as with any optimizer; the state dict is this rank's
    shard (a per-rank checkpoint, to be loaded on the same rank of the same mesh)."""

    _autopar_managed = True  # zero_plain_optim.MANAGED

    def __init__(self, engine, cls, groups: list[dict], **kwargs):
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"make_optimizer needs a torch.optim.Optimizer subclass, got {cls!r}")
        self.engine = engine
        self.optim = cls(groups, **kwargs)
        setattr(self.optim, MANAGED, True)  # stepped through the engine, not by zero_plain_optim's hooks
        masters = [p for g in self.optim.param_groups for p in g["params"]]
        super().__init__(masters, self.optim.defaults)
        # share the inner optimizer's groups and state, so LR schedulers and checkpoints see them
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure: run forward and backward "
                             "(and engine.finish_backward()) before step()")
        return self.engine._optimizer_step(self.optim)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        sd = self.optim.state_dict()
        sd["autopar_zero"] = {"stage": self.engine.stage, "dp": self.engine.k, "index": self.engine.index,
                              "loss_scaler": self.engine.scaler.state_dict() if self.engine.scaler else None}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        meta = sd.pop("autopar_zero", None)
        if meta is not None and (meta["dp"], meta["index"]) != (self.engine.k, self.engine.index):
            raise ValueError(f"this optimizer state is rank index {meta['index']} of dp={meta['dp']}, but this rank "
                             f"is index {self.engine.index} of dp={self.engine.k}; load each rank's own shard on "
                             "the same mesh (resharding goes through gather_full_state_dict)")
        self.optim.load_state_dict(sd)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        if meta is not None and meta.get("loss_scaler") and self.engine.scaler:
            self.engine.scaler.load_state_dict(meta["loss_scaler"])

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.engine.stage}, {self.optim!r})"
