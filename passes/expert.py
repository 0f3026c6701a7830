"""expert: carry out expert parallelism on this rank's graph, as `plan.extra["expert"]` says.

The plan entry (written by autopar/search/expert.py `plan_experts`, plain JSON):

    {"axis": "ep", "blocks": {<module path>: <MoEBlock.to_json()>, ...},
     "router_stats": [<node key>, ...], "capacity_factor": null | float,
     "global_router_stats": true}

For each block, with P ranks on the ep axis, this rank (index r) owning experts
[r * E/P, (r + 1) * E/P):

* a `moe.route(indices, E, axis, capacity)` node after the router plans the exchange;
  capacity is None (dropless), the model's own capacity rule evaluated for the ep group's
  batch (its SymInt expression copied with the batch size times P, so the drops are the ones
  one process makes on the group's batch), or `capacity_factor` when the plan forces one;
* "slots" blocks (models/moe.py): the expert slot buffer is bypassed: the tokens are
  dispatched (`moe.dispatch`, uneven all-to-all), local expert i reads its rows
  (`moe.expert_rows`) in place of `select(buffer, 0, e)`, the local experts' outputs are
  concatenated and combined back (`moe.combine`) in place of the slot gather; the keep mask
  becomes the dispatcher's (`moe.keep_mask`); the other experts' nodes and parameters go;
* "sorted" blocks (transformers' grouped_mm experts): each gather through the sort
  permutation becomes `moe.dispatch` of its source (token or per-assignment rows), the
  group offsets become `moe.local_offsets`, the combine becomes `moe.combine`, and every
  grouped expert parameter keeps this rank's rows of its expert dim; a masked_fill by a
  sentinel mask no router index sets (`identity_fills`) is dropped (its mask has the global
  row count); a per-expert parameter gathered by the sorted expert ids (`expert_gathers`,
  gpt-oss's biases) gathers this rank's slice by `moe.local_expert_ids`;
* "dense" blocks (every expert on every token, transformers' Llama 4: search/expert_dense.py):
  no route; the tokens and the dense (N, E) scores are all-gathered over the ep group
  (`moe.dense_dispatch`, backward reduce-scatter), this rank keeps its experts' score columns,
  the repeat over E and the (E, -1, D) views say E/P, every expert parameter keeps this rank's
  rows, and the sum over experts (a partial sum of the group's tokens) is reduce-scattered
  back to this rank's tokens (`moe.dense_combine`, backward all-gather);
* router statistics (reductions over tokens of router outputs) are averaged over the batch
  axes (dp, ep, and cp: a cp rank routes its chunk of every sequence, dropless only) with
  `autopar::all_reduce(avg)`, so the load-balancing loss is the one of the whole batch;
* every parameter read gets its gradient right for an engine that averages over dp only:
  expert parameters `moe.grad_scale(1/P)` (their gradient sums the ep group's tokens),
  the others `moe.grad_avg(axis)` (each ep rank saw different tokens).

Dead nodes are removed (an `_assert_tensor_metadata` or in-place op survives only if its
tensor does). `gm.meta["autopar_expert"]` records the axis and this rank's expert parameter
names (for `runtime.program.Program`, its `expert_params`). With tp, the pass runs after
`shard` and needs the block's tokens and per-expert rows replicated on tp; an expert output
that is a partial sum is all-reduced before the combine when the original combine was replicated.
When the combine itself stays a partial sum on tp (sequence parallelism around the block), the
partial rows go through `moe.combine` as they are (it only moves rows, so the sum commutes with
it), and the reduce-scatter `shard` put downstream (after the weighted sum over the top-k, on the
(B, T, C) output) lands them on this rank's sequence shard (sp x ep: tests/dist/test_compose_context.py).

Reads node.meta["autopar"] (shape, dtype, module, layout). Writes node.meta["autopar"] on
the nodes it inserts (with the nn_module_stack of the node they stand for, so the cost analysis
and the recompute search place them in their block; the parameter-side grad ops at the root)
and `.layout` S(0) on the ep axis for batch-sharded nodes.
Guarantees: with P = 1 the graph computes what it computed before (local permutes only).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.runtime import moe
from autopar.runtime.placement import Partial, Replicate, Shard

from . import ir
from .pass_manager import PassContext
from .rules.sharding import op_name


class ExpertPlanError(ValueError):
    pass


def expert(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    spec = (getattr(ctx.plan, "extra", None) or {}).get("expert")
    if not spec or not spec.get("blocks"):
        return _global_router_stats(gm, ctx)
    axis = spec.get("axis", "ep")
    P = ctx.mesh_sizes.get(axis, 1)
    me = ctx.coords.get(axis, 0)
    dp_axis = getattr(ctx.plan, "dp_axis", None)
    # cp splits the tokens too (each rank routes its chunk of every sequence; dropless only,
    # passes/context_routing.py): router statistics average over it, and a block's rows are
    # batch rows there, not a placement to check or to all-reduce
    cp_axis = ((getattr(ctx.plan, "extra", None) or {}).get("context") or {}).get("axis")
    batch_axes = [a for a in (dp_axis, axis, cp_axis) if a and ctx.mesh_sizes.get(a, 1) > 1]
    others = [a for a, s in ctx.mesh_sizes.items() if s > 1 and a not in (dp_axis, axis, cp_axis, "pp")]
    node = {k: n for n, k in _keys(gm).items()}
    cf = spec.get("capacity_factor")
    local_experts, drop = set(), set()
    for mod, b in spec["blocks"].items():
        missing = [k for k in _block_keys(b) if k not in node]
        if missing:
            raise ExpertPlanError(f"the plan's MoE block {mod!r} names nodes this graph does not have: {missing[:3]}; "
                                  "was the plan made for another capture of this model?")
        E = b["n_experts"]
        if E % P:
            raise ExpertPlanError(f"block {mod!r} has {E} experts, which do not divide over {axis}={P}")
        _check_replicated(b, node, others)
        keep, lose = _rewrite_block(gm, b, node, axis if P > 1 else None, P, me, cf, others)
        local_experts |= keep
        drop |= lose
    if spec.get("global_router_stats", True):
        for k in spec.get("router_stats", []):
            if k in node:
                _globalize(gm, node[k], batch_axes)
    _dce(gm)
    _drop_params(gm, drop)
    if P > 1:
        _grad_ops(gm, axis, P, local_experts)
        _mark_batch(gm, axis)
    gm.meta["autopar_expert"] = {"axis": axis, "ep": P, "expert_params": sorted(local_experts)}
    gm.graph.lint()
    return gm


# --- helpers -----------------------------------------------------------------------------------
def _inserted(n: fx.Node) -> bool:
    """A node an earlier pass inserted (collectives, tp ops): not in the captured graph."""
    i = ir.get_info(n)
    return getattr(n.target, "namespace", "") == "autopar" or (i is not None and i.kind == "collective") \
        or getattr(n.target, "__module__", "") == "autopar.runtime.tp_ops"


def _keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """`ir.node_keys` without the nodes earlier passes inserted, so a key from the captured
    graph names the same node after `shard`."""
    return ir.node_keys(gm, skip=_inserted)


def _block_keys(b: dict) -> list[str]:
    ks = [b["tokens"], b["expert_index"], b["combine"]] + list(b.get("entries", [])) + list(b.get("exits", []))
    ks += [d["node"] for d in b.get("gathers", [])] + [d["source"] for d in b.get("gathers", [])]
    ks += [k for k in (b.get("capacity"), b.get("keep"), b.get("offsets"), b.get("combine_input")) if k]
    ks += [d[f] for d in b.get("dense_entries", []) for f in ("node", "source")] + list(b.get("dense_sizes", []))
    return ks + list(b.get("identity_fills", [])) + [d["node"] for d in b.get("expert_gathers", [])]


def _new(g: fx.Graph, target, args, like: fx.Node, kwargs=None, shape=None, dtype=None) -> fx.Node:
    m = g.call_function(target, tuple(args), kwargs or {})
    base = ir.get_info(like)
    kind = "collective" if getattr(target, "namespace", "") == "autopar" else "op"
    ir.set_info(m, ir.NodeInfo(shape=shape, dtype=dtype, module=base.module if base else "", kind=kind,
                               layout=base.layout if (base and shape is not None) else None,
                               local_shape=shape))
    if "nn_module_stack" in like.meta:  # the cost analysis and the recompute search place it in like's module
        m.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    return m


def _latest(g: fx.Graph, nodes) -> fx.Node:
    order = {m: i for i, m in enumerate(g.nodes)}
    return max(nodes, key=order.__getitem__)


def _place(n: fx.Node, axis: str):
    i = ir.get_info(n)
    if i is None or i.layout is None:
        return Replicate()
    return i.layout.get(axis)


def _check_replicated(b: dict, node: dict, others: list[str]) -> None:
    for ax in others:
        for k in [b["tokens"], b["expert_index"]] + list(b.get("entries", [])) + \
                [d["node"] for d in b.get("gathers", [])]:
            p = _place(node[k], ax)
            if not isinstance(p, Replicate):
                raise ExpertPlanError(f"expert parallelism needs the MoE block's tokens and routed rows replicated on "
                                      f"{ax!r}, but the plan puts {k} at {p}; pin its {ax} strategy to replicated")


def _capacity(g: fx.Graph, b: dict, node: dict, P: int, where: fx.Node):
    """The capacity operand for moe.route: None, an int, or a node computing the model's rule
    for a P times larger batch (its SymInt chain copied, sizes of dim 0 times P)."""
    if b.get("dropless", True):
        return None
    if b.get("capacity") is None:
        if P > 1:
            raise ExpertPlanError(f"block {b['module']!r} was captured with a constant capacity "
                                  f"{b.get('capacity_value')}; capacity mode with ep={P} needs a dynamic batch capture "
                                  "(autopar.capture(..., dynamic_batch=True)) or a plan capacity_factor")
        return b.get("capacity_value")
    cap = node[b["capacity"]]
    if P == 1:
        return cap
    chain, stack = [], [cap]
    while stack:  # the SymInt/SymFloat nodes the capacity is computed from
        m = stack.pop()
        if m in chain or m.op != "call_function":
            continue
        chain.append(m)
        if op_name(m.target) != "aten.sym_size.int":
            stack.extend(a for a in m.all_input_nodes if ir.get_info(a) is None or ir.info(a).shape is None)
    order = {n: i for i, n in enumerate(g.nodes)}
    env = {}
    with g.inserting_before(where):
        for m in sorted(chain, key=order.__getitem__):
            if op_name(m.target) == "aten.sym_size.int":
                if m.args[1] != 0:
                    raise ExpertPlanError(f"the capacity of {b['module']!r} depends on dim {m.args[1]} of a tensor; "
                                          "only the batch dim (0) is supported")
                env[m] = _new(g, operator.mul, (m, P), m)
            else:
                env[m] = _new(g, m.target, fx.map_arg(m.args, lambda a: env.get(a, a)), m,
                              kwargs=fx.map_arg(m.kwargs, lambda a: env.get(a, a)))
    return env[cap]


def _rewrite_block(gm, b, node, axis, P, me, cf, others) -> tuple[set, set]:
    g = gm.graph
    x, idx = node[b["tokens"]], node[b["expert_index"]]
    E = b["n_experts"]
    El, first = E // P, me * (E // P)
    mod_dtype = b.get("dtype")
    with g.inserting_after(_latest(g, [x, idx])):
        kw = {"capacity_factor": float(cf)} if cf is not None else {}
        h = _new(g, moe.route, (idx, E, axis, None), idx, kwargs=kw)
    if cf is None:
        h.args = (idx, E, axis, _capacity(g, b, node, P, h))
    D = b["hidden"]
    keep_names, drop_names = set(), set()
    if b["idiom"] == "dense":
        g.erase_node(h)  # dense experts route nothing: every expert reads every token
        return _rewrite_dense(gm, b, node, axis, P, me), drop_names
    if b["idiom"] == "slots":
        with g.inserting_after(h):
            rows = _new(g, moe.dispatch, (x, h, "token"), x, shape=("routed_rows", D), dtype=mod_dtype)
        if b.get("keep"):
            with g.inserting_after(rows):
                km = _new(g, moe.keep_mask, (h,), node[b["keep"]], shape=ir.info(node[b["keep"]]).shape, dtype="bool")
            node[b["keep"]].replace_all_uses_with(km)
        for i in range(El):
            entry = node[b["entries"][first + i]]
            with g.inserting_before(entry):
                ri = _new(g, moe.expert_rows, (rows, h, i), entry, shape=("routed_rows", D), dtype=mod_dtype)
            entry.replace_all_uses_with(ri)
        exits = [node[b["exits"][first + i]] for i in range(El)]
        comb = node[b["combine"]]
        with g.inserting_before(comb):
            y = _new(g, torch.ops.aten.cat.default, ([*exits],), exits[0], shape=("routed_rows", D), dtype=mod_dtype)
            y = _to_combine_placement(g, y, exits[0], comb, others)
            out = _new(g, moe.combine, (y, h), comb, shape=ir.info(comb).shape, dtype=mod_dtype)
        comb.replace_all_uses_with(out)
        for name, e in b["expert_params"].items():
            (keep_names if first <= e < first + El else drop_names).add(name)
    else:
        for k in b.get("identity_fills", []):  # the identity (see expert_detect); in place or not
            f = node[k]
            f.replace_all_uses_with(f.args[0])
            g.erase_node(f)
        for gth in b["gathers"]:
            gn, src = node[gth["node"]], node[gth["source"]]
            with g.inserting_before(gn):
                d = _new(g, moe.dispatch, (src, h, gth["per"]), gn, shape=("routed_rows", *ir.info(gn).shape[1:]),
                         dtype=ir.info(gn).dtype)
            gn.replace_all_uses_with(d)
        for eg in b.get("expert_gathers", []):  # param[sorted expert ids] -> local param[local expert ids]
            gn = node[eg["node"]]
            with g.inserting_before(gn):
                ids = _new(g, moe.local_expert_ids, (h,), gn, shape=("routed_rows",), dtype="int64")
            gn.args = (gn.args[0], [ids], *gn.args[2:]) if op_name(gn.target).startswith("aten.index.") else \
                (gn.args[0], gn.args[1], ids, *gn.args[3:])
        if b.get("offsets"):
            off = node[b["offsets"]]
            dt = getattr(torch, ir.info(off).dtype or "int32")
            with g.inserting_after(h):
                lo = _new(g, moe.local_offsets, (h, dt), off, shape=(El,), dtype=ir.info(off).dtype)
            off.replace_all_uses_with(lo)
        comb, cin = node[b["combine"]], node[b["combine_input"]]
        with g.inserting_before(comb):
            y = _to_combine_placement(g, cin, cin, comb, others)
            out = _new(g, moe.combine, (y, h), comb, shape=ir.info(comb).shape, dtype=ir.info(comb).dtype)
        comb.replace_all_uses_with(out)
        for name in b["expert_params"]:
            keep_names.add(name)
            if P > 1:
                _slice_param(gm, name, first, El, E)
    return keep_names, drop_names


def _rewrite_dense(gm: fx.GraphModule, b: dict, node: dict, axis: str | None, P: int, me: int) -> set[str]:
    """Dense experts (search/expert_dense.py): this rank runs its E/P experts on every token of
    its ep group. The tokens and the dense scores are all-gathered over the group
    (`moe.dense_dispatch`; of the scores this rank keeps its experts' columns), the repeats and
    views over E say E/P, the expert parameters keep this rank's rows, and the sum over the
    local experts, a partial sum for the group's tokens, is reduce-scattered back to this
    rank's tokens (`moe.dense_combine`)."""
    g = gm.graph
    E = b["n_experts"]
    El, first = E // P, me * (E // P)
    order = {n: i for i, n in enumerate(g.nodes)}
    done: dict[tuple, fx.Node] = {}
    for e in sorted(b["dense_entries"], key=lambda e: order[node[e["node"]]]):
        m, src = node[e["node"]], node[e["source"]]
        if (src, e["per"]) not in done:
            shape, dt = ir.info(src).shape, ir.info(src).dtype
            with g.inserting_before(m):
                cur = _new(g, moe.dense_dispatch, (src, axis), src, shape=("group_tokens", *shape[1:]), dtype=dt)
                if e["per"] == "score":  # this rank's experts' columns of the group's (N, E) scores
                    cur = _new(g, torch.ops.aten.slice.Tensor, (cur, 1, first, first + El), src,
                               shape=("group_tokens", El), dtype=dt)
                done[(src, e["per"])] = cur
        m.replace_input_with(src, done[(src, e["per"])])
    for k in b["dense_sizes"]:  # repeat(x, [E, 1]), view(y, [E, -1, D]): E/P experts here
        n = node[k]
        n.args = (n.args[0], [El, *n.args[1][1:]], *n.args[2:])
    comb = node[b["combine"]]
    with g.inserting_after(comb):
        out = _new(g, moe.dense_combine, (comb, axis), comb, shape=ir.info(comb).shape, dtype=ir.info(comb).dtype)
    comb.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
    for name in b["expert_params"]:
        if P > 1:
            _slice_param(gm, name, first, El, E)
    return set(b["expert_params"])


def _to_combine_placement(g, y, exit_node, comb, others):
    """Expert outputs that are partial sums on a tp axis are all-reduced when the combine was
    replicated there, and reduce-scattered on the combine's dim when the sharding search sharded
    the combine on a dim other than its rows (dim 0, which the combine puts back in token order;
    e.g. S(1), the hidden dim, where a reduce-scatter is cheaper than an all-reduce)."""
    for ax in others:
        src, dst = _place(exit_node, ax), _place(comb, ax)
        shape = ir.info(y).shape
        if isinstance(src, Partial) and isinstance(dst, Replicate):
            y = _new(g, torch.ops.autopar.all_reduce.default, (y, ax, src.op), y, shape=shape,
                     dtype=ir.info(y).dtype)
        elif isinstance(src, Partial) and isinstance(dst, Shard) and shape and dst.dim % len(shape) != 0:
            d = dst.dim % len(shape)
            y = _new(g, torch.ops.autopar.reduce_scatter.default, (y, ax, d, src.op), y, shape=shape,
                     dtype=ir.info(y).dtype)
            local = ir.info(comb).local_shape
            if local is not None:  # this rank's slice of dim d, as the combine's output has it
                ir.set_info(y, dataclasses.replace(ir.info(y), local_shape=tuple(
                    local[d] if i == d else n for i, n in enumerate(shape))))
        elif src != dst:
            raise ExpertPlanError(f"expert outputs are {src} on {ax!r} but the combine {comb.name} is {dst}; "
                                  "pin the experts' output to replicated or partial on that axis")
    return y


def _slice_param(gm: fx.GraphModule, name: str, first: int, n: int, E: int) -> None:
    parent, _, attr = name.rpartition(".")
    mod = gm.get_submodule(parent) if parent else gm
    p = getattr(mod, attr)
    if p.shape[0] != E:
        raise ExpertPlanError(f"grouped expert parameter {name} has shape {tuple(p.shape)}, expected {E} experts in dim 0")
    local = p.detach()[first:first + n].clone()
    setattr(mod, attr, torch.nn.Parameter(local, requires_grad=p.requires_grad))


def _global_router_stats(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Without expert parallelism: average the router statistics that `plan.extra["router_stats"]`
    names over its axes (dp, cp), as the ep path does over dp and ep."""
    stats = (getattr(ctx.plan, "extra", None) or {}).get("router_stats")
    axes = [a for a in (stats or {}).get("axes", []) if ctx.mesh_sizes.get(a, 1) > 1]
    if not axes:
        return gm
    node = {k: n for n, k in _keys(gm).items()}
    missing = [k for k in stats["keys"] if k not in node]
    if missing:
        raise ExpertPlanError(f"the plan's router statistics name nodes this graph does not have: {missing[:3]}; "
                              "was the plan made for another capture of this model?")
    for k in stats["keys"]:
        _globalize(gm, node[k], axes)
    gm.graph.lint()
    return gm


def _globalize(gm: fx.GraphModule, n: fx.Node, axes: list[str]) -> None:
    """Average a reduction over tokens across the batch axes (identity backward: the engine and
    grad_avg average the gradients, which makes the sum of every rank's share exact)."""
    if not axes:
        return
    g = gm.graph
    users = list(n.users)
    cur = n
    for ax in axes:
        with g.inserting_after(cur):
            cur = _new(g, torch.ops.autopar.all_reduce.default, (cur, ax, "avg"), n, shape=ir.info(n).shape,
                       dtype=ir.info(n).dtype)
    for u in users:
        u.replace_input_with(n, cur)


def _is_inplace(n: fx.Node) -> bool:
    name = op_name(n.target) if n.op == "call_function" else ""
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_")


# ops whose output aliases their first argument: an in-place write into one writes its base
_ALIASING = ("aten.slice", "aten.select", "aten.narrow", "aten.view", "aten.as_strided", "aten.transpose",
             "aten.t", "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.alias",
             "aten.diagonal", "aten.unflatten", "aten._reshape_alias")


def _view_base(n: fx.Node) -> fx.Node:
    """The tensor a view chain starts from (DeepSeek-V3's attention writes key_states through
    slices of a new_empty: those copy_ nodes live while the new_empty does)."""
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and \
            ".".join(op_name(n.target).split(".")[:2]) in _ALIASING:
        n = n.args[0]
    return n


def _dce(gm: fx.GraphModule) -> None:
    """Remove nodes nothing live needs. Roots: the output and side-effecting autopar ops; an
    assert or in-place op lives while the tensor it checks or writes lives."""
    g = gm.graph
    live: set = set()

    def mark(n):
        stack = [n]
        while stack:
            m = stack.pop()
            if m in live:
                continue
            live.add(m)
            stack.extend(m.all_input_nodes)

    for n in g.nodes:
        if n.op in ("output", "placeholder") or (n.op == "call_function" and n.target in (
                torch.ops.autopar.send.default, torch.ops.autopar.recv.default)):
            mark(n)
    changed = True
    while changed:
        changed = False
        for n in g.nodes:
            if n in live or n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
                continue
            name = op_name(n.target)
            if (name.startswith("aten._assert_tensor_metadata") or _is_inplace(n)) and _view_base(n.args[0]) in live:
                mark(n)
                changed = True
    for n in reversed(list(g.nodes)):
        if n not in live and not n.users:
            g.erase_node(n)


def _drop_params(gm: fx.GraphModule, names: set[str]) -> None:
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name in sorted(names):
        if name in used:
            raise ExpertPlanError(f"{name} belongs to another ep rank's expert but the graph still reads it")
        parent, _, attr = name.rpartition(".")
        mod = gm.get_submodule(parent) if parent else gm
        mod._parameters.pop(attr, None)


def _grad_ops(gm: fx.GraphModule, axis: str, P: int, experts: set[str]) -> None:
    g = gm.graph
    params = dict(gm.named_parameters(remove_duplicate=False))
    order = {n: i for i, n in enumerate(g.nodes)}
    for n in list(g.nodes):
        if n.op != "get_attr" or not n.users:
            continue
        name = str(n.target)
        p = params.get(name)
        if p is None or not p.requires_grad:
            continue
        first = min(n.users, key=order.__getitem__)
        users = list(n.users)
        with g.inserting_before(first):
            if name in experts:
                m = _new(g, moe.grad_scale, (n, 1.0 / P), n, shape=ir.info(n).shape, dtype=ir.info(n).dtype)
            else:
                m = _new(g, moe.grad_avg, (n, axis), n, shape=ir.info(n).shape, dtype=ir.info(n).dtype)
        # identity forward on a parameter, outside every layer (as the cost analysis and the recompute
        # search see it: a layer's region reads the parameter through it)
        ir.update(m, module="")
        if "val" in n.meta:
            m.meta["val"] = n.meta["val"]
        for u in users:
            u.replace_input_with(n, m)


def _mark_batch(gm: fx.GraphModule, axis: str) -> None:
    batch = None
    for n in gm.graph.nodes:
        if n.op == "placeholder" and ir.info(n).shape:
            batch = ir.info(n).shape[0]
            break
    if batch is None:
        return
    for n in gm.graph.nodes:
        i = ir.get_info(n)
        if i is None or not i.shape or i.shape[0] != batch or i.layout is None or axis not in dict(i.layout.axes):
            continue
        ir.update(n, layout=i.layout.replace(axis, Shard(0)))


__all__ = ["expert", "ExpertPlanError"]
