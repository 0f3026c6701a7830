"""Fusion patterns: a table of rules, each matching a subgraph of ATen nodes by its structure
and naming the fused kernel (`autopar.runtime.kernels.KERNELS`) that computes it instead.

One rule a line in `RULES`, in priority order (a larger pattern before the smaller ones it
contains), with its algebra; each matcher's docstring gives its rewrite. Patterns are written
against the ATen training IR that `autopar.capture` produces, in the forms real models take:

  linear_cross_entropy  CE(reshape*(to_f32?(linear(x, W, b?))), t)  -> one chunked kernel
  cross_entropy         CE(reshape*(to_f32?(logits)), t)            (the fp32 copy is absorbed)
  add_rms_norm          s = a + r; RMSNorm(s)                       -> (s, y)
  add_layer_norm        s = a + r; LayerNorm(s)                     -> (s, y)
  rms_norm              aten.rms_norm, or HF's to_f32 / pow 2 / mean / add eps / rsqrt / mul /
                        to / mul weight
  layer_norm            aten.layer_norm over the last dim
  rope                  x * cos + cat(-x2, x1) * sin, halves by chunk, split or slice
  swiglu                silu(a) * b
  geglu                 gelu(a) * b                      (erf, tanh, or the tanh formula spelled out)
  bias_gelu             gelu(linear(x, W, bias)) and gelu(view(addmm(bias, x, W)))
                        -> bias_gelu(linear(x, W), bias)
  softmax               softmax over the last dim (attention inside SDPA is one op and untouched)

Every candidate goes through `fusion_match.finish` (self-contained, acyclic, no random op or
grad-mode switch crossed, the kernel's reference reproduces each output's shape and dtype).
No rule knows a model: the patterns are the algebra, whatever module computes it.

Reads node.meta["val"] (dtypes, fake values) and node.meta["autopar"] (shapes: the local shape
once a plan is applied, else the global one); writes nothing (passes/fuse.py rewrites).
Guarantees: matches returned by `find_matches` replace disjoint node sets.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from .fusion_match import (LOW_FLOAT, VIEWS, Emit, FusionRule, GraphView, Match, arg, cast_of,
                           dtype_of, finish, is_call, is_float, is_last_dim, is_weight_1d,
                           number, other_arg, plain_binary, same_type, shape_of, sole_user,
                           users, val_of)

aten = torch.ops.aten


# ---------------------------------------------------------------------------- norms


@dataclass
class _Norm:
    x: fx.Node  # the tensor normalised (before any fp32 upcast)
    nodes: list[fx.Node]
    out: fx.Node
    weight: Any
    bias: Any
    eps: float


def _default_rms_eps(x: fx.Node) -> float:
    dt = dtype_of(x)
    return torch.finfo(torch.float32 if dt in LOW_FLOAT else dt).eps  # aten: eps of the op math type


def _upcast(c: tuple[fx.Node, torch.dtype] | None) -> bool:
    """A cast to fp32 from a dtype no wider (bf16, fp16, fp32), which a fused norm computing in
    fp32 absorbs. A cast down to fp32 (an fp64 model whose norm computes in fp32, as
    transformers' RMSNorm does) is not: the fused norm would compute in fp64."""
    if c is None or c[1] != torch.float32:
        return False
    src = val_of(c[0])
    return src is not None and src.dtype in LOW_FLOAT


def _rms_norm_at(n: fx.Node) -> _Norm | None:
    """The RMSNorm that `n` starts: an aten.rms_norm node, or the `pow(x, 2)` of the spelled-
    out form (x -> [to f32] -> pow 2 -> mean(-1, keepdim) -> add eps -> rsqrt -> mul x ->
    [to dtype] -> [mul weight])."""
    if is_call(n, aten.rms_norm.default):
        x, norm_shape = n.args[0], arg(n, 1, "normalized_shape")
        shape = shape_of(x)
        if shape is None or list(norm_shape or []) != [shape[-1]]:
            return None
        w = arg(n, 2, "weight")
        eps = arg(n, 3, "eps")
        return _Norm(x, [n], n, w, None, _default_rms_eps(x) if eps is None else float(eps))
    if not (is_call(n, aten.pow.Tensor_Scalar) and number(n.args[1]) == 2.0):
        return None
    xf = n.args[0]
    mean = sole_user(n)
    if not is_call(mean, aten.mean.dim):
        return None
    dims = list(mean.args[1] or [])
    if not (len(dims) == 1 and is_last_dim(xf, dims[0]) and arg(mean, 2, "keepdim", False) is True
            and mean.kwargs.get("dtype") is None):
        return None
    add = sole_user(mean)
    if not (plain_binary(add, aten.add.Tensor, aten.add.Scalar) and add.args[0] is mean
            and number(add.args[1]) is not None):
        return None
    eps = number(add.args[1])
    rs = sole_user(add)
    if not is_call(rs, aten.rsqrt.default):
        return None
    mul = sole_user(rs)
    if not (plain_binary(mul, aten.mul.Tensor) and other_arg(mul, rs) is xf):
        return None
    nodes, out = [n, mean, add, rs, mul], mul
    x = xf
    c = cast_of(xf)
    if _upcast(c):
        x = c[0]
        if all(u in nodes for u in users(xf)):
            nodes.append(xf)  # else the upcast stays for its other users
    nxt = sole_user(out)
    if cast_of(nxt) is not None:
        nodes.append(nxt)
        out = nxt
    w = None
    nxt = sole_user(out)
    if plain_binary(nxt, aten.mul.Tensor) and is_weight_1d(other_arg(nxt, out), (shape_of(x) or [None])[-1]):
        w = other_arg(nxt, out)
        nodes.append(nxt)
        out = nxt
    return _Norm(x, nodes, out, w, None, eps)


def _layer_norm_at(n: fx.Node) -> _Norm | None:
    if not is_call(n, aten.layer_norm.default):
        return None
    x, norm_shape = n.args[0], arg(n, 1, "normalized_shape")
    shape = shape_of(x)
    if shape is None or list(norm_shape or []) != [shape[-1]]:
        return None
    return _Norm(x, [n], n, arg(n, 2, "weight"), arg(n, 3, "bias"), float(arg(n, 4, "eps", 1e-5)))


def _match_rms_norm(n: fx.Node, g: GraphView) -> Match | None:
    """RMSNorm(x) -> rms_norm(x, w, eps)"""
    c = _rms_norm_at(n)
    if c is None:
        return None
    return finish(g, "rms_norm", "rms_norm", c.nodes, (c.out,), (c.x, c.weight), {"eps": c.eps})


def _match_layer_norm(n: fx.Node, g: GraphView) -> Match | None:
    c = _layer_norm_at(n)
    if c is None:
        return None
    return finish(g, "layer_norm", "layer_norm", c.nodes, (c.out,), (c.x, c.weight, c.bias),
                   {"eps": c.eps})


def _norms_of(s: fx.Node, find: Callable[[fx.Node], _Norm | None]) -> list[_Norm]:
    """Norms (as found by `find`) that normalise `s`, directly or through an fp32 upcast."""
    starts = list(users(s))
    for u in users(s):
        if _upcast(cast_of(u)):
            starts += users(u)
    found = []
    for u in starts:
        c = find(u)
        if c is not None and c.x is s:
            found.append(c)
    return found


def _add_norm(n: fx.Node, g: GraphView, rule: str, kernel: str,
              find: Callable[[fx.Node], _Norm | None], with_bias: bool) -> Match | None:
    if not (plain_binary(n, aten.add.Tensor) and same_type(n.args[0], n.args[1])
            and same_type(n, n.args[0]) and is_float(n)):
        return None
    for c in _norms_of(n, find):
        args = (n.args[0], n.args[1], c.weight) + ((c.bias,) if with_bias else ())
        m = finish(g, rule, kernel, [n, *c.nodes], (n, c.out), args, {"eps": c.eps})
        if m is not None:
            return m
    return None


def _match_add_rms_norm(n: fx.Node, g: GraphView) -> Match | None:
    """s = a + r; y = RMSNorm(s) -> (s, y) = add_rms_norm(a, r, w, eps)"""
    return _add_norm(n, g, "add_rms_norm", "add_rms_norm", _rms_norm_at, with_bias=False)


def _match_add_layer_norm(n: fx.Node, g: GraphView) -> Match | None:
    """s = a + r; y = LayerNorm(s) -> (s, y) = add_layer_norm(a, r, w, b, eps)"""
    return _add_norm(n, g, "add_layer_norm", "add_layer_norm", _layer_norm_at, with_bias=True)


# ---------------------------------------------------------------------------- activations


@dataclass
class _Gelu:
    v: fx.Node  # the input
    approximate: str
    nodes: list[fx.Node]
    out: fx.Node


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _close(x: Any, want: float) -> bool:
    x = number(x)
    return x is not None and abs(x - want) <= 1e-6 * max(1.0, abs(want))


def _gelu_at(n: fx.Node) -> _Gelu | None:
    """aten.gelu, or the tanh formula written out (GPT-2's NewGELU), found from its tanh:
    0.5 * v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 * v^3)))."""
    if is_call(n, aten.gelu.default):
        approx = arg(n, 1, "approximate", "none")
        return _Gelu(n.args[0], approx, [n], n) if approx in ("none", "tanh") else None
    if not is_call(n, aten.tanh.default):
        return None
    scaled = n.args[0]
    if not (plain_binary(scaled, aten.mul.Tensor) and _close(scaled.args[1], _SQRT_2_OVER_PI)):
        return None
    inner = scaled.args[0]
    if not plain_binary(inner, aten.add.Tensor):
        return None
    for v, cube in ((inner.args[0], inner.args[1]), (inner.args[1], inner.args[0])):
        if not (plain_binary(cube, aten.mul.Tensor) and _close(cube.args[1], 0.044715)):
            continue
        p = cube.args[0]
        if not (is_call(p, aten.pow.Tensor_Scalar) and p.args[0] is v and number(p.args[1]) == 3.0):
            continue
        one = sole_user(n)
        if not (plain_binary(one, aten.add.Tensor) and one.args[0] is n and _close(one.args[1], 1.0)):
            return None
        out = sole_user(one)
        if not plain_binary(out, aten.mul.Tensor):
            return None
        half = other_arg(out, one)
        if not (plain_binary(half, aten.mul.Tensor) and half.args[0] is v and _close(half.args[1], 0.5)):
            return None
        return _Gelu(v, "tanh", [p, cube, inner, scaled, n, one, half, out], out)
    return None


def _match_glu(n: fx.Node, g: GraphView, act: str) -> Match | None:
    if act == "silu":
        if not is_call(n, aten.silu.default):
            return None
        a, nodes, out, kwargs = n.args[0], [n], n, {}
    else:
        c = _gelu_at(n)
        if c is None:
            return None
        a, nodes, out, kwargs = c.v, c.nodes, c.out, {"approximate": c.approximate}
    mul = sole_user(out)
    if not plain_binary(mul, aten.mul.Tensor):
        return None
    b = other_arg(mul, out)
    if b is out or not same_type(a, b) or not same_type(mul, a):
        return None
    rule = "swiglu" if act == "silu" else "geglu"
    return finish(g, rule, rule, [*nodes, mul], (mul,), (a, b), kwargs)


def _match_swiglu(n: fx.Node, g: GraphView) -> Match | None:
    """silu(a) * b -> swiglu(a, b)"""
    return _match_glu(n, g, "silu")


def _match_geglu(n: fx.Node, g: GraphView) -> Match | None:
    """gelu(a) * b -> geglu(a, b, approximate)"""
    return _match_glu(n, g, "gelu")


def _match_bias_gelu(n: fx.Node, g: GraphView) -> Match | None:
    """gelu(view*(linear(x, W, b))) or gelu(view*(addmm(b, x, W))) -> bias_gelu(view*(x @ W), b)"""
    c = _gelu_at(n)
    if c is None:
        return None
    views, p = [], c.v
    while is_call(p, *VIEWS):
        views.append(p)
        p = p.args[0]
    last = (shape_of(c.v) or [None])[-1]
    if is_call(p, aten.linear.default) and len(p.args) == 3 and not p.kwargs:
        x, w, bias = p.args
        bare = Emit(aten.linear.default, (x, w), like=p)
    elif (is_call(p, aten.addmm.default) and len(p.args) == 3
          and p.kwargs.get("beta", 1) == 1 and p.kwargs.get("alpha", 1) == 1):
        bias, x, w = p.args
        bare = Emit(aten.mm.default, (x, w), like=p)
    else:
        return None
    if not is_weight_1d(bias, last) or (shape_of(p) or [None])[-1] != last:
        return None
    v: Any = bare
    for view in reversed(views):  # the same views, on the bias-free product
        v = Emit(aten.reshape.default, (v, *view.args[1:]), like=view)
    return finish(g, "bias_gelu", "bias_gelu", [p, *views, *c.nodes], (c.out,), (v, bias),
                   {"approximate": c.approximate})


# ---------------------------------------------------------------------------- rotary


def _halves(a: Any, b: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, nodes) if `a` is the first and `b` the second half of x's last dim."""
    if is_call(a, operator.getitem) and is_call(b, operator.getitem) and a.args[0] is b.args[0]:
        src = a.args[0]
        if a.args[1] != 0 or b.args[1] != 1 or not isinstance(src.args[0], fx.Node):
            return None
        x = src.args[0]
        d = (shape_of(x) or [None])[-1]
        if not (isinstance(d, int) and d % 2 == 0 and is_last_dim(x, arg(src, 2, "dim", 0))):
            return None
        if is_call(src, aten.chunk.default) and src.args[1] == 2:
            return x, [a, b, src]
        if is_call(src, aten.split.Tensor) and src.args[1] == d // 2:
            return x, [a, b, src]
        if is_call(src, aten.split_with_sizes.default) and list(src.args[1]) == [d // 2, d // 2]:
            return x, [a, b, src]
        return None
    if is_call(a, aten.slice.Tensor) and is_call(b, aten.slice.Tensor) and a.args[0] is b.args[0]:
        x = a.args[0]
        d = (shape_of(x) or [None])[-1]
        if not (isinstance(d, int) and d % 2 == 0 and is_last_dim(x, arg(a, 1, "dim", 0))
                and is_last_dim(x, arg(b, 1, "dim", 0))):
            return None
        a0, a1 = arg(a, 2, "start", None) or 0, arg(a, 3, "end", None)
        b0, b1 = arg(b, 2, "start", None) or 0, arg(b, 3, "end", None)
        if a0 == 0 and a1 == d // 2 and b0 == d // 2 and (b1 is None or (isinstance(b1, int) and b1 >= d)) \
                and arg(a, 4, "step", 1) == 1 and arg(b, 4, "step", 1) == 1:
            return x, [a, b]
    return None


def _rope_layout(x: fx.Node, cos: fx.Node) -> str | None:
    """'bhtd' or 'bthd' if cos broadcasts over x as a (T, D) table in that layout."""
    xs, cs = shape_of(x), shape_of(cos)
    if xs is None or cs is None or len(xs) != 4 or len(cs) > 4 or len(cs) < 2:
        return None
    cs = (1,) * (4 - len(cs)) + tuple(cs)
    if cs[3] != xs[3]:
        return None
    if cs[0] == 1 and cs[1] == 1 and cs[2] == xs[2]:
        return "bhtd"
    if cs[0] == 1 and cs[2] == 1 and cs[1] == xs[1]:
        return "bthd"
    return None


def _match_rope(n: fx.Node, g: GraphView) -> Match | None:
    """x * cos + cat(-x2, x1) * sin -> rope(x, cos, sin, layout)   (x1, x2: halves of x's last dim)"""
    if not plain_binary(n, aten.add.Tensor):
        return None
    for m_cos, m_sin in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        if not (plain_binary(m_cos, aten.mul.Tensor) and plain_binary(m_sin, aten.mul.Tensor)):
            continue
        for rot, sin in ((m_sin.args[0], m_sin.args[1]), (m_sin.args[1], m_sin.args[0])):
            if not (is_call(rot, aten.cat.default) and len(rot.args[0]) == 2):
                continue
            neg, x1 = rot.args[0]
            if not is_call(neg, aten.neg.default):
                continue
            h = _halves(x1, neg.args[0])
            if h is None:
                continue
            x, half_nodes = h
            if not is_last_dim(rot, arg(rot, 1, "dim", 0)):
                continue
            cos = other_arg(m_cos, x)
            if not isinstance(cos, fx.Node) or not isinstance(sin, fx.Node) or cos is x:
                continue
            layout = _rope_layout(x, cos)
            if layout is None or _rope_layout(x, sin) != layout or shape_of(cos) != shape_of(sin):
                continue
            if cos in g.rg or sin in g.rg:
                continue  # the kernel treats cos / sin as constants
            if not (same_type(n, x) and is_float(x)):
                continue
            args = (x, _table(cos, x, layout), _table(sin, x, layout))
            m = finish(g, "rope", "rope", [n, m_cos, m_sin, rot, neg, *half_nodes], (n,), args,
                        {"layout": layout})
            if m is not None:
                return m
    return None


def _table(t: fx.Node, x: fx.Node, layout: str) -> Any:
    """cos / sin as the kernel takes them: (T, D), or with leading size-1 dims."""
    if layout == "bhtd":
        return t  # (..., 1, T, D) already
    return Emit(aten.flatten.using_ints, (t, 0, -2), like=t)  # (..., T, 1, D) -> (T, D)


# ---------------------------------------------------------------------------- softmax, losses


def _match_softmax(n: fx.Node, g: GraphView) -> Match | None:
    """softmax(x, -1) -> softmax(x)   (with dtype=f32 on a low-precision x: only when the result
    is cast straight back to x's dtype)"""
    if is_call(n, aten.softmax.int):
        x, dim, dtype = n.args[0], n.args[1], arg(n, 2, "dtype")
    elif is_call(n, aten._softmax.default):
        x, dim, dtype = n.args[0], n.args[1], (torch.float32 if n.args[2] else None)
    else:
        return None
    if not (is_float(x) and is_last_dim(x, dim)):
        return None
    nodes, out = [n], n
    if dtype is not None and dtype != dtype_of(x):
        back = sole_user(n)
        c = cast_of(back)
        if c is None or c[1] != dtype_of(x):
            return None
        nodes.append(back)
        out = back
    return finish(g, "softmax", "softmax", nodes, (out,), (x,))


def _ce_args(n: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(logits, target, ignore_index) of a plain mean cross-entropy over class indices."""
    if not is_call(n, aten.cross_entropy_loss.default):
        return None
    logits, target = n.args[0], n.args[1]
    if (arg(n, 2, "weight") is not None or arg(n, 3, "reduction", 1) != 1
            or arg(n, 5, "label_smoothing", 0.0) != 0.0):
        return None
    ls, ts = shape_of(logits), shape_of(target)
    if ls is None or ts is None or len(ls) != 2 or ts != ls[:1] or is_float(target):
        return None
    return logits, target, int(arg(n, 4, "ignore_index", -100))


def _logit_chain(logits: fx.Node) -> tuple[fx.Node, list[fx.Node], bool]:
    """Walk back from the CE's logits through reshapes and upcasts to fp32 that nothing else
    reads: (the tensor before them, the chain, whether it holds an upcast)."""
    chain, p, cast = [], logits, False
    while True:
        if len(users(p)) != 1:
            break
        c = cast_of(p)
        if is_call(p, *VIEWS):
            chain.append(p)
            p = p.args[0]
        elif c is not None and c[1] == torch.float32 and is_float(c[0]):
            chain.append(p)
            cast = True
            p = c[0]
        else:
            break
    return p, chain, cast


def _views_on(base: Any, chain: list[fx.Node]) -> Any:
    """Re-apply the reshapes of `chain` (outermost first in the list) to `base`; casts dropped."""
    v = base
    for node in reversed(chain):
        if is_call(node, *VIEWS):
            v = Emit(aten.reshape.default, (v, *node.args[1:]), like=node)
    return v


def _match_cross_entropy(n: fx.Node, g: GraphView) -> Match | None:
    """CE(reshape*(to_f32?(z)), t) -> cross_entropy(reshape*(z), t)   (mean, class indices)"""
    a = _ce_args(n)
    if a is None:
        return None
    logits, target, ignore = a
    base, chain, cast = _logit_chain(logits)
    if not cast:
        return finish(g, "cross_entropy", "cross_entropy", [n], (n,), (logits, target),
                       {"ignore_index": ignore})
    return finish(g, "cross_entropy", "cross_entropy", [n, *chain], (n,),
                   (_views_on(base, chain), target), {"ignore_index": ignore})


def _match_linear_cross_entropy(n: fx.Node, g: GraphView) -> Match | None:
    """CE(reshape*(to_f32?(linear(x, W, b?))), t) -> linear_cross_entropy(x rows, W, t, b)
    (the logits are read by nothing else, so they need never exist)"""
    a = _ce_args(n)
    if a is None:
        return None
    logits, target, ignore = a
    lin, chain, _ = _logit_chain(logits)
    if not (is_call(lin, aten.linear.default) and 2 <= len(lin.args) <= 3 and not lin.kwargs):
        return None  # (a linear read elsewhere too is refused by finish)
    x, w = lin.args[0], lin.args[1]
    bias = lin.args[2] if len(lin.args) == 3 else None
    xs, ws = shape_of(x), shape_of(w)
    if xs is None or ws is None or len(ws) != 2 or (shape_of(logits) or [None])[-1] != ws[0]:
        return None
    if dtype_of(x) != dtype_of(w) or (bias is not None and dtype_of(bias) != dtype_of(x)):
        return None
    rows = x if len(xs) == 2 else Emit(aten.reshape.default, (x, [-1, xs[-1]]), like=x)
    return finish(g, "linear_cross_entropy", "linear_cross_entropy", [n, lin, *chain], (n,),
                   (rows, w, target, bias), {"ignore_index": ignore})


# ---------------------------------------------------------------------------- the table

RULES: tuple[FusionRule, ...] = (
    FusionRule("linear_cross_entropy", "linear_cross_entropy", _match_linear_cross_entropy,
               "CE(x @ W.T + b, t) -> chunked: logits never materialised"),
    FusionRule("cross_entropy", "cross_entropy", _match_cross_entropy,
               "CE(f32(z), t) -> one pass over z, online logsumexp"),
    FusionRule("add_rms_norm", "add_rms_norm", _match_add_rms_norm,
               "s = a + r; y = s * rsqrt(mean(s^2) + eps) * w -> (s, y)"),
    FusionRule("add_layer_norm", "add_layer_norm", _match_add_layer_norm,
               "s = a + r; y = (s - mean) * rsqrt(var + eps) * w + b -> (s, y)"),
    FusionRule("rms_norm", "rms_norm", _match_rms_norm, "x * rsqrt(mean(x^2) + eps) * w"),
    FusionRule("layer_norm", "layer_norm", _match_layer_norm,
               "(x - mean) * rsqrt(var + eps) * w + b"),
    FusionRule("rope", "rope", _match_rope, "x * cos + cat(-x2, x1) * sin"),
    FusionRule("swiglu", "swiglu", _match_swiglu, "silu(a) * b"),
    FusionRule("geglu", "geglu", _match_geglu, "gelu(a) * b"),
    FusionRule("bias_gelu", "bias_gelu", _match_bias_gelu, "gelu(x @ W + b) -> bias_gelu(x @ W, b)"),
    FusionRule("softmax", "softmax", _match_softmax, "exp(x - max) / sum(exp(x - max))"),
)
RULE_NAMES = tuple(r.name for r in RULES)
_BY_NAME = {r.name: r for r in RULES}


def rule(name: str) -> FusionRule:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown fusion rule {name!r}; the rules are {', '.join(RULE_NAMES)}") from None


# ---------------------------------------------------------------------------- selection


def parse_entry(entry: str) -> tuple[str, str | None]:
    """A plan.fusions entry: "rule" (everywhere) or "rule@module-pattern" (fnmatch on the
    match's module path, e.g. "swiglu@model.layers.*.mlp"; "rule@" is the root module).
    Returns (rule, pattern or None); raises ValueError naming the known rules."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"a fusion entry is a rule name or 'rule@module', got {entry!r}")
    name, at, pattern = entry.partition("@")
    rule(name)  # validates
    return name, pattern if at else None


def selection(entries: Iterable[str]) -> Callable[[Match], bool]:
    """The predicate `plan.fusions` defines over matches."""
    parsed = [parse_entry(e) for e in entries]

    def allowed(m: Match) -> bool:
        return any(m.rule == name and (pat is None or fnmatchcase(m.module, pat)) for name, pat in parsed)

    return allowed


def find_matches(gm: fx.GraphModule, rules: Iterable[str] | None = None,
                 allow: Callable[[Match], bool] | None = None) -> list[Match]:
    """Every place a rule applies, larger patterns first, no node replaced twice.

    Args:
        rules: rule names to try (default: all), tried in table order whatever the order here.
        allow: keep only matches it accepts (a rejected match leaves its nodes to other rules).
    Returns:
        the matches in graph order of their anchors.
    """
    wanted = set(RULE_NAMES if rules is None else rules)
    for name in wanted:
        rule(name)
    g = GraphView(gm)
    claimed: set[fx.Node] = set()
    found: list[Match] = []
    for r in RULES:
        if r.name not in wanted:
            continue
        for n in gm.graph.nodes:
            if n.op != "call_function" or n in claimed:
                continue
            m = r.match(n, g)
            if m is None or any(x in claimed for x in m.nodes) or (allow is not None and not allow(m)):
                continue
            claimed.update(m.nodes)
            found.append(m)
    return sorted(found, key=lambda m: g.order[m.anchor])
