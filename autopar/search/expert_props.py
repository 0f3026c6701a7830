"""The two properties MoE detection tests on a graph (`search/expert_detect.py` walks the
blocks): what a router is, and whether an op between dispatch and combine is row-wise.

* A *router* is an `aten.topk` over the last dim of a token-major (N, E) score whose
  ancestors hold a linear map of token rows x (N, D) by a parameter weight (E, D) (through
  casts). Whatever lies between the linear map and the top-k is free: softmax or sigmoid
  scores, a per-expert correction bias, group-limited selection (a top-k over groups whose
  mask fills the scores), so DeepSeek-V3 / Glm4-MoE / Dots1 routers are routers as much as
  Mixtral's. The top-k over groups (N, G) is not one: no (G, D) weight maps tokens to it.
* An op is *row-wise* when its sharding rule (`passes/rules/sharding_table.py`, the one
  table) has a strategy that takes every row input as S(0), every other input replicated,
  and gives S(0): each output row then comes from the same input row, so the op runs on any
  number of rows. The probe lifts divisibility (it asks about the op, not a mesh). A view
  must also keep the row count free (`-1` leading), since the experts run on a rank's rows.

API: `find_router(t, index=None) -> (linear, tokens, E) | None` (`RouterIndex(nodes, order)`
bounds its walk per graph), `router_failure(t) -> str` (why a top-k
is not a router), `row_wise_failure(n, rows, dim=0) -> str | None` (why an op is not row-wise,
naming its rule; `dim` holds the rows). Reads node.meta["autopar"] and node.meta["val"];
writes nothing.
"""
from __future__ import annotations

import math

import torch.fx as fx

from autopar.passes import ir
from autopar.passes.rules import sharding_table  # noqa: F401  (registers the rules)
from autopar.passes.rules.sharding import RULES, OpView, Replicate, Shard, is_tensor, op_name, value_shape

# casts and views a router weight may pass through between its parameter and the linear map
WEIGHT_CASTS = {"aten.to", "aten._to_copy", "aten.clone", "aten.contiguous", "aten.alias", "aten.detach",
                "aten.type_as"}


# ops an index tensor passes through on its way to a scatter or a leaf (views, casts)
PASS_THROUGH = ("aten.view", "aten.reshape", "aten.unsqueeze", "aten.expand", "aten.to", "aten._to_copy",
                "aten.clone", "aten.contiguous", "aten.alias")


def users_through(start: fx.Node, through=PASS_THROUGH):
    """(read, user) for every node that reads `start` directly or through a chain of `through`
    ops, each user once: `read` is the node it reads (`start` or the last op of the chain)."""
    stack, seen = [start], set()
    while stack:
        m = stack.pop()
        for u in m.users:
            if u in seen:
                continue
            seen.add(u)
            yield m, u
            if base_name(u) in through:
                stack.append(u)


def base_name(n: fx.Node) -> str:
    """'aten.linear' for aten.linear.default (overload dropped)."""
    if n.op != "call_function":
        return n.op
    name = op_name(n.target)
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("aten", "transformers", "autopar", "prims") else name


def param_of(w) -> fx.Node | None:
    """The parameter get_attr node behind a weight argument (through casts), or None."""
    while isinstance(w, fx.Node) and w.op == "call_function" and base_name(w) in WEIGHT_CASTS:
        w = w.args[0]
    if isinstance(w, fx.Node) and w.op == "get_attr":
        i = ir.get_info(w)
        if i is None or i.kind == "param":
            return w
    return None


def _scores(t: fx.Node) -> tuple[fx.Node, tuple] | str:
    inp = t.args[0]
    shape = value_shape(inp) if isinstance(inp, fx.Node) else None
    if not shape or len(shape) != 2:
        return f"it selects over a {len(shape or ())}-d tensor, not token scores (N, E)"
    at = 2 if base_name(t) == "aten.topk" else 1  # topk(x, k, dim); max(x, dim) / argmax(x, dim)
    dim = t.args[at] if len(t.args) > at else t.kwargs.get("dim", -1)
    if dim not in (-1, 1):
        return f"it selects along dim {dim}, not over experts (the last dim)"
    return inp, shape


class RouterIndex:
    """Where router linear maps can be, per graph: for each (N, E) output shape, the position of
    the first linear node with that output whose weight is a parameter (E, ...). `find_router`
    with it skips a top-k whose shape no linear map gives (DeepSeek-V3's top-k over expert
    groups) and never walks above the first candidate, which its breadth-first walk could not
    find there: nodes earlier than every candidate have only earlier ancestors. Without the
    index that walk visits every ancestor of each such top-k, the whole graph above it."""

    def __init__(self, nodes: list[fx.Node], order: dict[fx.Node, int]):
        self.order = order
        self.first: dict = {}
        for n in nodes:
            if n.op != "call_function" or base_name(n) != "aten.linear" or len(n.args) < 2:
                continue
            w, shape = param_of(n.args[1]), value_shape(n)
            if w is None or not shape or len(shape) != 2 or not value_shape(w) or value_shape(w)[0] != shape[1]:
                continue
            try:
                self.first.setdefault(tuple(shape), self.order[n])
            except TypeError:  # an unhashable size: no bound for this shape
                self.first[None] = 0

    def floor(self, shape) -> int | None:
        """The first position a router linear map of output `shape` can have; None: none can."""
        if None in self.first:
            return 0
        try:
            return self.first.get(tuple(shape))
        except TypeError:
            return 0


