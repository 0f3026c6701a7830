"""shard: carry out the plan's sharding strategies on this rank's graph (tensor / sequence
parallelism on every mesh axis in `plan.strategies`).

For each node, in graph order, the strategy named in the plan (`plan.strategies[axis][key]`,
keys from `ir.node_keys`; a node missing from the plan is replicated) is looked up among the
strategies its rule allows here — a plan that does not fit the graph is an error naming the
node and the valid choices. Then:

* every input whose placement differs from what the strategy needs gets a conversion, inserted
  once per (input, target) before its first consumer and shared by the later ones:
      S(d) -> R    all_gather (backward reduce-scatter) when the consumer's gradient is
                   partial, else all_gather_chunk_grad (backward: this rank's chunk)
      P -> R       all_reduce              P -> S(d)   reduce_scatter
      R -> S(d)    split (local)           S(d)->S(e)  all_to_all
      R -> P       to_partial (local)      S(d) -> P   all_gather_chunk_grad + to_partial
  and a replicated input of a strategy with a sharded or partial output gets
  grad_all_reduce (identity forward, all-reduce of its gradient backward: Megatron's "f");
* size arguments of views, expands and factories become local sizes;
* strategies with a local implementation are substituted (`vocab_embedding` ->
  runtime.tp_ops.vocab_parallel_embedding; `mean_partial`: the local mean scaled by 1/k);
* sharded parameters and buffers are replaced on the module by this rank's piece
  (`torch.chunk` along the sharded dim), so the optimizer and ZeRO see local shards.

Reads node.meta["autopar"] (shape, layout, local_shape). Writes node.meta["autopar"].layout and
.local_shape for every tensor node (the axis's placement merged in), and annotations on the
nodes it inserts (kind "collective"). Guarantees: every graph output is replicated on the axis,
except under `plan.loss_parallel` the one output sharded along its last dim (the logits of a
column-parallel head), left vocab-sharded and recorded in gm.meta["autopar_vocab_shard"]
({"output", "axis", "dim", "size"}; also on the output node's meta: runtime/vocab_loss.py); no
collective is inserted where placements already agree.
Option `ctx.options["inputs_require_grad"]`: graph inputs get complete gradients too (they
are data, so by default their gradients are left partial and not communicated).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.runtime import collectives as _collectives  # noqa: F401  (registers the ops)
from autopar.runtime import tp_ops
from autopar.runtime.placement import Layout, Partial, Placement, R, Replicate, Shard

from . import ir
from .pass_manager import PassContext
from .rules.sharding import (PS, Strategy, is_tensor, partial_grad, requires_grad_nodes, strategies_for,
                             value_shape)

_SIZE_ARG = {"aten.view.default": 1, "aten.reshape.default": 1, "aten._unsafe_view.default": 1,
             "aten.expand.default": 1, "aten.new_zeros.default": 1, "aten.new_ones.default": 1,
             "aten.new_empty.default": 1, "aten.new_full.default": 1, "aten.zeros.default": 0,
             "aten.ones.default": 0, "aten.empty.memory_format": 0, "aten.full.default": 0,
             "aten.broadcast_to.default": 1}


def _op(name: str):
    return getattr(torch.ops.autopar, name).default


class ShardPlanError(ValueError):
    pass


def shard(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan_strats = getattr(ctx.plan, "strategies", None) or {}
    for axis, table in plan_strats.items():
        k = ctx.mesh_sizes.get(axis, 1)
        if k > 1:
            _shard_axis(gm, ctx, axis, k, table)
    return gm


def _shard_axis(gm: fx.GraphModule, ctx: PassContext, axis: str, k: int, table: dict[str, str]) -> None:
    from .rules.sharding import op_name  # noqa: PLC0415

    keys = ir.node_keys(gm)
    rg = requires_grad_nodes(gm, inputs_require_grad=bool(ctx.options.get("inputs_require_grad")))
    idx = ctx.coords.get(axis, 0)
    place: dict[fx.Node, Placement | None] = {}
    conv: dict[tuple, fx.Node] = {}
    localized: dict[int, tuple[Placement, object]] = {}
    axes = tuple(ctx.mesh_sizes)
    g = gm.graph

    def set_layout(n: fx.Node, p: Placement | None) -> None:
        i = ir.get_info(n)
        if i is None or i.shape is None or p is None:
            return
        lay = i.layout or Layout.replicated(axes)
        local = list(i.local_shape or i.shape)
        if isinstance(p, Shard) and isinstance(local[p.dim], int):
            local[p.dim] = local[p.dim] // k
        ir.update(n, layout=lay.replace(axis, p), local_shape=tuple(local))

    def new_node(target, args, like: fx.Node, p: Placement, at: fx.Node) -> fx.Node:
        """A conversion of `like`'s value, inserted for consumer `at` (whose module it joins)."""
        m = g.call_function(target, args)
        if "val" in like.meta:  # the global value's fake tensor, as on every node (local shapes: NodeInfo)
            m.meta["val"] = like.meta["val"]
        if "nn_module_stack" in at.meta:
            m.meta["nn_module_stack"] = at.meta["nn_module_stack"]
        base = ir.info(like)
        ir.set_info(m, replace(base, kind="collective" if getattr(target, "namespace", "") == "autopar" else "op",
                               layout=base.layout, local_shape=base.local_shape, param=None,
                               module=ir.info(at).module if ir.get_info(at) else base.module))
        if base.layout is not None:
            # recompute the local shape from the global one under the new placement
            lay = base.layout.replace(axis, p)
            local = list(base.shape)
            for ax, pl in lay.axes:
                if isinstance(pl, Shard) and isinstance(local[pl.dim], int):
                    local[pl.dim] //= ctx.mesh_sizes.get(ax, 1)
            ir.update(m, layout=lay, local_shape=tuple(local))
        return m

    def convert(a: fx.Node, src, dst, pg: bool, before: fx.Node) -> fx.Node:
        key = (a, str(dst), pg)
        if key in conv:
            return conv[key]
        full = value_shape(a)
        x = a
        with g.inserting_before(before):
            if src == dst:
                if pg and isinstance(dst, Replicate):
                    x = new_node(_op('grad_all_reduce'), (x, axis), a, R, before)
            elif isinstance(dst, Replicate):
                if isinstance(src, Shard):
                    op = _op('all_gather') if pg else _op('all_gather_chunk_grad')
                    x = new_node(op, (x, axis, src.dim, -1), a, R, before)
                elif isinstance(src, Partial):
                    x = new_node(_op('all_reduce'), (x, axis, src.op), a, R, before)
                    if pg:
                        x = new_node(_op('grad_all_reduce'), (x, axis), a, R, before)
            elif isinstance(dst, Shard):
                if isinstance(src, Replicate):
                    x = new_node(_op('split'), (x, axis, dst.dim), a, dst, before)
                elif isinstance(src, Shard):
                    x = new_node(_op('all_to_all'), (x, axis, src.dim, dst.dim, -1), a, dst, before)
                elif isinstance(src, Partial):
                    x = new_node(_op('reduce_scatter'), (x, axis, dst.dim, src.op), a, dst, before)
            elif isinstance(dst, Partial):
                if isinstance(src, Shard):
                    x = new_node(_op('all_gather_chunk_grad'), (x, axis, src.dim, -1), a, R, before)
                x = new_node(_op('to_partial'), (x, axis), a, dst, before)
        if x is a and src != dst:
            raise ShardPlanError(f"no conversion from {src} to {dst} on axis {axis!r} for {a.name}")
        del full
        conv[key] = x
        return x

    loss_parallel = bool(getattr(ctx.plan, "loss_parallel", False))
    for n in list(g.nodes):
        if n.op == "placeholder":
            if is_tensor(n):
                place[n] = R
                set_layout(n, R)
            continue
        if n.op not in ("get_attr", "call_function", "output") or n.op == "get_attr" and not is_tensor(n):
            continue
        ins = [a for a in n.all_input_nodes if is_tensor(a)]
        if n.op == "call_function" and not is_tensor(n) and not ins:
            continue
        s = _resolve(n, keys[n], table.get(keys[n]), axis, k, ins)
        if n.op == "get_attr":
            if isinstance(s.out, Shard):
                _localize(gm, str(n.target), s.out, k, idx, localized)
            place[n] = s.out
            set_layout(n, s.out)
            continue
        keep_sharded = _vocab_output(gm, n, axis, place) if n.op == "output" and loss_parallel else None
        for a, p in zip(ins, s.ins):
            if p is None or a is keep_sharded:
                continue  # the logits stay vocab-sharded: the vocab-parallel loss reads the shard
            if a not in place:
                raise ShardPlanError(f"{n.name} reads {a.name}, which has no placement on {axis!r}")
            pg = partial_grad(s, p, a, rg)
            new = convert(a, place[a], p, pg, n)
            if new is not a:
                n.replace_input_with(a, new)
        if n.op == "output":
            continue
        name = op_name(n.target)
        if isinstance(s.out, Shard) and name in _SIZE_ARG:
            _localize_sizes(n, _SIZE_ARG[name], s.out.dim, k)
        if name == "aten.unflatten.int" and isinstance(s.out, Shard):
            dim = n.args[1] % len(value_shape(n))
            sizes = list(n.args[2])
            j = s.out.dim - dim
            if 0 <= j < len(sizes) and isinstance(sizes[j], int) and sizes[j] > 0:
                sizes[j] //= k
                n.args = (n.args[0], n.args[1], sizes)
        out_node = n
        if s.impl == "vocab_embedding":
            w, ids = n.args[0], n.args[1]
            pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
            vocab = ir.info(_origin(w)).shape[0]
            with g.inserting_before(n):
                m = g.call_function(tp_ops.vocab_parallel_embedding, (w, ids, axis, vocab, pad))
            ir.copy_meta(n, m)
            n.replace_all_uses_with(m)
            g.erase_node(n)
            out_node = m
        elif s.impl == "mean_partial":
            with g.inserting_after(n):
                m = g.call_function(torch.ops.aten.mul.Tensor, (n, 1.0 / k))
            ir.copy_meta(n, m)
            n.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
            out_node = m
            place[n] = PS
        place[out_node] = s.out
        set_layout(out_node, s.out)
        if out_node is not n:
            place[n] = s.out
            set_layout(n, s.out)
    g.lint()


