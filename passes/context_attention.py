"""context_attention: attention over the whole sequence when each rank holds a chunk of it.

Runs after `context_positions` and `shard` (so it sees this rank's heads under tp). Every
`aten.scaled_dot_product_attention` becomes the exchange the plan names
(`plan.extra["context"]["method"]`):

    ring      ring_attention(q, k, v, axis, is_causal, scale): K/V blocks travel
              around the cp ring (send/recv overlapped with the block computation), partial
              results merged through their log-sum-exp;
    ulysses   ulysses_attention(...): all-to-all from sequence- to head-sharded
              and back (needs this rank's heads divisible by cp).

Masks are evaluated here as one process would compute them, at small lengths: a mask built
from positions only (transformers builds one from `arange(T)`) is recognised as causal
(-> is_causal=True) or as no mask; a mask built from position ids given as an input, as
causal within the documents they delimit (packed sequences: a document starts where the
position does not continue; the exchange then carries each token's document index,
`runtime.context_layout.cp_document_ids`). The mask's computation is then removed. Any other
mask (padding, sliding windows) and attention dropout are refused, naming the node.

Grouped-query attention whose kv heads the model repeats before attention (models/gpt.py,
transformers' `repeat_kv`: `reshape(expand(unsqueeze(k)))`, `unrepeated_kv`) exchanges the kv
heads themselves (the runtime's exchanges take Hkv < Hq heads as `enable_gqa` does): the ring
moves Hq / Hkv times fewer K/V bytes; the repeat's nodes are removed.

Reads: node.meta["val"], node.meta["autopar"] (local_shape), plan.extra["context"].
Writes: annotations of the nodes it inserts (those of the SDPA node they replace; a transpose
of the unrepeated K/V gets that node's layout and its own shapes).
Guarantees: no scaled_dot_product_attention is left in a graph with a cp axis > 1; the
graph is unchanged without one.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime.context_attention import doc_ids_from_positions, ring_attention, ulysses_attention
from autopar.runtime.context_layout import cp_global_len

from . import ir
from .context_positions import SDPA, context_axis, sequence_symbol
from .pass_manager import PassContext

METHODS = ("ring", "ulysses")
_ASSERT_META = torch.ops.aten._assert_tensor_metadata.default


def context_attention(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    found = context_axis(ctx)
    if found is None:
        return gm
    axis, k = found
    method = ctx.plan.extra["context"].get("method", "ring")
    if method not in METHODS:
        raise ValueError(f"context-parallel method {method!r} is not one of {METHODS}")
    target = ring_attention if method == "ring" else ulysses_attention
    g = gm.graph
    _, seq = sequence_symbol(gm)
    dead_masks = []
    for n in [n for n in g.nodes if n.op == "call_function" and n.target is SDPA]:
        q, key, v = n.args[:3]
        opt = dict(zip(("attn_mask", "dropout_p", "is_causal"), n.args[3:6]), **n.kwargs)
        where = f"attention node {n.name} in {ir.info(n).module or 'the model'}"
        if opt.get("dropout_p") or 0.0:
            raise ValueError(f"{where} has dropout_p={opt['dropout_p']}; attention dropout is not supported under "
                             "context parallelism: set the attention dropout to 0 or use a mesh without cp")
        causal = bool(opt.get("is_causal", False))
        mask, doc = opt.get("attn_mask"), None
        if mask is not None:
            kind, source = mask_kind(gm, mask, seq)
            if kind == "other":
                raise ValueError(f"{where} takes a mask that is neither causal, nor empty, nor causal within the "
                                 "documents that position ids delimit (padding, a sliding window, chunked "
                                 "attention?); under context parallelism attention supports those three: drop "
                                 "the attention mask (pack documents and pass position_ids instead of padding), "
                                 "or use a mesh without cp")
            causal = causal or kind in ("causal", "document_causal")
            if kind == "document_causal":  # documents from the position ids, over the whole sequence
                with g.inserting_before(n):
                    ids = g.call_function(torch.ops.autopar.cp_document_ids.default, (source, axis))
                    rows = g.call_function(torch.ops.aten.sym_size.int, (q, 0))
                    doc = g.call_function(torch.ops.aten.expand.default, (ids, [rows, -1]))
                for new in (ids, rows, doc):
                    ir.set_info(new, ir.NodeInfo(shape=ir.info(source).shape if new is not rows else None,
                                                 dtype="int64" if new is not rows else None,
                                                 module=ir.info(n).module, kind="op"))
            dead_masks.append(mask)
        if method == "ulysses":
            heads = (ir.info(q).local_shape or ir.info(q).shape)[1]
            if isinstance(heads, int) and heads % k:
                raise ValueError(f"{where}: Ulysses attention splits this rank's {heads} query heads over cp={k}, "
                                 f"which does not divide them; use method='ring' or a cp size that divides {heads}")
        repeated = []  # grouped-query K/V repeated to the query heads: exchange the kv heads (enable_gqa)
        with g.inserting_before(n):
            for name, x in (("key", key), ("value", v)):
                found = unrepeated_kv(x)
                if found is None:
                    continue
                src, transposed = found
                if transposed:  # (B, T, Hkv, D) -> (B, Hkv, T, D), laid out as the repeated one
                    t = g.call_function(torch.ops.aten.transpose.int, (src, 1, 2))
                    ir.copy_meta(x, t)
                    val, info = src.meta.get("val"), ir.get_info(src)
                    if isinstance(val, torch.Tensor):
                        t.meta["val"] = val.transpose(1, 2)
                    if info is not None:
                        swap = lambda sh: None if sh is None else (sh[0], sh[2], sh[1], *sh[3:])  # noqa: E731
                        ir.update(t, shape=swap(info.shape), local_shape=swap(info.local_shape))
                    src = t
                repeated.append(x)
                key, v = (src, v) if name == "key" else (key, src)
            m = g.call_function(target, (q, key, v, axis, causal, opt.get("scale"))
                                + ((doc,) if doc is not None else ()))
        ir.copy_meta(n, m)
        n.replace_all_uses_with(m)
        g.erase_node(n)
        _erase_unused(g, repeated)
    _erase_unused(g, dead_masks)
    return gm


_IDENTITY_END = 2**62  # a slice to at least this is `x[:]` along its dim


def unrepeated_kv(x: fx.Node) -> tuple[fx.Node, bool] | None:
    """Grouped-query attention's repeat of the kv heads feeding attention, read backwards:
    `[transpose(1, 2)] reshape(expand(unsqueeze(k0, h + 1)))` (models/gpt.py, transformers'
    `repeat_kv`), the new dim expanded r times and merged into k0's head dim h, so that head
    j r + i is kv head j (what `enable_gqa` computes from k0 itself). Returns (k0, whether a
    transpose(1, 2) must be applied to it to put its heads at dim 1), or None for anything else.
    Shapes are checked on this rank's shapes (`local_shape` after tp) where the graph has them."""
    transposed = False
    n = x
    if _is(n, torch.ops.aten.transpose.int) and sorted(n.args[1:3]) == [1, 2]:
        transposed, n = True, n.args[0]
    if not (_is(n, torch.ops.aten.reshape.default) or _is(n, torch.ops.aten.view.default)):
        return None
    e = n.args[0]
    if not _is(e, torch.ops.aten.expand.default) or not _is(e.args[0], torch.ops.aten.unsqueeze.default):
        return None
    u_node = e.args[0]
    src = u_node.args[0]
    while _is(src, torch.ops.aten.slice.Tensor) and _identity_slice(src):
        src = src.args[0]
    s, es, rs = _shape(src), _shape(e), _shape(n)
    if s is None or es is None or rs is None or len(s) != 4 or len(es) != 5 or len(rs) != 4:
        return None
    u = u_node.args[1] % 5
    h = u - 1
    if h != (2 if transposed else 1) or not isinstance(es[u], int) or not isinstance(s[h], int):
        return None
    same = [str(a) == str(b) for a, b in zip(es[:u] + es[u + 1:], s)]
    merged = list(s[:h]) + [s[h] * es[u]] + list(s[h + 1:])
    if not all(same) or [str(a) for a in rs] != [str(a) for a in merged] or len(x.users) != 1:
        return None
    return src, transposed


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _identity_slice(n: fx.Node) -> bool:
    start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start")
    end = n.args[3] if len(n.args) > 3 else n.kwargs.get("end")
    step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= _IDENTITY_END)) and step in (None, 1)


