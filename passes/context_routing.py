"""context_routing: which token-mixing ops of an MoE router may run on a chunk of the sequence.

Under context parallelism (`context_positions`) an op that scans or reduces along the tokens is
refused: each rank holds only its chunk of every sequence. Two such ops of a mixture-of-experts
router are exact on a chunk all the same, and this module finds them from the graph's structure
(ATen ops and data flow; no class names):

* the *queue position* of a dropless router (models/moe.py's slots idiom): a running count
  (`cumsum` along the assignments, dim 0) of a value computed from the top-k indices alone,
  which only picks each assignment's slot in a buffer that holds every token. Every use of
  the count is an index (the scatter `index_add` into a fresh zero buffer, or a gather back
  from what that buffer computes) or the keep mask `lt(position, C)` with C the router's
  token count N, which is always true. The slots then differ with the token order, but each
  token's output does not, so the rank's tokens get what one process gives them. A capacity
  C < N (`capacity_factor`) is different: which assignments are dropped depends on every
  token before them in the whole batch, so such a scan stays refused, with that reason;
* *router statistics*: floating reductions over the token dim of values computed from the
  router alone (the load-balancing loss's f_e and P_e: the softmax scores, the top-k indices
  and weights). Each rank's mean over its tokens, averaged over the cp ranks (equal chunks),
  is the global mean: `build/plan_complete.py` lists them (`plan.extra["router_stats"]`, axes
  dp and cp) and `passes/expert.py` inserts the average (with ep too). The pass checks the
  plan does so for every one it exempts.

API: `routing_exemptions(gm, data, seq) -> RoutingExemptions` (the exempt scans, the refused
scans with their reason, the router statistics).

Reads node.meta["val"] (shapes, symbolic sizes); writes nothing.
Guarantees: only ops computed from a top-k's outputs (or its scores) alone are exempted; an op
that reads any other data of the tokens is never exempted.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

_aten = torch.ops.aten
TOPK = _aten.topk.default
_LT = {_aten.lt.Scalar, _aten.lt.Tensor}
_FRESH = {_aten.new_zeros.default, _aten.zeros.default, _aten.zeros_like.default}
# index reads: (op, position of the index argument, position of the source)
_GATHERS = {_aten.index_select.default: (2, 0), _aten.gather.default: (2, 0)}
_REDUCTIONS = {_aten.sum, _aten.mean}

__all__ = ["RoutingExemptions", "routing_exemptions"]


@dataclass
class RoutingExemptions:
    scans: set = field(default_factory=set)  # dropless queue positions: exact on a chunk
    refused_scans: dict = field(default_factory=dict)  # scan node -> why it cannot run on a chunk
    stats: set = field(default_factory=set)  # router statistics: exact once averaged over cp
    slots: set = field(default_factory=set)  # the slot buffer of an exempt scan (E * N + 1 rows, not a shift)


def routing_exemptions(gm: fx.GraphModule, data: set[fx.Node], seq) -> RoutingExemptions:
    """The router ops of `gm` that run on a chunk of the sequence (see the module docstring).
    `data`: the nodes computed from the graph's inputs (`context_positions.data_nodes`); `seq`:
    the sequence's sympy symbol."""
    out = RoutingExemptions()
    tops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TOPK]
    if not tops:
        return out
    index_of = _closure(gm, data, {u: t for t in tops for u in t.users if _getitem(u) == 1})
    router_of = _closure(gm, data, {**{t.args[0]: t for t in tops if isinstance(t.args[0], fx.Node)},
                                    **{u: t for t in tops for u in t.users if _getitem(u) in (0, 1)}})
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n in index_of and n.target is _aten.cumsum.default and _along_tokens(n, seq):
            why = _slot_count_problem(gm, n, index_of, out.slots)
            if why is None:
                out.scans.add(n)
            elif why:
                out.refused_scans[n] = why
        elif n in router_of and getattr(n.target, "overloadpacket", None) in _REDUCTIONS and _reduces_tokens(n, seq) \
                and _floating(n):
            out.stats.add(n)
    return out


def _getitem(n: fx.Node) -> int | None:
    return n.args[1] if n.op == "call_function" and n.target is operator.getitem else None


