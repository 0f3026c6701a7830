"""context_positions: make the graph run on this rank's chunk of the sequence (the `cp` axis).

Under context parallelism every rank runs the graph on its own tokens of each sequence (the
load-balanced zigzag chunks of `runtime.context_layout`): the graph was captured with a
symbolic sequence length, so the same code runs on the local length `t`. Token-wise work
(embeddings, norms, projections, the MLP, the logits) is then already right. What is not:

* values that depend on *positions* and not on the inputs (RoPE tables sliced to `[:T]`,
  position ids from `arange(T)`, learned position embeddings, masks built from positions).
  Here they are computed at the global length (every size argument that derives from the
  local length `t` becomes `cp_global_len(t, axis)` = t * cp), and where such a value meets
  the inputs' data it is taken at this rank's positions (`take_positions`, an index_select
  along each sequence dim). Attention masks, and everything computed only for them (from
  positions, or from position ids given as an input for packed documents), are left as they
  are: the `context_attention` pass evaluates them and removes them.
* ops that mix tokens of the sequence. Attention (`aten.scaled_dot_product_attention`) is the
  `context_attention` pass's (ring or Ulysses exchange). Anything else is refused here, naming
  the node: a T x T matrix of the data (attention written as matmul + softmax: use SDPA), a
  shift or slice of the sequence (`labels[..., 1:]`: shift the targets outside the model), a
  reduction over the sequence (a loss computed inside the model: compute it in loss_fn). Two
  MoE router ops are exact on a chunk and pass (`passes/context_routing.py`): a dropless
  router's queue positions (a running count that only picks slots of a buffer holding every
  token; with a capacity the drops depend on the whole batch's order, refused with that
  reason) and the router statistics of a load-balancing loss, which the plan must average over
  cp (`plan.extra["router_stats"]`, or the expert pass's list with ep: checked here).

The sequence is dim 1 of the first graph input; it must be symbolic (capture with a dynamic
sequence dim, as `parallelize` does on a mesh with a cp axis).

Reads: node.meta["val"] (symbolic shapes), node.meta["autopar"]; plan.extra["context"]
({"axis", "method"}), plan.extra["router_stats"] and plan.extra["expert"]["router_stats"]. Writes annotations on the nodes it inserts (copies of the node they
stand for, replicated). Guarantees: with cp = 1, or no context entry in the plan, the graph
is unchanged; afterwards no node outside attention consumes a global-length sequence value.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime.context_layout import cp_global_len, take_positions

from . import ir
from .context_routing import routing_exemptions
from .pass_manager import PassContext

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ASSERT_META = torch.ops.aten._assert_tensor_metadata.default


def context_axis(ctx: PassContext) -> tuple[str, int] | None:
    """(axis, size) of the plan's context-parallel axis, or None when there is none (or it is 1)."""
    entry = (getattr(ctx.plan, "extra", None) or {}).get("context")
    if not entry:
        return None
    axis = entry.get("axis", "cp")
    k = ctx.mesh_sizes.get(axis, 1)
    return (axis, k) if k > 1 else None


def context_positions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    found = context_axis(ctx)
    if found is None:
        return gm
    axis, _ = found
    g = gm.graph
    first, seq = sequence_symbol(gm)
    data = data_nodes(gm)
    masks = mask_only_nodes(gm)
    _refuse_token_mixing(gm, data - masks, seq, averaged=_router_stats_averaged(ctx, axis))

    local_len = _local_len_node(g, first)
    twins: dict[fx.Node, fx.Node] = {}

    def local_sym(s) -> bool:
        return isinstance(s, fx.Node) and _is_symint(s) and seq in _free(s) and \
            (any(a in data for a in s.all_input_nodes) or any(local_sym(a) for a in s.all_input_nodes))

    def twin(s: fx.Node) -> fx.Node:
        """The global-length counterpart of a symint that derives from the local length."""
        if s in twins:
            return twins[s]
        if s.target is torch.ops.aten.sym_size.int:
            with g.inserting_after(s):
                m = g.call_function(cp_global_len, (s, axis))
        else:
            args = [twin(a) if local_sym(a) else a for a in s.args]
            with g.inserting_after(s):
                m = g.call_function(s.target, tuple(args), dict(s.kwargs))
        ir.copy_meta(s, m)
        twins[s] = m
        return m

    def glob(a):
        if isinstance(a, fx.Node):
            return twin(a) if local_sym(a) else a
        if isinstance(a, (list, tuple)):
            return type(a)(glob(x) for x in a)
        return a

    # 1. position-only tensors are computed at the global length
    for n in list(g.nodes):
        if n.op == "call_function" and n not in data and _is_tensor(n):
            args, kwargs = glob(n.args), {k: glob(v) for k, v in n.kwargs.items()}
            if args != n.args or kwargs != n.kwargs:
                n.args, n.kwargs = args, kwargs

    # 2. ... and taken at this rank's positions where they meet the data
    taken: dict[fx.Node, fx.Node] = {}
    for n in list(g.nodes):
        if n not in data or n.op != "call_function" or n in masks:
            continue
        for p in n.all_input_nodes:
            if p in data or not _is_tensor(p) or p in masks:
                continue
            dims = seq_dims(p, seq)
            if not dims:
                continue
            if p not in taken:
                with g.inserting_before(n):
                    m = g.call_function(take_positions, (p, dims, local_len, axis))
                ir.copy_meta(p, m)
                ir.update(m, kind="op", param=None)
                taken[p] = m
            n.replace_input_with(p, taken[p])
    return gm