def _vocab_output(gm: fx.GraphModule, out: fx.Node, axis: str, place: dict) -> fx.Node | None:
    """The graph output that stays sharded under `Plan.loss_parallel`: the one floating output
    sharded on `axis` along its last dim (the logits, vocab-parallel after a column-parallel
    head). Records it as gm.meta["autopar_vocab_shard"] and on the output node's meta under
    the same key (runtime/vocab_loss.py reads either); None,
    and nothing recorded, when no output or several are so sharded (all are then gathered)."""
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    found = []
    for i, a in enumerate(flat):
        if not isinstance(a, fx.Node) or not is_tensor(a):
            continue
        p, shape = place.get(a), value_shape(a)
        val = a.meta.get("val")
        if isinstance(p, Shard) and shape and p.dim == len(shape) - 1 and isinstance(shape[-1], int) \
                and isinstance(val, torch.Tensor) and val.is_floating_point():
            found.append((i, a, p.dim, shape[-1]))
    if len(found) != 1:
        return None
    i, a, dim, size = found[0]
    entry = {"output": i, "axis": axis, "dim": dim, "size": size}
    gm.meta["autopar_vocab_shard"] = out.meta["autopar_vocab_shard"] = entry  # the node's: a pipeline cut keeps it
    return a


def _origin(n: fx.Node) -> fx.Node:
    """Follow conversion nodes back to the value they convert (for global sizes)."""
    while n.op == "call_function" and getattr(n.target, "namespace", "") == "autopar" and n.args:
        n = n.args[0]
    return n


