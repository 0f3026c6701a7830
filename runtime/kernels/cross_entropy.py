"""Fused cross-entropy, and linear + cross-entropy chunked so the full logits never exist.

    cross_entropy(logits, target)                = mean over rows with target != ignore_index
                                                   of logsumexp(logits) - logits[target]
    linear_cross_entropy(x, weight, target, bias) = cross_entropy(x @ weight.T + bias, target)

Both return an fp32 scalar (also for bf16 / fp16 inputs); a batch whose rows are all ignored
gives nan, as `torch.nn.functional.cross_entropy` does. Logsumexp runs with a running max,
so logits offset by 1e4 (or any amount that fp32 holds) stay finite.

`linear_cross_entropy` walks the rows in chunks. Forward: per chunk, logits = x_c W^T (+b)
into one reusable (chunk, V) buffer, then the Triton kernel writes each row's loss and
logsumexp; it saves only x, W, b, target and two fp32 numbers per row (max, log-sum). Backward: per
chunk, recompute the logits into the buffer, turn them into d loss / d logits in place
(Triton), then dx_c = dlogits W (written straight into dx), dW += dlogits^T x_c and
db += column sums. Extra memory is one chunk of logits plus, for bf16 / fp16 weights, an
fp32 (V, H) accumulator for dW (so that dW is rounded once, like the unfused reference) and
an fp32 temporary no larger than one chunk of logits.
The chunk defaults to about as many logits as x has elements (at least 1, at most all rows).

Torch references (`<op>_reference`: the oracles and CPU fallbacks), autograd Functions over
`_triton_cross_entropy.py`, and the dispatching public functions.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._dispatch import acc, as_rows, load_kernels, use_triton

# ---------------------------------------------------------------------------- references


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(acc(logits).reshape(-1, V), target.reshape(-1),
                           ignore_index=ignore_index)


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   bias: torch.Tensor | None = None, ignore_index: int = -100,
                                   chunk_size: int | None = None) -> torch.Tensor:
    """The unfused op: full logits, then cross-entropy (`chunk_size` is ignored)."""
    return cross_entropy_reference(F.linear(x, weight, bias), target, ignore_index)


# ---------------------------------------------------------------------------- helpers

_FP32_OUT_MM: dict[str, bool] = {}  # device type -> torch.mm(..., out_dtype=fp32) works


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from bf16 / fp16 operands without rounding the product to 16 bits.

    cuBLAS does it natively (`out_dtype`, torch >= 2.8 on CUDA); elsewhere the operands are
    upcast (exact: a product of two 16-bit floats fits fp32).
    """
    kind = a.device.type
    if _FP32_OUT_MM.get(kind, kind == "cuda"):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_MM[kind] = False
    return torch.mm(a.float(), b.float())