def _router_stats_averaged(ctx: PassContext, axis: str) -> set[str]:
    """Keys of the router statistics the plan has averaged over `axis`: without ep
    plan.extra["router_stats"] (axes listed), with ep the expert pass's list (it averages over
    the batch axes, cp among them)."""
    extra = getattr(ctx.plan, "extra", None) or {}
    stats = extra.get("router_stats") or {}
    out = set(stats.get("keys", [])) if axis in stats.get("axes", []) else set()
    spec = extra.get("expert") or {}
    if spec.get("blocks") and spec.get("global_router_stats", True):
        out |= set(spec.get("router_stats", []))
    return out


# --- what the graph says about the sequence ---------------------------------------------------
def sequence_symbol(gm: fx.GraphModule):
    """(first input node, the sympy symbol of its dim 1): the sequence length."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 2:
            size = v.shape[1]
            if isinstance(size, int) or not hasattr(size, "node"):
                raise ValueError(f"context parallelism needs the sequence dim (dim 1 of input {n.name}) captured as "
                                 f"symbolic, but it was captured as the constant {size}; capture with "
                                 "dynamic_shapes marking dim 1 as Dim.AUTO (parallelize does this on a mesh with a cp axis)")
            expr = size.node.expr
            if not getattr(expr, "is_Symbol", False):
                raise ValueError(f"the sequence dim of input {n.name} was captured as {expr}, not a free size; "
                                 "context parallelism needs the model to accept any sequence length")
            return n, expr
    raise ValueError("context parallelism needs an input with a sequence dim (a (batch, seq, ...) tensor); "
                     "the graph has none")


def data_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value is computed from the graph's inputs (different on each cp rank):
    tensors, and the tuples of multi-output ops (chunk, split) whose items are tensors.
    Sizes (symints) are not data."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:  # topological order
        v = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(v, torch.Tensor):
                out.add(n)
        elif n.op == "call_function" and isinstance(v, (torch.Tensor, tuple, list)) \
                and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def seq_dims(n: fx.Node, seq) -> list[int]:
    """Dims of `n`'s value whose size is exactly the sequence length."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return []
    return [d for d, s in enumerate(v.shape) if not isinstance(s, int) and s.node.expr == seq]


def check_context_parallel(gm: fx.GraphModule) -> None:
    """ValueError, naming the node, when the captured graph cannot run on a chunk of the
    sequence (see the module docstring); the planner calls it before any pass runs."""
    _, seq = sequence_symbol(gm)
    _refuse_token_mixing(gm, data_nodes(gm) - mask_only_nodes(gm), seq)


