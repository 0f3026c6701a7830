"""Expert parallelism, the brain's side: find mixture-of-experts blocks in a captured graph,
cost an ep degree, and write what the expert pass needs into `plan.extra["expert"]`.

Detection works on the graph's structure (ATen ops and data flow), never on class names:

* a *router* is an `aten.topk` over the last dim of (softmax / sigmoid / casts of) a linear
  map of token rows x (N, D) by a weight (E, D); its indices (N, K) route assignment
  a = n * K + k to an expert;
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
  Every expert op must be row-wise (no op mixes rows), which is what lets the experts run on
  any number of rows;
* capacity: the bool (N, K) mask in I that selects the slot (`where(keep, slot, dummy)`), and
  the SymInt it compares queue positions against; dropless when that capacity equals N;
* router statistics: reductions over the token dim of values computed from router outputs
  alone (the load-balancing loss's f_e and P_e, transformers' aux loss). The pass makes
  them global over the batch axes so the loss equals one process's.

The result for a block is plain JSON keyed by stable node keys (`passes.ir.node_keys`).

Cost (`ep_cost`, `rank_ep_degrees`): per MoE layer and rank, dispatch and combine forward
and their reverses backward each move M rows (M = N * K dropless, at most E * C otherwise),
payload M * row_bytes as `collectives.COUNTER` counts it; the receiving side of the
busiest rank carries `imbalance` times the mean (the routing-imbalance factor, max over
ranks of rows received / mean). Time per all-to-all by the alpha-beta model of
`autopar.cost.comm` on the ep axis's link; expert compute scales with the busiest rank's rows.

API: `detect_moe(gm) -> [MoEBlock]`, `router_stats(gm, blocks) -> [node key]`,
`ep_cost(blocks, mesh, ...) -> EPCost`, `rank_ep_degrees(...)` / `search_ep(gm, world, ...)`
(the ep dimension of the planner: every feasible degree, cheapest first),
`plan_experts(global_gm, mesh, ...) -> dict` (the `plan.extra["expert"]` entry), and
`parallelize_experts(model, mesh, ...)`, the parallelize glue for meshes with ep until
`autopar.parallelize` takes the ep axis.

Reads node.meta["autopar"] (shapes, modules) and node.meta["val"]; writes nothing on nodes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx

from autopar.passes import ir
from autopar.passes.rules.sharding import op_name

VIEWLIKE = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.unsqueeze", "aten.expand", "aten.slice",
            "aten.clone", "aten.contiguous", "aten.alias", "aten.to", "aten._to_copy", "aten.flatten"}
ROUTER_UNARY = {"aten.softmax", "aten._softmax", "aten.sigmoid", "aten.log_softmax", "aten.to", "aten._to_copy",
                "aten.clone", "aten.contiguous", "aten.alias"}
# ops that compute each output row from the same input row only (experts must be made of these)
ROW_WISE = {"aten.linear", "aten.silu", "aten.gelu", "aten.relu", "aten.mul", "aten.add", "aten.sub", "aten.div",
            "aten.neg", "aten.sigmoid", "aten.tanh", "aten.to", "aten._to_copy", "aten.clone", "aten.contiguous",
            "aten.chunk", "aten.split", "operator.getitem", "aten.pow", "aten.dropout", "aten.alias", "aten.mm",
            "aten.matmul", "aten.addmm", "aten.rms_norm", "aten.layer_norm", "aten._assert_tensor_metadata",
            "transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm", "aten.narrow",
            "aten.slice", "aten.split_with_sizes", "aten.erf", "aten.exp", "aten.square", "aten.relu6"}
SPLITS_DIM = {"aten.chunk": 2, "aten.split": 2, "aten.split_with_sizes": 2, "aten.narrow": 1, "aten.slice": 1}
GROUPED = {"transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm"}
REDUCTIONS = {"aten.sum", "aten.mean", "aten.histc"}


class MoEDetectError(ValueError):
    pass


def _base(n: fx.Node) -> str:
    """'aten.linear' for aten.linear.default (overload dropped)."""
    if n.op != "call_function":
        return n.op
    name = op_name(n.target)
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("aten", "transformers", "autopar", "prims") else name


def _shape(n) -> tuple | None:
    if not isinstance(n, fx.Node):
        return None
    i = ir.get_info(n)
    if i is not None and i.shape is not None:
        return i.shape
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(s if isinstance(s, int) else str(s) for s in val.shape)
    return None


def _tensorish(n) -> bool:
    if not isinstance(n, fx.Node) or n.op == "output":
        return False
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        return True
    return n.op == "get_attr" or _shape(n) is not None


def _sym(x) -> sympy.Expr:
    return sympy.sympify(x) if isinstance(x, str) else sympy.Integer(int(x))


def _same(a, b) -> bool:
    try:
        return sympy.simplify(_sym(a) - _sym(b)) == 0
    except (sympy.SympifyError, TypeError):
        return str(a) == str(b)


def _val_expr(x):
    """A capacity operand as a sympy expression (SymInt node or int)."""
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        if isinstance(v, int):
            return sympy.Integer(v)
        if isinstance(v, torch.SymInt):
            return sympy.sympify(str(v.node.expr))
    return None


@dataclass
class MoEBlock:
    """One detected MoE block (plain data; `to_json()` goes into plan.extra["expert"])."""

    module: str  # common module path of router and combine
    idiom: str  # "slots" | "sorted"
    n_experts: int
    top_k: int
    hidden: int  # D
    dtype: str
    tokens: str  # key of x (N, D)
    expert_index: str  # key of the router's indices (N, K)
    router: str  # key of the topk node
    gate: str | None  # router weight parameter
    combine: str  # key of the node with expert outputs in assignment order (N*K, D), replaced
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

    def to_json(self) -> dict:
        return asdict(self)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


# --- detection -----------------------------------------------------------------------------
class _Graph:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.keys = ir.node_keys(gm)
        self.dep: dict[fx.Node, bool] = {}
        for n in self.nodes:
            # data dependence on an input through tensors (sizes do not count: arange(N) is token-free)
            self.dep[n] = n.op == "placeholder" or any(self.dep.get(a, False) for a in n.all_input_nodes
                                                       if _tensorish(a))
        self.batch = None
        for n in self.nodes:
            if n.op == "placeholder" and _shape(n):
                self.batch = _shape(n)[0]
                break

    def tin(self, n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if _tensorish(a)]

    def closure(self, seeds) -> set:
        """Nodes computed from `seeds` whose other tensor inputs are all token-free or in the set."""
        out = set(seeds)
        start = min(self.order[s] for s in seeds)
        for n in self.nodes[start:]:
            if n in out or n.op != "call_function":
                continue
            ins = self.tin(n)
            if ins and any(a in out for a in ins) and all(a in out or not self.dep[a] for a in ins):
                out.add(n)
        return out

    def descendants(self, seeds) -> set:
        out = set(seeds)
        start = min(self.order[s] for s in seeds)
        for n in self.nodes[start:]:
            if any(a in out for a in n.all_input_nodes):
                out.add(n)
        return out

    def ancestors(self, n: fx.Node) -> set:
        out, stack = set(), [n]
        while stack:
            m = stack.pop()
            for a in m.all_input_nodes:
                if a not in out:
                    out.add(a)
                    stack.append(a)
        return out

    def token_major(self, n: fx.Node, n_tokens) -> bool:
        s = _shape(n)
        if not s:
            return False
        d0 = s[0]
        if isinstance(d0, str) and isinstance(self.batch, str):
            return any(str(f) == self.batch for f in _sym(d0).free_symbols)
        return any(isinstance(d0, int) and isinstance(t, int) and t and d0 % t == 0 for t in n_tokens)


def _router(g: _Graph, t: fx.Node):
    """(gate linear node, token rows node, E) if topk node `t` selects experts, else None."""
    inp = t.args[0]
    shape = _shape(inp)
    if not shape or len(shape) != 2:
        return None
    dim = t.args[2] if len(t.args) > 2 else t.kwargs.get("dim", -1)
    if dim not in (-1, 1):
        return None
    m = inp
    while isinstance(m, fx.Node) and _base(m) in ROUTER_UNARY:
        m = m.args[0]
    if not isinstance(m, fx.Node) or _base(m) != "aten.linear":
        return None
    w = m.args[1]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and _shape(w) and _shape(w)[0] == shape[1]):
        return None
    return m, m.args[0], int(shape[1])


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


def _params_feeding(g: _Graph, region: set) -> dict[str, fx.Node]:
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


def _check_row_wise(g: _Graph, region: set, starts: set, what: str) -> None:
    rows = region | starts
    for n in region:
        b = _base(n)
        mixes = n.op == "call_function" and b not in ROW_WISE
        if b in SPLITS_DIM:  # along the last dims only, never across rows (a full slice is a copy)
            pos = SPLITS_DIM[b]
            dim = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", 0)
            full = b == "aten.slice" and (n.args[2:3] or [0])[0] in (0, None) and \
                ((n.args[3:4] or [None])[0] is None or (n.args[3:4] or [0])[0] >= 2**62)
            mixes |= dim % max(1, len(_shape(n.args[0]) or ())) == 0 and not full
        if b in ("aten.unsqueeze", "aten.squeeze", "aten.transpose"):  # fine unless dim 0 moves
            nd = len(_shape(n.args[0]) or ()) + (b == "aten.unsqueeze")
            dims = [d for d in n.args[1:3] if isinstance(d, int)]
            mixes = not dims or any(d % max(1, nd) == 0 for d in dims)
        if b in ("aten.view", "aten.reshape"):  # (-1, trailing...) keeping the trailing size
            sizes, ins = list(n.args[1]), _shape(n.args[0]) or ()
            mixes = not (sizes and sizes[0] == -1 and all(isinstance(d, int) for d in sizes[1:]) and
                         all(isinstance(d, int) for d in ins[1:]) and math.prod(sizes[1:]) == math.prod(ins[1:]))
        if b in ("aten.mm", "aten.matmul"):  # rows times a weight, not a weight times rows
            mixes |= n.args[1] in rows or n.args[0] not in rows
        if mixes:
            raise MoEDetectError(f"{what}: {g.keys[n]} ({n.format_node()}) is not a row-wise op, so the experts "
                                 "cannot run on a different number of rows; expert parallelism does not apply")
        for a in list(n.args) + list(n.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(x, fx.Node) and not _tensorish(x) and b not in ("aten._assert_tensor_metadata",):
                    raise MoEDetectError(f"{what}: {g.keys[n]} uses the size {x.name}; expert ops must not "
                                         "depend on row counts")


def _flops_per_row(params: dict[str, fx.Node], per_expert: int) -> float:
    numel = sum(math.prod(int(s) for s in _shape(p)) for p in params.values())
    return 2.0 * numel / per_expert


def _block_module(g: _Graph, a: fx.Node, b: fx.Node) -> str:
    pa, pb = ir.info(a).module.split("."), ir.info(b).module.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _detect_one(g: _Graph, t: fx.Node) -> MoEBlock | None:
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
    for n in g.nodes[g.order[idx]:]:
        if n in I or n.op != "call_function":
            continue
        io = _index_of(n)
        if io is None or io[1] not in I:
            continue
        data = io[0]
        if disp and any(d in g.ancestors(data) for d in disp):
            comb = n
            break
        disp.append(n)
    if not disp or comb is None:
        return None
    scatter = [d for d in disp if _base(d) == "aten.index_add"]
    common = dict(n_experts=E, top_k=K, router=g.keys[t], expert_index=g.keys[idx], combine=g.keys[comb],
                  gate=str(lin.args[1].target), dtype=ir.info(comb).dtype or "float32")
    if scatter:
        return _slots(g, t, idx, I, scatter[0], comb, N, common)
    return _sorted(g, t, idx, I, disp, comb, N, common)


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
            side += math.prod(int(s) for s in _shape(data)[1:]) * _itemsize(ir.info(data).dtype or "float32")
        else:
            raise MoEDetectError(f"{where}: {g.keys[d]} gathers rows of {g.keys[data]} ({rows} rows), neither "
                                 f"tokens ({N}) nor assignments")
    if x is None:
        raise MoEDetectError(f"{where}: no gather of token rows")
    cdata, cindex = _index_of(comb)
    starts = set(gathers)
    region = (g.descendants(list(starts)) & (g.ancestors(cdata) | {cdata})) - starts
    _check_row_wise(g, region, starts, where)
    offsets = None
    for n in region:
        for a in g.tin(n):
            if a in region or a in starts or not g.dep[a]:
                continue
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
    return MoEBlock(module=_block_module(g, t, comb), idiom="sorted", hidden=int(_shape(x)[1]), tokens=g.keys[x],
                    gathers=out, offsets=g.keys[offsets] if offsets is not None else None,
                    combine_input=g.keys[cdata], expert_params={n: "dim0" for n in sorted(pe)},
                    flops_per_row=_flops_per_row(pe, E), side_row_bytes=side, **common)


def detect_moe(gm: fx.GraphModule) -> list[MoEBlock]:
    """Every MoE block of a captured graph, in graph order (empty for a dense model).
    Raises MoEDetectError naming the node when a router leads to a dispatch this module
    cannot take apart (an expert op that mixes rows, an unknown index pattern)."""
    g = _Graph(gm)
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
    g = _Graph(gm)
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


# --- cost ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EPCost:
    """What ep degree `ep` costs one rank per training step (forward + backward), all MoE blocks."""

    ep: int
    imbalance: float  # busiest rank's received rows / mean
    rows_sent: float  # per rank per step, all blocks (kept assignments)
    a2a_payload_bytes: float  # mean rank, COUNTER convention (all_to_all@ep)
    a2a_payload_bytes_max: float  # the busiest rank
    count_bytes: float  # all_gather of per-expert counts
    a2a_s: float  # all-to-all time on the busiest rank
    expert_s: float  # expert compute time on the busiest rank
    grad_sync_s: float  # averaging non-expert gradients over ep
    expert_param_bytes: float  # expert parameters held per rank
    total_s: float

    def summary(self) -> dict[str, float]:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def a2a_payload_bytes(rows_sent: float, rows_received: float, row_bytes: float, side_row_bytes: float = 0.0) -> float:
    """Payload `COUNTER` records for one MoE block's all-to-alls in one forward + backward on
    one rank: dispatch (rows_sent x (row_bytes + side)) and combine (rows_received x row_bytes)
    forward; their reverses backward (rows_sent x row_bytes, rows_received x (row_bytes + side))."""
    return (rows_sent + rows_received) * (2 * row_bytes + side_row_bytes)


def kept_rows(tokens: float, top_k: int, capacity_factor: float | None) -> float:
    """Assignments a rank sends per block on average: N * K dropless, at most cf * N * K with capacity."""
    return tokens * top_k * (1.0 if capacity_factor is None else min(1.0, capacity_factor))


def ep_cost(blocks: list[MoEBlock], mesh: Mapping[str, int], ep_axis: str = "ep", hardware="cpu-gloo", *,
            tokens_per_rank: float, imbalance: float = 1.0, capacity_factor: float | None = None,
            non_expert_param_bytes: float = 0.0, expert_tp: int = 1) -> EPCost:
    """Cost of the ep degree `mesh[ep_axis]` for `blocks`, `tokens_per_rank` tokens per rank
    per step (the batch is split over dp x ep; tensor-parallel peers share tokens).
    `expert_tp`: the tp degree the experts themselves are sharded over (their compute and
    parameters divide by it; the all-to-alls do not)."""
    from autopar.cost.comm import axis_links  # noqa: PLC0415
    from autopar.cost.hardware import load_profile  # noqa: PLC0415

    if imbalance < 1.0:
        raise ValueError(f"imbalance is the busiest rank's load over the mean, >= 1; got {imbalance}")
    hw = load_profile(hardware)
    ep = int(mesh.get(ep_axis, 1))
    if math.prod(mesh.values()) > hw.world_size:
        hw = hw.with_nodes(-(-math.prod(mesh.values()) // hw.gpus_per_node))
    link = axis_links(hw, dict(mesh)).get(ep_axis)
    sent = payload = payload_max = counts = a2a_s = expert_s = pbytes = 0.0
    for b in blocks:
        item = _itemsize(b.dtype)
        row = b.hidden * item
        m = kept_rows(tokens_per_rank, b.top_k, capacity_factor)
        m_max = m * imbalance if ep > 1 else m
        sent += m
        flops = 3 * m_max * b.flops_per_row  # forward + backward (2x)
        expert_s += flops / expert_tp / (hw.peak(_dtype_key(b.dtype)) * hw.eff("matmul"))
        pbytes += _expert_param_bytes(b) / ep / expert_tp
        if ep == 1:
            continue
        payload += a2a_payload_bytes(m, m, row, b.side_row_bytes)
        payload_max += a2a_payload_bytes(m, m_max, row, b.side_row_bytes)
        counts += b.n_experts * 8
        big = max(m, m_max)
        for rb in (row, row) * 2 + ((b.side_row_bytes,) * 2 if b.side_row_bytes else ()):
            a2a_s += link.time("all_to_all", big * rb)
        a2a_s += link.time("all_gather", b.n_experts * 8)
    grad_s = link.time("all_reduce", non_expert_param_bytes) if ep > 1 and non_expert_param_bytes else 0.0
    return EPCost(ep, imbalance, sent, payload, payload_max, counts, a2a_s, expert_s, grad_s, pbytes,
                  a2a_s + expert_s + grad_s)


def _dtype_key(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, "fp32")


def _expert_param_bytes(b: MoEBlock) -> float:
    return b.flops_per_row / 2 * b.n_experts * _itemsize(b.dtype)


def rank_ep_degrees(blocks: list[MoEBlock], world: int, hardware="cpu-gloo", *, global_tokens: float,
                    imbalance: float = 1.0, capacity_factor: float | None = None, non_expert_param_bytes: float = 0.0,
                    memory_budget_bytes: float | None = None, other_axes: Mapping[str, int] | None = None
                    ) -> list[EPCost]:
    """Every ep degree that divides the world (over `other_axes`) and every block's expert
    count, cheapest first; degrees whose expert parameters exceed `memory_budget_bytes` per
    rank are left out. The planner enumerates ep with the other mesh factors through this."""
    if not blocks:
        return []
    other = dict(other_axes or {})
    rest = world // math.prod(other.values()) if other else world
    E = math.gcd(*[b.n_experts for b in blocks])
    out = []
    for ep in range(1, rest + 1):
        if rest % ep or E % ep:
            continue
        mesh = {"dp": rest // ep, "ep": ep, **other}
        c = ep_cost(blocks, mesh, "ep", hardware, tokens_per_rank=global_tokens / rest, imbalance=imbalance,
                    capacity_factor=capacity_factor, non_expert_param_bytes=non_expert_param_bytes,
                    expert_tp=other.get("tp", 1))
        if memory_budget_bytes is not None and c.expert_param_bytes > memory_budget_bytes:
            continue
        out.append(c)
    return sorted(out, key=lambda c: (c.total_s, c.ep))


def measured_imbalance(routes) -> float:
    """Routing imbalance of recorded routes (runtime.moe.recording): max over ranks of rows
    received / mean, from the all-gathered counts each route holds (the worst layer)."""
    worst = 1.0
    for r in routes:
        P, El = r.ep, r.n_experts // r.ep
        table = r.counts
        recv = [sum(table[j][e] for j in range(P) for e in range(i * El, (i + 1) * El)) for i in range(P)]
        mean = sum(recv) / P
        if mean:
            worst = max(worst, max(recv) / mean)
    return worst


# --- the plan entry ----------------------------------------------------------------------------
def _hint(x) -> int | None:
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        h = x.node.hint
        return int(h) if h is not None else None
    return None


def plan_experts(global_gm: fx.GraphModule, mesh, *, ep_axis: str = "ep", dp_axis: str | None = "dp",
                 capacity_factor: float | None = None, hardware="cpu-gloo", imbalance: float = 1.0,
                 n_microbatches: int = 1, global_router_stats: bool = True) -> dict:
    """`plan.extra["expert"]` for a graph captured at the global batch on `mesh` (an autopar
    Mesh or {axis: size}). Empty when the model has no MoE block and ep is 1.

    capacity_factor: None keeps each block's own rule (dropless or the model's capacity);
    a number forces capacity C = min(Ng, ceil(cf * Ng * K / E)) per ep group of Ng tokens."""
    sizes = dict(getattr(mesh, "sizes", mesh))
    ep = sizes.get(ep_axis, 1)
    blocks = detect_moe(global_gm)
    if not blocks:
        if ep > 1:
            raise ValueError(f"the mesh has {ep_axis}={ep} but the model has no mixture-of-experts block (no top-k "
                             "router feeding an expert dispatch); use a mesh without the ep axis")
        return {}
    for b in blocks:
        if b.n_experts % ep:
            raise ValueError(f"MoE block {b.module!r} has {b.n_experts} experts, which do not divide over "
                             f"{ep_axis}={ep}; choose an ep degree that divides {b.n_experts}")
    batch_split = sizes.get(dp_axis, 1) * ep * n_microbatches if dp_axis else ep * n_microbatches
    tokens, other_bytes = _tokens_and_dense_bytes(global_gm, blocks)
    cost = ep_cost(blocks, sizes, ep_axis, hardware, tokens_per_rank=(tokens or 0) / batch_split,
                   imbalance=imbalance, capacity_factor=capacity_factor, non_expert_param_bytes=other_bytes,
                   expert_tp=sizes.get("tp", 1))
    return {"axis": ep_axis, "ep": ep, "blocks": {b.module: b.to_json() for b in blocks},
            "router_stats": router_stats(global_gm, blocks) if global_router_stats else [],
            "capacity_factor": capacity_factor, "global_router_stats": global_router_stats,
            "tokens_per_rank": (tokens or 0) / batch_split, "predicted": cost.summary(),
            "notes": [f"{len(blocks)} MoE blocks ({blocks[0].idiom}, {blocks[0].n_experts} experts, top-"
                      f"{blocks[0].top_k}) over {ep_axis}={ep}: {blocks[0].n_experts // ep} experts per rank, "
                      + ("dropless" if capacity_factor is None and all(b.dropless for b in blocks)
                         else f"capacity {'cf=' + str(capacity_factor) if capacity_factor else 'as the model'}")]}


def _tokens_and_dense_bytes(gm: fx.GraphModule, blocks: list[MoEBlock]) -> tuple[int | None, int]:
    """Tokens of the first block at the captured batch, and bytes of the non-expert parameters."""
    g = _Graph(gm)
    by_key = {k: n for n, k in g.keys.items()}
    val = by_key[blocks[0].tokens].meta.get("val")
    tokens = _hint(val.shape[0]) if isinstance(val, torch.Tensor) else None
    experts = {n for b in blocks for n in b.expert_params}
    dense = sum(p.numel() * p.element_size() for n, p in gm.named_parameters() if n not in experts)
    return tokens, dense


def search_ep(global_gm: fx.GraphModule, world: int, hardware="h100-sxm", *, other_axes: Mapping[str, int] | None = None,
              memory_budget_bytes: float | None = None, imbalance: float = 1.0,
              capacity_factor: float | None = None) -> list[EPCost]:
    """The ep degrees worth trying for a graph captured at the global batch on `world` ranks
    (with `other_axes` such as {"tp": 2} fixed), cheapest first: the planner's ep dimension."""
    blocks = detect_moe(global_gm)
    if not blocks:
        return []
    tokens, dense = _tokens_and_dense_bytes(global_gm, blocks)
    return rank_ep_degrees(blocks, world, hardware, global_tokens=tokens or 0, imbalance=imbalance,
                           capacity_factor=capacity_factor, non_expert_param_bytes=dense,
                           memory_budget_bytes=memory_budget_bytes, other_axes=other_axes)


