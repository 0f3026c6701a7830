"""Per-op compute cost: a table op -> rule(call) -> OpCost.

FLOPs follow `torch.utils.flop_counter.FlopCounterMode` exactly: only matmul-class work is
counted (mm, addmm, bmm, baddbmm, convolution, scaled-dot-product attention) at 2 FLOPs per
multiply-add, forward and backward as FlopCounterMode sees the kernels that autograd runs:
  linear  (M,K)x(N,K)^T   fwd 2MKN;  bwd 2MKN per input that requires grad (dX, dW)
  matmul  batch B         fwd 2BMKN; bwd 2BMKN per input that requires grad (mv/dot: 0, as torch)
  sdpa    flash/efficient fwd 2bh*sq*sk*(d+dv); bwd 2bh*sq*sk*(3d+2dv) (5 bmms: torch's formula)
          math            fwd the same; bwd = the two bmms' backward (8bh*sq*sk*d when all need grad)
  conv                    torch's conv_flop_count, forward and backward (dX, dW)
  grouped mm (MoE)        2*S*K*N (the per-expert mm loop FlopCounterMode counts in eager MoE)
Elementwise and reduction work, which FlopCounterMode does not count, goes in `other_flops`
(a per-element estimate used only for time); every op also has bytes read and written.

An op without a rule gets the stated fallback: bytes = its inputs + outputs, other_flops =
numel of its outputs, `fallback=True`; the analysis counts and lists such ops, so nothing
is silently zero.

It reads nothing from `node.meta` (rules see a `Call`). Guarantees: rules are pure functions
of the call's shapes, dtypes, requires-grad flags and arguments, so results are cached per
signature (identical layers are costed once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .symbolic import Num, prod
from .tensors import Call, TensorMeta, dtype_name


@dataclass(frozen=True)
class CommOp:
    """A collective in the graph: op, mesh axis, payload bytes (as the runtime counts them:
    the tensor handed to the collective on this rank), and whether it runs in backward."""

    op: str
    axis: str
    nbytes: Num
    backward: bool = False
    # all_gather / reduce_scatter over an uneven dim: the runtime pads every piece to
    # ceil(rows / n) rows, so the payload depends on the axis size n (comm.padded_payload);
    # None: the payload is `nbytes`
    rows: Num | None = None
    row_bytes: Num | None = None


@dataclass(frozen=True)
class OpCost:
    flops: Num = 0  # forward, FlopCounterMode convention (matmul-class)
    bwd_flops: Num = 0  # backward, FlopCounterMode convention
    other_flops: Num = 0  # forward non-matmul work (elementwise, reductions), for time only
    bytes_read: Num = 0  # forward memory traffic
    bytes_written: Num = 0
    kind: str = "vector"  # matmul | attention | vector | view | comm | none
    dtype: str = "fp32"  # operand dtype: picks the peak a matmul runs at
    causal_fraction: float = 1.0  # share of the attention score matrix a causal kernel computes
    comm: tuple[CommOp, ...] = ()
    fallback: bool = False
    differentiable: bool = True


Rule = Callable[[Call], OpCost]
RULES: dict[str, Rule] = {}


def register(*names: str):
    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn

    return deco


def op_name(target) -> str:
    """'aten.linear.default' for OpOverloads, 'transformers.grouped_mm_fallback.default' for
    custom ops, the qualified name for other callables ('operator.getitem')."""
    if hasattr(target, "overloadpacket"):
        return str(target)
    if hasattr(target, "__module__") and hasattr(target, "__name__"):
        mod = target.__module__ or ""
        if mod in ("_operator", "operator"):
            mod = "operator"
        return f"{mod}.{target.__name__}" if mod else target.__name__
    return str(target)


def packet_name(name: str) -> str:
    """'aten.linear.default' -> 'aten.linear'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else name


def rule_for(name: str) -> Rule | None:
    return RULES.get(name) or RULES.get(packet_name(name))


def fallback(c: Call) -> OpCost:
    """No rule: bytes of inputs and outputs, one FLOP per output element, flagged."""
    return OpCost(other_flops=c.out_numel(), bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="vector", dtype=_dt(c), fallback=True)


