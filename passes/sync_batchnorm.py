"""sync_batchnorm: batch norm in training mode over the global batch, not each rank's part.

Each `aten.batch_norm(x, w, b, running_mean, running_var, training=True, momentum, eps, ...)`
whose input is batch-sharded (`S(0)` on a mesh axis of size > 1: dp, and ep when the batch is
split over experts too) becomes `autopar::sync_batch_norm` over those axes, followed by a
getitem of its output and `autopar::update_running_stats` of the buffers: statistics (and the running averages) are the ones one process
computes on the whole batch, so the parallel program keeps one-process parity, as
`nn.SyncBatchNorm` gives DDP. With micro-batches the statistics are those of the global
micro-batch.

Runs after `shard` and `expert` (their node keys name the original ops). Skipped when
`plan.extra["sync_batchnorm"]` is False (per-rank statistics, DDP's default).

Reads node.meta["autopar"] (layout). Writes node.meta["autopar"] on the nodes it inserts
(kind "collective": recomputation never re-runs it, so running statistics move once).
Guarantees: nothing changes when no batch norm is batch-sharded; in eval mode
(training=False) batch norm uses the running statistics and is left alone.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.runtime import sync_bn  # noqa: F401 - registers autopar::sync_batch_norm
from autopar.runtime.placement import Shard

from . import ir
from .pass_manager import PassContext

_BN = torch.ops.aten.batch_norm.default


def sync_batchnorm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if (getattr(ctx.plan, "extra", None) or {}).get("sync_batchnorm", True) is False:
        return gm
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not _BN:
            continue
        x, w, b, rm, rv, training, momentum, eps = n.args[:8]
        axes = _batch_axes(x, ctx)
        if not training or not axes:
            continue
        g = gm.graph
        with g.inserting_before(n):
            s = g.call_function(torch.ops.autopar.sync_batch_norm.default, (x, w, b, float(eps), ",".join(axes)))
            y = g.call_function(operator.getitem, (s, 0))
            stats = [g.call_function(operator.getitem, (s, k)) for k in (1, 3)]
            channels = (ir.info(n).shape or (None, None))[1]
            for st in stats:
                ir.set_info(st, ir.NodeInfo(shape=(channels,), dtype="float32", module=ir.info(n).module, kind="op"))
            if rm is not None or rv is not None:
                upd = g.call_function(torch.ops.autopar.update_running_stats.default,
                                      (rm, rv, *stats, float(momentum if momentum is not None else 0.1)))
                ir.set_info(upd, ir.NodeInfo(shape=None, dtype=None, module=ir.info(n).module, kind="op"))
        base = ir.info(n)
        ir.set_info(s, ir.NodeInfo(shape=None, dtype=base.dtype, module=base.module, kind="collective"))
        ir.set_info(y, ir.NodeInfo(shape=base.shape, dtype=base.dtype, module=base.module, kind="op",
                                   layout=base.layout, local_shape=base.local_shape))
        y.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(y)
        g.erase_node(n)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _batch_axes(x, ctx: PassContext) -> list[str]:
    i = ir.get_info(x) if isinstance(x, fx.Node) else None
    if i is None or i.layout is None:
        return []
    return [a for a, p in i.layout.axes if isinstance(p, Shard) and p.dim == 0 and ctx.mesh_sizes.get(a, 1) > 1]


__all__ = ["sync_batchnorm"]