def _closure(gm: fx.GraphModule, data: set[fx.Node], seeds: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """{node: its top-k} for the seeds and every node computed from them and non-data values
    (constants, sizes, aranges) alone."""
    out = dict(seeds)
    for n in gm.graph.nodes:  # topological order
        if n in out or n.op != "call_function":
            continue
        ins = [a for a in n.all_input_nodes if a in data or a in out]
        if ins and all(a in out for a in ins):
            out[n] = out[ins[0]]
    return out


def _token_dim_has_seq(v, dim: int, seq) -> bool:
    if not isinstance(v, torch.Tensor) or not -v.dim() <= dim < v.dim():
        return False
    s = v.shape[dim]
    return not isinstance(s, int) and seq in s.node.expr.free_symbols


def _along_tokens(n: fx.Node, seq) -> bool:
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return isinstance(n.args[0], fx.Node) and isinstance(dim, int) and _token_dim_has_seq(n.args[0].meta.get("val"), dim, seq)


def _reduces_tokens(n: fx.Node, seq) -> bool:
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    v, res = (src.meta.get("val") if src is not None else None), n.meta.get("val")
    if not isinstance(v, torch.Tensor) or not isinstance(res, torch.Tensor):
        return False
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    dims = range(v.dim()) if dims is None or dims == [] else ([dims] if isinstance(dims, int) else dims)
    out_free = set().union(*(s.node.expr.free_symbols for s in res.shape if not isinstance(s, int)))
    return any(_token_dim_has_seq(v, d, seq) for d in dims) and seq not in out_free


def _floating(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _expr(a):
    if isinstance(a, int):
        return a
    v = a.meta.get("val") if isinstance(a, fx.Node) else a
    if isinstance(v, int):
        return v
    return v.node.expr if hasattr(v, "node") else None


def _slot_count_problem(gm: fx.GraphModule, scan: fx.Node, index_of: dict, slots: set[fx.Node]) -> str | None:
    """None when the running count `scan` only picks slots of a dropless dispatch (and then
    adds the slot buffer's nodes to `slots`); else why not ("" for a use this module does not
    know: the caller's general refusal applies)."""
    top = index_of[scan]
    rows = _expr(top.args[0].meta["val"].shape[0])  # N: the router's tokens
    walk = {scan}
    fresh_scatters: set[fx.Node] = set()
    gathered: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n is scan or not any(a in walk for a in n.all_input_nodes):
            continue
        if n.target in _LT and n.args[0] in walk:
            cap = _expr(n.args[1])
            if cap is None or not _same(cap, rows):
                return (f"it numbers each expert's assignments in token order and drops those at or past the "
                        f"expert's capacity {cap} (a capacity_factor; the router has {rows} tokens), and which "
                        "assignments are dropped depends on every token before them in the whole batch")
            continue  # position < N: the keep mask of a dropless router is always true
        if n in index_of:
            walk.add(n)
            continue
        if n.target is _aten.index_add.default and n.args[2] in walk and n.args[0] not in walk \
                and n.args[3] not in walk and isinstance(n.args[0], fx.Node) and n.args[0].target in _FRESH:
            fresh_scatters.add(n)
            continue
        if n.target in _GATHERS:
            i, s = _GATHERS[n.target]
            src = n.args[s]
            if n.args[i] in walk and src not in walk and fresh_scatters and _descends(src, fresh_scatters):
                gathered.append(src)
                continue
        return ""
    if not fresh_scatters:
        return ""
    between = _reach(gathered, lambda m: m.all_input_nodes) & _reach(fresh_scatters, lambda m: m.users)
    slots |= between | fresh_scatters | {s.args[0] for s in fresh_scatters}
    return None


def _descends(n: fx.Node, roots: set[fx.Node]) -> bool:
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in roots:
            return True
        if m in seen:
            continue
        seen.add(m)
        todo.extend(m.all_input_nodes)
    return False


def _reach(nodes, step) -> set[fx.Node]:
    """`nodes` and every node reached from them by `step` (a node -> its neighbours)."""
    out, todo = set(), list(nodes)
    while todo:
        m = todo.pop()
        if m not in out:
            out.add(m)
            todo.extend(step(m))
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b) or (hasattr(a, "equals") and bool(a.equals(b))) or (a - b) == 0
    except TypeError:
        return False
