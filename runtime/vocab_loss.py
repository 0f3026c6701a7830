"""Cross-entropy over vocabulary-sharded logits (a vocab-parallel loss), and the loss that opts in.

`cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0)` is
`F.cross_entropy` over (N, ..., V) logits (the vocabulary last, as a language model's head
writes them; targets (N, ...)). Called on ordinary tensors it is exactly `F.cross_entropy` on
the flattened tokens. Given as a program's `loss_fn` (`pm.step(batch, autopar.cross_entropy)`,
or a `functools.partial` of it), it tells the program that the loss is this one: when the
plan keeps the logits sharded over the vocabulary on tp (`Plan.loss_parallel`), the program
does not gather them and runs `vocab_parallel_cross_entropy` on this rank's shard instead.

`vocab_parallel_cross_entropy(local, target, axis, vocab, scale=...)`: the loss over logits of
which this rank holds vocabulary columns [start, start + V/k) (torch.chunk order along `axis`),
as Megatron-LM's `vocab_parallel_cross_entropy` and DTensor's `loss_parallel` compute it:

  forward   m = all_reduce_max(max_j z_j)                       (1st all-reduce, B*T values)
            e = exp(z - m) on the shard;  [sum_j e_j, z_t - m, sum_j (z_j - m)]
            all-reduced as one SUM (2nd all-reduce, 2 or 3 x B*T values; z_t: the target's
            logit, from the one rank that holds it, 0 elsewhere)
            nll = log(sum e) - (z_t - m); with label smoothing eps the token's loss is
            (1 - eps) nll + eps (log(sum e) - sum_j (z_j - m) / V), 0 on ignored tokens
            loss = scale * sum over tokens
  backward  dz = scale * g * (softmax - (1 - eps) onehot_shard - eps / V) on kept tokens,
            written into the saved softmax (in place: the loss holds one shard-sized buffer
            from its forward to its backward, which then becomes the logits' gradient)

`scale` makes it a mean "as one process": the program passes (batch pieces x micro-batches) /
(tokens not ignored in the whole global batch), so that after it averages the loss over the
ranks that split the batch and the micro-batches, loss and gradients are those of one
process's `F.cross_entropy(..., reduction="mean")` over the global batch, ignored tokens
counted over the global batch (`global_scale`).

Reads and writes no node.meta. `sharded_output(module)` reads the `autopar_vocab_shard` entry
that passes/shard.py writes into a rewritten GraphModule's `meta` (which output stays sharded,
on which axis and dim, and its global vocabulary size; a pipeline stage keeps it on its output
node). Guarantees: equal to `F.cross_entropy`
up to summation order (fp64: 1e-12 in tests/dist/test_loss_parallel.py); the logits'
gradient keeps their sharding; the backward runs once (a second backward raises).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .active_mesh import axis_index, axis_size, chunk_range
from .collective_calls import all_reduce_

__all__ = [
    "LossSpec",
    "check_targets",
    "cross_entropy",
    "global_scale",
    "parallel_spec",
    "select_logits",
    "sharded_output",
    "vocab_parallel_cross_entropy",
]


def cross_entropy(logits: Any, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, output: str | int | None = None) -> torch.Tensor:
    """`F.cross_entropy` over (N, ..., V) logits with the vocabulary last; targets (N, ...).

    Args:
        logits: the model's logits, or its output holding them (a dict / transformers output:
            `output` names the key, default "logits"; a tuple or list: `output` is the index,
            default 0).
        target: class indices, `ignore_index` where a token is not counted.
        reduction: "mean" only (the mean over tokens that are not ignored).
        label_smoothing: in [0, 1], as `F.cross_entropy`.
        output: which entry of a dict / tuple output holds the logits.

    As a program's loss_fn it lets a vocab-sharded plan (`Plan.loss_parallel`) compute the loss
    without gathering the logits (module docstring)."""
    spec = LossSpec.of(ignore_index, reduction, label_smoothing, output)
    z = select_logits(logits, spec.output)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=spec.ignore_index,
                           label_smoothing=spec.label_smoothing)


@dataclass(frozen=True)
class LossSpec:
    """The arguments of a `cross_entropy` loss_fn: what the vocab-parallel loss computes."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    output: str | int | None = None

    @staticmethod
    def of(ignore_index: Any = -100, reduction: Any = "mean", label_smoothing: Any = 0.0,
           output: Any = None) -> LossSpec:
        if reduction != "mean":
            raise ValueError(f"autopar.cross_entropy supports reduction='mean' (the mean over the tokens not "
                             f"ignored), got reduction={reduction!r}; for a sum multiply the mean by the number of "
                             "counted tokens, or use F.cross_entropy in your own loss_fn (the logits are then "
                             "gathered)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"ignore_index must be an integer, got {ignore_index!r}")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
                or not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
        if output is not None and (isinstance(output, bool) or not isinstance(output, (str, int))):
            raise ValueError(f"output names the logits in the model's output: a key (str) or an index (int), "
                             f"got {output!r}")
        return LossSpec(int(ignore_index), float(label_smoothing), output)


def parallel_spec(loss_fn: Callable) -> LossSpec | None:
    """The `LossSpec` of `loss_fn` when it is `cross_entropy` or a `functools.partial` of it
    (keyword arguments only), else None (another loss: the program gathers the logits)."""
    if loss_fn is cross_entropy:
        return LossSpec()
    if isinstance(loss_fn, functools.partial) and loss_fn.func is cross_entropy and not loss_fn.args:
        kw = dict(loss_fn.keywords)
        unknown = sorted(set(kw) - {"ignore_index", "reduction", "label_smoothing", "output"})
        if unknown:
            raise ValueError(f"autopar.cross_entropy got unknown arguments {unknown}; it takes ignore_index, "
                             "reduction, label_smoothing and output")
        return LossSpec.of(kw.get("ignore_index", -100), kw.get("reduction", "mean"),
                           kw.get("label_smoothing", 0.0), kw.get("output"))
    return None


def select_logits(out: Any, output: str | int | None) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, `out[output]` of a dict (default
    "logits") or of a tuple / list (default 0)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        key = "logits" if output is None else output
        if key not in out:
            raise ValueError(f"the model's output has keys {list(out.keys())}, no {key!r}; pass "
                             "functools.partial(autopar.cross_entropy, output=<the logits' key>)")
        return out[key]
    if isinstance(out, (tuple, list)):
        i = 0 if output is None else output
        if not isinstance(i, int) or not -len(out) <= i < len(out):
            raise ValueError(f"the model's output is a {type(out).__name__} of {len(out)}; output={output!r} is "
                             "not an index of it")
        return out[i]
    raise ValueError(f"autopar.cross_entropy takes logits as a tensor (or a dict / tuple holding them), got "
                     f"{type(out).__name__}")


def sharded_output(module: Any) -> dict | None:
    """{"output": flat output index, "axis", "dim", "size": global vocabulary} of a rewritten
    GraphModule whose logits stay vocab-sharded (passes/shard.py), else None."""
    meta = getattr(module, "meta", None)
    entry = meta.get("autopar_vocab_shard") if isinstance(meta, dict) else None
    graph = getattr(module, "graph", None)
    if not entry and graph is not None:  # a pipeline's last stage: the output node keeps the entry
        out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
        entry = out.meta.get("autopar_vocab_shard") if out is not None else None
    return dict(entry) if entry else None


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError when a counted target is outside [0, vocab) (F.cross_entropy raises on one)."""
    kept = target[target != ignore_index]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab):
        raise ValueError(f"cross_entropy targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
                         f"got values from {int(kept.min())} to {int(kept.max())}")


def global_scale(global_target: torch.Tensor, ignore_index: int, pieces: int) -> float:
    """`pieces` / (tokens of the whole global batch not ignored): the factor that turns this
    rank's sum over a micro-batch into its share of one process's mean (module docstring);
    `pieces` = ranks splitting the batch x micro-batches. inf when every token is ignored (the
    mean is then nan, as F.cross_entropy's)."""
    count = int((global_target != ignore_index).sum())
    return float(pieces) / count if count else float("inf")


def vocab_parallel_cross_entropy(local: torch.Tensor, target: torch.Tensor, axis: str, vocab: int, *,
                                 scale: float = 1.0, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """scale x the summed cross-entropy of the tokens of `target` (N, ...) against logits of
    which `local` (N, ..., V/k) holds this rank's vocabulary chunk along mesh axis `axis`
    (torch.chunk order; `vocab` the global size). Differentiable in `local`."""
    k = axis_size(axis)
    start, end = chunk_range(vocab, k, axis_index(axis))
    if local.shape[-1] != end - start:
        raise ValueError(f"the logits shard has {local.shape[-1]} vocabulary columns, but a {vocab}-token "
                         f"vocabulary over {axis}={k} gives this rank {end - start}")
    if tuple(local.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits {tuple(local.shape)} and targets {tuple(target.shape)} do not match: targets "
                         "need the logits' shape without its last (vocabulary) dim")
    return _VocabParallelCE.apply(local, target, axis, vocab, start, float(scale), int(ignore_index),
                                  float(label_smoothing))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target, axis, vocab, start, scale, ignore_index, eps):
        vl = z.shape[-1]
        zmax = z.amax(dim=-1)  # (N, ...): the global max, so exp never overflows
        all_reduce_(zmax, axis, "max")
        e = z - zmax.unsqueeze(-1)  # shifted logits, the shard's size
        kept = target != ignore_index
        t = target - start
        here = kept & (t >= 0) & (t < vl)  # this rank holds the target's column
        idx = torch.where(here, t, torch.zeros_like(t)).unsqueeze(-1)
        parts = [None, torch.gather(e, -1, idx).squeeze(-1) * here]  # the target's shifted logit, 0 elsewhere
        if eps > 0:
            parts.append(e.sum(dim=-1))
        e.exp_()
        parts[0] = e.sum(dim=-1)
        sums = torch.stack(parts).to(torch.promote_types(z.dtype, torch.float32))
        all_reduce_(sums, axis, "sum")
        lse = sums[0].log()
        per = lse - sums[1]
        if eps > 0:
            per = (1.0 - eps) * per + eps * (lse - sums[2] / vocab)
        loss = torch.where(kept, per, torch.zeros_like(per)).sum() * scale
        e.div_(sums[0].to(e.dtype).unsqueeze(-1))  # the softmax of the shard, in place: saved for backward
        ctx.softmax, ctx.idx, ctx.here, ctx.kept = e, idx, here, kept
        ctx.scale, ctx.eps, ctx.vocab = scale, eps, vocab
        ctx.mark_non_differentiable(target)
        return loss.to(z.dtype)

    @staticmethod
    def backward(ctx, g):
        grad = ctx.softmax
        if grad is None:
            raise RuntimeError("the vocab-parallel cross-entropy's backward ran twice; it frees its buffer "
                               "(the logits' gradient is written into it): call backward once per forward")
        ctx.softmax = None
        grad.scatter_add_(-1, ctx.idx, -(1.0 - ctx.eps) * ctx.here.to(grad.dtype).unsqueeze(-1))
        if ctx.eps > 0:
            grad.sub_(ctx.eps / ctx.vocab)
        grad.mul_((ctx.kept.to(grad.dtype) * (g.to(grad.dtype) * ctx.scale)).unsqueeze(-1))
        return grad, None, None, None, None, None, None, None