def cost_of(c: Call) -> OpCost:
    rule = rule_for(c.name)
    return rule(c) if rule is not None else fallback(c)


def _dt(c: Call) -> str:
    for t in c.ins:
        if t.is_float:
            return dtype_name(t.dtype)
    return "fp32"


# ------------------------------------------------------------------------ nothing to do


@register(
    "operator.getitem", "aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_size",
    "aten.sym_numel", "aten.sym_stride", "aten.sym_constrain_range_for_size", "aten._assert_async",
    "operator.mul", "operator.add", "operator.sub", "operator.floordiv", "operator.truediv",
    "operator.mod", "operator.neg", "operator.eq", "operator.ne", "operator.lt", "operator.le",
    "operator.gt", "operator.ge", "aten._set_grad_enabled", "aten.lift_fresh_copy",
    "torch._C._set_grad_enabled", "aten._local_scalar_dense", "aten.item",
)  # fmt: skip
def _none(c: Call) -> OpCost:
    return OpCost(kind="none", differentiable=c.name.startswith("operator.getitem"))


# ------------------------------------------------------------------------ views
VIEW_OPS = (
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.transpose", "aten.permute", "aten.unsqueeze",
    "aten.squeeze", "aten.expand", "aten.expand_as", "aten.slice", "aten.select", "aten.t", "aten.alias",
    "aten.as_strided", "aten.unflatten", "aten.flatten", "aten.split", "aten.split_with_sizes",
    "aten.chunk", "aten.unbind", "aten.narrow", "aten.detach", "aten.view_as", "aten.reshape_as",
    "aten.movedim", "aten.swapaxes", "aten.contiguous", "aten.to", "aten.type_as", "aten.real",
    "aten.tensor_split", "aten.diagonal", "aten.unfold", "aten.lift_fresh", "aten.dropout",
    "aten.feature_dropout", "aten.alpha_dropout", "aten.clone",
)  # fmt: skip


def _view_or_copy(c: Call) -> OpCost:
    """A view moves nothing; the same op materialising a copy (reshape of a non-viewable
    layout, a dtype-changing `to`, a training dropout ...) reads and writes its bytes."""
    diff = c.name.split(".")[1] != "detach"
    if c.aliases_input():
        return OpCost(kind="view", differentiable=diff)
    n = c.out_numel()
    elementwise = c.name.split(".")[1] in ("dropout", "feature_dropout", "alpha_dropout")
    return OpCost(other_flops=n if elementwise else 0, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="vector", dtype=_dt(c), differentiable=diff)


register(*VIEW_OPS)(_view_or_copy)


# ------------------------------------------------------------------------ matmul class
def _mm(c: Call, a: TensorMeta, b: TensorMeta, flops: Num) -> OpCost:
    bwd = (flops if a.rg else 0) + (flops if b.rg else 0)
    return OpCost(flops=flops, bwd_flops=bwd, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="matmul", dtype=dtype_name(a.dtype))


@register("aten.mm")
def _mm_rule(c: Call) -> OpCost:
    a, b = c.t(0), c.t(1)
    m, k = a.shape
    n = b.shape[1]
    return _mm(c, a, b, 2 * m * k * n)


@register("aten.addmm")
def _addmm(c: Call) -> OpCost:
    a, b = c.t(1), c.t(2)
    m, k = a.shape
    n = b.shape[1]
    return _mm(c, a, b, 2 * m * k * n)


@register("aten.bmm")
def _bmm(c: Call) -> OpCost:
    a, b = c.t(0), c.t(1)
    bb, m, k = a.shape
    return _mm(c, a, b, 2 * bb * m * k * b.shape[2])


@register("aten.baddbmm")
def _baddbmm(c: Call) -> OpCost:
    a, b = c.t(1), c.t(2)
    bb, m, k = a.shape
    return _mm(c, a, b, 2 * bb * m * k * b.shape[2])


@register("aten.linear")
def _linear(c: Call) -> OpCost:
    x, w = c.t(0), c.t(1)
    if w.dim == 1:  # matmul(x, w) is a matrix-vector product: FlopCounterMode counts none
        return OpCost(other_flops=2 * x.numel, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                      dtype=dtype_name(x.dtype))
    k = x.shape[-1]
    return _mm(c, x, w, 2 * prod(x.shape[:-1]) * k * w.shape[0])