def _shape(n: fx.Node) -> tuple | None:
    i = ir.get_info(n)
    if i is not None and i.local_shape is not None:
        return tuple(i.local_shape)
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def mask_kind(gm: fx.GraphModule, mask: fx.Node, seq) -> tuple[str, fx.Node | None]:
    """What an attention mask is, evaluated as one process would compute it: ("causal", None),
    ("none", None) (every key visible), ("document_causal", position_ids input) (causal within
    the documents that the position ids delimit: a document starts where the position does
    not continue the previous one, as transformers' packed-sequence masks), or ("other", None).
    Masks are evaluated at small lengths (booleans: True attends; floats: 0 attends, -inf or a
    huge negative blocks): from sizes only, or from one integer (batch, seq) input."""
    inputs = [a for a in _ancestors(mask) if a.op == "placeholder"]
    if not inputs:
        kinds = {_classify(_value(gm, mask, seq, t, {}), None) for t in (4, 6)}
        return (kinds.pop(), None) if len(kinds) == 1 else ("other", None)
    src = inputs[0]
    v = src.meta.get("val")
    if len(inputs) > 1 or not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dim() != 2 or \
            isinstance(v.shape[1], int) or v.shape[1].node.expr != seq:
        return "other", None
    rows = 1 if isinstance(v.shape[0], int) and v.shape[0] == 1 else 2
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])[:rows]
    plain = torch.arange(12).expand(rows, 12)
    kinds = {_classify(_value(gm, mask, seq, 12, {src: pos}), pos) for pos in (packed, plain)}
    return ("document_causal", src) if kinds == {"document_causal"} else ("other", None)


