"""Opaque leaf modules: an untraceable submodule becomes one graph node.

`torch.ops.autopar.leaf(key, inputs, params)` runs the registered module `key` on `inputs`
with `params` (its parameters, passed explicitly so that autograd reaches them) and returns
its outputs as a list. Backward recomputes the leaf under autograd (like activation
checkpointing), so nothing inside it needs to be traceable. Shapes for fake tensors come
from running the leaf on fake inputs, or, when it cannot run on them (data-dependent
Python control flow), from one run on zero-filled real inputs of the same shapes.

A leaf is replicated under every plan: every rank runs it whole on its local inputs.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
from ._torch_compat import pytree

_LEAVES: dict[str, nn.Module] = {}
_OUT_SPECS: dict[str, Any] = {}
_INSIDE: set[str] = set()  # leaves currently running their own forward (bypass the opaque wrapper)


def _run(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]):
    mod = _LEAVES[key]
    names = [n for n, _ in mod.named_parameters()]
    _INSIDE.add(key)
    try:
        out = torch.func.functional_call(mod, dict(zip(names, params)), tuple(inputs))
    finally:
        _INSIDE.discard(key)
    flat, spec = pytree.tree_flatten(out)
    _OUT_SPECS[key] = spec
    return flat


@torch.library.custom_op("autopar::leaf", mutates_args=())
def leaf(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [t.clone() if any(t is i for i in inputs) else t for t in _run(key, inputs, params)]


@leaf.register_fake
def _(key, inputs, params):
    # Shapes come from running the leaf on concrete-shaped tensors outside the tracer's fake
    # mode (a fresh fake mode first; if the leaf cannot run on fake tensors, zeros on CPU),
    # so nothing the leaf does (item(), data-dependent branches) leaks into the trace.
    from ._torch_compat import FakeTensorMode, unset_fake_temporarily

    with unset_fake_temporarily():
        ins = [(tuple(int(s) for s in t.shape), t.dtype) for t in inputs]
        ps = [(tuple(int(s) for s in p.shape), p.dtype) for p in params]
        try:
            with FakeTensorMode():
                outs = [(tuple(o.shape), o.dtype) for o in _run(key, [torch.empty(s, dtype=d) for s, d in ins],
                                                                 [torch.empty(s, dtype=d) for s, d in ps])]
        except Exception:  # noqa: BLE001 - cannot run on fake tensors: one real run on zeros
            outs = [(tuple(o.shape), o.dtype) for o in _run(key, [torch.zeros(s, dtype=d) for s, d in ins],
                                                             [torch.zeros(s, dtype=d) for s, d in ps])]
    return [inputs[0].new_empty(s, dtype=d) for s, d in outs]


def _setup(ctx, inputs, output):
    key, ins, params = inputs
    ctx.key = key
    ctx.n_in = len(ins)
    ctx.save_for_backward(*ins, *params)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    ins = [t.detach().requires_grad_(t.is_floating_point()) for t in saved[:ctx.n_in]]
    params = [p.detach().requires_grad_(True) for p in saved[ctx.n_in:]]
    with torch.enable_grad():
        outs = _run(ctx.key, ins, params)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wrt = [t for t in ins + params if t.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(wrt)
    it = iter(got)
    all_grads = [next(it) if t.requires_grad else None for t in ins + params]
    return None, all_grads[:ctx.n_in], all_grads[ctx.n_in:]


leaf.register_autograd(_backward, setup_context=_setup)


@contextlib.contextmanager
def opaque(model: nn.Module, paths: list[str], args=(), kwargs=None):
    """While active, each submodule in `paths` runs as one `autopar::leaf` node."""
    saved = []
    try:
        for path in paths:
            mod = model.get_submodule(path)
            _LEAVES[path] = mod
            orig = mod.forward

            def fwd(*inputs, _key=path, _mod=mod, _orig=orig, **kw):
                if _key in _INSIDE:
                    return _orig(*inputs, **kw)
                if kw:
                    raise ValueError(f"leaf module {_key!r} was called with keyword arguments {sorted(kw)}; "
                                     "opaque leaves take positional tensors only")
                params = list(_mod.parameters())
                outs = torch.ops.autopar.leaf(_key, list(inputs), params)
                spec = _OUT_SPECS.get(_key)
                return pytree.tree_unflatten(list(outs), spec) if spec is not None else outs[0]

            had_own = "forward" in mod.__dict__
            mod.forward = fwd
            saved.append((mod, orig, had_own))
        yield
    finally:
        for mod, orig, had_own in saved:
            if had_own:
                mod.forward = orig
            else:
                del mod.forward
