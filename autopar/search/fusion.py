"""Which fusions pay: the cost model's choice among the matches of the fusion table.

For every match of `passes/rules/fusion_table.py` in a graph, the time of the ops it would
replace (forward + backward, from `autopar.cost.analyze` and the step estimate's per-node
time, `max(compute, bytes / bandwidth) + launch overhead` per kernel) is set against the time
of the fused kernel: its own memory traffic (inputs, outputs, what it saves and re-reads in
backward) over the same bandwidth, one launch per pass (the cost model's convention for every
op: a kernel's internal reductions, like the weight-gradient sum, are bytes, not launches),
and the same elementwise arithmetic. Matmuls a rule keeps (the bias-free linear of
`bias_gelu`) are counted on both sides, less the bias-gradient reduction the bias-free one
no longer runs (one launch and a read of the gradient; the fused kernel sums the bias
gradient in its own pass). `linear_cross_entropy` is costed in full: it
recomputes the logits in backward (one more matmul) and walks the vocabulary in chunks,
which saves time only where the logits' traffic outweighs that; its gain is memory.

Bandwidth, efficiency and launch overhead come from the hardware profile, so a profile
calibrated on the target GPU (the `efficiency` and `kernel_overhead_s` that `autopar tune`
measures) calibrates these choices too. Matches are grouped by (rule, module path); a group
is fused when its predicted saving exceeds `min_gain` of its unfused time (or, with
`prefer_memory`, when it frees saved-activation memory). On a profile without Triton (a CPU
device) nothing is fused: there the fused op would run its torch reference, the same work.

    fusions, rows = plan_fusions(gm, "h100-sxm")
    plan.fusions = fusions                   # ["swiglu", "rope@model.layers.0.self_attn", ...]
    plan.notes += fusion_notes(rows)         # the decision and its predicted saving
    plan.extra["fusion"] = [r.to_dict() for r in rows]

`search_fusions(plan, gm, hardware, batch_split)` does the above into a Plan, as
`autopar.parallelize` does when the fusions are not pinned.

Importing this module also gives `autopar.cost` a cost rule and a saved-tensor rule for each
fused call (`cost.fused.register_fused_cost_rules`), so that a fused graph is costed without
fallbacks.

Reads node.meta["val"] and node.meta["autopar"] (through the fusion table and the cost
model); writes nothing. Deterministic: rows are sorted by graph order.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost import analyze, load_profile
from autopar.cost.fused import SUPPORTED_DTYPES, default_chunk_rows  # importing it registers the fused calls' rules
from autopar.cost.graph import GraphCost, NodeCost
from autopar.cost.hardware import Hardware
from autopar.cost.node_time import NodeTimer  # the step estimate's per-node time: one formula for both sides
from autopar.cost.symbolic import evaluate
from autopar.cost.tensors import dtype_name
from autopar.passes.plan import Plan
from autopar.passes.rules.fusion_match import Emit, Match, value_of
from autopar.passes.rules.fusion_table import RULE_NAMES, find_matches
from autopar.passes.rules.sharding import requires_grad_nodes


@dataclass(frozen=True)
class FusionChoice:
    """One (rule, module) group of matches and what the cost model says about it.

    Times are seconds per training step on one rank (forward + backward of the ops involved);
    saved_bytes: saved-for-backward activation bytes the fusion frees (negative: it adds).
    """

    rule: str
    module: str
    sites: int
    unfused_s: float
    fused_s: float
    saved_bytes: float
    applied: bool
    reason: str

    @property
    def saving_s(self) -> float:
        return self.unfused_s - self.fused_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saving_s": self.saving_s}


@dataclass
class _Traffic:
    """A fused kernel's work: bytes moved, launches and matmul FLOPs per pass, bytes saved."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_launches: int = 1
    bwd_launches: int = 1
    fwd_mm_flops: float = 0.0
    bwd_mm_flops: float = 0.0
    saved: float = 0.0


def plan_fusions(gm: fx.GraphModule, hardware: Hardware | str = "h100-sxm", *,
                 sizes: Mapping[str, int] | None = None, batch_split: int = 1,
                 rules: list[str] | None = None, min_gain: float = 0.01,
                 prefer_memory: bool = False, gc: GraphCost | None = None) -> tuple[list[str], list[FusionChoice]]:
    """Choose the fusions that the cost model predicts to be faster.

    Args:
        gm: a captured (or per-rank) graph.
        hardware: profile name, path or Hardware.
        sizes: values of the size symbols ({"b": 8, "s": 4096}); default: the example's.
        batch_split: divide the example batch by this (the global graph, costed per rank:
            dp x micro-batches); ignored when the batch dim is static or given in `sizes`.
        rules: rule names to consider (default: all).
        min_gain: fuse a group when it saves more than this fraction of its unfused time.
        prefer_memory: also fuse groups predicted slower that free saved activations.
        gc: `cost.analyze(gm, hardware)` when the caller has it (the joint planner).
    Returns:
        (entries for `Plan.fusions`: "rule" where every group of the rule is fused, else
        "rule@module" per fused group; one FusionChoice per group, in graph order).
    """
    if batch_split < 1:
        raise ValueError(f"batch_split={batch_split} must be a positive integer (dp x micro-batches)")
    hw = load_profile(hardware)
    matches = find_matches(gm, rules)
    if not matches:
        return [], []
    gc = gc if gc is not None else analyze(gm, hw)
    values = gc.values(_sizes(gc, sizes, batch_split))
    cost = _Coster(gm, gc, hw, values)
    groups: dict[tuple[str, str], list[Match]] = {}
    for m in matches:
        groups.setdefault((m.rule, m.module), []).append(m)
    rows: list[FusionChoice] = []
    worth = 0.01 * cost.ev(gc.saved_bytes)  # memory worth naming: 1% of all saved activations
    for (rule, module), ms in groups.items():
        unfused = fused = saved = 0.0
        for m in ms:
            u, f, s = cost.match(m)
            unfused, fused, saved = unfused + u, fused + f, saved + s
        gain = unfused - fused
        dtypes = {v.dtype for m in ms for v in value_of(m.args) if isinstance(v, torch.Tensor) and v.is_floating_point()}
        unsupported = sorted(str(d).replace("torch.", "") for d in dtypes - set(SUPPORTED_DTYPES))
        if unsupported:
            applied, reason = False, f"the kernels take fp32, bf16 and fp16, not {', '.join(unsupported)}"
        elif hw.device.kind != "cuda":
            applied, reason = False, (f"no Triton kernels on {hw.name} ({hw.device.kind}): the fused op "
                                      "would run its torch reference")
        elif gain > min_gain * unfused:
            applied, reason = True, f"saves {_us(gain)} of {_us(unfused)}"
        elif prefer_memory and saved > worth:
            applied, reason = True, f"frees {_mib(saved)} saved for backward (costs {_us(-gain)})"
        else:
            applied, reason = False, f"no gain: fused {_us(fused)} vs unfused {_us(unfused)}"
            if saved > worth:
                reason += f"; would free {_mib(saved)} saved for backward (prefer_memory takes it)"
        rows.append(FusionChoice(rule, module, len(ms), unfused, fused, saved, applied, reason))
    return fusion_entries(rows), rows


def fusion_notes(rows: list[FusionChoice]) -> list[str]:
    """One line per rule for the plan report: where it was fused and the predicted saving."""
    notes = []
    for rule in RULE_NAMES:
        rs = [r for r in rows if r.rule == rule]
        if not rs:
            continue
        on = [r for r in rs if r.applied]
        sites, on_sites = sum(r.sites for r in rs), sum(r.sites for r in on)
        if on:
            gain = sum(r.saving_s for r in on)
            mem = sum(r.saved_bytes for r in on)
            notes.append(f"fusion {rule}: fused at {on_sites} of {sites} sites, predicted "
                         f"{'saving' if gain >= 0 else 'cost'} {_us(abs(gain))} per step"
                         + (f", frees {_mib(mem)} of saved activations" if mem > 0 else ""))
        else:
            best = max(rs, key=lambda r: r.saving_s)
            notes.append(f"fusion {rule}: not fused at {sites} sites ({best.reason})")
    return notes


