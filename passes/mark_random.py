"""mark_random: make dropout and batch norm follow the program's mode and RNG (runtime/rng.py).

A captured graph bakes the module's mode into its ops (`aten.dropout(x, p, True)`,
`aten.batch_norm(..., training=True, ...)`, `num_batches_tracked.add_(1)`), so `pm.eval()`
would change nothing. This pass rewrites, once, each of them into the function of
`autopar.runtime.rng` that reads the mode of the running program:

  aten.dropout(x, p, train)               -> rng.dropout(x, p, axes)              (p > 0; p = 0 is left)
  aten.feature_dropout(x, p, train)       -> rng.feature_dropout(x, p, axes)      (p > 0; p = 0 is left)
  aten.scaled_dot_product_attention(q, k, v, mask, p, causal, scale, gqa)   (p > 0)
                                          -> rng.attention(q, k, v, mask, p, causal, scale, gqa, axes)
  aten.batch_norm(x, w, b, rm, rv, t, m, eps, cudnn)  (rm or rv given)
                                          -> rng.batch_norm(x, w, b, rm, rv, m, eps, cudnn)
  aten.add_(<...num_batches_tracked>, k)  -> autopar.count_batch(buf, k)   (its result unused)
  autopar.sync_batch_norm(x, w, b, eps, axes)  (from passes/sync_batchnorm; with running stats)
                                          -> rng.sync_batch_norm(x, w, b, eps, axes, rm, rv)
  autopar.update_running_stats(rm, rv, mean, var, m)
                                          -> autopar.update_running_stats_in_training(...)

`axes` are the mesh axes (size > 1) on which the dropout's input (attention: the query) is
sharded (`Shard` in its layout from the shard pass): ranks that differ on them draw different
masks; ranks that differ only on axes where the input is replicated (tp on a replicated
activation) draw the same one. Data axes (the plan's dp axis, ep) and stages (pp) are left
out: the runtime tracker's state already differs between them.

Why a runtime flag read by these small functions and not a second, eval-only graph: the
rewrite then travels through every later step that copies nodes (zero, fuse, recompute
regions, pipeline stage cuts, expert dispatch) with nothing to keep in sync, all program kinds
switch by setting one flag, and the eval path runs PyTorch's own eval ops (exact parity).

Runs after `shard`, `expert` and `sync_batchnorm` (reads their layouts and rewrites the
latter's ops). Reads node.meta["autopar"] (layout); rebuilt nodes copy the meta of the node
they replace. Guarantees: in training mode the program computes what the captured ops
computed, except for which random numbers dropout draws; nothing else changes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime import rng
from autopar.runtime.placement import Shard

from . import ir
from .pass_manager import PassContext

_A = torch.ops.aten
_DROPOUTS = {_A.dropout.default: rng.dropout, _A.feature_dropout.default: rng.feature_dropout}


def mark_random(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    changed = 0
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        t = n.target
        new = None
        if t in _DROPOUTS and float(n.args[1]) > 0:  # p = 0 is the identity in either mode: left alone
            x, p = n.args[0], n.args[1]
            new = (_DROPOUTS[t], (x, float(p), ",".join(_sharded_axes(x, ctx))))
        elif t is _A.scaled_dot_product_attention.default and _sdpa_args(n)[4] > 0:
            q = n.args[0]
            new = (rng.attention, _sdpa_args(n) + (",".join(_sharded_axes(q, ctx)),))
        elif t is _A.batch_norm.default and (n.args[3] is not None or n.args[4] is not None):
            x, w, b, rm, rv, _training, momentum, eps, cudnn = n.args[:9]
            new = (rng.batch_norm, (x, w, b, rm, rv, momentum, eps, cudnn))
        elif t is _A.add_.Tensor and _is_batch_counter(n.args[0]) and not n.users:
            new = (torch.ops.autopar.count_batch.default, (n.args[0], int(n.args[1])))
        elif _is(t, "sync_batch_norm") and _running_stats_of(n) != (None, None):
            new = (rng.sync_batch_norm, tuple(n.args[:5]) + _running_stats_of(n))
        elif _is(t, "update_running_stats"):
            new = (torch.ops.autopar.update_running_stats_in_training.default, tuple(n.args))
        if new is None:
            continue
        with g.inserting_before(n):
            m = g.call_function(new[0], new[1])
        m.meta = dict(n.meta)
        if new[0] is torch.ops.autopar.count_batch.default:  # returns nothing
            ir.set_info(m, ir.NodeInfo(shape=None, dtype=None, module=ir.info(n).module, kind="op"))
            m.meta.pop("val", None)
        n.replace_all_uses_with(m)
        g.erase_node(n)
        changed += 1
    if changed:
        g.lint()
        gm.recompile()
    return gm


def _is(target, name: str) -> bool:
    return getattr(target, "namespace", None) == "autopar" and \
        getattr(getattr(target, "overloadpacket", None), "__name__", "") == name


def _sharded_axes(x, ctx: PassContext) -> list[str]:
    i = ir.get_info(x) if isinstance(x, fx.Node) else None
    if i is None or i.layout is None:
        return []
    data = set(rng.DATA_AXES) | {getattr(ctx.plan, "dp_axis", None) or "dp"}  # the tracker's state tells them apart
    return [a for a, p in i.layout.axes
            if isinstance(p, Shard) and ctx.mesh_sizes.get(a, 1) > 1 and a not in data]


def _sdpa_args(n: fx.Node) -> tuple:
    """(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) of an sdpa node."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    vals = [n.args[i] if i < len(n.args) else n.kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, defaults))]
    vals[4] = float(vals[4])
    return tuple(vals)


def _is_batch_counter(t) -> bool:
    return isinstance(t, fx.Node) and t.op == "get_attr" and str(t.target).endswith("num_batches_tracked")


def _running_stats_of(sync: fx.Node):
    """The running mean and variance the sync_batch_norm's statistics update (None, None if none)."""
    for g in sync.users:
        for u in g.users:
            if _is(u.target, "update_running_stats"):
                return u.args[0], u.args[1]
    return None, None


__all__ = ["mark_random"]
