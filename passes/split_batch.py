"""split_batch: lay the graph out for data parallelism over the plan's dp axis.

Inputs are sharded along dim 0 (`S(0)`) over the dp axis, parameters and buffers are
replicated, and every op that depends on an input is batch-sharded too; everything else
(parameter-only computation) is replicated. The graph's code does not change: batch dims
are symbolic from capture (`Dim.AUTO`), so the same code runs on the local batch. When the
capture specialised the batch dim, the pass checks that the local batch size is what the
graph was captured with and says how to fix it otherwise.

Reads: node.meta["autopar"] (shape). Writes: node.meta["autopar"].layout / .local_shape.
Guarantees: the graph is unchanged; every tensor node gets a layout over all mesh axes.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.runtime.placement import Layout, Shard

from . import ir
from .pass_manager import PassContext


def split_batch(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    axes = tuple(ctx.mesh_sizes)
    dp_axis = ctx.plan.dp_axis if ctx.plan.dp_axis in ctx.mesh_sizes else None
    dp = ctx.mesh_sizes.get(dp_axis, 1) if dp_axis else 1
    batch = None
    for n in gm.graph.nodes:
        if n.op == "placeholder" and ir.info(n).shape:
            batch = ir.info(n).shape[0]
            break
    from_inputs = _reached_from_inputs(gm.graph)
    for n in gm.graph.nodes:
        i = ir.info(n)
        if i.shape is None or n.op == "output":
            continue
        if n.op == "placeholder" and i.shape and i.shape[0] != batch:
            raise ValueError(f"input {n.name} has {i.shape[0]} rows but the first input has {batch}; "
                             "every input of a data-parallel model must have the batch in dim 0")
        layout = Layout.replicated(axes)
        local = i.shape
        # a node whose dim 0 is the batch (the same symbol, or the same size when static) is
        # batch-sharded; others that depend on the batch (flattened tokens, reductions) keep
        # no layout here: their placement is the sharding pass's to derive
        if dp_axis and n.op in ("placeholder", "call_function") and i.shape and i.shape[0] == batch:
            layout = layout.replace(dp_axis, Shard(0))
            if isinstance(batch, int):
                if batch % dp:
                    raise ValueError(f"the batch dim of {n.name} has size {batch}, which does not divide by "
                                     f"{dp_axis}={dp}; use a global batch that is a multiple of {dp}")
                local = (batch // dp, *i.shape[1:])
        elif n.op == "call_function" and n in from_inputs:  # not parameter-only
            continue
        ir.update(n, layout=layout, local_shape=tuple(local))
    return gm


def _reached_from_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that some input of the graph reaches (the others compute on parameters only).
    One pass in graph order (fx keeps it topological), where a walk up from each node was
    quadratic in the graph's depth (the same set on gpt-tiny, moe-tiny and hf-llama tiny)."""
    reached: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return reached


__all__ = ["split_batch"]