@register("aten.matmul")
def _matmul(c: Call) -> OpCost:
    a, b = c.t(0), c.t(1)
    if b.dim == 1:  # dot / mv: not matmul-class in FlopCounterMode
        return OpCost(other_flops=2 * a.numel, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                      dtype=dtype_name(a.dtype))
    k = b.shape[-2]
    n = b.shape[-1]
    # out is (*batch, m, n), or (*batch, n) when a is a vector: prod(out[:-1]) = batch * m
    return _mm(c, a, b, 2 * prod(c.out.shape[:-1]) * k * n)


@register("aten.mv", "aten.dot", "aten.addmv", "aten.vdot", "aten.outer", "aten.ger")
def _mv(c: Call) -> OpCost:
    return OpCost(other_flops=2 * sum((t.numel for t in c.ins), 0), bytes_read=c.in_bytes(),
                  bytes_written=c.out_bytes(), dtype=_dt(c))


def _conv_count(x_shape, w_shape, out_shape, transposed: bool) -> Num:
    # torch.utils.flop_counter.conv_flop_count, restated
    batch = x_shape[0]
    conv_shape = (x_shape if transposed else out_shape)[2:]
    return batch * prod(w_shape) * prod(conv_shape) * 2


def _swap01(s):
    return (s[1], s[0], *s[2:])


@register("aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten._convolution",
          "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d")
def _conv(c: Call) -> OpCost:
    x, w, out = c.t(0), c.t(1), c.out
    name = c.name.split(".")[1]
    transposed = bool(c.arg(6, "transposed", False)) if name in ("convolution", "_convolution") else "transpose" in name
    fwd = _conv_count(x.shape, w.shape, out.shape, transposed)
    bwd = 0
    if x.rg:
        bwd = bwd + _conv_count(out.shape, w.shape, x.shape, not transposed)
    if w.rg:
        if transposed:
            bwd = bwd + _conv_count(_swap01(out.shape), _swap01(x.shape), _swap01(w.shape), False)
        else:
            bwd = bwd + _conv_count(_swap01(x.shape), _swap01(out.shape), _swap01(w.shape), False)
    return OpCost(flops=fwd, bwd_flops=bwd, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="matmul", dtype=dtype_name(x.dtype))


# ------------------------------------------------------------------------ attention
def sdpa_backend(c: Call, kernels) -> str:
    """'flash' (fused kernel that saves q, k, v, out, logsumexp) or 'math' (the composite
    that materialises the score matrix), as torch would choose on the profile's device."""
    choice = kernels.get("sdpa", "flash")
    if choice == "math":
        return "math"
    if choice == "cpu":
        dropout = c.arg(4, "dropout_p", 0.0) or 0.0
        q, v = c.t(0), c.t(2)
        if dropout > 0 or q.shape[-1] != v.shape[-1]:
            return "math"  # CPU flash attention has no dropout and needs equal head dims
    return "flash"


@register("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention",
          "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
          "aten._scaled_dot_product_cudnn_attention")
def _sdpa(c: Call) -> OpCost:
    q, k, v = c.t(0), c.t(1), c.t(2)
    h, sq, d = q.shape[-3], q.shape[-2], q.shape[-1]
    b = prod(q.shape[:-3]) if q.dim >= 4 else 1
    sk, dv = k.shape[-2], v.shape[-1]
    fwd = 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv
    flash_bwd = 2 * b * h * sq * sk * (3 * d + 2 * dv) if c.any_rg else 0
    causal = bool(c.arg(5, "is_causal", False)) if c.name.startswith("aten.scaled_dot_product_attention") else False
    # backward FLOPs depend on the kernel: the analysis picks flash_bwd or math_bwd
    return OpCost(flops=fwd, bwd_flops=flash_bwd, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="attention", dtype=dtype_name(q.dtype), causal_fraction=0.5 if causal else 1.0)


