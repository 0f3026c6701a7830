"""zero: the graph side of ZeRO-3 — read each parameter just before its first use.

A captured graph (`torch.export(...).module()`) reads every parameter with a `get_attr`
node at its top, so every parameter is live for the whole forward. The ZeRO-3 engine
(runtime/zero_stage3.py) gathers a parameter's unit when the attribute is read and frees
it when another unit is read, so this pass moves each `get_attr` node to just before its
first user; fx's code generator already drops a value after its last use. With that, a
forward holds about one gathered unit at a time (plus the one being prefetched).

Runs when the plan's ZeRO stage is 3 (or when called without a context).
Reads/writes: no `node.meta` keys; nodes keep their meta (they are moved, not rebuilt).
Guarantees: the graph computes the same values (a get_attr has no inputs and no side
effects, so any position before its first user is valid); no node is added or removed.
"""
from __future__ import annotations

import torch.fx as fx


def zero(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    if ctx is not None and getattr(ctx.plan, "zero_stage", 3) != 3:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if node.next is not first:
            first.prepend(node)
            moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm
