"""The one per-node time formula, and the tensor-parallel divisors it is applied with.

`NodeTimer(hw, values).node(node_cost, div)` is (forward, backward) seconds of one node on one
rank (roofline): max(matmul FLOPs / (peak[dtype] x eff_mm) + other FLOPs / (vector peak x
eff.vector), bytes / (memory bandwidth x eff.memory), floor[kind]) + kernel overhead.
eff_mm is `hw.matmul_eff(dtype, m, n, k)`: the profile's compute table by GEMM shape
(autopar/cost/compute_tables.py), else the flat eff.matmul. The shape comes from the node's
FLOPs and its first output: n = out.shape[-1], m = out.numel / n (batch dims folded in),
k = FLOPs / (2 m n); a tensor-parallel divisor shrinks max(n, k) (column-parallel shards n,
row-parallel k, and the sharded one is the wide one). Attention uses `hw.attention_eff(dtype,
seq, head_dim, causal, backward)` with seq and head_dim from its output (b, h, seq, head_dim)
and counts `causal_fraction` of the score matrix. floor[kind] is the table's per-kernel floor
(0 without one). Backward: the node's backward FLOPs, twice its other FLOPs, and bytes =
output gradients + input gradients + saved tensors (+ unfused attention's passes over its score
gradients, `MATH_BWD_SCORE_PASSES`). The step estimate, the searches
(sharding, fusion, planner) and the memory timeline all time nodes with it.

`layout_divisors(gc, plan)`: the tensor-parallel plug-in. `Plan.node_layouts` maps a node key
to its output layout; a node's compute is divided by the sizes of the axes where its output
is Shard or Partial, its new storages by those where it is Shard (the dp axis is ignored:
graph shapes are already per dp rank). A buffer the op makes for backward per element of its output
(`cost.saved.New` tags in `PER_OUTPUT_ELEMENT`: dropout mask, norm statistics, logsumexp ...)
is divided like the output: under sequence parallelism a dropout mask is sbh/t bytes per
layer, not sbh (Korthikanti et al. 2022, section 4.2.2, the 34 sbh/t of selective recompute);
other buffers (a copy of an input, an attention bias) stay whole. The graph's outputs are whole
too (the runtime gathers them for the loss), except the vocab-sharded logits of a
`Plan.loss_parallel` plan (`cost.loss_memory.gathered_outputs`).

Reads no node.meta (only `cost.analyze`'s NodeCosts). Deterministic; `NodeTimer` memoises per
(cost, divisor), so one timer serves one set of symbol values.
"""
from __future__ import annotations

from typing import Any

from autopar.passes.plan import Plan

from .graph import GraphCost, NodeCost
from .hardware import Hardware
from .placements import Partial, Shard
from .symbolic import evaluate

__all__ = ["NodeTimer", "layout_divisors", "PER_OUTPUT_ELEMENT"]

# `cost.saved.New` tags of buffers made per element (or per row, per head) of the op's output:
# a rank that computes a shard of the output makes only its shard of them. The others (a copy
# of an input made to flatten it, an attention bias, batch-norm statistics per channel) follow
# an input or a dimension the output's sharding need not split: they stay whole.
PER_OUTPUT_ELEMENT = frozenset({"dropout_mask", "mean", "rstd", "logsumexp", "q_scaled", "k_scaled", "attn_probs",
                                "attn_dropout_mask", "attn_dropped", "v_bmm", "x_fp32", "normed", "original_self"})

# Backward of unfused ("math") attention, in passes over the score matrix (at the saved `attn_probs`' width)
# that no saved tensor stands for: the dropped probabilities' gradient (written by bmm, read by dropout's
# backward), the probabilities' gradient (written, read by softmax's backward), the scores' gradient (written,
# read by the two bmms giving dq and dk): 7 with attention dropout; 6 without (the dropout pair gone, the saved
# probabilities read a second time: by the bmm giving dv and by softmax's backward). Counted op by op in torch's
# math backward (tests/unit/test_cost_models.py). Flash attention's backward keeps these on chip. Against Korthikanti et al. 2022, Table 4 (22B, tp 8, sequence parallel,
# no recompute, 2022 Megatron-LM's unfused core; benchmarks/bench_published.py --attention unfused): one block's
# backward 11.14 ms predicted (9.99 ms without these passes) against 11.8 ms measured; forward 7.03 against 7.2.
MATH_BWD_SCORE_PASSES = {True: 7, False: 6}


class NodeTimer:
    """(forward, backward) seconds of one node on one rank: the one per-node time formula the
    estimate, the searches (sharding, fusion, planner) and the memory timeline share."""

    def __init__(self, hw: Hardware, values, compute_dtype: str | None = None):
        """`compute_dtype` ("bf16" ...): the dtype the plan computes in (its `param_dtype`: the
        engine casts the model to it); floating matmuls and attention run at that dtype's peak
        whatever the capture's dtype. None: as captured. Bytes stay the captured ones."""
        self.hw, self.values = hw, values
        self.compute_dtype = compute_dtype
        self.cache: dict[Any, tuple[float, float]] = {}

    def ev(self, x) -> float:
        return evaluate(x, self.values)

    def node(self, n: NodeCost, div: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of one node's compute on one rank."""
        c = n.cost
        if c.kind in ("none", "view", "comm"):
            return 0.0, 0.0
        key = (id(c), n.bwd_flops, n.has_grad_fn, tuple(nb for _k, nb, _t in n.saved), div)
        hit = self.cache.get(key)
        if hit is None:
            flops = self.ev(c.flops)
            shape = self._shape(c, n, flops)
            hit = (self.seconds(c.kind, c.dtype, flops, self.ev(c.other_flops), self.ev(c.bytes_read + c.bytes_written),
                                div=div, shape=shape, causal_fraction=c.causal_fraction),
                   self.seconds(c.kind, c.dtype, self.ev(n.bwd_flops), 2 * self.ev(c.other_flops), self._bwd_bytes(n),
                                div=div, shape=shape, causal_fraction=c.causal_fraction, backward=True)
                   if n.has_grad_fn else 0.0)
            self.cache[key] = hit
        return hit

    def _shape(self, c, n: NodeCost, flops: float) -> tuple[float, ...] | None:
        """matmul: (m, n, k) of one forward GEMM; attention: (seq, head_dim); else None."""
        if c.kind not in ("matmul", "attention") or not n.outputs or not flops:
            return None
        out = n.outputs[0]
        if len(out.shape) < (2 if c.kind == "attention" else 1):
            return None
        last, numel = self.ev(out.shape[-1]), self.ev(out.numel)
        if not last or not numel:
            return None
        if c.kind == "attention":
            return self.ev(out.shape[-2]), last
        return numel / last, last, flops / (2.0 * numel)

    def _bwd_bytes(self, n: NodeCost) -> float:
        b = sum(self.ev(t.nbytes) for t in n.outputs) + sum(self.ev(t.nbytes) for t in n.grad_inputs)
        b += sum(self.ev(nb) for _k, nb, _t in n.saved)
        probs = [self.ev(nb) for _k, nb, tag in n.saved if tag == "attn_probs"]  # the math path of attention
        if probs:
            passes = MATH_BWD_SCORE_PASSES[any(tag == "attn_dropout_mask" for _k, _nb, tag in n.saved)]
            b += passes * sum(probs)
        return b

    def seconds(self, kind: str, dtype: str, flops: float, other: float, nbytes: float, *, div: int = 1,
                shape: tuple[float, ...] | None = None, causal_fraction: float = 1.0,
                backward: bool = False) -> float:
        """Seconds of one kernel of `kind` ("matmul", "attention", "vector") on one rank: the
        roofline with the shape's efficiency, its floor and the launch overhead. `shape`:
        (m, n, k) of a matmul (one GEMM, before `div`), (seq, head_dim) of attention; None:
        the flat efficiency."""
        hw = self.hw
        flops, other, nbytes = flops / div, other / div, nbytes / div
        t_c = 0.0
        dt = dtype
        if self.compute_dtype is not None and dt in ("fp32", "bf16", "fp16") \
                and (self.compute_dtype in hw.device.peak_flops or self.compute_dtype == "fp32"):
            dt = self.compute_dtype
        if kind == "matmul":
            dt = dt if dt in hw.device.peak_flops or dt == "fp32" else "fp32"
            if shape is not None and div > 1:
                m_, n_, k_ = shape
                shape = (m_, n_ / div, k_) if n_ >= k_ else (m_, n_, k_ / div)
            t_c = flops / (hw.peak(dt) * hw.matmul_eff(dt, *(shape or ())))
        elif kind == "attention":
            dt = dt if dt in hw.device.peak_flops else "fp32"
            seq, hd = shape if shape is not None else (None, None)
            eff = hw.attention_eff(dt, seq, hd, causal_fraction < 1.0, backward)
            t_c = flops * causal_fraction / (hw.peak(dt) * eff)
        t_v = other / (hw.device.vector_flops * hw.eff("vector"))
        t_m = nbytes / (hw.device.memory_bandwidth * hw.eff("memory"))
        floor = hw.kernel_floor(kind if kind in ("matmul", "attention") else "vector")
        return max(t_c + t_v, t_m, floor) + hw.kernel_overhead_s


def layout_divisors(gc: GraphCost, plan: Plan | None) -> tuple[dict[int, int], dict[Any, int]]:
    """node index -> compute divisor; storage key -> memory divisor, from Plan.node_layouts."""
    if plan is None or not plan.node_layouts:
        return {}, {}
    comp, mem = {}, {}
    for n in gc.nodes:
        lay = plan.node_layouts.get(n.key)
        if lay is None:
            continue
        cd = md = 1
        for axis, p in lay.axes:
            if axis == plan.dp_axis or axis not in plan.mesh:
                continue
            if isinstance(p, (Shard, Partial)):
                cd *= plan.mesh[axis]
            if isinstance(p, Shard):
                md *= plan.mesh[axis]
        comp[n.index] = cd
        for k in n.new_storages:
            mem[k] = md
        if md > 1:  # the buffers it makes for backward per element it computes: sharded as it is
            for k, _nb, tag in n.saved:
                if tag in PER_OUTPUT_ELEMENT and isinstance(k, tuple) and k[:1] == ("new",):
                    mem[k] = md
    from .loss_memory import gathered_outputs  # noqa: PLC0415

    return comp, gathered_outputs(gc, plan, mem)  # outputs the runtime gathers for the loss are whole