def find_router(t: fx.Node, index: RouterIndex | None = None):
    """(router linear node, token rows node, E) when top-k node `t` (or a max / argmax over the
    last dim, for `expert_reasons`) selects experts per token:
    the nearest linear map among its input's ancestors whose weight is a parameter (E, D) and
    whose output has the top-k input's shape. None otherwise. `index` (the graph's
    `RouterIndex`) bounds the walk; the answer is the same with or without it."""
    s = _scores(t)
    if isinstance(s, str):
        return None
    inp, shape = s
    lo = 0
    if index is not None:
        lo = index.floor(shape)
        if lo is None:
            return None
    order = index.order if index is not None else None
    seen, frontier = {inp}, [inp]
    while frontier:  # breadth first: the nearest linear map wins
        nxt = []
        for m in frontier:
            if m.op == "call_function" and base_name(m) == "aten.linear":
                w = param_of(m.args[1])
                if w is not None and value_shape(w) and value_shape(w)[0] == shape[1] and \
                        value_shape(m) == shape:
                    return m, m.args[0], int(shape[1])
            for a in m.all_input_nodes:
                if a not in seen and a.op == "call_function" and (order is None or order[a] >= lo):
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return None


def router_failure(t: fx.Node) -> str:
    """Why top-k node `t` is not an expert router (for errors)."""
    s = _scores(t)
    if isinstance(s, str):
        return s
    return (f"no linear map of token rows by a parameter weight ({s[1][1]}, D) feeds its scores "
            f"{s[0].name} {tuple(s[1])}")


def row_wise_failure(n: fx.Node, rows: set, dim: int = 0) -> str | None:
    """None when `n` is row-wise in its row inputs `rows` by its sharding rule; else why not.
    `dim`: the dim that holds the rows (dense experts' (E, N, ...) tensors keep tokens in dim 1)."""
    op = op_name(n.target)
    if op == "operator.getitem":
        return None  # an element of a row-wise tuple op (chunk, split): rows stay rows
    fn = RULES.get(op)
    if fn is None and _inplace_of(op) in RULES:  # x.add_(y) keeps rows apart exactly when x.add(y) does
        fn = RULES[_inplace_of(op)]
    if fn is None:
        return f"{op} has no sharding rule in passes/rules/sharding_table.py"
    inputs = [a for a in n.all_input_nodes if is_tensor(a)]
    args_t = [a for a in _flat((n.args, n.kwargs)) if is_tensor(a)]
    v = _RowProbe(node=n, op=op, k=2, axis="rows", args_t=args_t, inputs=inputs)
    try:
        strategies = fn(v)
    except (IndexError, TypeError, KeyError) as e:
        return f"its rule for {op} cannot read this call ({type(e).__name__}: {e})"
    want = [Shard(dim) if a in rows else None for a in args_t]
    out_ok = (Shard(dim),) if value_shape(n) is not None else (None, Shard(dim))
    for s in strategies:
        # None: the op reads only that input's dtype / device
        if s.out in out_ok and len(s.ins) == len(want) and all(
                p is None or (p == w if w is not None else isinstance(p, Replicate)) for p, w in zip(s.ins, want)):
            break
    else:
        return f"its rule for {op} has no strategy S({dim}) on the rows -> S({dim}) (the op mixes rows)"
    b = base_name(n)
    # (-1, trailing...) keeping the trailing size
    if dim == 0 and b in ("aten.view", "aten.reshape", "aten._unsafe_view"):
        sizes, ins = list(n.args[1]), value_shape(n.args[0]) or ()
        if not (sizes and sizes[0] == -1 and all(isinstance(d, int) for d in sizes[1:]) and
                all(isinstance(d, int) for d in ins[1:]) and math.prod(sizes[1:]) == math.prod(ins[1:])):
            return f"it reshapes rows to {sizes}, fixing the row count"
    return None


def _inplace_of(op: str) -> str | None:
    """"aten.add.Tensor" for the in-place "aten.add_.Tensor" (None for any other name)."""
    parts = op.split(".")
    if len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_"):
        return ".".join([parts[0], parts[1][:-1], *parts[2:]])
    return None


class _RowProbe(OpView):
    """An OpView that allows sharding any dim: the probe asks whether the op keeps rows apart,
    not whether a mesh axis divides them."""

    def can_shard(self, shape: tuple, d: int, who: fx.Node | None = None) -> bool:
        return 0 <= d < len(shape)


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [z for y in x for z in _flat(y)]
    if isinstance(x, dict):
        return [z for y in x.values() for z in _flat(y)]
    return [x]