def sdpa_math_bwd(c: Call) -> Num:
    """Backward FLOPs of the math path: bmm(q, k^T) and bmm(p, v), each input needing grad."""
    q, k, v = c.t(0), c.t(1), c.t(2)
    b = prod(q.shape[:-3]) if q.dim >= 4 else 1
    h, sq, d = q.shape[-3], q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    qk, pv = 2 * b * h * sq * sk * d, 2 * b * h * sq * sk * dv
    return (qk if q.rg else 0) + (qk if k.rg else 0) + (pv if (q.rg or k.rg) else 0) + (pv if v.rg else 0)


def sdpa_math_bytes(c: Call) -> tuple[Num, Num]:
    """Extra forward traffic of the math path: the (b, h, sq, sk) scores are written, read by
    softmax, written again and read by the second bmm (fp32 when upcast)."""
    q, k = c.t(0), c.t(1)
    b = prod(q.shape[:-3]) if q.dim >= 4 else 1
    scores = b * q.shape[-3] * q.shape[-2] * k.shape[-2] * 4
    return 2 * scores, 2 * scores


@register("transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm")
def _grouped_mm(c: Call) -> OpCost:
    a, w = c.t(0), c.t(1)
    if a.dim == 2 and w.dim == 3:  # (S, K) x (E, K, N), rows grouped by offs: every row meets one expert
        s, k = a.shape
        fl = 2 * s * k * w.shape[2]
    elif a.dim == 3 and w.dim == 3:  # batched (E, m, K) x (E, K, N)
        fl = 2 * a.shape[0] * a.shape[1] * a.shape[2] * w.shape[2]
    else:
        fl = 2 * c.out.numel * a.shape[-1]
    if c.name.startswith("transformers."):  # its backward op always computes both grads
        bwd = 2 * fl if c.any_rg else 0
    else:
        bwd = (fl if a.rg else 0) + (fl if w.rg else 0)
    return OpCost(flops=fl, bwd_flops=bwd, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  kind="matmul", dtype=dtype_name(a.dtype))


# ------------------------------------------------------------------------ elementwise, reductions
def _ew(per_elem: float = 1.0, differentiable: bool = True) -> Rule:
    def rule(c: Call) -> OpCost:
        return OpCost(other_flops=per_elem * c.out_numel(), bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                      kind="vector", dtype=_dt(c), differentiable=differentiable)

    return rule


def _red(per_elem: float = 1.0, differentiable: bool = True) -> Rule:
    def rule(c: Call) -> OpCost:
        n = c.ins[0].numel if c.ins else 0
        return OpCost(other_flops=per_elem * n, bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                      kind="vector", dtype=_dt(c), differentiable=differentiable)

    return rule


register("aten.add", "aten.sub", "aten.mul", "aten.div", "aten.neg", "aten.rsub", "aten.add_", "aten.sub_",
         "aten.mul_", "aten.div_", "aten.where", "aten.masked_fill", "aten.masked_fill_", "aten.clamp",
         "aten.clamp_", "aten.clamp_min", "aten.clamp_min_", "aten.clamp_max", "aten.clamp_max_", "aten.maximum", "aten.minimum", "aten.abs", "aten.relu",
         "aten.square", "aten.reciprocal", "aten.lerp", "aten.addcmul", "aten.addcdiv", "aten.copy",
         "aten.copy_", "aten.fill_", "aten.zero_", "aten._to_copy", "aten.fill", "aten.hardtanh",
         "aten.leaky_relu", "aten.sign", "aten.floor", "aten.ceil", "aten.round", "aten.trunc",
         "aten.nan_to_num", "aten.threshold", "aten.repeat", "aten.repeat_interleave", "aten.roll",
         "aten.flip", "aten.tril", "aten.triu", "aten.pad", "aten.constant_pad_nd")(_ew(1))
register("aten.pow", "aten.rsqrt", "aten.sqrt", "aten.exp", "aten.log", "aten.sigmoid", "aten.tanh",
         "aten.sin", "aten.cos", "aten.erf", "aten.log1p", "aten.expm1", "aten.softplus", "aten.hardswish",
         "aten.hardsigmoid", "aten.elu", "aten.exp2", "aten.log2")(_ew(4))
