"""The graph the rank runs once `plan.fusions` are applied, for the cost model.

`passes/fuse.py` runs last on every rank's graph: each match of `plan.fusions` becomes one call
of a fused kernel (Triton on a GPU), which moves fewer bytes, launches fewer kernels and saves
less for backward than the ops it replaces. `cost.estimate` prices what runs, so for a plan
with fusions it costs a copy of the graph with the same matches fused by the same pass
(`fused_copy`), each fused call priced by its own rules (`cost/fused.py`: one op, what the
kernel's autograd Function saves).

A copy shares the original's tensors and its nodes' meta (a shallow copy of each dict); the
original graph is not changed. The plan's node keys ("<module path>:<op>#<k>", counted per
module and op) shift where ops were fused away, so the plan is re-keyed for the copy:
`node_layouts` by node name (a node kept keeps its layout; a fused call takes its anchor's,
an item of a two-output call the output it replaces, an emitted reshape or matmul the node
it is modelled on: `fuse.apply_matches(sources=)`), and `extra["recompute_save"]` likewise
(a saved node fused away: the fused call that computes it) unless its keys are the copy's
already (a recompute choice made on the rank's fused graph, as `build/program.py` makes it),
and the node keys inside `extra["expert"]` and `extra["router_stats"]` likewise.

The matches are the fuse pass's (`passes.fuse.plan_matches`: none across a pipeline cut, at the
split points the build fused with, `plan.extra["fusion_split_points"]`, else the plan's), found
on the graph given, the global graph where `autopar.parallelize` costs its plan; the rank's
graph is fused after sharding, where a collective between two ops of a pattern can leave a
match out. Reads node.meta through the fusion table and the cost model;
writes meta only on the copy's new nodes. Deterministic.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.fx as fx

from autopar.passes.fuse import apply_matches, plan_matches
from autopar.passes.plan import Plan
from autopar.runtime._torch_compat import lazy_graph_module

from .fused import register_fused_cost_rules
from .graph import GraphCost, analyze
from .hardware import Hardware

__all__ = ["KEYED_EXTRAS", "fused_copy"]

# plan.extra entries that name nodes by key (made on the unfused global graph: build/plan_complete.py)
KEYED_EXTRAS = ("expert", "router_stats")


def fused_copy(gm: fx.GraphModule, plan: Plan, hardware: Hardware, *, kernels: Mapping[str, Any] | None = None,
               analysis: GraphCost | None = None) -> tuple[fx.GraphModule, Plan, int, GraphCost | None] | None:
    """(a copy of `gm` with `plan.fusions` applied, the plan re-keyed for it, the number of
    fused calls, the copy's analysis where re-keying made one), or None when no entry of
    `plan.fusions` matches anything in `gm` (a graph fused already, or rules that do not
    apply). `analysis`: `analyze(gm, hardware, kernels=kernels)` when the caller has it (read
    for the old node keys)."""
    entries = list(plan.fusions or [])
    if not entries:
        return None
    register_fused_cost_rules()  # the fused calls' cost and saved-tensor rules
    copy = _graph_copy(gm)
    # the fuse pass's own selection, at the split points the build fused with (none across a cut)
    matches = plan_matches(copy, plan, plan.extra.get("fusion_split_points"))
    if not matches:
        return None
    fused_of = {n.name: m.anchor.name for m in matches for n in m.nodes}  # a node fused away -> its anchor
    sources: dict[str, str] = {}
    apply_matches(copy, matches, sources)
    new_plan, new = plan, None
    save = dict(plan.extra.get("recompute_save") or {})
    keyed = [k for k in KEYED_EXTRAS if plan.extra.get(k)]
    if plan.node_layouts or save or keyed:
        old = analysis if analysis is not None else analyze(gm, hardware, kernels=kernels)
        new = analyze(copy, hardware, kernels=kernels)
        old_key = {n.name: n.key for n in old.nodes}
        new_key = {n.name: n.key for n in new.nodes}
        new_keys = set(new_key.values())
        # each node of the copy -> the original node whose layout it carries
        origin = {name: sources.get(name, name) for name in new_key}
        layouts = {}
        for name, key in new_key.items():
            lay = plan.node_layouts.get(old_key.get(origin[name]))
            if lay is not None:
                layouts[key] = lay
        extra = dict(plan.extra)
        anchor_call = {d["anchor"]: d["node"] for d in copy.meta["autopar_fusions"]}
        by_old_key = {k: n for n, k in old_key.items()}
        if save and not all(k in new_keys for keys in save.values() for k in keys):
            # keys of the unfused graph (a recompute choice made there): re-keyed; keys the copy
            # has already (a choice made on the rank's fused graph, build/program.py) stay
            extra["recompute_save"] = {path: _rekey(keys, by_old_key, new_key, fused_of, anchor_call)
                                       for path, keys in save.items()}
        if keyed:  # the expert entry and the router statistics name nodes of the unfused graph
            table = {k: got[0] for k in by_old_key
                     if (got := _rekey([k], by_old_key, new_key, fused_of, anchor_call))}
            for k in keyed:
                extra[k] = _deep_rekey(plan.extra[k], table)
        new_plan = dataclasses.replace(plan, node_layouts=layouts, extra=extra)
    return copy, new_plan, len(matches), new


def _deep_rekey(obj: Any, table: dict[str, str]) -> Any:
    """`obj` (plain data: dicts, lists, tuples, strings ...) with every string that is an old node
    key replaced by the copy's key for it (all at once: keys that shift do not chain)."""
    if isinstance(obj, str):
        return table.get(obj, obj)
    if isinstance(obj, dict):
        return {_deep_rekey(k, table): _deep_rekey(v, table) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_deep_rekey(v, table) for v in obj)
    return obj


def _rekey(keys, by_old_key: dict[str, str], new_key: dict[str, str], fused_of: dict[str, str],
           anchor_call: dict[str, str]) -> list[str]:
    """Old node keys -> the copy's: a kept node's own key, a fused-away node's fused call's."""
    out: list[str] = []
    for k in keys:
        name = by_old_key.get(k)
        if name is None:
            continue
        if name in new_key:
            got = new_key[name]
        else:
            call = anchor_call.get(fused_of.get(name, ""))
            got = new_key.get(call) if call is not None else None
        if got is not None and got not in out:
            out.append(got)
    return out


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of `gm`'s graph (same node names, each node's meta a shallow
    copy) sharing `gm`'s tensors and submodules."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_node = None
    for n in gm.graph.nodes:
        if n.op == "output":
            out_node = n
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    if out_node is not None:
        new_out = graph.output(fx.map_arg(out_node.args[0], lambda a: env[a]), out_node.type)
        new_out.meta = dict(out_node.meta)
    copy = lazy_graph_module(gm, graph)  # never run: its code is not generated
    copy.meta.update(gm.meta)
    copy.meta["autopar_fusions"] = []  # this copy's own (the original's list is not extended)
    return copy
