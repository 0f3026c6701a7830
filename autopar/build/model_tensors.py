"""The unsharded description of a captured model's tensors, as plain data: the layouts the
plan gives them, their global shapes, and the groups of names that share one tensor (tied
weights). Checkpoints, imports and materialization all describe a rank's pieces from it.

It reads no `node.meta` keys (only the GraphModule's parameters and buffers).
"""
from __future__ import annotations

from typing import Any


def model_tensors(global_gm, plan) -> dict[str, Any]:
    """{"layouts": plan.param_layouts, "global_shapes": name -> shape, "aliases": [[names]]}."""
    shapes: dict[str, tuple[int, ...]] = {}
    by_id: dict[int, list[str]] = {}
    for n, t in list(global_gm.named_parameters(remove_duplicate=False)) + \
            list(global_gm.named_buffers(remove_duplicate=False)):
        shapes[n] = tuple(t.shape)
        by_id.setdefault(id(t), []).append(n)
    return {"layouts": dict(plan.param_layouts), "global_shapes": shapes,
            "aliases": [sorted(g) for g in by_id.values() if len(g) > 1]}