def _value(gm, mask, seq, t, inputs):
    try:
        return evaluate(gm, mask, seq, t, inputs)
    except _Unknown:
        return None


def _classify(m: torch.Tensor | None, positions: torch.Tensor | None) -> str:
    if m is None or m.dim() < 2:
        return "other"
    if m.dtype == torch.bool:
        attend = m
    else:
        attend = m == 0
        if not bool(((m == 0) | (m <= -1e30)).all()):
            return "other"
    t = attend.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if positions is not None:
        doc = doc_ids_from_positions(positions)  # (B, T)
        same = doc[:, None, :, None] == doc[:, None, None, :]  # (B, 1, T, T)
        want = causal & same
        if attend.shape[0] != want.shape[0] and attend.shape[0] != 1:
            return "other"
        return "document_causal" if bool((attend.expand_as(want) == want).all()) else "other"
    if bool((attend == causal).all()):
        return "causal"
    return "none" if bool(attend.all()) else "other"


class _Unknown(Exception):
    """The value depends on something not known while planning (inputs, meta tensors)."""


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and what it is computed from; sizes (sym_size) are leaves: they are bound, not read."""
    need, stack = set(), [node]
    while stack:
        a = stack.pop()
        if a not in need:
            need.add(a)
            if a.target is not torch.ops.aten.sym_size.int:
                stack.extend(a.all_input_nodes)
    return need


def evaluate(gm: fx.GraphModule, node: fx.Node, seq, t: int, inputs: dict) -> torch.Tensor:
    """The value of `node` as one process computes it, on the CPU, for a sequence of `t` tokens:
    `inputs` binds graph inputs to tensors; the sequence symbol is `t`, the other sizes those of
    the bound inputs, else 1; the global length of a local one (`cp_global_len`) is itself."""
    need = _ancestors(node)
    sizes = {seq: t}
    for ph, val in inputs.items():
        for d, s in zip(ph.meta["val"].shape, val.shape):
            if not isinstance(d, int) and d.node.expr.is_Symbol:
                sizes.setdefault(d.node.expr, int(s))
    env: dict[fx.Node, object] = {}

    def val(x):
        if isinstance(x, fx.Node):
            return env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(val(y) for y in x)
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    for a in gm.graph.nodes:
        if a not in need:
            continue
        if a.op == "placeholder":
            if a not in inputs:
                raise _Unknown(a.name)
            env[a] = inputs[a]
        elif a.op == "get_attr":
            t_ = gm
            for part in str(a.target).split("."):
                t_ = getattr(t_, part)
            if isinstance(t_, torch.Tensor) and t_.is_meta:
                raise _Unknown(a.name)
            env[a] = t_.detach().cpu() if isinstance(t_, torch.Tensor) else t_
        elif a.target is torch.ops.aten.sym_size.int:
            expr = a.meta["val"].node.expr
            env[a] = int(expr.subs({s: sizes.get(s, 1) for s in expr.free_symbols}))
        elif a.target is cp_global_len:
            env[a] = env[a.args[0]]
        elif a.op == "call_function":
            kwargs = {k: val(v) for k, v in a.kwargs.items()}
            if "device" in kwargs:
                kwargs["device"] = torch.device("cpu")
            env[a] = a.target(*val(a.args), **kwargs)
        else:
            raise _Unknown(a.name)
    return env[node]


def _erase_unused(g: fx.Graph, roots: list[fx.Node]) -> None:
    """Remove the masks' computations that nothing uses any more (side-effect-free ones)."""
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.op != "call_function" or n not in g.nodes:
            continue
        for u in [u for u in n.users if u.target is _ASSERT_META]:  # checks of a value nobody reads
            g.erase_node(u)
        if n.users or n.is_impure():
            continue
        inputs = list(n.all_input_nodes)
        g.erase_node(n)
        stack.extend(inputs)


__all__ = ["context_attention", "mask_kind", "evaluate", "METHODS", "unrepeated_kv"]
