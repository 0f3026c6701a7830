"""The sharding rules, one per ATen op (or family): which placements go together.

Each rule returns the valid strategies of one call (see passes/rules/sharding.py). Conventions:
`S(d)` entries name dims of that argument; `P` is P(sum); a rule lists the replicated strategy
too. Linear ops (views, sums, adds, matmuls in one operand, exact casts, ...) propagate P; a
narrowing cast does not (it would round each partial: `exact_cast`). Every rule here
is checked on gloo against the single-process op for each of its strategies
(tests/dist/test_shard_rules_sweep.py).

Reads node.meta["autopar"] through OpView; writes nothing.
"""
from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx

from autopar.runtime.placement import R, Shard

from .. import ir
from .sharding import PS, OpView, Strategy, broadcast_maps, dim_map, replicated, rule

# --- pointwise ----------------------------------------------------------------------------------
_LINEAR_UNARY = ("aten.neg.default", "aten.clone.default", "aten.to.dtype", "aten.to.dtype_layout",
                 "aten._to_copy.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
                 "aten.lift_fresh_copy.default", "aten.type_as.default", "aten.positive.default")
_UNARY = ("aten.silu.default", "aten.gelu.default", "aten.relu.default", "aten.tanh.default", "aten.sigmoid.default",
          "aten.exp.default", "aten.log.default", "aten.rsqrt.default", "aten.sqrt.default", "aten.abs.default",
          "aten.erf.default", "aten.sin.default", "aten.cos.default", "aten.reciprocal.default",
          "aten.square.default", "aten.pow.Tensor_Scalar", "aten.logical_not.default", "aten.bitwise_not.default",
          "aten.ne.Scalar", "aten.eq.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
          "aten.clamp.default", "aten.leaky_relu.default", "aten.hardtanh.default", "aten.softplus.default",
          "aten.log1p.default", "aten.expm1.default", "aten.mish.default", "aten.gelu_.default", "aten.relu_.default",
          "aten.dropout.default", "aten.masked_fill.Scalar", "aten.where.ScalarOther", "aten.where.ScalarSelf",
          "aten.isnan.default", "aten.isinf.default", "aten.sign.default", "aten.floor.default", "aten.ceil.default",
          "aten.round.default", "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar")
_BINARY = ("aten.maximum.default", "aten.minimum.default", "aten.pow.Tensor_Tensor", "aten.eq.Tensor",
           "aten.ne.Tensor", "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor",
           "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
           "aten.logical_and.default", "aten.logical_or.default", "aten.where.self", "aten.masked_fill.Tensor",
           "aten.atan2.default", "aten.rsub.Tensor", "aten.floor_divide.default", "aten.remainder.Tensor",
           "aten.fmod.Tensor")


_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default")


@rule(*_LINEAR_UNARY)
def _linear_unary(v: OpView):
    linear = len(v.args_t) == 1 and (v.op not in _CASTS or exact_cast(v.args_t[0], v.node))
    return dim_map(v, broadcast_maps(v), partial=[(PS,)] if linear else ())


def exact_cast(src: fx.Node, dst: fx.Node) -> bool:
    """Whether every value of `src`'s dtype is exactly a value of `dst`'s (no cast, or a widening
    one): only then is the cast of a sum the sum of the cast partials. A narrowing cast rounds
    each partial (fp64 -> fp32: round(a) + round(b), where one process rounds a + b once: an
    error of fp32's eps times the partials, seen as transformers' fp32 RMSNorm in an fp64 model
    ending 2e-5 off under cp x tp); a cast to an integer truncates each partial. An unknown
    dtype counts as not exact."""
    a, b = _dtype(src), _dtype(dst)
    if a is None or b is None:
        return False
    if a == b:
        return True
    if a.is_floating_point and b.is_floating_point:
        fa, fb = torch.finfo(a), torch.finfo(b)
        return fb.eps <= fa.eps and fb.max >= fa.max and fb.tiny <= fa.tiny
    if a.is_floating_point or b.is_floating_point or a.is_complex or b.is_complex or torch.bool in (a, b):
        return False
    ia, ib = torch.iinfo(a), torch.iinfo(b)
    return ib.min <= ia.min and ib.max >= ia.max


def _dtype(n: fx.Node) -> torch.dtype | None:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype
    i = ir.get_info(n)
    d = getattr(torch, i.dtype, None) if i is not None and i.dtype else None
    return d if isinstance(d, torch.dtype) else None


@rule(*_UNARY, *_BINARY)
def _pointwise(v: OpView):
    return dim_map(v, broadcast_maps(v))


@rule("aten.add.Tensor", "aten.sub.Tensor")
def _add(v: OpView):
    n = len(v.args_t)
    # x + scalar is not linear (the scalar would be added k times); x + y is
    return dim_map(v, broadcast_maps(v), partial=[(PS, PS)] if n == 2 else ())


@rule("aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar", "aten.div.Scalar")
def _mul(v: OpView):
    n = len(v.args_t)
    if n == 1:
        pat = [(PS,)]
    elif v.op.startswith("aten.div"):
        pat = [(PS, R)]
    else:
        pat = [(PS, R), (R, PS)]
    return dim_map(v, broadcast_maps(v), partial=pat)


@rule("aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default",
      "aten.rand_like.default", "aten.randn_like.default")
def _like(v: OpView):
    # the input gives shape/dtype only: the output mirrors its placement (values are constant)
    out = dim_map(v, broadcast_maps(v))
    if v.op == "aten.zeros_like.default":
        out.append(Strategy((None,), PS, 1.0))  # zeros are a valid partial sum
    if v.op.startswith("aten.rand"):
        return [replicated(v)]  # random values would differ from one process
    return out


# --- factories ---------------------------------------------------------------------------------
@rule("aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.empty.memory_format",
      "aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
      "aten.scalar_tensor.default")
def _factory(v: OpView):
    ins = tuple(None for _ in v.args_t)
    out = [Strategy(ins, R, 1.0)]
    shape = v.out_shape or ()
    for d in range(len(shape)):
        if v.out_ok(d):
            out.append(Strategy(ins, Shard(d), 1.0 / v.k))
    if v.op in ("aten.zeros.default", "aten.new_zeros.default"):
        out.append(Strategy(ins, PS, 1.0))
    return out


@rule("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def _arange(v: OpView):
    return [replicated(v)]


# --- views and shape ops -----------------------------------------------------------------------
def _size(x):
    return sympy.sympify(x) if isinstance(x, str) else sympy.Integer(x)


def _view_groups(a: tuple, b: tuple) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Split two shapes of equal numel into aligned groups of dims with equal products
    (symbolic sizes such as "32*s0" compare exactly through sympy). A pure function of the two
    shapes (ints, and symbolic sizes by name), memoized per process: the sympy work costs ~7 ms
    a call, asked ~25 times a build for the same few view shapes (per layer, pass and mesh)."""
    return _view_groups_of(tuple(a), tuple(b))


@functools.lru_cache(maxsize=4096)
def _view_groups_of(a: tuple, b: tuple) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = sympy.Integer(1)
        if i < len(a):
            gi.append(i)
            pa = _size(a[i])
            i += 1
        if j < len(b):
            gj.append(j)
            pb = _size(b[j])
            j += 1
        while True:
            num, den = sympy.fraction(sympy.cancel(pb / pa))
            if num == den:
                break
            if den == 1 and i < len(a):  # pb is a multiple of pa: take more of a
                pa *= _size(a[i])
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= _size(b[j])
                gj.append(j)
                j += 1
            elif i < len(a):
                pa *= _size(a[i])
                gi.append(i)
                i += 1
            else:
                raise TypeError(f"view {a} -> {b} does not keep the number of elements")
        groups.append((tuple(gi), tuple(gj)))
    return tuple(groups)


@rule("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints",
      "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.unsqueeze.default",
      "aten.view_as.default", "aten.reshape_as.default")
def _view(v: OpView):
    a, b = v.shape(v.args_t[0]), v.out_shape
    out = [replicated(v)]
    out[0] = Strategy((R,) + tuple(None for _ in v.args_t[1:]), R, 1.0)
    for gi, gj in _view_groups(a, b):
        # the outermost non-1 dim of a group keeps the sharding when both sides divide
        ii = [d for d in gi if a[d] != 1]
        jj = [d for d in gj if b[d] != 1]
        if not ii or not jj:
            continue
        di, dj = ii[0], jj[0]
        # k contiguous blocks of the input's outer dim are k contiguous blocks of the output's
        if v.can_shard(a, di, v.args_t[0]) and v.out_ok(dj):
            out.append(Strategy((Shard(di),) + tuple(None for _ in v.args_t[1:]), Shard(dj), 1.0 / v.k))
    out.append(Strategy((PS,) + tuple(None for _ in v.args_t[1:]), PS, 1.0))
    return out


@rule("aten.transpose.int", "aten.t.default", "aten.permute.default", "aten.movedim.int", "aten.swapaxes.default")
def _permute(v: OpView):
    nd = len(v.out_shape)
    if v.op == "aten.permute.default":
        perm = [d % nd for d in v.arg(1, "dims")]
    elif v.op == "aten.t.default":
        perm = list(range(nd))[::-1]
    elif v.op == "aten.movedim.int":
        src, dst = v.arg(1, "source") % nd, v.arg(2, "destination") % nd
        rest = [d for d in range(nd) if d != src]
        rest.insert(dst, src)
        perm = rest
    else:
        d0, d1 = v.arg(1, "dim0") % nd, v.arg(2, "dim1") % nd
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return dim_map(v, [perm], partial=[(PS,)])


@rule("aten.expand.default", "aten.expand_as.default", "aten.broadcast_to.default")
def _expand(v: OpView):
    maps = broadcast_maps(v)[:1] + [[None] * len(v.out_shape) for _ in v.args_t[1:]]
    return dim_map(v, maps, partial=[(PS,) + (R,) * (len(v.args_t) - 1)])


@rule("aten.slice.Tensor", "aten.narrow.default")
def _slice(v: OpView):
    shape = v.shape(v.args_t[0])
    nd = len(shape)
    dim = v.arg(1, "dim", 0) % nd
    full = False
    if v.op == "aten.slice.Tensor":
        start, end, step = v.arg(2, "start", None), v.arg(3, "end", None), v.arg(4, "step", 1)
        # end >= 2**62 is export's "to the end" (sys.maxsize), a full slice of a symbolic dim too
        full = (start in (None, 0)) and (end is None or (isinstance(end, int) and (
            end >= 2**62 or isinstance(shape[dim], int) and end >= shape[dim]))) and step == 1
    skip = () if full else (dim,)
    return dim_map(v, [list(range(nd))], partial=[(PS,)], skip_out=skip)


@rule("aten.select.int")
def _select(v: OpView):
    nd = len(v.shape(v.args_t[0]))
    dim = v.arg(1, "dim") % nd
    return dim_map(v, [[d if d < dim else d + 1 for d in range(nd - 1)]], partial=[(PS,)])


@rule("aten.chunk.default", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int",
      "aten.tensor_split.sections")
def _split(v: OpView):
    shape = v.shape(v.args_t[0])
    nd = len(shape)
    default_dim = 0
    dim_pos = 1 if v.op == "aten.unbind.int" else 2
    dim = v.arg(dim_pos, "dim", default_dim) % nd
    if v.op == "aten.unbind.int":
        m = [d if d < dim else d + 1 for d in range(nd - 1)]
        return dim_map(v, [m], partial=[(PS,)])
    return dim_map(v, [list(range(nd))], partial=[(PS,)], skip_out=(dim,))


@rule("aten.cat.default", "aten.concat.default")
def _cat(v: OpView):
    nd = len(v.out_shape)
    dim = v.arg(1, "dim", 0) % nd
    maps = [list(range(nd)) if len(v.shape(a)) == nd else [None] * nd for a in v.args_t]
    return dim_map(v, maps, partial=[tuple(PS for _ in v.args_t)], skip_out=(dim,))


@rule("aten.stack.default")
def _stack(v: OpView):
    nd = len(v.out_shape)
    dim = v.arg(1, "dim", 0) % nd
    m = [d if d < dim else (d - 1 if d > dim else None) for d in range(nd)]
    return dim_map(v, [m] * len(v.args_t), partial=[tuple(PS for _ in v.args_t)], skip_out=(dim,))


@rule("aten.repeat.default")
def _repeat(v: OpView):
    reps = v.arg(1, "repeats")
    nd = len(v.out_shape)
    off = nd - len(v.shape(v.args_t[0]))
    m = [d - off if d >= off and reps[d] == 1 else None for d in range(nd)]
    return [s for s in dim_map(v, [m]) if s.ins[0] != R or s.out == R]


@rule("operator.getitem")
def _getitem(v: OpView):
    # an element of a tuple-valued node (chunk, topk ...): the rules of tuple ops give the
    # placement of every element, so the element has the tuple's placement
    shape = v.out_shape or ()
    cands = [R, PS] + [Shard(d) for d in range(len(shape)) if v.out_ok(d)]
    return [Strategy((p,), p, 0.0) for p in cands]


# --- matmuls -----------------------------------------------------------------------------------
@rule("aten.linear.default")
def _linear(v: OpView):
    x, w = v.args_t[0], v.args_t[1]
    xs, ws = v.shape(x), v.shape(w)
    nd = len(xs)
    bias = len(v.args_t) > 2
    out = [replicated(v)]
    b = (R,) if bias else ()
    for d in range(nd - 1):  # batch-like dims of x
        if v.can_shard(xs, d, x) and v.out_ok(d):
            out.append(Strategy((Shard(d), R) + b, Shard(d), 1.0 / v.k))
    if v.can_shard(ws, 0, w) and v.out_ok(nd - 1):  # column parallel
        out.append(Strategy((R, Shard(0)) + ((Shard(0),) if bias else ()), Shard(nd - 1), 1.0 / v.k))
    if v.can_shard(ws, 1, w) and v.can_shard(xs, nd - 1, x):  # row parallel
        out.append(Strategy((Shard(nd - 1), Shard(1)) + ((PS,) if bias else ()), PS, 1.0 / v.k))
    out.append(Strategy((PS, R) + ((PS,) if bias else ()), PS, 1.0))
    return out


def _mm_like(v: OpView, a_i: int, b_i: int):
    """mm/bmm/matmul (a_i=0, b_i=1) and addmm/baddbmm (bias first: a_i=1, b_i=2)."""
    a, b = v.args_t[a_i], v.args_t[b_i]
    ash, bsh = v.shape(a), v.shape(b)
    nd = len(v.out_shape)
    bias = v.args_t[0] if a_i else None
    bmap = None
    if bias is not None:
        bs = v.shape(bias)
        off = nd - len(bs)
        bmap = [d - off if d - off >= 0 and bs[d - off] != 1 else None for d in range(nd)]

    def bias_p(out):
        if bias is None:
            return ()
        if out == PS:
            return (PS,)
        if isinstance(out, Shard) and bmap[out.dim] is not None:
            return (Shard(bmap[out.dim]),)
        return (R,)

    def mk(pa, pb, po, work):
        return Strategy(bias_p(po) + (pa, pb), po, work)

    out = [replicated(v)]
    if len(ash) == nd and len(bsh) == nd:
        for d in range(nd - 2):  # batch dims
            if v.can_shard(ash, d, a) and v.can_shard(bsh, d, b) and v.out_ok(d):
                out.append(mk(Shard(d), Shard(d), Shard(d), 1.0 / v.k))
    if v.can_shard(ash, len(ash) - 2, a) and v.out_ok(nd - 2):
        out.append(mk(Shard(len(ash) - 2), R, Shard(nd - 2), 1.0 / v.k))
    if v.can_shard(bsh, len(bsh) - 1, b) and v.out_ok(nd - 1):
        out.append(mk(R, Shard(len(bsh) - 1), Shard(nd - 1), 1.0 / v.k))
    if v.can_shard(ash, len(ash) - 1, a) and v.can_shard(bsh, len(bsh) - 2, b):
        out.append(mk(Shard(len(ash) - 1), Shard(len(bsh) - 2), PS, 1.0 / v.k))
    out.append(mk(PS, R, PS, 1.0))
    out.append(mk(R, PS, PS, 1.0))
    return out


@rule("aten.mm.default", "aten.bmm.default")
def _mm(v: OpView):
    return _mm_like(v, 0, 1)


@rule("aten.matmul.default")
def _matmul(v: OpView):
    if len(v.shape(v.args_t[0])) < 2 or len(v.shape(v.args_t[1])) < 2:
        return [replicated(v)]
    if len(v.shape(v.args_t[0])) != len(v.shape(v.args_t[1])):
        # x[..., K] @ w[K, N]: batch dims of x only
        x = v.args_t[0]
        xs = v.shape(x)
        out = [replicated(v)]
        for d in range(len(xs) - 1):
            if v.can_shard(xs, d, x) and v.out_ok(d):
                out.append(Strategy((Shard(d), R), Shard(d), 1.0 / v.k))
        ws = v.shape(v.args_t[1])
        if len(ws) == 2 and v.can_shard(ws, 1, v.args_t[1]) and v.out_ok(len(v.out_shape) - 1):
            out.append(Strategy((R, Shard(1)), Shard(len(v.out_shape) - 1), 1.0 / v.k))
        if len(ws) == 2 and v.can_shard(ws, 0, v.args_t[1]) and v.can_shard(xs, len(xs) - 1, x):
            out.append(Strategy((Shard(len(xs) - 1), Shard(0)), PS, 1.0 / v.k))
        out.append(Strategy((PS, R), PS, 1.0))
        return out
    return _mm_like(v, 0, 1)


@rule("aten.addmm.default", "aten.baddbmm.default")
def _addmm(v: OpView):
    return _mm_like(v, 1, 2)


# --- reductions -------------------------------------------------------------------------------
@rule("aten.sum.dim_IntList", "aten.mean.dim", "aten.sum.default", "aten.mean.default", "aten.amax.default",
      "aten.amin.default", "aten.argmax.default", "aten.argmin.default", "aten.any.dim", "aten.all.dim",
      "aten.var.correction", "aten.std.correction", "aten.logsumexp.default", "aten.prod.dim_int",
      "aten.max.dim", "aten.min.dim")
def _reduce(v: OpView):
    x = v.args_t[0]
    xs = v.shape(x)
    nd = len(xs)
    dims = v.arg(1, "dim", None)
    if v.op in ("aten.sum.default", "aten.mean.default") or dims is None:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    dims = sorted({d % nd for d in dims}) if nd else []
    keep = bool(v.arg(2, "keepdim", False)) if v.op not in ("aten.sum.default", "aten.mean.default") else False
    if v.op in ("aten.var.correction", "aten.std.correction"):
        keep = bool(v.node.kwargs.get("keepdim", False))
    m = [d for d in range(nd)] if keep else [d for d in range(nd) if d not in dims]
    out = [replicated(v)]
    oshape = v.out_shape or ()
    for od, idim in enumerate(m):
        if idim in dims:
            continue
        if v.can_shard(xs, idim, x) and v.out_ok(od):
            out.append(Strategy((Shard(idim),), Shard(od), 1.0 / v.k))
    linear = v.op in ("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default")
    if linear:
        for d in dims:  # reducing over a sharded dim leaves a partial sum
            if v.can_shard(xs, d, x):
                impl = "mean_partial" if v.op.startswith("aten.mean") else None
                out.append(Strategy((Shard(d),), PS, 1.0 / v.k, impl))
        if v.node.kwargs.get("dtype") is None or exact_cast(x, v.node):  # a narrowing dtype= rounds each partial
            out.append(Strategy((PS,), PS, 1.0))
    del oshape
    return out


@rule("aten.cumsum.default", "aten.cumprod.default", "aten._softmax.default", "aten.softmax.int",
      "aten._log_softmax.default", "aten.log_softmax.int", "aten.topk.default", "aten.sort.default",
      "aten.argsort.default", "aten.flip.default", "aten.roll.default")
def _along_dim(v: OpView):
    nd = len(v.shape(v.args_t[0]))
    pos = {"aten.topk.default": 2, "aten.sort.default": 1, "aten.argsort.default": 1}.get(v.op, 1)
    default = -1
    if v.op in ("aten.flip.default",):
        dims = [d % nd for d in v.arg(1, "dims")]
    elif v.op == "aten.roll.default":
        dims = [d % nd for d in (v.arg(2, "dims") or range(nd))]
    else:
        dims = [v.arg(pos, "dim", default) % nd]
    partial = [(PS,)] if v.op in ("aten.cumsum.default", "aten.flip.default", "aten.roll.default") else []
    return dim_map(v, [list(range(nd))], partial=partial, skip_out=dims)


@rule("aten.tril.default", "aten.triu.default")
def _tri(v: OpView):
    nd = len(v.out_shape)
    return dim_map(v, [list(range(nd))], partial=[(PS,)], skip_out=(nd - 2, nd - 1))


# --- normalisation -----------------------------------------------------------------------------
@rule("aten.rms_norm.default", "aten.layer_norm.default", "aten.native_layer_norm.default",
      "aten.group_norm.default")
def _norm(v: OpView):
    x = v.args_t[0]
    xs = v.shape(x)
    if v.op == "aten.group_norm.default":
        n_norm = len(xs) - 1
    else:
        n_norm = len(v.arg(1, "normalized_shape"))
    out = [replicated(v)]
    for d in range(len(xs) - n_norm):
        if v.can_shard(xs, d, x) and v.out_ok(d):
            out.append(Strategy((Shard(d),) + tuple(R for _ in v.args_t[1:]), Shard(d), 1.0 / v.k))
    return out


# --- attention ---------------------------------------------------------------------------------
@rule("aten.scaled_dot_product_attention.default")
def _sdpa(v: OpView):
    q, k, val = v.args_t[:3]
    mask = v.args_t[3] if len(v.args_t) > 3 else None
    qs, ks = v.shape(q), v.shape(k)
    out = [replicated(v)]
    causal = bool(v.arg(5, "is_causal", False))
    nd = len(qs)

    def mask_p(d):
        if mask is None:
            return ()
        ms = v.shape(mask)
        md = d - (nd - len(ms))
        if md < 0 or ms[md] == 1:
            return (R,)
        return (Shard(md),) if v.can_shard(ms, md, mask) else None

    for d in range(nd - 2):  # batch and heads
        if all(v.can_shard(v.shape(t), d, t) for t in (q, k, val)) and v.out_ok(d):
            mp = mask_p(d)
            if mp is not None:
                out.append(Strategy((Shard(d), Shard(d), Shard(d)) + mp, Shard(d), 1.0 / v.k))
    if not causal and v.can_shard(qs, nd - 2, q) and v.out_ok(nd - 2):  # query rows against all keys
        mp = () if mask is None else ((Shard(len(v.shape(mask)) - 2),) if v.shape(mask)[-2] != 1 else (R,))
        out.append(Strategy((Shard(nd - 2), R, R) + mp, Shard(nd - 2), 1.0 / v.k))
    del ks
    return out


# --- embedding, gather/scatter -----------------------------------------------------------------
@rule("aten.embedding.default")
def _embedding(v: OpView):
    w, ids = v.args_t[0], v.args_t[1]
    ws, ids_s = v.shape(w), v.shape(ids)
    out = [replicated(v)]
    for d in range(len(ids_s)):
        if v.can_shard(ids_s, d, ids) and v.out_ok(d):
            out.append(Strategy((R, Shard(d)), Shard(d), 1.0 / v.k))
    if v.can_shard(ws, 1, w) and v.out_ok(len(ids_s)):
        out.append(Strategy((Shard(1), R), Shard(len(ids_s)), 1.0 / v.k))
    if v.can_shard(ws, 0, w):  # vocabulary parallel: masked lookup, partial sum
        out.append(Strategy((Shard(0), R), PS, 1.0 / v.k, "vocab_embedding"))
    return out


@rule("aten.index_select.default")
def _index_select(v: OpView):
    x = v.args_t[0]
    nd = len(v.shape(x))
    dim = v.arg(1, "dim") % nd
    maps = [[d if d != dim else None for d in range(nd)], [None] * nd]
    return dim_map(v, maps, partial=[(PS, R)], skip_out=(dim,))


@rule("aten.gather.default")
def _gather(v: OpView):
    nd = len(v.out_shape)
    dim = v.arg(1, "dim") % nd
    x, idx = v.args_t[0], v.args_t[1]
    out = [replicated(v)]
    for d in range(nd):
        if d == dim:
            continue
        if v.shape(x)[d] == v.out_shape[d] and v.can_shard(v.shape(x), d, x) and v.can_shard(v.shape(idx), d, idx) \
                and v.out_ok(d):
            out.append(Strategy((Shard(d), Shard(d)), Shard(d), 1.0 / v.k))
    return out


@rule("aten.index_add.default")
def _index_add(v: OpView):
    nd = len(v.out_shape)
    dim = v.arg(1, "dim") % nd
    base, idx, src = v.args_t[0], v.args_t[1], v.args_t[2]
    out = [replicated(v)]
    for d in range(nd):
        if d != dim and v.can_shard(v.shape(base), d, base) and v.can_shard(v.shape(src), d, src) and v.out_ok(d):
            out.append(Strategy((Shard(d), R, Shard(d)), Shard(d), 1.0 / v.k))
    out.append(Strategy((PS, R, PS), PS, 1.0))
    return out


# --- no-ops and helpers -------------------------------------------------------------------------
@rule("aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default")
def _no_output(v: OpView):
    return [Strategy(tuple(None for _ in v.args_t), None, 0.0)]


@rule("aten.sym_size.int")
def _sym_size(v: OpView):
    x = v.args_t[0]
    nd = len(v.shape(x))
    d = v.arg(1, "dim") % nd
    out = [Strategy((R,), None, 0.0), Strategy((PS,), None, 0.0)]
    out += [Strategy((Shard(e),), None, 0.0) for e in range(nd) if e != d and v.can_shard(v.shape(x), e, x)]
    return out


_ = operator  # getitem is registered by name ("operator.getitem")

__all__: list[str] = []