def _accumulate_dw(dw: torch.Tensor, dlogits: torch.Tensor, xc: torch.Tensor) -> None:
    """dw (V, H) fp32 += dlogits^T xc, the product kept in fp32.

    For 16-bit inputs the fp32 product is formed over vocab slices, so that the temporary
    stays within the size of one chunk of logits.
    """
    if dlogits.dtype == torch.float32:
        dw.addmm_(dlogits.t(), xc)
        return
    step = max(1, dlogits.numel() * dlogits.element_size() // (4 * xc.shape[1]))
    for v0 in range(0, dw.shape[0], step):
        dw[v0:v0 + step].add_(_mm_fp32(dlogits[:, v0:v0 + step].t(), xc))


def _chunk_logits(xc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  buf: torch.Tensor) -> torch.Tensor:
    out = buf[: xc.shape[0]]
    if bias is None:
        return torch.mm(xc, weight.t(), out=out)
    return torch.addmm(bias, xc, weight.t(), out=out)


def _row_stats(rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(loss, max, log-sum-exp minus max) per row, fp32, filled by the forward kernel."""
    return tuple(torch.empty(rows, dtype=torch.float32, device=device) for _ in range(3))


def default_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """About as many logits per chunk as x has elements: rows / ceil(V / H), a power of 2."""
    per_chunk = math.ceil(rows / max(1, math.ceil(vocab / max(hidden, 1))))
    return max(1, min(rows, 1 << max(0, per_chunk - 1).bit_length()))


# ---------------------------------------------------------------------------- autograd


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        logits2 = as_rows(logits)
        t = target.reshape(-1).contiguous()
        M = logits2.shape[0]
        loss_rows, row_max, row_logsum = _row_stats(M, logits.device)
        load_kernels("cross_entropy").ce_fwd(logits2, t, ignore_index, loss_rows, row_max,
                                              row_logsum)
        n_valid = (t != ignore_index).sum()
        ctx.save_for_backward(logits2, t, row_max, row_logsum, n_valid)
        ctx.ignore_index, ctx.shape = ignore_index, logits.shape
        return loss_rows.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        logits2, t, row_max, row_logsum, n_valid = ctx.saved_tensors
        scale = (grad_loss.float() / n_valid).reshape(())
        dlogits = torch.empty(logits2.shape, dtype=logits2.dtype, device=logits2.device)
        load_kernels("cross_entropy").ce_bwd(logits2, t, row_max, row_logsum, scale,
                                              ctx.ignore_index, out=dlogits)
        return dlogits.view(ctx.shape), None, None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, chunk):
        k = load_kernels("cross_entropy")
        x2, t = as_rows(x), target.reshape(-1).contiguous()
        M, V = x2.shape[0], weight.shape[0]
        loss_rows, row_max, row_logsum = _row_stats(M, x.device)
        buf = torch.empty((min(chunk, M), V), dtype=x.dtype, device=x.device)
        for start in range(0, M, chunk):
            end = min(start + chunk, M)
            logits = _chunk_logits(x2[start:end], weight, bias, buf)
            k.ce_fwd(logits, t[start:end], ignore_index, loss_rows[start:end],
                     row_max[start:end], row_logsum[start:end])
        del buf
        n_valid = (t != ignore_index).sum()
        ctx.save_for_backward(x2, weight, bias, t, row_max, row_logsum, n_valid)
        ctx.ignore_index, ctx.chunk, ctx.shape = ignore_index, chunk, x.shape
        return loss_rows.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        x2, weight, bias, t, row_max, row_logsum, n_valid = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        k = load_kernels("cross_entropy")
        M, H = x2.shape
        V, chunk = weight.shape[0], ctx.chunk
        scale = (grad_loss.float() / n_valid).reshape(())
        dx = torch.empty((M, H), dtype=x2.dtype, device=x2.device) if need_x else None
        dw = db = None
        if need_w:
            dw = torch.zeros((V, H), dtype=torch.float32, device=x2.device)
        if need_b:
            db = torch.zeros(V, dtype=torch.float32, device=x2.device)
        buf = torch.empty((min(chunk, M), V), dtype=x2.dtype, device=x2.device)
        for start in range(0, M, chunk):
            end = min(start + chunk, M)
            xc = x2[start:end]
            dlogits = _chunk_logits(xc, weight, bias, buf)
            k.ce_bwd(dlogits, t[start:end], row_max[start:end], row_logsum[start:end], scale,
                     ctx.ignore_index, out=dlogits)
            if need_x:
                torch.mm(dlogits, weight, out=dx[start:end])
            if need_w:
                _accumulate_dw(dw, dlogits, xc)
            if need_b:
                db.add_(dlogits.sum(0, dtype=torch.float32))
        return (
            dx.view(ctx.shape) if need_x else None,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
            None, None, None,
        )


# ---------------------------------------------------------------------------- public


def _check_target(op: str, target: torch.Tensor, rows_shape: torch.Size) -> None:
    if target.shape != rows_shape:
        raise ValueError(f"{op}: target has shape {tuple(target.shape)}, expected "
                         f"{tuple(rows_shape)} (the input's shape without its last dim)")
    if target.is_floating_point() or target.is_complex():
        raise ValueError(f"{op}: target has dtype {target.dtype}; pass class indices "
                         "(torch.long); probabilities are not supported")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., V) against class indices `target` (...).

    Returns:
        fp32 scalar: the mean over rows whose target is not `ignore_index`.
    """
    _check_target("cross_entropy", target, logits.shape[:-1])
    if use_triton("cross_entropy", logits, target):
        return _CrossEntropy.apply(logits, target, ignore_index)
    return cross_entropy_reference(logits, target, ignore_index)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         chunk_size: int | None = None) -> torch.Tensor:
    """cross_entropy(x @ weight.T + bias, target) without materialising all the logits.

    Args:
        x: (..., H) activations; weight: (V, H) as in nn.Linear; bias: (V,) or None;
        target: (...) class indices.
        chunk_size: rows per chunk; by default about as many logits as x has elements.
    Returns:
        fp32 scalar: the mean over rows whose target is not `ignore_index`.
    """
    H = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"linear_cross_entropy: weight has shape {tuple(weight.shape)}; "
                         f"expected (vocab, {H}) to match x's last dim")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias has shape {tuple(bias.shape)}; "
                         f"expected ({weight.shape[0]},)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear_cross_entropy: x is {x.dtype} but weight / bias are "
                         f"{weight.dtype} / {None if bias is None else bias.dtype}; cast them "
                         "to one dtype (autocast does this for F.linear)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size}; use a positive "
                         "row count or None")
    _check_target("linear_cross_entropy", target, x.shape[:-1])
    if use_triton("linear_cross_entropy", x, weight, bias, target):
        rows = math.prod(x.shape[:-1])
        chunk = chunk_size or default_chunk_rows(rows, H, weight.shape[0])
        return _LinearCrossEntropy.apply(x, weight, bias, target, ignore_index, max(1, chunk))
    return linear_cross_entropy_reference(x, weight, target, bias, ignore_index)
