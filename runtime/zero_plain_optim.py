"""Plain torch optimizers over a ZeRO engine's tensors: run them right, or refuse them.

`torch.optim.AdamW(pm.parameters())` must train as `autopar.optimizer(pm, torch.optim.AdamW)`
does, and an optimizer over tensors that the program does not train must not train nothing
in silence. What a program trains are its engine's *masters* (`named_masters`): the
parameters themselves at stage 0, this rank's rows at stages 1-2 (views of the parameters,
or fp32 copies under mixed precision / offload), this rank's shards at stage 3. What it does
not train (`engine.untrained`): the module's full parameters when the masters are rows or
copies of them (their own gradients are freed by ZeRO-2's reduce-scatter, or are not what the
step reads), and the original parameters that ZeRO-3 replaced with shards (they get no
gradient at all) — the user's model's parameters, since the captured graph shares them.

Both go through torch's global optimizer step hooks (`register_optimizer_step_pre_hook` /
`register_optimizer_step_post_hook` of `torch.optim.optimizer`, public), installed once, when
the first engine registers:

- before a step, an optimizer that holds a tensor some live engine knows as untrained raises
  ValueError naming the tensors and saying what to use instead. An optimizer over masters
  makes their engine finish its gradient reduction (once per backward), and when fp16 loss
  scaling found an overflow it drops the masters' gradients, so the optimizer skips them;
- after the step, the engine writes the masters back into the model (cast, or all-gather of
  the rows) and drops the model-side gradients the masters' gradients were made from, so the
  next backward starts from zero (`EngineBase.after_plain_step`).

Optimizers made by autopar (`ShardedOptimizer`, its inner optimizer, `PipelineOptimizer`)
carry `MANAGED` and are left alone. The verdict per optimizer is cached until its number of
parameters changes; with no live engine the hooks return at once.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import weakref
from typing import Iterator

import torch

MANAGED = "_autopar_managed"  # attribute set on optimizers that autopar drives itself

_ENGINES: list[weakref.ref] = []
_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (n params, engines)
_INSTALLED = False


def register(engine) -> None:
    """Let plain optimizers over `engine`'s masters work and refuse ones over its untrained
    tensors (`engine.untrained`: id -> (weakref, name, why)). Called by the engine itself."""
    global _INSTALLED
    _ENGINES[:] = [r for r in _ENGINES if r() is not None]
    _ENGINES.append(weakref.ref(engine))
    _VERDICTS.clear()
    if not _INSTALLED:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _INSTALLED = True


def unregister(engine) -> None:
    _ENGINES[:] = [r for r in _ENGINES if r() is not None and r() is not engine]
    _VERDICTS.clear()


def engines_in(engine) -> list:
    """The ZeRO engines behind a program's `engine` (a pipeline holds one per local stage)."""
    return [engine.engines[s] for s in sorted(engine.engines)] if hasattr(engine, "engines") else [engine]


def named_masters(engine, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, master) of every parameter the program trains (frozen ones included, as
    `nn.Module.named_parameters` does); tied aliases too unless `remove_duplicate`."""
    for e in engines_in(engine):
        for s in e.slots:
            for n in [s.name] if remove_duplicate else [s.name, *s.aliases]:
                yield n, s.master


def _verdict(opt) -> list:
    """The live engines whose masters `opt` steps; ValueError when it holds untrained tensors."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    hit = _VERDICTS.get(opt)
    if hit is not None and hit[0] == n:
        return [e for e in (r() for r in hit[1]) if e is not None]
    held = {id(p): p for g in opt.param_groups for p in g["params"]}
    engines, bad = [], []
    for e in (r() for r in list(_ENGINES)):
        if e is None:
            continue
        for i, (ref, name, why) in e.untrained.items():
            if i in held and ref() is held[i]:
                bad.append((name, why))
        if any(held.get(id(s.master)) is s.master for s in e.slots):
            engines.append(e)
    if bad:
        cls = type(opt)
        qual = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
        names = ", ".join(repr(n) for n, _ in bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(
            f"{qual} was built over {len(bad)} tensor(s) that this autopar program does not train: {names} "
            f"({bad[0][1]}). Build the optimizer over what the program trains: autopar.optimizer(pm, {qual}, ...) "
            f"(ZeRO-aware: sharded state, global clipping, loss scaling), or {qual}(pm.parameters(), ...), where "
            "pm is the model autopar.parallelize returned")
    _VERDICTS[opt] = (n, [weakref.ref(e) for e in engines])
    return engines


def _before_step(opt, args, kwargs):
    if not _ENGINES or getattr(opt, MANAGED, False):
        return None
    for e in _verdict(opt):
        e.before_plain_step()
    return None


def _after_step(opt, args, kwargs):
    if not _ENGINES or getattr(opt, MANAGED, False):
        return None
    for e in _verdict(opt):
        e.after_plain_step()
    return None


__all__ = ["MANAGED", "register", "unregister", "engines_in", "named_masters"]
