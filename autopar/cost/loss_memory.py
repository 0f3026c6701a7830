"""What the loss on a graph's outputs costs: gathered logits, or a vocab-parallel loss on shards.

The runtime hands `loss_fn` its outputs gathered over tp (passes/shard.py), except under
`Plan.loss_parallel`, where the one output sharded along its last dim on tp (a column-parallel
head's logits) stays sharded and `autopar.cross_entropy` runs on the shards
(runtime/vocab_loss.py). This file prices both, for `cost.estimate` (and anything else that
walks a plan's memory through `node_time.layout_divisors`):

* `gathered_outputs(gc, plan, mem_div)`: the storage divisors with every gathered output whole
  (divisor removed): a sharded head's logits are all-gathered before the loss, so each tp rank
  holds all of them, and its cross-entropy (`memory.CROSS_ENTROPY`) works at that size. Under
  `loss_parallel` the vocab-sharded output keeps its divisor (`vocab_sharded_outputs`).
* `loss_model(gc, plan)`: `VOCAB_PARALLEL` when the plan keeps an output vocab-sharded, else
  `memory.CROSS_ENTROPY`. The vocab-parallel loss keeps one shard-sized buffer (the softmax of
  the shard, made in its forward) until its backward, which writes the logits' gradient into
  that same buffer: at the loss's backward the outputs (held by `step`) and that one buffer,
  2x the shard, against CROSS_ENTROPY's 4x the whole logits (log-softmax, its gradient, the
  outputs' gradient, the outputs).
* `loss_collectives(gc, plan, ev)`: its two blocking all-reduces on tp, per micro-batch, as
  `(op, axis, payload bytes)`: the max (one value per token, the logits' dtype) and the sums
  (sum of exp and the target's logit per token, at least fp32; label smoothing adds a third
  row, which the plan does not know: priced without).

Reads no node.meta (only `cost.analyze`'s GraphCost and the Plan). Deterministic.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from autopar.passes.plan import Plan

from .graph import GraphCost
from .memory import CROSS_ENTROPY, LossModel
from .placements import Shard
from .tensors import TensorMeta

__all__ = ["VOCAB_PARALLEL", "gathered_outputs", "loss_collectives", "loss_model", "loss_payloads",
           "vocab_sharded_outputs"]

# runtime/vocab_loss.py: the shard's softmax from the loss's forward to its backward (saved),
# then the logits' gradient written into it (the seed's buffer is that one: -1 grad_temp)
VOCAB_PARALLEL = LossModel(saved=1.0, grad_temp=-1.0, outputs_held=True)
LOSS_AXIS = "tp"


def _placement(gc: GraphCost, plan: Plan, t: TensorMeta):
    st = gc.storages.get(t.key)
    if st is None or st.producer < 0:
        return None, None
    n = gc.nodes[st.producer]
    lay = plan.node_layouts.get(n.key)
    return (lay.get(LOSS_AXIS) if lay is not None and LOSS_AXIS in dict(lay.axes) else None), n


def vocab_sharded_outputs(gc: GraphCost, plan: Plan | None) -> list[TensorMeta]:
    """The outputs the runtime leaves vocab-sharded: under `plan.loss_parallel` with tp > 1, the
    one floating output whose producer is Shard(last dim) on tp (none when several are)."""
    if plan is None or not plan.loss_parallel or plan.mesh.get(LOSS_AXIS, 1) < 2:
        return []
    found = []
    for t in gc.outputs:
        if t.is_state or not t.dtype.is_floating_point:
            continue
        p, n = _placement(gc, plan, t)
        if isinstance(p, Shard) and n.outputs and p.dim == len(n.outputs[0].shape) - 1 \
                and len(t.shape) == len(n.outputs[0].shape):
            found.append(t)
    return found if len(found) == 1 else []


def gathered_outputs(gc: GraphCost, plan: Plan | None, mem_div: Mapping[Any, int]) -> dict[Any, int]:
    """`mem_div` without the divisors of the outputs the runtime gathers (all but the
    vocab-sharded one under `loss_parallel`): each rank holds them whole."""
    if not mem_div:
        return dict(mem_div)
    keep = {t.key for t in vocab_sharded_outputs(gc, plan)}
    out = dict(mem_div)
    for t in gc.outputs:
        if not t.is_state and t.key not in keep:
            out.pop(t.key, None)
    return out


def loss_model(gc: GraphCost, plan: Plan | None) -> LossModel:
    """What the loss adds around the outputs under `plan` (module docstring)."""
    return VOCAB_PARALLEL if vocab_sharded_outputs(gc, plan) else CROSS_ENTROPY


def loss_collectives(gc: GraphCost, plan: Plan | None, ev: Callable[[Any], float]) -> list[tuple[str, str, float]]:
    """The vocab-parallel loss's all-reduces on tp for one micro-batch: (op, axis, payload bytes)."""
    outs = vocab_sharded_outputs(gc, plan)
    if not outs:
        return []
    t = outs[0]
    return loss_payloads(ev(t.numel) / max(ev(t.shape[-1]), 1), t.dtype)


def loss_payloads(tokens: float, dtype: torch.dtype) -> list[tuple[str, str, float]]:
    """The vocab-parallel loss's two tp all-reduces for `tokens` rows of logits of `dtype`:
    the max (one value per token, the logits' dtype), the sums (two per token, at least fp32)."""
    wide = torch.promote_types(dtype, torch.float32).itemsize
    return [("all_reduce", LOSS_AXIS, float(tokens * dtype.itemsize)),
            ("all_reduce", LOSS_AXIS, float(2 * tokens * wide))]
