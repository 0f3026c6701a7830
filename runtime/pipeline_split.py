"""The zero-bubble split of a pipeline stage's backward (`I` then `W`), used by
`runtime.pipeline.PipelineExecutor` for the zb_h1 / zbv schedules.

`backward_input` computes only the input gradients (`autograd.grad(outputs, inputs)`),
capturing the gradient arriving at every autograd node that lies on an input path and has an
edge towards a parameter (the "frontier", as in torch's `stage_backward_input`);
`backward_weight` restarts autograd from those nodes' captured gradients towards the
parameters only, so it does not repeat the input-gradient chain. A parameter reached from
several frontier nodes (one weight used twice in a stage) is done in one call with the
captured gradients pinned, so nothing is counted twice; that call does re-run the chain
between the two uses. On a stage whose inputs need no gradient (stage 0), `I` is empty and
`W` is the full backward (as in torch). The split walks the autograd graph once per (stage,
micro-batch) and makes one autograd call per parameter group: a fixed Python cost that
matters only for very small stages.

A stage that holds a module allowing one backward (`allows_one_backward`: an activation
checkpoint region of passes/recompute.py says so with `ONE_BACKWARD = True`; a selective
checkpoint's cache is spent by the first backward through it, torch: "Trying to backward an
extra time") does not split: `runtime.schedules.fuse_backward` turns its `I`s into full `B`s
and drops its `W`s (runtime/pipeline.py).

Public autograd graph APIs only (`get_gradient_edge`, `Node.register_prehook`,
`autograd.backward` on `GradientEdge`s). Reads and writes no `node.meta` keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGradState", "allows_one_backward", "backward_input", "backward_weight"]


def allows_one_backward(module: nn.Module) -> bool:
    """Whether `module` holds a submodule (itself included) whose class or instance sets
    `ONE_BACKWARD = True`: its autograd graph may be walked by one backward only, so a stage
    holding it runs its backward whole (input and weight gradients in one pass)."""
    return any(getattr(m, "ONE_BACKWARD", False) is True for m in module.modules())


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


@dataclass
class WeightGradState:
    """What `W` needs after `I`: groups of (frontier nodes, parameters), the gradients
    captured at the frontier, or (`full`) the outputs for a full backward."""

    full: bool
    outputs: list
    grads: list
    params: list
    groups: list  # [(nodes, params)]
    captured: dict


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter]
                   ) -> tuple[list[torch.Tensor | None], WeightGradState]:
    """Input gradients of `outputs` (seeded with `grads`) w.r.t. `inputs`; no parameter
    gradient is computed or accumulated. Returns them (None where not needed) and the state
    for `backward_weight`."""
    outputs, grads = list(outputs), list(grads)
    params = [p for p in params if p.requires_grad]
    in_req = [x for x in inputs if x.requires_grad]
    full = WeightGradState(True, outputs, grads, params, [], {})
    if not in_req or not outputs:
        return [None] * len(inputs), full
    roots = [_node(o) for o in outputs]
    children: dict = {}
    order: list = []  # post-order: children before parents
    for root in roots:
        if root in children:
            continue
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                order.append(n)
                continue
            if n in children:
                continue
            ch = [f for f, _ in n.next_functions if f is not None]
            children[n] = ch
            stack.append((n, True))
            stack.extend((c, False) for c in ch if c not in children)
    in_nodes = {_node(x) for x in in_req}
    param_of = {_node(p): p for p in params}
    to_in: dict = {}
    to_par: dict = {}
    for n in order:
        to_in[n] = n in in_nodes or any(to_in[c] for c in children[n])
        to_par[n] = n in param_of or any(to_par[c] for c in children[n])
    if any(not to_in[r] and to_par[r] for r in roots):
        # an output depends on parameters but not on the inputs: W does the full backward
        grads_in = torch.autograd.grad(outputs, in_req, grads, retain_graph=True, allow_unused=True)
        return _place(inputs, in_req, grads_in), full
    frontier = [n for n in order if to_in[n] and any(not to_in[c] and to_par[c] for c in children[n])]
    groups: list[tuple[list, set]] = []
    for n in frontier:
        reached, seen = set(), set()
        stack = [c for c in children[n] if not to_in[c] and to_par[c]]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in param_of:
                reached.add(x)
            stack.extend(c for c in children[x] if not to_in[c] and to_par[c])
        merged = [g for g in groups if g[1] & reached]
        nodes, ps = [n], set(reached)
        for g in merged:
            nodes = g[0] + nodes
            ps |= g[1]
            groups.remove(g)
        groups.append((nodes, ps))
    captured: dict = {}
    hooks = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in frontier]
    try:
        grads_in = torch.autograd.grad(outputs, in_req, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    # outputs stay referenced until W: a Python-defined autograd node does not keep its graph alive
    state = WeightGradState(False, outputs, grads, params,
                            [(nodes, [param_of[x] for x in ps]) for nodes, ps in groups], captured)
    return _place(inputs, in_req, grads_in), state


def _place(inputs, in_req, grads_in) -> list:
    by_id = {id(x): g for x, g in zip(in_req, grads_in)}
    return [by_id.get(id(x)) for x in inputs]


def backward_weight(state: WeightGradState) -> None:
    """Accumulate the parameter gradients left by `backward_input` into `.grad` (firing
    post-accumulate hooks, so data-parallel bucket reduction sees them)."""
    if state.full:
        if state.outputs and state.params:
            torch.autograd.backward(state.outputs, state.grads, inputs=state.params)
        return
    for nodes, params in state.groups:
        edges, gs = [], []
        for n in nodes:
            for k, g in enumerate(state.captured.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, k))
                    gs.append(g)
        if not edges:
            continue
        pins = []
        if len(nodes) > 1:  # a path between two of these nodes must not add to the captured value
            pins = [n.register_prehook(lambda g, s=state.captured[n]: s) for n in nodes if n in state.captured]
        try:
            torch.autograd.backward(edges, gs, inputs=params, retain_graph=True)
        finally:
            for h in pins:
                h.remove()
