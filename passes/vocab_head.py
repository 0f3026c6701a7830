"""Find a language model's output layer (its vocabulary head) in a captured graph, and pin it
vocab-parallel for `Plan.loss_parallel`.

`vocab_head(gm)`: the parameter whose rows are the vocabulary (the weight of the `aten.linear`
or `aten.matmul`/`mm` that makes a floating graph output's last dim), with that output's
index among the flat outputs and its vocabulary size; None when no graph output is such a
product. `pin_vocab_parallel(plan, gm, axis, k)`: with `Plan.loss_parallel`, pins that weight
`S(0)` on `axis` (the column-parallel head whose logits stay sharded over the vocabulary,
torchtitan's ColwiseParallel(output_layouts=Shard(-1)) for loss_parallel) unless the plan
already places it otherwise on that axis, and returns a note saying what was done or why not,
with the node pin that keeps the head's output sharded in the sharding search.

Reads node.meta["val"] (shapes) of the output's producers; writes nothing on nodes.
Guarantees: never overrides a placement the plan already gives the weight on `axis`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autopar.runtime.placement import Layout, Replicate, Shard

from . import ir
from .plan import Plan
from .rules.sharding import op_name

__all__ = ["VocabHead", "logits_input", "pin_vocab_parallel", "vocab_head"]

_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.contiguous.default",
          "aten.alias.default"}


@dataclass(frozen=True)
class VocabHead:
    weight: str  # the parameter's name (get_attr target)
    output: int  # index among the graph's flat outputs
    vocab: int  # its rows: the vocabulary size
    node: str  # the head's node key (`ir.node_keys`: the Plan's key)
    ndim: int  # dims of its output (the vocabulary is the last)


def vocab_head(gm: fx.GraphModule) -> VocabHead | None:
    """The vocabulary head of `gm` (see the module docstring); None when there is none."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    for i, a in enumerate(flat):
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2):
            continue
        n = a
        while n.op == "call_function" and op_name(n.target) in _VIEWS:
            n = n.args[0]
        if n.op != "call_function" or op_name(n.target) not in ("aten.linear.default",):
            continue
        w = n.args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr":
            wv = w.meta.get("val")
            v = val.shape[-1]
            if isinstance(wv, torch.Tensor) and wv.dim() == 2 and isinstance(v, int) and wv.shape[0] == v:
                return VocabHead(str(w.target), i, int(v), ir.node_keys(gm)[n], val.dim())
    return None


def pin_vocab_parallel(plan: Plan, gm: fx.GraphModule, axis: str, k: int) -> tuple[str, dict]:
    """Pin the vocabulary head's weight S(0) on `axis` (size k) for `plan.loss_parallel`.
    Returns (the note to add to the plan: what was pinned, or why the logits will be gathered;
    the node pins for the sharding search on `axis`: {the head's node key: Shard(last dim)},
    so that the search computes the logits sharded instead of gathering the weight; {} when
    nothing is pinned)."""
    head = vocab_head(gm)
    if head is None:
        return ("loss_parallel: no graph output is a linear head's logits (vocabulary last); the outputs are "
                "gathered and any loss_fn sees them whole"), {}
    if head.vocab % k:
        return (f"loss_parallel: the vocabulary ({head.vocab}) does not divide by {axis}={k}; {head.weight} is not "
                "pinned and the logits are gathered (pad the vocabulary to a multiple of the tp degree)"), {}
    lay = plan.param_layouts.get(head.weight)
    if lay is not None and lay.get(axis) != Shard(0) and not isinstance(lay.get(axis), Replicate):
        return f"loss_parallel: {head.weight} keeps its pinned placement {lay.get(axis)} on {axis}", {}
    base = lay or Layout.replicated(tuple(plan.mesh))
    plan.param_layouts[head.weight] = base.replace(axis, Shard(0))
    return (f"loss_parallel: {head.weight} pinned S(0) on {axis} and its output S({head.ndim - 1}) (column-parallel "
            f"head); its logits stay sharded over the {head.vocab}-token vocabulary and autopar.cross_entropy runs "
            "on the shards"), {head.node: Shard(head.ndim - 1)}


def logits_input(gm: fx.GraphModule, ins: list[fx.Node], k: int) -> tuple[int, fx.Node] | None:
    """(index in `ins`, node) of the vocabulary head's logits among the output node's tensor
    inputs `ins`, when the vocabulary divides by `k` and the logits leave the graph once; else
    None (the outputs are gathered). The sharding search (`search.shard_loss`) and the cost
    model (`cost.tp_conversions`) both ask it."""
    head = vocab_head(gm)
    if head is None or head.vocab % k:
        return None
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    a = flat[head.output]
    return (ins.index(a), a) if a in ins and sum(f is a for f in flat) == 1 else None
