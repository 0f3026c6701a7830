"""The unsharded description of a captured model's tensors, as plain data: the layouts the
plan gives them, their global shapes, and the groups of names that share one tensor (tied
weights). Checkpoints, imports and materialization all describe a rank's pieces from it.

`shape_only_copy(gm)` copies a graph with meta tensors in place of its own; `make_shape_only(gm)`
does the same to `gm` itself (no copy: for a graph nothing else runs, the captured global graph
once the rank's program is built).

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


def shape_only_copy(gm):
    """A copy of `gm` whose parameters and buffers are meta tensors of the same shapes, dtypes
    and tying (two names of one tensor stay one tensor), for the parts of a ParallelModel that
    only describe the model (checkpoint layouts, save_pretrained's names, dumps, batch checks).
    Holding the user's full tensors there would keep the whole model alive in every rank's
    memory after the program took its shards. Returns None when `gm` cannot be deep-copied."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415

    memo: dict[int, Any] = {}
    for _n, t in gm.named_parameters(remove_duplicate=False):
        if id(t) not in memo:
            memo[id(t)] = torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    for _n, t in gm.named_buffers(remove_duplicate=False):
        if id(t) not in memo:
            memo[id(t)] = torch.empty_like(t, device="meta")
    for v in gm.meta.values():  # pytree specs and capture records: shared, not copied
        memo[id(v)] = v
    try:
        return copy.deepcopy(gm, memo)
    except Exception:  # noqa: BLE001 - an attribute that does not copy: the caller keeps the original
        return None


def make_shape_only(gm) -> bool:
    """Swap, in place, every parameter and buffer of `gm`'s modules for a meta tensor of the same
    shape, dtype and requires_grad (tied names stay one tensor), as `shape_only_copy` makes them,
    without copying the graph and its modules. Only the modules' references change: the tensors
    themselves, shared with the user's model and the rank's program, are untouched. For a graph
    that only describes the model from now on (nothing runs it with real values). Returns False,
    changing nothing, when the graph calls submodules (`call_module`: they may be the user's own
    modules, which must keep their tensors; copy with `shape_only_copy` instead)."""
    import torch  # noqa: PLC0415

    if any(n.op == "call_module" for n in gm.graph.nodes):
        return False

    made: dict[int, Any] = {}

    def meta_of(t, param: bool):
        if id(t) not in made:
            e = torch.empty_like(t, device="meta")
            made[id(t)] = torch.nn.Parameter(e, requires_grad=t.requires_grad) if param else e
        return made[id(t)]

    for mod in gm.modules():
        for store, param in ((mod._parameters, True), (mod._buffers, False)):
            for n, t in list(store.items()):
                if t is not None and not t.is_meta:
                    store[n] = meta_of(t, param)
    return True