def fusion_entries(rows: list[FusionChoice]) -> list[str]:
    """`Plan.fusions` for these rows: "rule" where every group of the rule is applied, else
    "rule@module" for each applied group; in table order."""
    out = []
    for rule in RULE_NAMES:
        rs = [r for r in rows if r.rule == rule]
        on = [r for r in rs if r.applied]
        if on and len(on) == len(rs):
            out.append(rule)
        else:
            out += [f"{rule}@{r.module}" for r in on]
    return out


# ---------------------------------------------------------------------------- helpers


def _sizes(gc: GraphCost, sizes: Mapping[str, int] | None, batch_split: int) -> dict[str, int]:
    out = dict(sizes or {})
    syms = gc.symbols.symbols
    if batch_split > 1 and "b" in syms and "b" not in out:
        b = gc.symbols.hints.get(syms["b"])
        if b is not None:
            if b % batch_split:
                raise ValueError(f"the example batch {b} does not divide by batch_split={batch_split}")
            out["b"] = b // batch_split
    return out


def _us(s: float) -> str:
    return f"{s * 1e6:.1f} us"


def _mib(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


class _Coster:
    """Unfused and fused times of matches in one analysed graph."""

    def __init__(self, gm: fx.GraphModule, gc: GraphCost, hw: Hardware, values):
        self.gc, self.hw, self.values = gc, hw, values
        self.timer = NodeTimer(hw, values)
        self.by_name: dict[str, NodeCost] = {n.name: n for n in gc.nodes}
        self.rg = requires_grad_nodes(gm)

    # --- sizes ----------------------------------------------------------------------------
    def numel(self, t: Any) -> float:
        if not isinstance(t, torch.Tensor):
            return 0.0
        return float(math.prod(evaluate(self.gc.symbols.dim(d), self.values) for d in t.shape))

    def nbytes(self, t: Any) -> float:
        return self.numel(t) * t.element_size() if isinstance(t, torch.Tensor) else 0.0

    def ev(self, x) -> float:
        return float(evaluate(x, self.values))

    # --- one match ------------------------------------------------------------------------
    def match(self, m: Match) -> tuple[float, float, float]:
        """(unfused seconds, fused seconds, saved-for-backward bytes freed) of one match."""
        ncs = [self.by_name[n.name] for n in m.nodes if n.name in self.by_name]
        keep_mm = m.kernel != "linear_cross_entropy"
        kept = [n for n in ncs if keep_mm and n.kind == "matmul"]
        unfused = kept_t = other = 0.0
        for n in ncs:
            f, b = self.timer.node(n)
            unfused += f + b
            if n in kept:
                kept_t += f + b
            elif n.kind not in ("none", "view", "comm"):
                other += self.ev(n.cost.other_flops)
        backward = any(n.has_grad_fn for n in ncs)
        tr = self.traffic(m, backward)
        hw = self.hw
        dtype = next((v.dtype for v in value_of(m.args) if isinstance(v, torch.Tensor)
                      and v.is_floating_point()), torch.float32)
        peak = hw.peak(dtype_name(dtype)) * hw.eff("matmul")
        vec = hw.device.vector_flops * hw.eff("vector")
        bw = hw.device.memory_bandwidth * hw.eff("memory")

        def t(mm: float, oth: float, nbytes: float, launches: int) -> float:
            floor = launches * hw.kernel_floor("matmul" if mm else "vector")  # as the kept nodes are priced
            return max(mm / peak + oth / vec, nbytes / bw, floor) + launches * hw.kernel_overhead_s

        if m.kernel == "bias_gelu" and backward and self.needs_grad(m.args[1]):
            # the bias-free matmul no longer reduces the output gradient into the bias gradient
            kept_t -= hw.kernel_overhead_s + self.nbytes(m.outputs[0].meta.get("val")) / bw
        fused = kept_t + t(tr.fwd_mm_flops, other, tr.fwd_bytes, tr.fwd_launches)
        if backward:
            fused += t(tr.bwd_mm_flops, 2 * other, tr.bwd_bytes, tr.bwd_launches)
        return unfused, fused, self.unfused_saved(ncs) - (tr.saved if backward else 0.0)

    def unfused_saved(self, ncs: list[NodeCost]) -> float:
        seen: dict[Any, float] = {}
        for n in ncs:
            for key, nbytes, tag in n.saved:
                if tag != "state" and key not in seen:
                    seen[key] = self.ev(nbytes)
        return sum(seen.values())

    def needs_grad(self, a: Any) -> bool:
        if isinstance(a, fx.Node):
            return a in self.rg
        if isinstance(a, Emit):
            return any(self.needs_grad(b) for b in a.args)
        return False

    def traffic(self, m: Match, backward: bool) -> _Traffic:
        """Bytes each fused kernel moves (see runtime/kernels for what each pass reads,
        writes and saves); `g(i)`: bytes of argument i's gradient if it needs one."""
        vals = value_of(m.args)
        outs = [o.meta.get("val") for o in m.outputs]
        b = self.nbytes
        args = list(m.args)

        def g(i: int) -> float:
            return b(vals[i]) if i < len(vals) and self.needs_grad(args[i]) else 0.0

        k = m.kernel
        x = vals[0]
        rows = self.numel(x) / max(1.0, self.numel_last(x))
        ins = sum(b(v) for v in vals)
        out = sum(b(o) for o in outs)
        if k in ("rms_norm", "layer_norm"):
            stats = rows * 4 * (1 if k == "rms_norm" else 2)
            params = ins - b(x)
            return _Traffic(ins + out + stats, out + b(x) + params + stats + g(0) + g(1) + g(2),
                            saved=b(x) + stats)
        if k in ("add_rms_norm", "add_layer_norm"):
            stats = rows * 4 * (1 if k == "add_rms_norm" else 2)
            s = b(outs[0])
            params = ins - b(vals[0]) - b(vals[1])
            dx = b(x) if (g(0) or g(1)) else 0.0
            return _Traffic(ins + out + stats, out + s + params + stats + dx + g(2) + g(3),
                            saved=s + stats)
        if k in ("swiglu", "geglu"):
            return _Traffic(ins + out, out + ins + g(0) + g(1), saved=ins)
        if k == "bias_gelu":
            return _Traffic(ins + out, out + ins + g(0) + g(1), saved=b(x))
        if k == "rope":
            tables = ins - b(x)
            return _Traffic(ins + out, out + tables + g(0), saved=tables)
        if k == "softmax":
            return _Traffic(ins + out, 2 * out + g(0), saved=out)
        if k == "cross_entropy":
            stats = rows * 4 * 3
            return _Traffic(ins + stats, ins + stats + g(0), 3, 1, saved=b(x) + stats)
        if k == "linear_cross_entropy":
            return self.linear_ce(vals, g)
        raise AssertionError(f"no traffic model for kernel {k!r}")

    def numel_last(self, t: Any) -> float:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return 1.0
        return float(evaluate(self.gc.symbols.dim(t.shape[-1]), self.values))

    def linear_ce(self, vals: list, g) -> _Traffic:
        x, w, target, bias = vals
        b = self.nbytes
        M, H, V = self.numel(x) / self.numel_last(x), self.numel_last(x), float(w.shape[0])
        chunk = default_chunk_rows(int(M), int(H), int(V))
        n = math.ceil(M / chunk)
        logits = M * V * x.element_size()
        stats = M * 4 * 3
        mm = 2 * M * H * V
        fwd = b(x) + n * b(w) + 2 * logits + stats + b(target) + b(bias)
        # backward: recompute logits, dlogits in place, dx = dlogits W, dW (fp32) += dlogits^T x
        dw_acc = n * 2 * V * H * 4 if g(1) else 0.0
        bwd = (b(x) + 2 * n * b(w) + 5 * logits + stats + b(target) + g(0) + dw_acc
               + (b(w) if g(1) else 0.0) + (g(3) if bias is not None else 0.0))
        mm_bwd = mm * (1 + (1 if g(0) else 0) + (1 if g(1) else 0))
        return _Traffic(fwd, bwd, 2 * n + 2, 4 * n + 2, mm, mm_bwd, saved=b(x) + stats + b(target))


def search_fusions(plan: Plan, gm: fx.GraphModule, hardware: Hardware | str, batch_split: int) -> None:
    """plan.fusions from the cost model, with their notes and `plan.extra["fusion"]` rows
    (deterministic: every rank gets the same)."""
    plan.fusions, rows = plan_fusions(gm, hardware, batch_split=batch_split)
    plan.notes += fusion_notes(rows)
    plan.extra["fusion"] = [r.to_dict() for r in rows]
