"""Mixture-of-experts blocks in a captured graph: the detection half of expert parallelism
(`search/expert.py` costs an ep degree and writes the plan entry from what this finds).

Detection works on the graph's structure (ATen ops and data flow), never on class names:

* a *router* is an `aten.topk` over the last dim of token scores (N, E) computed from a
  linear map of token rows x (N, D) by a parameter weight (E, D), whatever lies between
  (softmax or sigmoid, a correction bias, a group-limited mask from a top-k over groups:
  `search/expert_props.py`); its indices (N, K) route assignment a = n * K + k to an expert;
* the *index set* I of a router is everything computed from the indices alone (positions,
  slots, permutations, counts, capacity masks);
* a *dispatch* is an indexing op whose index is in I and whose data is not: a scatter of
  per-assignment copies of x into expert slots (`index_add`, "slots" idiom: models/moe.py),
  or gathers of rows through a sort permutation (`index` / `index_select`, "sorted" idiom:
  transformers' Mixtral, Qwen2-MoE, OLMoE with the grouped-matmul op
  `transformers.grouped_mm_fallback`);
* the *combine* is the indexing op (index in I) that brings expert outputs back to
  assignment order, (N * K, D);
* the *experts* are the nodes between dispatch and combine: per expert (slots: from
  `select(buffer, 0, e)` to the e-th input of a `stack`) or grouped (sorted: row-wise ops and
  grouped matmuls over parameters with a leading expert dim, with group offsets computed in I).
  A per-expert parameter gathered by the sorted expert ids (gpt-oss's biases,
  `out += bias[expert_ids]`) is a row operand too (`expert_gathers`): row r reads its expert's row.
  Every expert op must be row-wise by its sharding rule (`expert_props.row_wise_failure`:
  the rule table has S(0) on the rows -> S(0)), which is what lets the experts run on any
  number of rows. One exception, recorded as `identity_fills`: a `masked_fill` whose mask
  is `expert id >= n_experts` (transformers 5.17's sentinel rows for expert-parallel padding,
  Mixtral / Qwen2-MoE grouped experts). No top-k index over n_experts sets it, so the fill is
  the identity, and the pass drops it (its mask has the global row count, not a rank's);
* *dense* experts (transformers' Llama 4 text MoE): a router whose indices scatter its scores
  into a dense (N, E) matrix and every expert runs on every token (the tokens repeated over E,
  batched matmuls by (E, d, d') parameters, a sum over experts), found by
  `search/expert_dense.py`; idiom "dense", with `dense_entries` (where tokens and scores enter)
  and `dense_sizes` (the repeats / views whose leading size is E);
* capacity: the bool (N, K) mask in I that selects the slot (`where(keep, slot, dummy)`), and
  the SymInt it compares queue positions against; dropless when that capacity equals N;
* router statistics: reductions over the token dim of values computed from router outputs
  alone (the load-balancing loss's f_e and P_e, transformers' aux loss; its expert counts
  by `histc`, or by `bincount` and a float cast in transformers 5.17). The pass makes them
  global over the batch axes so the loss equals one process's.

The result for a block is plain JSON keyed by stable node keys (`passes.ir.node_keys`).

API: `detect_moe(gm) -> [MoEBlock]`, `router_stats(gm, blocks) -> [node key]`,
`no_moe_reasons(gm) -> [str]` (why each expert selection is not a block; it lives in
`search/expert_reasons.py`); all are re-exported by `autopar.search.expert`. `MoEGraph` (the
indexed graph the detector walks, `search/expert_graph.py`) and `dtype_itemsize` serve
`search/expert.py` too.

Guarantees: a dense model gives no blocks; a router that leads to a dispatch this module
cannot take apart (an expert op that mixes rows, an unknown index pattern) raises
`MoEDetectError` (a ValueError) naming the node, and for a row-mixing op the rule that
failed and what to do.

Reads node.meta["autopar"] (shapes, modules) and node.meta["val"]; writes nothing on nodes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.passes import ir
from autopar.passes.rules.sharding import op_name
from autopar.search.expert_dense import dense_experts, dense_scatter
from autopar.search.expert_graph import MoEGraph, same_size as _same, shape_of as _shape, sym as _sym
from autopar.search.expert_graph import tensorish as _tensorish, val_expr as _val_expr
from autopar.search.expert_props import base_name as _base
from autopar.search.expert_props import param_of, row_wise_failure
from autopar.search.expert_reasons import no_moe_reasons  # noqa: F401  (re-exported)

VIEWLIKE = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.unsqueeze", "aten.expand", "aten.slice",
            "aten.clone", "aten.contiguous", "aten.alias", "aten.to", "aten._to_copy", "aten.flatten"}
GROUPED = {"transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm"}
REDUCTIONS = {"aten.sum", "aten.mean", "aten.histc", "aten.bincount"}


class MoEDetectError(ValueError):
    pass


@dataclass
class MoEBlock:
    """One detected MoE block (plain data; `to_json()` goes into plan.extra["expert"])."""

    module: str  # common module path of router and combine
    idiom: str  # "slots" | "sorted" | "dense"
    n_experts: int
    top_k: int
    hidden: int  # D
    dtype: str
    tokens: str  # key of x (N, D)
    expert_index: str  # key of the router's indices (N, K)
    router: str  # key of the topk node
    gate: str | None  # router weight parameter
    combine: str  # key of the node with expert outputs in assignment order (N*K, D) (dense: the sum over experts)
    capacity: str | None = None  # key of the capacity SymInt node (slots)
    capacity_value: int | None = None  # the capacity when it is a constant
    keep: str | None = None  # key of the keep mask (N, K)
    dropless: bool = True
    entries: list[str] = field(default_factory=list)  # slots: per expert, its input rows
    exits: list[str] = field(default_factory=list)  # slots: per expert, its output rows
    gathers: list[dict] = field(default_factory=list)  # sorted: {"node", "source", "per"}
    offsets: str | None = None  # sorted: group offsets (cumulative rows per expert)
    combine_input: str | None = None  # sorted: expert rows (region output) read by the combine
    expert_params: dict[str, Any] = field(default_factory=dict)  # name -> expert id (slots) | "dim0" (sorted)
    flops_per_row: float = 0.0  # forward FLOPs of one expert on one row
    side_row_bytes: int = 0  # per-assignment data dispatched besides x (sorted idiom: weights)
    identity_fills: list[str] = field(default_factory=list)  # sorted: masked_fills by a never-set sentinel mask
    expert_gathers: list[dict] = field(default_factory=list)  # sorted: {"node", "param"}: param[sorted expert ids]
    dense_entries: list[dict] = field(default_factory=list)  # dense: {"node", "source", "per": "token" | "score"}
    dense_sizes: list[str] = field(default_factory=list)  # dense: repeats / views whose leading size is E

    def to_json(self) -> dict:
        return asdict(self)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in `passes.ir` ("float32", "bfloat16" ...)."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


# --- detection -----------------------------------------------------------------------------
def _router(g: MoEGraph, t: fx.Node):
    """(gate linear node, token rows node, E) if topk node `t` selects experts (expert_props)."""
    return g.router(t)


def _getitem(n: fx.Node, i: int) -> fx.Node | None:
    for u in n.users:
        if u.op == "call_function" and op_name(u.target) == "operator.getitem" and u.args[1] == i:
            return u
    return None


def _index_of(n: fx.Node):
    """(data, index) of an indexing op, or None."""
    b = _base(n)
    if b == "aten.index" and isinstance(n.args[1], (list, tuple)) and len(n.args[1]) == 1:
        return n.args[0], n.args[1][0]
    if b == "aten.index_select" and n.args[1] == 0:
        return n.args[0], n.args[2]
    if b == "aten.index_add" and n.args[1] == 0:
        return n.args[3], n.args[2]
    return None


def _params_feeding(g: MoEGraph, region: set) -> dict[str, fx.Node]:
    """Parameters read by `region` directly or through parameter-only nodes."""
    out = {}
    for n in region:
        for a in n.all_input_nodes:
            if a in region or g.dep[a]:
                continue
            for m in [a] + list(g.ancestors(a)):
                if m.op == "get_attr" and ir.get_info(m) and ir.info(m).kind == "param":
                    out[str(m.target)] = m
    return out


def _carries_expert_ids(m: fx.Node, idx: fx.Node) -> bool:
    """Whether `m` holds (a reshaping or sorting of) the router's indices `idx`: values in [0, E)."""
    while m is not idx:
        b = _base(m)
        if b in VIEWLIKE:
            m = m.args[0]
        elif b == "operator.getitem" and m.args[1] == 0 and isinstance(m.args[0], fx.Node) and \
                _base(m.args[0]) == "aten.sort":
            m = m.args[0].args[0]  # sorted values: the same set of ids
        else:
            return False
        if not isinstance(m, fx.Node):
            return False
    return True


