"""The vocab-parallel loss (`Plan.loss_parallel`) in the sharding search: which output it keeps
sharded, what it pins, and what its all-reduces cost.

`vocab_output(gm, ins, k)`: the vocabulary head's logits among the output node's tensor inputs
(`passes.vocab_head.vocab_head`), when the vocabulary divides by the tp degree k: the output the
runtime leaves Shard(last dim) (passes/shard.py). `head_pins(gm, k, param_pins, node_pins)`:
the pins `autopar.parallelize(..., loss_parallel=True)` puts on the head before the search
(`passes.vocab_head.pin_vocab_parallel`: its weight S(0), its output S(last)), added to the
given ones unless they place the weight otherwise. `loss_seconds(node, nbytes, link)`: the
loss's two blocking tp all-reduces (`cost.loss_memory.loss_payloads`), timed as `cost.estimate`
times them (algorithm "auto").

Reads node.meta["val"] (shapes, dtypes); writes nothing. Deterministic.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import fx

from autopar.cost.loss_memory import loss_payloads
from autopar.cost.placements import Placement, Replicate, Shard
from autopar.passes.vocab_head import logits_input, vocab_head

__all__ = ["head_pins", "loss_seconds", "vocab_output"]


def vocab_output(gm: fx.GraphModule, ins: list[fx.Node], k: int) -> tuple[int, fx.Node] | None:
    """(index in `ins`, node) of the vocabulary head's logits (`passes.vocab_head.logits_input`)."""
    return logits_input(gm, ins, k)


def head_pins(gm: fx.GraphModule, k: int, param_pins: Mapping[str, Placement] | None,
              node_pins: Mapping[str, Placement] | None) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """`param_pins` and `node_pins` with the vocabulary head pinned column-parallel (weight S(0),
    output S(last)) as `parallelize(..., loss_parallel=True)` pins it; unchanged when there is no
    head, the vocabulary does not divide by k, or the weight is pinned to another sharding."""
    pp, npins = dict(param_pins or {}), dict(node_pins or {})
    head = vocab_head(gm)
    if head is None or head.vocab % k:
        return pp, npins
    mine = pp.get(head.weight)
    if mine is not None and mine != Shard(0) and not isinstance(mine, Replicate):
        return pp, npins
    pp[head.weight] = Shard(0)
    npins.setdefault(head.node, Shard(head.ndim - 1))
    return pp, npins


def loss_seconds(node: fx.Node, nbytes: float, link: Any) -> float:
    """Seconds of the vocab-parallel loss's two all-reduces on `link` (a `cost.comm` axis link)
    for the logits `node` of `nbytes` bytes (at the search's sizes)."""
    val = node.meta["val"]
    tokens = nbytes / val.dtype.itemsize / int(val.shape[-1])
    return sum(link.time(op, nb, "auto") for op, _axis, nb in loss_payloads(tokens, val.dtype))
