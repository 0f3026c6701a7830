"""fuse: replace the subgraphs that `plan.fusions` names by calls to the fused kernels.

Runs last, on this rank's local graph. `ctx.plan.fusions` lists entries "rule" (every match of
that rule) or "rule@module-pattern" (matches whose module path fits the fnmatch pattern,
e.g. "swiglu@model.layers.*.mlp"); rules and their patterns are in
`passes/rules/fusion_table.py`. An empty list changes nothing. With `plan.split_points` set
no match spans two pipeline stages (`plan_matches`); a split chosen later, at the cut, is not
known here, and the build records which split points the fusions saw
(`plan.extra["fusion_split_points"]`, build/program.py). Each match becomes one
`call_function` node whose target is the kernel's public function in
`autopar.runtime.kernels` (Triton forward and backward on CUDA, the torch reference on CPU,
see runtime/kernels/_dispatch.py), plus `getitem` nodes for kernels with two outputs and the
small reshapes / bias-free matmuls a rule asks for.

Reads node.meta["val"] and node.meta["autopar"]. Writes node.meta on every node it creates:
all entries copied from the node it stands for (module stack, layout), then "val" (the value
of the output it replaces, whose shape and dtype the matcher checked the kernel gives; for an
emitted reshape or matmul, its op run on fake values) and "autopar" (shape and dtype from that
value; layout and local shape kept where the shape is unchanged, dropped where a rule reshapes
a value). Guarantees: the graph computes the same values up to floating-point rounding (each
rule's kernel is the same function); nodes are left in an order where each follows its inputs
and otherwise keeps its old place; `gm.meta["autopar_fusions"]` lists what was fused
({"rule", "module", "node": the fused call's name, "anchor": the name of the match's anchor}).
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autopar.runtime.kernels import KERNELS

from . import ir
from .pass_manager import PassContext
from .rules.fusion_match import Emit, Match, value_of
from .rules.fusion_table import find_matches, parse_entry, selection
from .split_pipeline import stage_of_nodes


def fuse(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    matches = plan_matches(gm, ctx.plan) if ctx is not None else []
    if matches:
        apply_matches(gm, matches)
    return gm


def plan_matches(gm: fx.GraphModule, plan: Any, split_points: list[str] | None = None) -> list[Match]:
    """The matches `plan.fusions` selects in `gm`, none spanning two pipeline stages of
    `split_points` (default `plan.split_points`): fused, an add + norm at a cut would move the
    residual sum into the next stage, which would then receive both addends instead of their
    sum (twice the bytes sent and held). The cost model fuses its copies with the same
    matches, at the split points the build fused with (cost/fused_graph.py)."""
    entries = list(getattr(plan, "fusions", None) or [])
    if not entries:
        return []
    allow = selection(entries)
    split = list(getattr(plan, "split_points", None) or []) if split_points is None else list(split_points)
    stage: dict = {}
    if split:
        try:
            stage = stage_of_nodes(gm, split)
        except ValueError:  # not this graph's units: the cut itself reports it
            stage = {}
    if stage:
        picked = allow
        allow = lambda m: picked(m) and len({stage[n] for n in m.nodes if n in stage}) <= 1  # noqa: E731
    return find_matches(gm, sorted({parse_entry(e)[0] for e in entries}), allow=allow)


def apply_matches(gm: fx.GraphModule, matches: list[Match], sources: dict[str, str] | None = None) -> None:
    """Rewrite `gm` in place: each match (disjoint, as `find_matches` returns them) becomes a
    fused call. Later matches may read outputs of earlier ones; those are remapped.
    `sources`, when given, receives for every node created the name of the node it stands for
    (the fused call and a cast of its output: the match's anchor; an item of a two-output call:
    the output it replaces; an emitted reshape or matmul: the node it is modelled on), which is
    where the cost model takes its layout from (cost/fused_graph.py)."""
    graph = gm.graph
    src = sources if sources is not None else {}
    remap: dict[fx.Node, fx.Node] = {}
    done = []
    for m in matches:
        vals: dict = {}
        made: dict[int, fx.Node] = {}
        with graph.inserting_before(m.anchor):
            args = _materialise(graph, m.args, remap, made, vals, src)
            kwargs = _materialise(graph, m.kwargs, remap, made, vals, src)
            fn = KERNELS[m.kernel].fused
            call = graph.call_function(fn, tuple(args), dict(kwargs))
            # find_matches checked that the kernel gives each output's shape and dtype (or
            # a loss in fp32, cast here to the graph's dtype)
            if len(m.outputs) == 1 and not any(m.casts):
                _annotate(call, m.anchor, m.outputs[0].meta["val"])
                news = [call]
                src[call.name] = m.anchor.name
            elif len(m.outputs) == 1:
                val = m.outputs[0].meta["val"]
                _annotate(call, m.anchor, val.to(torch.float32))
                cast = graph.call_function(torch.ops.aten.to.dtype, (call, m.casts[0]))
                _annotate(cast, m.anchor, val)
                news = [cast]
                src[call.name] = src[cast.name] = m.anchor.name
            else:
                _annotate(call, m.anchor, tuple(o.meta["val"] for o in m.outputs), tuple_out=True)
                news = []
                src[call.name] = m.anchor.name
                for i, old in enumerate(m.outputs):
                    item = graph.call_function(operator.getitem, (call, i))
                    # module of the fused call (a residual sum moves into the norm's module,
                    # so that module-based regions and stages keep the call and its items
                    # together); layout and local shape of the value it carries
                    _annotate(item, m.anchor, old.meta["val"], carries=old)
                    news.append(item)
                    src[item.name] = old.name
        done.append({"rule": m.rule, "module": m.module, "node": call.name, "anchor": m.anchor.name})
        for old, new in zip(m.outputs, news):
            old.replace_all_uses_with(new)
            remap[old] = new
        for n in reversed(m.nodes):  # graph order: users before what they use
            if n.users:
                raise AssertionError(f"fuse: {m.describe()} left {n.format_node()} in use by "
                                     f"{[u.format_node() for u in n.users]}")
            graph.erase_node(n)
    _stable_topological_order(graph)
    graph.lint()
    gm.recompile()
    gm.meta.setdefault("autopar_fusions", []).extend(done)


def _materialise(graph: fx.Graph, a: Any, remap: dict, made: dict[int, fx.Node], vals: dict,
                 src: dict[str, str]) -> Any:
    """Match arguments -> graph arguments: nodes through `remap`, Emits created once each
    (`src`: each one's name -> the name of the node it is modelled on)."""
    if isinstance(a, fx.Node):
        return remap.get(a, a)
    if isinstance(a, Emit):
        if id(a) not in made:
            node = graph.call_function(a.target, tuple(_materialise(graph, a.args, remap, made, vals, src)),
                                       dict(_materialise(graph, a.kwargs, remap, made, vals, src)))
            _annotate(node, a.like, value_of(a, vals))
            src[node.name] = a.like.name
            made[id(a)] = node
        return made[id(a)]
    if isinstance(a, (list, tuple)):
        return type(a)(_materialise(graph, b, remap, made, vals, src) for b in a)
    if isinstance(a, dict):
        return {k: _materialise(graph, v, remap, made, vals, src) for k, v in a.items()}
    return a


def _annotate(node: fx.Node, like: fx.Node, val: Any, tuple_out: bool = False,
              carries: fx.Node | None = None) -> None:
    """Meta of `like`, with the value (and the shape / dtype it implies) of the new node;
    `carries`: the node whose value this one stands for, if another (its layout is kept)."""
    ir.copy_meta(like, node)
    node.meta["val"] = val
    old = ir.get_info(like)
    if old is None:
        old = ir.NodeInfo(shape=None, dtype=None, module=ir.module_path(like))
    if carries is not None and ir.get_info(carries) is not None:
        old = replace(ir.get_info(carries), module=old.module)
    if tuple_out or not isinstance(val, torch.Tensor):
        ir.set_info(node, replace(old, shape=None, dtype=None, param=None, kind="op", layout=None,
                                  local_shape=None))
        return
    shape = tuple(d if isinstance(d, int) else str(d) for d in val.shape)
    dtype = str(val.dtype).replace("torch.", "")
    local = old.local_shape if shape == old.shape else None
    ir.set_info(node, replace(old, shape=shape, dtype=dtype, param=None, kind="op",
                              layout=old.layout if shape == old.shape else None, local_shape=local))


def _stable_topological_order(graph: fx.Graph) -> None:
    """Reorder nodes so each follows its inputs, otherwise keeping their current order.

    A fused call sits where the last node it replaced was; a user of one of its outputs
    that came earlier (e.g. a kept upcast of a residual sum) moves down to just after it.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(pos[n], n.name) for n in nodes if waiting[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    ordered: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        n = by_name[name]
        ordered.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (pos[u], u.name))
    if len(ordered) != len(nodes):
        stuck = [n.format_node() for n in nodes if waiting[n] > 0][:3]
        raise AssertionError(f"fuse left a cycle in the graph, e.g. {stuck}")
    if ordered == nodes:
        return
    anchor = nodes[0]
    for n in ordered:
        if n is anchor:
            continue
        anchor.append(n)
        anchor = n
    # the output node must stay last; it is (its inputs are all before it)