register("aten.silu", "aten.mish")(_ew(5))
register("aten.gelu")(_ew(8))
register("aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge", "aten.__and__", "aten.__or__",
         "aten.__xor__", "aten.__invert__", "aten.bitwise_and", "aten.bitwise_or", "aten.bitwise_not",
         "aten.bitwise_xor", "aten.logical_and", "aten.logical_or", "aten.logical_not", "aten.floor_divide",
         "aten.remainder", "aten.fmod", "aten.isnan", "aten.isinf", "aten.isfinite",
         "aten.bucketize", "aten.searchsorted")(_ew(1, differentiable=False))
register("aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.prod",
         "aten.cumsum", "aten.cumprod", "aten.logsumexp", "aten.norm", "aten.linalg_vector_norm",
         "aten.var", "aten.std", "aten.var_mean", "aten.all", "aten.any")(_red(1))
register("aten.argmax", "aten.argmin", "aten.count_nonzero", "aten.histc", "aten.bincount", "aten.diff",
         "aten.nonzero", "aten.unique", "aten._unique2")(_red(1, differentiable=False))
register("aten.softmax", "aten._softmax", "aten._safe_softmax", "aten.log_softmax", "aten._log_softmax")(_red(5))
register("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm", "aten._fused_rms_norm",
         "aten.group_norm", "aten.native_group_norm", "aten.batch_norm", "aten._native_batch_norm_legit",
         "aten._native_batch_norm_legit_no_training", "aten.instance_norm")(_red(8))
register("aten.topk", "aten.sort", "aten.argsort", "aten.kthvalue", "aten.median")(_red(8))
register("aten.cross_entropy_loss", "aten.nll_loss", "aten.nll_loss_forward", "aten.nll_loss2d",
         "aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.binary_cross_entropy_with_logits",
         "aten.binary_cross_entropy")(_red(6))


@register("aten.native_dropout", "aten.bernoulli", "aten.bernoulli_")
def _rand(c: Call) -> OpCost:
    return OpCost(other_flops=2 * c.out_numel(), bytes_read=c.in_bytes(), bytes_written=c.out_bytes(),
                  dtype=_dt(c), differentiable=not c.name.startswith("aten.bernoulli"))


# ------------------------------------------------------------------------ data movement
@register("aten.cat", "aten.stack", "aten.index", "aten.index_select", "aten.gather", "aten.take_along_dim",
          "aten.index_put", "aten.index_put_", "aten.index_add", "aten.index_add_", "aten.scatter",
          "aten.scatter_", "aten.scatter_add", "aten.scatter_add_", "aten.scatter_reduce", "aten.index_copy",
          "aten.masked_scatter", "aten.masked_select", "aten.hstack", "aten.vstack", "aten.concat",
          "aten.concatenate", "aten.one_hot")
def _move(c: Call) -> OpCost:
    return OpCost(bytes_read=c.in_bytes(), bytes_written=c.out_bytes(), kind="vector", dtype=_dt(c))


@register("aten.embedding")
def _embedding(c: Call) -> OpCost:
    # reads the gathered rows and the indices, writes the rows; backward scatter-adds them
    idx = c.t(1)
    return OpCost(other_flops=0, bytes_read=c.out_bytes() + (idx.nbytes if idx else 0),
                  bytes_written=c.out_bytes(), kind="vector", dtype=_dt(c))


_CREATE = ("aten.zeros", "aten.ones", "aten.full", "aten.arange", "aten.zeros_like", "aten.ones_like",
           "aten.full_like", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.scalar_tensor",
           "aten.rand", "aten.randn", "aten.randint", "aten.rand_like", "aten.randn_like", "aten.randint_like",
           "aten.linspace", "aten.eye", "aten.tensor", "aten.randperm")  # fmt: skip


@register(*_CREATE)
def _create(c: Call) -> OpCost:
    return OpCost(bytes_written=c.out_bytes(), kind="vector", dtype=_dt(c), differentiable=False)


@register("aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided", "aten.new_empty_strided",
          "aten.empty_permuted")
def _empty(c: Call) -> OpCost:
    return OpCost(kind="none", differentiable=False)


