"""What autograd saves for backward, per op: a table op -> rule(call, kernels) -> saved items.

A saved item is either a graph tensor (`TensorMeta`: counted by its storage, so a view saved
by one op and its base saved by another cost one storage) or `New(tag, nbytes)`: a buffer
the op creates inside itself and autograd keeps (layer norm's mean/rstd, attention's
logsumexp, a dropout mask, the score matrix of math attention, a copy made to flatten a
non-viewable input for a matmul). The rules restate `derivatives.yaml` and the composite
implementations in ATen, including their conditions: autograd saves an input only when a
derivative that needs it will be computed (e.g. linear saves its input only if the weight
requires grad, and the weight only if the input does).

Backend differences are read from the hardware profile's `kernels`:
  sdpa            flash: q, k, v, out, logsumexp (+ attn_mask when given: efficient/CPU kernels)
                  math: q*scale, k*scale, softmax probs, [dropout mask, dropped probs], v,
                  in fp32 when `sdpa_math_upcast` and the inputs are fp16/bf16
                  cpu: flash unless dropout_p > 0 (CPU flash has no dropout), then math
  rms_norm        fused: input, rstd; composite: input (fp32 copy if half), rstd, normalised x
  layer_norm_stats  acc: mean/rstd in fp32 (CUDA); input_dtype: in the input's dtype (CPU)
  dropout_mask    bool (CUDA native_dropout) or input_dtype (CPU: input * scaled noise)

An op without a rule saves, by the stated fallback, every tensor input when any input
requires grad (an upper bound), and the analysis lists it.

It reads nothing from `node.meta`. Guarantees: rules are pure functions of the call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .ops import packet_name, sdpa_backend
from .symbolic import Num, prod
from .tensors import Call, TensorMeta, flatten_tensors


@dataclass(frozen=True)
class New:
    """A buffer created inside the op and kept for backward."""

    tag: str
    nbytes: Num


Item = TensorMeta | New
SavedRule = Callable[[Call, Mapping[str, Any]], list[Item]]
SAVED: dict[str, SavedRule] = {}

# ops that save no tensor (or only sizes, dtypes and scalars)
SAVES_NOTHING = {
    "operator.getitem", "aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_size",
    "aten.sym_numel", "aten.sym_stride", "aten.add", "aten.sub", "aten.rsub", "aten.add_", "aten.sub_",
    "aten.neg", "aten.sum", "aten.mean", "aten.cumsum", "aten.cat", "aten.stack", "aten.concat",
    "aten.concatenate", "aten.hstack", "aten.vstack", "aten.repeat", "aten.repeat_interleave", "aten.roll",
    "aten.flip", "aten.tril", "aten.triu", "aten.pad", "aten.constant_pad_nd", "aten._to_copy", "aten.copy",
    "aten.copy_", "aten.fill_", "aten.fill", "aten.zero_", "aten.one_hot",
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.transpose", "aten.permute", "aten.unsqueeze",
    "aten.squeeze", "aten.expand", "aten.expand_as", "aten.slice", "aten.select", "aten.t", "aten.alias",
    "aten.as_strided", "aten.unflatten", "aten.flatten", "aten.split", "aten.split_with_sizes",
    "aten.chunk", "aten.unbind", "aten.narrow", "aten.detach", "aten.view_as", "aten.reshape_as",
    "aten.movedim", "aten.swapaxes", "aten.contiguous", "aten.to", "aten.type_as", "aten.real",
    "aten.tensor_split", "aten.diagonal", "aten.unfold", "aten.lift_fresh", "aten.clone", "aten.lift_fresh_copy",
    "aten.floor", "aten.ceil", "aten.round", "aten.trunc", "aten.sign",
}  # fmt: skip


def rule_for(name: str) -> SavedRule | None:
    return SAVED.get(name) or SAVED.get(packet_name(name))


def known(name: str) -> bool:
    p = packet_name(name)
    return p in SAVES_NOTHING or name in SAVES_NOTHING or rule_for(name) is not None


def saved_items(c: Call, kernels: Mapping[str, Any]) -> tuple[list[Item], bool]:
    """(items autograd saves for this call, whether the fallback was used)."""
    if not c.any_rg:
        return [], False
    rule = rule_for(c.name)
    if rule is not None:
        return [x for x in rule(c, kernels) if x is not None], False
    if packet_name(c.name) in SAVES_NOTHING or c.name in SAVES_NOTHING:
        return [], False
    return list(c.ins), True  # fallback: everything it was given


def register(*names: str):
    def deco(fn: SavedRule) -> SavedRule:
        for n in names:
            SAVED[n] = fn
        return fn

    return deco


def _t(x: Any) -> TensorMeta | None:
    return x if isinstance(x, TensorMeta) else None


def _acc_bytes(t: TensorMeta) -> int:
    """Bytes of an accumulation-type scalar (mean, rstd, logsumexp): fp32, fp64 for fp64."""
    return 8 if t.dtype == torch.float64 else 4


def _rows(t: TensorMeta, normalized: int) -> Num:
    return prod(t.shape[: t.dim - normalized]) if normalized else t.numel


# ------------------------------------------------------------------------ matmul class
def _flat_rows(x: TensorMeta) -> Item:
    """The (rows, K) operand a linear / folded matmul saves: x itself when its rows flatten
    as a view, else the copy that reshape makes."""
    return x if (x.dim <= 2 or x.rows_mergeable) else New("rows_copy", x.nbytes)


@register("aten.linear")
def _linear(c: Call, k) -> list[Item]:
    x, w = c.t(0), c.t(1)
    return [_flat_rows(x) if w.rg else None, w if x.rg else None]


@register("aten.mm", "aten.bmm")
def _mm(c: Call, k) -> list[Item]:
    a, b = c.t(0), c.t(1)
    return [a if b.rg else None, b if a.rg else None]


@register("aten.addmm", "aten.baddbmm")
def _addmm(c: Call, k) -> list[Item]:
    a, b = c.t(1), c.t(2)
    return [a if b.rg else None, b if a.rg else None]


def _batched(x: TensorMeta, batch: tuple, rows: Num, cols: Num) -> Item:
    """A matmul operand after expand(batch) + reshape to 3-D: itself if that is a view."""
    if tuple(x.shape[:-2]) == tuple(batch) and x.mergeable:
        return x
    return New("matmul_copy", prod(batch) * rows * cols * x.itemsize)


@register("aten.matmul")
def _matmul(c: Call, k) -> list[Item]:
    a, b = c.t(0), c.t(1)
    if a.dim == 1 or b.dim == 1:
        return [a if b.rg else None, b if a.rg else None]
    if b.dim == 2:  # (*, m, k) @ (k, n): folded to mm over the rows of a
        return [_flat_rows(a) if b.rg else None, b if a.rg else None]
    batch = tuple(c.out.shape[:-2])
    sa = _batched(a, batch, a.shape[-2], a.shape[-1]) if b.rg else None
    sb = _batched(b, batch, b.shape[-2], b.shape[-1]) if a.rg else None
    return [sa, sb]


@register("aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten._convolution",
          "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d")
def _conv(c: Call, k) -> list[Item]:
    x, w = c.t(0), c.t(1)
    return [x if w.rg else None, w if x.rg else None]


@register("transformers.grouped_mm_fallback")
def _grouped_fallback(c: Call, k) -> list[Item]:
    return [c.t(0), c.t(1)]  # ctx.save_for_backward(input, weight)


@register("aten._grouped_mm", "aten.grouped_mm")
def _grouped(c: Call, k) -> list[Item]:
    a, b, offs = c.t(0), c.t(1), c.t(2, "offs")
    return [a if b.rg else None, b if a.rg else None, offs]


# ------------------------------------------------------------------------ attention
@register("aten.scaled_dot_product_attention")
def _sdpa(c: Call, kernels) -> list[Item]:
    q, k, v = c.t(0), c.t(1), c.t(2)
    mask = c.t(3, "attn_mask")
    b = prod(q.shape[:-3]) if q.dim >= 4 else 1
    h, sq, d = q.shape[-3], q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    if sdpa_backend(c, kernels) == "flash":
        if mask is not None and mask.dtype == torch.bool:  # sdpa turns a bool mask into an additive float one
            mask = New("attn_bias", mask.numel * q.itemsize)
        return [q, k, v, c.out, New("logsumexp", b * h * sq * _acc_bytes(q)), mask]
    half = q.dtype in (torch.float16, torch.bfloat16)
    ic = 4 if (half and kernels.get("sdpa_math_upcast", True)) else q.itemsize
    dropout = (c.arg(4, "dropout_p", 0.0) or 0.0) > 0
    scores = b * h * sq * sk
    qk_grad = q.rg or k.rg
    items: list[Item | None] = [
        New("q_scaled", b * h * sq * d * ic) if k.rg else None,  # bmm(q*s, (k*s)^T) saves both factors
        New("k_scaled", b * h * sk * d * ic) if q.rg else None,
        New("attn_probs", scores * ic) if (qk_grad or (v.rg and not dropout)) else None,
    ]
    if dropout:
        mask_bytes = 1 if kernels.get("dropout_mask") == "bool" else ic
        items += [New("attn_dropout_mask", scores * mask_bytes) if qk_grad else None,
                  New("attn_dropped", scores * ic) if v.rg else None]
    if qk_grad:  # bmm(p, v) saves v, as a new buffer when upcast, repeated for GQA, or copied
        repeated = k.shape[-3] != h if k.dim >= 3 else False
        if ic != v.itemsize or repeated or not v.mergeable:
            items.append(New("v_bmm", b * h * sk * dv * ic))
        else:
            items.append(v)
    return items


@register("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
          "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention")
def _sdpa_fused(c: Call, k) -> list[Item]:
    return [c.t(0), c.t(1), c.t(2), c.outs[0], c.outs[1], c.t(3, "attn_mask")]


# ------------------------------------------------------------------------ norms
@register("aten.layer_norm")
def _layer_norm(c: Call, kernels) -> list[Item]:
    x, shape = c.t(0), c.arg(1, "normalized_shape")
    rows = _rows(x, len(shape))
    # mean and rstd: fp32 on CUDA (accumulation type), the input's dtype on CPU
    per = x.itemsize if kernels.get("layer_norm_stats") == "input_dtype" else _acc_bytes(x)
    return [x, New("mean", rows * per), New("rstd", rows * per), c.t(2, "weight"), c.t(3, "bias")]


@register("aten.native_layer_norm")
def _native_layer_norm(c: Call, k) -> list[Item]:
    return [c.t(0), c.outs[1], c.outs[2], c.t(2, "weight"), c.t(3, "bias")]


@register("aten.rms_norm")
def _rms_norm(c: Call, kernels) -> list[Item]:
    x, shape, w = c.t(0), c.arg(1, "normalized_shape"), c.t(2, "weight")
    rows = _rows(x, len(shape))
    rstd = New("rstd", rows * _acc_bytes(x))
    if kernels.get("rms_norm") == "fused":
        return [x, rstd, w]
    # composite: x32 = x.float(); rstd = rsqrt(mean(x32^2) + eps); y = (x32 * rstd).type_as(x) * w
    # (for fp16/bf16 everything up to the final cast, the weight product included, is fp32)
    half = x.dtype in (torch.float16, torch.bfloat16)
    x32 = New("x_fp32", x.numel * 4) if half else x
    items: list[Item | None] = [x32, rstd] if x.rg else []
    if w is not None:
        items += [New("normed", x.numel * (4 if half else x.itemsize)) if w.rg else None, w if x.rg else None]
    return items


@register("aten._fused_rms_norm")
def _fused_rms(c: Call, k) -> list[Item]:
    return [c.t(0), c.outs[1], c.t(2, "weight")]


@register("aten.group_norm")
def _group_norm(c: Call, k) -> list[Item]:
    x, groups = c.t(0), c.arg(1, "num_groups")
    return [x, New("mean", x.shape[0] * groups * 4), New("rstd", x.shape[0] * groups * 4), c.t(2), c.t(3)]


@register("aten.batch_norm")
def _batch_norm(c: Call, k) -> list[Item]:
    x = c.t(0)
    ch = x.shape[1] if x.dim > 1 else 1
    return [x, c.t(1), c.t(2), c.t(3), c.t(4), New("save_mean", ch * 4), New("save_invstd", ch * 4)]


# ------------------------------------------------------------------------ elementwise
def _self_if_rg(c: Call, k) -> list[Item]:
    x = c.t(0)
    return [x] if x is not None and x.rg else []


def _result_if_rg(c: Call, k) -> list[Item]:
    x = c.t(0)
    return [c.outs[0]] if x is not None and x.rg else []


register("aten.silu", "aten.silu_", "aten.gelu", "aten.gelu_", "aten.mish", "aten.softplus", "aten.log",
         "aten.log2", "aten.log1p", "aten.sin", "aten.cos", "aten.abs", "aten.erf", "aten.hardswish",
         "aten.hardsigmoid", "aten.leaky_relu", "aten.hardtanh", "aten.threshold", "aten.clamp",
         "aten.clamp_min", "aten.clamp_max", "aten.square", "aten.elu", "aten.nan_to_num")(_self_if_rg)
register("aten.tanh", "aten.sigmoid", "aten.exp", "aten.exp2", "aten.expm1", "aten.rsqrt", "aten.sqrt",
         "aten.relu", "aten.relu_", "aten.reciprocal", "aten.softmax", "aten._softmax", "aten._safe_softmax",
         "aten.log_softmax", "aten._log_softmax")(_result_if_rg)


@register("aten.pow")
def _pow(c: Call, k) -> list[Item]:
    a, b = c.arg(0), c.arg(1, "exponent")
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):  # Tensor_Tensor: self, exponent, result
        return [a, b, c.outs[0]]
    if isinstance(a, TensorMeta):
        return [a] if (a.rg and b != 0) else []
    return [b, c.outs[0]] if b is not None else []  # Scalar ** Tensor saves exponent and result


@register("aten.mul", "aten.mul_")
def _mul(c: Call, k) -> list[Item]:
    a, b = _t(c.arg(0)), _t(c.arg(1, "other"))
    if a is None or b is None:
        return []  # a scalar factor: nothing saved
    inplace = c.name.split(".")[1].endswith("_")
    sa = (New("original_self", a.nbytes) if inplace else a) if b.rg else None
    return [sa, b if a.rg else None]


@register("aten.div", "aten.div_")
def _div(c: Call, k) -> list[Item]:
    a, b = _t(c.arg(0)), _t(c.arg(1, "other"))
    if b is None:
        return []
    inplace = c.name.split(".")[1].endswith("_")
    sa = (New("original_self", a.nbytes) if inplace else a) if (b.rg and a is not None) else None
    return [sa, b if ((a is not None and a.rg) or b.rg) else None]


@register("aten.addcmul", "aten.addcdiv")
def _addcmul(c: Call, k) -> list[Item]:
    t1, t2 = c.t(1), c.t(2)
    return [t1, t2]


@register("aten.maximum", "aten.minimum", "aten.lerp", "aten.fmax", "aten.fmin")
def _binary_both(c: Call, k) -> list[Item]:
    return flatten_tensors(c.args[:3])


@register("aten.where")
def _where(c: Call, k) -> list[Item]:
    return [c.t(0)]


@register("aten.masked_fill", "aten.masked_fill_")
def _masked_fill(c: Call, k) -> list[Item]:
    x = c.t(0)
    return [c.t(1, "mask")] if x is not None and x.rg else []


@register("aten.native_dropout")
def _native_dropout(c: Call, k) -> list[Item]:
    return [c.outs[1]]


@register("aten.dropout", "aten.feature_dropout", "aten.alpha_dropout")
def _dropout(c: Call, kernels) -> list[Item]:
    x, p, train = c.t(0), c.arg(1, "p", 0.5), c.arg(2, "train", True)
    if not train or not p or c.aliases_input():
        return []
    # CUDA: native_dropout keeps a bool mask; CPU: input * (bernoulli noise / (1-p)) keeps the noise
    per = 1 if kernels.get("dropout_mask") == "bool" else x.itemsize
    return [New("dropout_mask", x.numel * per)]


# ------------------------------------------------------------------------ reductions
@register("aten.amax", "aten.amin", "aten.logsumexp", "aten.norm", "aten.linalg_vector_norm", "aten.prod",
          "aten.std", "aten.cumprod")
def _self_result(c: Call, k) -> list[Item]:
    return [c.t(0), c.outs[0]]


@register("aten.max", "aten.min", "aten.topk", "aten.sort", "aten.kthvalue", "aten.median", "aten.mode")
def _indices(c: Call, k) -> list[Item]:
    if len(c.outs) >= 2:
        return [c.outs[1]]  # values are selected by the saved indices
    return [c.t(0), c.outs[0]]  # full reduction max/min: self and result


@register("aten.var", "aten.var_mean")
def _var(c: Call, k) -> list[Item]:
    return [c.t(0)]


# ------------------------------------------------------------------------ indexing
@register("aten.embedding")
def _embedding(c: Call, k) -> list[Item]:
    return [c.t(1)] if c.t(0).rg else []


@register("aten.index")
def _index(c: Call, k) -> list[Item]:
    return flatten_tensors(c.arg(1, "indices")) if c.t(0).rg else []


@register("aten.index_select", "aten.gather", "aten.take_along_dim")
def _index_select(c: Call, k) -> list[Item]:
    x = c.t(0)
    return [c.t(2, "index") or c.t(1, "indices")] if x.rg else []


@register("aten.index_add", "aten.index_add_", "aten.index_copy", "aten.index_copy_")
def _index_add(c: Call, k) -> list[Item]:
    src = c.t(3, "source")
    return [c.t(2, "index"), src] if src is not None and src.rg else []


@register("aten.index_put", "aten.index_put_")
def _index_put(c: Call, k) -> list[Item]:
    return flatten_tensors(c.arg(1, "indices"))


@register("aten.scatter", "aten.scatter_", "aten.scatter_add", "aten.scatter_add_", "aten.scatter_reduce")
def _scatter(c: Call, k) -> list[Item]:
    return [c.t(2, "index")]


@register("aten.masked_select", "aten.masked_scatter")
def _masked_select(c: Call, k) -> list[Item]:
    return [c.t(1, "mask")]


# ------------------------------------------------------------------------ losses
@register("aten.cross_entropy_loss")
def _cross_entropy(c: Call, k) -> list[Item]:
    x, target = c.t(0), c.t(1)
    if not x.rg:
        return []
    # log_softmax keeps its result; nll_loss keeps it (same storage), the target and total_weight
    return [New("log_softmax", x.nbytes), target, New("total_weight", _acc_bytes(x)), c.t(2, "weight")]


@register("aten.nll_loss", "aten.nll_loss2d")
def _nll(c: Call, k) -> list[Item]:
    return [c.t(0), c.t(1), New("total_weight", 4), c.t(2, "weight")]


@register("aten.nll_loss_forward")
def _nll_fwd(c: Call, k) -> list[Item]:
    return [c.t(0), c.t(1), c.outs[1], c.t(2, "weight")]


@register("aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.binary_cross_entropy",
          "aten.binary_cross_entropy_with_logits")
def _loss(c: Call, k) -> list[Item]:
    return flatten_tensors(c.args[:4])


# ------------------------------------------------------------------------ collectives: nothing saved
for _n in ("autopar.all_reduce", "autopar.grad_all_reduce", "autopar.all_gather", "autopar.all_gather_chunk_grad",
           "autopar.reduce_scatter", "autopar.split", "autopar.all_to_all", "autopar.all_to_all_v",
           "autopar.broadcast", "autopar.send", "autopar.recv"):
    SAVES_NOTHING.add(_n)