def _resolve(n: fx.Node, key: str, text: str | None, axis: str, k: int, ins: list[fx.Node]) -> Strategy:
    if n.op == "output":
        return Strategy(tuple(R for _ in ins), None, 0.0)
    if n.op == "get_attr":
        shape = value_shape(n)
        valid = [Strategy((), R, 0.0)] + [Strategy((), Shard(d), 0.0) for d in range(len(shape))
                                           if isinstance(shape[d], int) and shape[d] % k == 0 and shape[d] >= k]
    else:
        valid = strategies_for(n, axis, k).strategies  # type: ignore[attr-defined]
    if text is None:
        rep = [s for s in valid if s.out in (R, None) and all(p in (R, None) for p in s.ins)]
        if rep:
            return rep[0]
        raise ShardPlanError(f"node {key} ({n.format_node()}) has no strategy in the plan on {axis!r} and no "
                             f"replicated one; valid: {[str(s) for s in valid]}")
    for s in valid:
        if str(s) == text:
            return s
    raise ShardPlanError(f"the plan gives {key} the strategy {text!r} on {axis!r}, which is not valid for this "
                         f"graph; valid: {[str(s) for s in valid]}")


def _localize_sizes(n: fx.Node, pos: int, dim: int, k: int) -> None:
    args = list(n.args)
    sizes = list(args[pos])
    if dim < len(sizes) and isinstance(sizes[dim], int) and sizes[dim] > 0:
        sizes[dim] //= k
    args[pos] = sizes
    n.args = tuple(args)


def _localize(gm: fx.GraphModule, name: str, p: Shard, k: int, idx: int, done: dict) -> None:
    """Replace parameter/buffer `name` on its module by this rank's chunk along p.dim."""
    parent, _, attr = name.rpartition(".")
    mod = gm.get_submodule(parent) if parent else gm
    obj = getattr(mod, attr)
    if id(obj) in done:
        prev_p, new = done[id(obj)]
        if prev_p != p:
            raise ShardPlanError(f"{name} is tied to another name with placement {prev_p}, here {p}; tied "
                                 "tensors need one placement")
        if isinstance(obj, nn.Parameter):
            setattr(mod, attr, new)
        else:
            mod.register_buffer(attr, new)
        return
    local = obj.detach().chunk(k, p.dim)[idx].clone()
    new = nn.Parameter(local, requires_grad=obj.requires_grad) if isinstance(obj, nn.Parameter) else local
    # every name of this tensor (tied weights: the embedding and the LM head) gets the shard
    for mname, m in gm.named_modules(remove_duplicate=False):
        tensors = list(m.named_parameters(recurse=False, remove_duplicate=False)) + \
            list(m.named_buffers(recurse=False, remove_duplicate=False))
        for a, t in tensors:
            if t is obj:
                if isinstance(obj, nn.Parameter):
                    setattr(m, a, new)
                else:
                    m.register_buffer(a, new)
    done[id(obj)] = done[id(new)] = (p, new)  # a later name of the tie now finds `new`


__all__ = ["shard", "ShardPlanError"]