# ------------------------------------------------------------------------ collectives (autopar graph ops)
# The runtime's graph ops (runtime/collectives.py) with the collective each issues forward and
# the one its autograd formula issues backward, payloads as COUNTER records them (comm.py):
#   all_reduce(x)                  fwd all_reduce x                ; bwd none (identity)
#   grad_all_reduce(x)             fwd none                        ; bwd all_reduce of dx
#   all_gather(x, dim, N)          fwd all_gather x padded to cpad ; bwd reduce_scatter of dout (N rows)
#   all_gather_chunk_grad(x, dim, N) fwd the same                  ; bwd none (split: local)
#   reduce_scatter(x, dim)         fwd reduce_scatter x (n * cpad) ; bwd all_gather of dout (cpad rows)
#   split(x, dim)                  fwd none (local narrow)         ; bwd all_gather of dout (cpad rows)
#   all_to_all(x) / all_to_all_v   fwd all_to_all x                ; bwd all_to_all of dout
#   send(x) / recv(like)           send_recv of the tensor         ; bwd none (not differentiable)
_COMM_OPS = ("autopar.all_reduce", "autopar.grad_all_reduce", "autopar.all_gather", "autopar.all_gather_chunk_grad",
             "autopar.reduce_scatter", "autopar.split", "autopar.all_to_all", "autopar.all_to_all_v",
             "autopar.broadcast", "autopar.send", "autopar.recv")


def _rows_of(t: TensorMeta, dim: int) -> tuple[Num, Num]:
    """(rows along dim, bytes per row) of a tensor."""
    d = dim % t.dim
    return t.shape[d], prod(t.shape[:d] + t.shape[d + 1:]) * t.itemsize


def _comm(c: Call) -> OpCost:
    name = packet_name(c.name)
    op = name.split(".", 1)[1]
    x = c.ins[0] if c.ins else None
    out = c.out
    axis = next((a for a in c.args[1:] if isinstance(a, str)), c.kwargs.get("axis", "?"))
    nbytes = x.nbytes if x is not None else 0
    bwd = x is not None and c.any_rg
    comms: list[CommOp] = []
    if op in ("all_reduce", "broadcast"):
        comms.append(CommOp(op, axis, nbytes))
    elif op == "grad_all_reduce":
        if bwd:
            comms.append(CommOp("all_reduce", axis, nbytes, backward=True))
    elif op in ("all_gather", "all_gather_chunk_grad"):
        dim, full = c.arg(2, "dim", 0), c.arg(3, "full_size", -1)
        _, rb = _rows_of(x, dim)
        # even (full_size -1): every piece is whole, the payload is x itself
        comms.append(CommOp("all_gather", axis, nbytes, rows=None if full < 0 else full, row_bytes=rb))
        if bwd and op == "all_gather" and out is not None:
            r, rb = _rows_of(out, dim)
            comms.append(CommOp("reduce_scatter", axis, out.nbytes, backward=True, rows=r, row_bytes=rb))
    elif op == "reduce_scatter":
        r, rb = _rows_of(x, c.arg(2, "dim", 0))
        comms.append(CommOp("reduce_scatter", axis, nbytes, rows=r, row_bytes=rb))
        if bwd:
            comms.append(CommOp("all_gather", axis, out.nbytes if out is not None else nbytes, backward=True,
                                rows=r, row_bytes=rb))
    elif op == "split":
        if bwd:
            r, rb = _rows_of(x, c.arg(2, "dim", 0))
            comms.append(CommOp("all_gather", axis, out.nbytes if out is not None else nbytes, backward=True,
                                rows=r, row_bytes=rb))
    elif op in ("all_to_all", "all_to_all_v"):
        comms.append(CommOp("all_to_all", axis, nbytes))
        if bwd:
            comms.append(CommOp("all_to_all", axis, out.nbytes if out is not None else nbytes, backward=True))
    elif op in ("send", "recv"):
        comms.append(CommOp("send_recv", axis, nbytes))
    moved = c.out_bytes() if op == "split" else c.in_bytes()
    return OpCost(bytes_read=moved, bytes_written=c.out_bytes(), kind="vector" if op == "split" else "comm",
                  dtype=_dt(c), comm=tuple(comms))


register(*_COMM_OPS)(_comm)