# --- glue until autopar.parallelize takes "ep" ------------------------------------------------
def parallelize_experts(model, mesh, *, example_inputs, zero_stage: int = 0, capacity_factor: float | None = None,
                        hardware: str | None = None, sync_init: bool = True, dump_dir: str | None = None,
                        bucket_mb: float = 25.0):
    """`autopar.parallelize` for a mesh with an ep axis (and dp, tp): capture, the tp search,
    `plan_experts`, passes split_batch -> shard -> expert -> zero, and an `ExpertProgram`.
    Returns an `autopar.api.ParallelModel` (so `autopar.optimizer` works on it)."""
    import torch.distributed as dist  # noqa: PLC0415

    from autopar import api  # noqa: PLC0415
    from autopar.capture import capture  # noqa: PLC0415
    from autopar.passes.expert import expert  # noqa: PLC0415
    from autopar.passes.pass_manager import PassContext, PassManager  # noqa: PLC0415
    from autopar.passes.plan import Plan  # noqa: PLC0415
    from autopar.passes.shard import shard  # noqa: PLC0415
    from autopar.passes.split_batch import split_batch  # noqa: PLC0415
    from autopar.passes.zero import zero  # noqa: PLC0415
    from autopar.runtime.moe import ExpertProgram  # noqa: PLC0415

    sizes = dict(mesh.sizes)
    if sizes.get("pp", 1) > 1:
        raise ValueError("expert parallelism with pipeline parallelism is not wired yet; use a mesh without pp")
    plan = Plan(mesh=sizes, dp_axis="dp" if "dp" in sizes else None, zero_stage=zero_stage, bucket_mb=bucket_mb)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    split = sizes.get("dp", 1) * sizes.get("ep", 1)
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % split:
            raise ValueError(f"the example batch has {t.shape[0]} rows, which does not divide by dp x ep = {split}")
    global_gm = capture(model, args)
    if api._batch_is_static(global_gm) and split > 1:
        raise ValueError("the capture specialised the batch dim; expert parallelism needs a dynamic batch capture")
    hw = hardware or api._hardware(mesh)
    api._search_sharding(plan, global_gm, mesh, hw)
    plan.extra["expert"] = plan_experts(global_gm, mesh, capacity_factor=capacity_factor, hardware=hw,
                                        dp_axis=plan.dp_axis)
    plan.notes += plan.extra["expert"].get("notes", [])
    rank = dist.get_rank() if dist.is_initialized() else 0
    ctx = PassContext(plan=plan, mesh_sizes=sizes, coords=mesh.coords(rank))
    pm = PassManager([split_batch, shard, expert, zero], dump_dir=dump_dir)
    local_gm = pm.run(api._fresh(global_gm), ctx, tag=f"rank{rank}")
    info = local_gm.meta.get("autopar_expert", {})
    mp = {name: tuple(a for a, p in lay.axes if a != plan.dp_axis and type(p).__name__ == "Shard")
          for name, lay in plan.param_layouts.items()}
    program = ExpertProgram(local_gm, mesh, ep_axis="ep", expert_params=info.get("expert_params", ()),
                            engine_options={"model_parallel": mp},
                            dp_axis=plan.dp_axis, zero_stage=plan.zero_stage, bucket_mb=plan.bucket_mb,
                            in_spec=global_gm.meta.get("autopar_in_spec"),
                            out_spec=global_gm.meta.get("autopar_out_spec"), sync_init=sync_init)
    return api.ParallelModel(program, plan, local_gm, global_gm, list(pm.records),
                             global_gm.meta.get("autopar_capture", {}))