def _identity_fills(region: set, idx: fx.Node, E: int) -> dict[fx.Node, fx.Node]:
    """masked_fill nodes of `region` whose mask is `ids >= E` (or `ids > E - 1`) for expert ids
    `ids` of the router indices `idx`: never set, so the fill is the identity. -> {fill: mask}."""
    out = {}
    for n in region:
        if _base(n) not in ("aten.masked_fill", "aten.masked_fill_") or not isinstance(n.args[1], fx.Node):
            continue
        m = n.args[1]
        while _base(m) in VIEWLIKE and isinstance(m.args[0], fx.Node):
            m = m.args[0]
        c = m.args[1] if _base(m) in ("aten.ge", "aten.gt") and len(m.args) > 1 else None
        if isinstance(c, int) and not isinstance(c, bool) and (c >= E if _base(m) == "aten.ge" else c >= E - 1) \
                and isinstance(m.args[0], fx.Node) and _carries_expert_ids(m.args[0], idx):
            out[n] = n.args[1]
    return out


def _check_row_wise(g: MoEGraph, region: set, starts: set, what: str, identity: set = frozenset()) -> None:
    """Every op of `region` (rows entering at `starts`) is row-wise by its sharding rule
    (`expert_props.row_wise_failure`), or grouped over experts, or an identity fill."""
    rows = region | starts
    for n in region:
        b = _base(n)
        if n.op != "call_function":
            continue
        why = None if n in identity or b in GROUPED else row_wise_failure(n, rows)
        if why is not None:
            raise MoEDetectError(f"{what}: {g.keys[n]} ({n.format_node()}) is not a row-wise op, so the experts "
                                 f"cannot run on a different number of rows: {why}. Expert parallelism does not "
                                 "apply to this block; add a row-wise rule for the op (passes/rules/"
                                 "sharding_table.py), or keep the expert module opaque with "
                                 "autopar.capture(..., leaf_modules=[...]) and use a mesh without the ep axis")
        for a in list(n.args) + list(n.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(x, fx.Node) and not _tensorish(x) and b not in ("aten._assert_tensor_metadata",):
                    raise MoEDetectError(f"{what}: {g.keys[n]} uses the size {x.name}; expert ops must not "
                                         "depend on row counts")


def _flops_per_row(params: dict[str, fx.Node], per_expert: int) -> float:
    numel = sum(math.prod(int(s) for s in _shape(p)) for p in params.values())
    return 2.0 * numel / per_expert


def _block_module(g: MoEGraph, a: fx.Node, b: fx.Node) -> str:
    pa, pb = ir.info(a).module.split("."), ir.info(b).module.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _detect_one(g: MoEGraph, t: fx.Node) -> MoEBlock | None:
    r = _router(g, t)
    if r is None:
        return None
    lin, x_router, E = r
    idx = _getitem(t, 1)
    if idx is None:
        return None
    K = int(t.args[1])
    N = _shape(t.args[0])[0]
    I = g.closure([idx])
    disp, comb = [], None
    # after: the nodes computed from a dispatch (not the dispatches themselves, unless computed
    # from an earlier one), kept up to date along the walk instead of an ancestry walk per op
    after: set = set()
    disp_set: set = set()
    for n in g.nodes[g.order[idx]:]:
        if disp and any(a in after or a in disp_set for a in n.all_input_nodes):
            after.add(n)
        if n in I or n.op != "call_function":
            continue
        io = _index_of(n)
        if io is None or io[1] not in I:
            continue
        data = io[0]
        if disp and data in after:  # the data is computed from a dispatch: n brings expert rows back
            comb = n
            break
        disp.append(n)
        disp_set.add(n)
    if not disp or comb is None:
        return _dense(g, t, lin, idx, E, K)
    scatter = [d for d in disp if _base(d) == "aten.index_add"]
    common = dict(n_experts=E, top_k=K, router=g.keys[t], expert_index=g.keys[idx], combine=g.keys[comb],
                  gate=str(param_of(lin.args[1]).target), dtype=ir.info(comb).dtype or "float32")
    if scatter:
        return _slots(g, t, idx, I, scatter[0], comb, N, common)
    return _sorted(g, t, idx, I, disp, comb, N, common)


def _dense(g: MoEGraph, t: fx.Node, lin: fx.Node, idx: fx.Node, E: int, K: int) -> MoEBlock | None:
    """The block of a router whose scores are scattered into a dense (N, E) matrix with every
    expert on every token (`search/expert_dense.py`); None when `t` does not route densely."""
    d = dense_experts(g, t, idx, E)
    if d is None:
        return None
    if isinstance(d, str):
        scat = dense_scatter(idx, _shape(t.args[0])[0], E)
        raise MoEDetectError(f"MoE block at {g.keys[t]}: its router (weight {param_of(lin.args[1]).target}) scatters "
                             f"the top-k scores into a dense (N, {E}) matrix ({g.keys[scat]}) and every expert runs "
                             f"on every token, but the experts cannot be split over ep: {d}. Keep the "
                             "expert module opaque with autopar.capture(..., leaf_modules=[...]) and use a mesh "
                             "without the ep axis")
    comb = next(n for n, key in g.keys.items() if key == d["combine"])
    params = d.pop("expert_params")
    return MoEBlock(module=_block_module(g, t, comb), idiom="dense", n_experts=E, top_k=K, router=g.keys[t],
                    expert_index=g.keys[idx], gate=str(param_of(lin.args[1]).target),
                    dtype=ir.info(comb).dtype or "float32", expert_params={n: "dim0" for n in sorted(params)},
                    flops_per_row=_flops_per_row(params, E), **d)


def _slots(g, t, idx, I, scat, comb, N, common) -> MoEBlock:
    E, K = common["n_experts"], common["top_k"]
    where = f"MoE block at {g.keys[t]}"
    src = scat.args[3]
    # src must be x repeated per assignment: reshape(expand(unsqueeze(x, 1), [N, K, D]), [N*K, D])
    chain, m = [], src
    while _base(m) in VIEWLIKE:
        chain.append(m)
        m = m.args[0]
    kinds = [_base(c) for c in chain]
    if "aten.expand" not in kinds or "aten.unsqueeze" not in kinds:
        raise MoEDetectError(f"{where}: the dispatched rows {g.keys[src]} are not a per-assignment copy of tokens")
    unsq = chain[kinds.index("aten.unsqueeze")]
    exp = chain[kinds.index("aten.expand")]
    if unsq.args[1] != 1 or len(_shape(exp)) != 3 or _shape(exp)[1] != K:
        raise MoEDetectError(f"{where}: tokens are repeated in an order other than token-major ({g.keys[exp]})")
    x = unsq.args[0]
    while _base(x) in ("aten.slice", "aten.alias", "aten.clone") and _shape(x.args[0]) == _shape(x):
        x = x.args[0]
    # buffer (E*C(+1), D) -> ... -> (E, C, D) -> select(., 0, e)
    m = scat
    while True:
        users = list(m.users)
        sel = [u for u in users if _base(u) == "aten.select"]
        if sel:
            break
        nxt = [u for u in users if _base(u) in VIEWLIKE]
        if len(users) != 1 or not nxt:
            raise MoEDetectError(f"{where}: expert slots {g.keys[m]} are used by {[g.keys[u] for u in users]}")
        m = nxt[0]
    buf = m
    if _shape(buf)[0] != E or len(sel) != E or sorted(u.args[2] for u in sel) != list(range(E)):
        raise MoEDetectError(f"{where}: expected {E} per-expert selects of {g.keys[buf]}")
    entries = {u.args[2]: u for u in sel}
    reach = {e: g.descendants([entries[e]]) for e in range(E)}
    join = next(n for n in g.nodes if all(n in reach[e] for e in range(E)))
    if _base(join) not in ("aten.stack", "aten.cat") or len(join.args[0]) != E:
        raise MoEDetectError(f"{where}: expert outputs meet at {g.keys[join]}, not a stack of {E} outputs")
    exits = {}
    for a in join.args[0]:
        owners = [e for e in range(E) if a in reach[e]]
        if len(owners) != 1:
            raise MoEDetectError(f"{where}: {g.keys[a]} mixes experts {owners}")
        exits[owners[0]] = a
    params, flops = {}, 0.0
    for e in range(E):
        region = (reach[e] & (g.ancestors(exits[e]) | {exits[e]})) - {entries[e]}
        _check_row_wise(g, region, {entries[e]}, f"{where}, expert {e}")
        for n in region:
            for a in g.tin(n):
                if a not in region and a is not entries[e] and g.dep[a]:
                    raise MoEDetectError(f"{where}: expert {e} reads {g.keys[a]} besides its rows")
        pe = _params_feeding(g, region)
        flops = max(flops, _flops_per_row(pe, 1))
        for name in sorted(pe):
            params[name] = e
    # capacity: where(keep, slot, dummy) on the slot index's ancestry, keep = lt(position, C)
    keep = cap = None
    cap_value, dropless = None, True
    for n in sorted(g.ancestors(scat.args[2]) | {scat.args[2]}, key=g.order.get):
        if n in I and _base(n) == "aten.where" and isinstance(n.args[0], fx.Node) and n.args[0] in I:
            keep = n.args[0]
            break
    if keep is not None and _base(keep) == "aten.lt":
        c = keep.args[1]
        ce = _val_expr(c)
        if isinstance(c, fx.Node):
            cap = g.keys[c]
        elif isinstance(c, int):
            cap_value = c
        dropless = ce is not None and _same(str(ce), N)
        if ce is None:
            raise MoEDetectError(f"{where}: cannot read the capacity {c!r} of {g.keys[keep]}")
    return MoEBlock(module=_block_module(g, t, comb), idiom="slots", hidden=int(_shape(x)[1]), tokens=g.keys[x],
                    capacity=None if dropless else cap, capacity_value=None if dropless else cap_value,
                    keep=g.keys[keep] if keep is not None else None, dropless=dropless,
                    entries=[g.keys[entries[e]] for e in range(E)], exits=[g.keys[exits[e]] for e in range(E)],
                    expert_params=params, flops_per_row=flops, **common)


def _sorted(g, t, idx, I, gathers, comb, N, common) -> MoEBlock:
    E, K = common["n_experts"], common["top_k"]
    where = f"MoE block at {g.keys[t]}"
    out, x = [], None
    side = 0
    for d in gathers:
        data, index = _index_of(d)
        rows = _shape(data)[0]
        if _same(rows, N):
            if not (_base(index) in ("aten.floor_divide", "aten.div") and index.args[1] == K and index.args[0] in I):
                raise MoEDetectError(f"{where}: token rows {g.keys[d]} are gathered by {g.keys[index]}, "
                                     f"not by assignment // {K}")
            out.append({"node": g.keys[d], "source": g.keys[data], "per": "token"})
            x = data
        elif _same(rows, _sym(N) * K):
            out.append({"node": g.keys[d], "source": g.keys[data], "per": "assignment"})
            side += math.prod(int(s) for s in _shape(data)[1:]) * dtype_itemsize(ir.info(data).dtype or "float32")
        else:
            raise MoEDetectError(f"{where}: {g.keys[d]} gathers rows of {g.keys[data]} ({rows} rows), neither "
                                 f"tokens ({N}) nor assignments")
    if x is None:
        raise MoEDetectError(f"{where}: no gather of token rows")
    cdata, cindex = _index_of(comb)
    # the nodes between the gathers and cdata: descendants of the gathers up to cdata, then the
    # ancestors of cdata among them (every path from a descendant to cdata stays among them)
    below = g.descendants(list(gathers), stop=cdata)
    region = (g.ancestors(cdata, within=below) | ({cdata} & below)) - set(gathers)
    per_expert = _expert_gathers(g, region, idx, I, E)
    starts = set(gathers) | set(per_expert)
    fills = _identity_fills(region, idx, E)
    _check_row_wise(g, region, starts, where, set(fills))
    offsets = None
    for n in region:
        for a in g.tin(n):
            if a in region or a in starts or not g.dep[a]:
                continue
            if n in fills and a is fills[n]:
                continue  # the sentinel mask of an identity fill, dropped with it
            if a in I and _base(a) == "aten.cumsum" and _base(n) in GROUPED:
                if offsets not in (None, a):
                    raise MoEDetectError(f"{where}: two different group offsets {g.keys[offsets]}, {g.keys[a]}")
                offsets = a
            else:
                raise MoEDetectError(f"{where}: the experts read {g.keys[a]} ({a.format_node()}), which is neither "
                                     "a dispatched row nor group offsets")
    pe = _params_feeding(g, region)
    for name, p in pe.items():
        if _shape(p)[0] != E:
            raise MoEDetectError(f"{where}: expert parameter {name} has shape {_shape(p)}; grouped experts need a "
                                 f"leading dim of {E}")
    by_node = {g.keys[gn]: str(p.target) for gn, p in per_expert.values()}
    return MoEBlock(module=_block_module(g, t, comb), idiom="sorted", hidden=int(_shape(x)[1]), tokens=g.keys[x],
                    gathers=out, offsets=g.keys[offsets] if offsets is not None else None,
                    combine_input=g.keys[cdata], expert_params={n: "dim0" for n in sorted(set(pe) | set(by_node.values()))},
                    flops_per_row=_flops_per_row(pe, E), side_row_bytes=side,
                    identity_fills=sorted(g.keys[n] for n in fills),
                    expert_gathers=[{"node": k, "param": by_node[k]} for k in sorted(by_node)], **common)


def _expert_gathers(g: MoEGraph, region: set, idx: fx.Node, I: set, E: int) -> dict[fx.Node, tuple]:
    """Per-expert parameter rows gathered by the sorted expert ids that the experts read
    (gpt-oss's biases, `out += bias[expert_ids]`): row r holds the row of row r's expert, so it
    is a row operand like the dispatched rows. -> {node read: (gather node, parameter)}."""
    out = {}
    for n in region:
        for a in g.tin(n):
            if a in region or a not in I or a in out:
                continue
            m = a
            while _base(m) in VIEWLIKE and _index_of(m) is None and isinstance(m.args[0], fx.Node):
                m = m.args[0]
            io = _index_of(m)
            if io is None or _base(m) == "aten.index_add":
                continue
            p = param_of(io[0])
            if p is not None and _shape(p) and _shape(p)[0] == E and _carries_expert_ids(io[1], idx):
                out[a] = (m, p)
    return out


def detect_moe(gm: fx.GraphModule) -> list[MoEBlock]:
    """Every MoE block of a captured graph, in graph order (empty for a dense model).
    Raises MoEDetectError naming the node when a router leads to a dispatch this module
    cannot take apart (an expert op that mixes rows, an unknown index pattern)."""
    g = MoEGraph(gm)
    out = []
    for n in g.nodes:
        if n.op == "call_function" and _base(n) == "aten.topk":
            b = _detect_one(g, n)
            if b is not None:
                out.append(b)
    return out


def router_stats(gm: fx.GraphModule, blocks: list[MoEBlock] | None = None) -> list[str]:
    """Keys of floating reductions over the token dim of values computed from router outputs
    alone (load-balancing statistics), excluding the dispatch bookkeeping of `blocks`."""
    g = MoEGraph(gm)
    blocks = detect_moe(gm) if blocks is None else blocks
    by_key = {k: n for n, k in g.keys.items()}
    seeds, n_tok = [], []
    for n in g.nodes:
        if n.op == "call_function" and _base(n) == "aten.topk":
            r = _router(g, n)
            if r is not None:
                seeds.append(r[0])
                n_tok.append(_shape(n.args[0])[0])
    if not seeds:
        return []
    n_tok_int = [t * k for t in n_tok if isinstance(t, int) for k in (1, 2, 4, 8)]
    S = g.closure(seeds)
    bookkeeping: set = set()
    for b in blocks:
        for key in [b.offsets, b.combine] + [d["node"] for d in b.gathers]:
            if key:
                bookkeeping |= g.ancestors(by_key[key])
        if b.idiom == "slots":
            for e in b.entries:
                bookkeeping |= g.ancestors(by_key[e])
    out = []
    for n in g.nodes:
        if n not in S or n in bookkeeping or _base(n) not in REDUCTIONS:
            continue
        inp = n.args[0]
        if not g.token_major(inp, n_tok_int) or g.token_major(n, n_tok_int):
            continue
        if _base(n) == "aten.bincount":  # integer counts (transformers 5.17's aux loss): average their float cast
            n = next((u for u in n.users if _base(u) in ("aten.to", "aten._to_copy")
                      and (ir.info(u).dtype or "").startswith(("float", "bfloat"))), None)
            if n is None:
                continue
        dtype = ir.info(n).dtype or ""
        if not dtype.startswith(("float", "bfloat")):
            continue
        nd = len(_shape(inp))
        if _base(n) in ("aten.sum", "aten.mean") and len(n.args) > 1 and n.args[1] is not None:
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
            if 0 not in [d % nd for d in dims]:
                continue
        out.append(g.keys[n])
    return out