def _refuse_token_mixing(gm: fx.GraphModule, data: set[fx.Node], seq, averaged: set[str] | None = None) -> None:
    """ValueError naming the first node that mixes tokens of the sequence. A dropless MoE
    router's queue positions and its statistics are exact on a chunk (passes/context_routing.py);
    `averaged`: the keys of the router statistics the plan averages over cp (None: the caller
    plans before any plan exists; the pass then checks the plan's list)."""
    routing = routing_exemptions(gm, data, seq)
    keys = ir.node_keys(gm) if averaged is not None and routing.stats else {}
    for n in gm.graph.nodes:
        if n not in data or n.op != "call_function" or n.target is SDPA or not _is_tensor(n):
            continue
        if n in routing.scans:
            continue
        where = f"node {n.name} ({n.format_node()}) in {ir.info(n).module or 'the model'}"
        if n in routing.stats:
            if averaged is None or keys[n] in averaged:
                continue
            raise ValueError(f"{where} is an MoE router statistic (a mean over the tokens for the load-balancing "
                             "loss), and the plan does not average it over the cp ranks (plan.extra['router_stats'] "
                             f"lists {sorted(averaged)[:4]}), so each rank's loss would use its own chunk's statistic: "
                             "let parallelize complete the plan (drop a pinned extra['router_stats']), or use a mesh "
                             "without cp")
        if n in routing.refused_scans:
            raise ValueError(f"{where} scans along the tokens: {routing.refused_scans[n]}, and under context "
                             "parallelism each rank holds only its chunk of the sequence. Use dropless routing "
                             "(capacity_factor=None), or a mesh without cp")
        shape = n.meta["val"].shape
        exprs = [s.node.expr for s in shape if not isinstance(s, int)]
        if sum(1 for e in exprs if e == seq) >= 2:
            raise ValueError(f"{where} builds a sequence x sequence matrix of the data (attention written out as "
                             "matmul + softmax?); context parallelism exchanges attention only through "
                             "aten.scaled_dot_product_attention: use F.scaled_dot_product_attention "
                             "(transformers: attn_implementation='sdpa'), or a mesh without cp")
        if n not in routing.slots and any(e.is_Add and seq in e.free_symbols for e in exprs):
            raise ValueError(f"{where} shifts or slices the sequence (a length of {next(e for e in exprs if e.is_Add)}); "
                             "under context parallelism every rank holds only its tokens. Shift targets outside "
                             "the model (pass inputs and next-token targets, compute the loss in loss_fn), "
                             "or use a mesh without cp")
        scan = _SCANS.get(getattr(n.target, "overloadpacket", None))
        if scan is not None and isinstance(n.args[0], fx.Node):
            src = n.args[0].meta.get("val")
            dims = scan(n)
            hit = [d for d in dims if isinstance(src, torch.Tensor) and -src.dim() <= d < src.dim()
                   and not isinstance(src.shape[d], int) and seq in src.shape[d].node.expr.free_symbols]
            if hit:
                raise ValueError(f"{where} scans along the sequence (dim {hit[0]}); under context parallelism "
                                 "each rank holds only its tokens, so a running sum, difference, flip or roll "
                                 "over the sequence cannot be computed locally: use a mesh without cp")
        if n.target in _META_ONLY:  # reads only its input's dtype and device
            continue
        ins = [a for a in n.all_input_nodes if a in data and _is_tensor(a) and seq in _free(a)]
        if ins and seq not in set().union(*(e.free_symbols for e in exprs)) and n.target is not torch.ops.aten.sym_size.int:
            raise ValueError(f"{where} reduces over the sequence (a loss or pooling inside the model?); under "
                             "context parallelism each rank holds only its tokens. Return per-token outputs "
                             "and compute the loss in loss_fn (it is averaged over the cp ranks), or use a "
                             "mesh without cp")


def _dims(x) -> list[int]:
    return [int(d) for d in x] if isinstance(x, (list, tuple)) else [int(x)]


_aten = torch.ops.aten
_META_ONLY = {_aten.new_zeros.default, _aten.new_ones.default, _aten.new_empty.default, _aten.new_full.default}
# ops that mix tokens along a dim: the dims they run along, from their arguments
_SCANS = {
    _aten.cumsum: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dim"]),
    _aten.cumprod: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dim"]),
    _aten.cummax: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dim"]),
    _aten.cummin: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dim"]),
    _aten.logcumsumexp: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dim"]),
    _aten.diff: lambda n: _dims(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)),
    _aten.flip: lambda n: _dims(n.args[1] if len(n.args) > 1 else n.kwargs["dims"]),
    _aten.roll: lambda n: _dims(n.args[2] if len(n.args) > 2 else n.kwargs.get("dims", [])),
}


def mask_only_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The attention masks of scaled_dot_product_attention calls and the nodes computed only
    for them (every user is one of them, or reads it as the mask)."""
    roots = {m for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA
             for m in [sdpa_mask(n)] if isinstance(m, fx.Node)}
    out: set[fx.Node] = set()
    for n in reversed(gm.graph.nodes):  # users before their inputs
        if n.op != "call_function":
            continue
        users = [u for u in n.users if u.target is not _ASSERT_META]
        if n in roots and all(u.target is SDPA and sdpa_mask(u) is n and n not in u.args[:3] for u in users):
            out.add(n)
        elif users and all(u in out for u in users):
            out.add(n)
    return out


def sdpa_mask(n: fx.Node):
    """The attn_mask argument of a scaled_dot_product_attention node (None when absent)."""
    if len(n.args) > 3:
        return n.args[3]
    return n.kwargs.get("attn_mask")


def _local_len_node(g: fx.Graph, first: fx.Node) -> fx.Node:
    for n in g.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int and n.args == (first, 1):
            return n
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_after(last_ph):
        m = g.call_function(torch.ops.aten.sym_size.int, (first, 1))
    m.meta["val"] = first.meta["val"].shape[1]
    ir.set_info(m, ir.NodeInfo(shape=None, dtype=None, module="", kind="op"))
    return m


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _is_symint(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.SymInt)


def _free(n: fx.Node) -> set:
    v = n.meta.get("val")
    if isinstance(v, torch.SymInt):
        return set(v.node.expr.free_symbols)
    if isinstance(v, torch.Tensor):
        out: set = set()
        for s in v.shape:
            if not isinstance(s, int):
                out |= s.node.expr.free_symbols
        return out
    return set()


__all__ = ["context_positions", "context_axis", "check_context_parallel", "sequence_symbol", "data_nodes", "seq_dims",
           "mask_only_nodes", "sdpa_mask"]
