"""Where a step's time goes by kind of work, the cost model's prediction against a profiled step.

The kinds: "matmul" (GEMMs: mm, addmm, bmm, baddbmm and the composites that call them),
"attention" (fused attention kernels, forward and backward), "other" (what else the graph runs:
pointwise ops, norms, reductions, copies, embedding, loss; autopar's fused kernels) and
"optimizer" (every op inside the optimizer step). "outside ops" is the step's wall time less
what the ops account for: host-bound gaps and idle device time when measured; exposed
communication and replays (recompute) when predicted.

Measured: a `torch.profiler` profile of a few steps, each op's self time (its kernels' device
time on a GPU, its CPU time on the CPU) summed by the kind its name gives (`op_kind`); an op is
the optimizer's when it runs inside `record_function(OPTIMIZER_RANGE)`. On a GPU the kernels no
aten op claims (Triton launched from Python: autopar's fused kernels) count as "other", so the
kinds sum to the device's busy time; the spans that `record_function` ranges leave on the GPU's
timeline (user annotations such as "Optimizer.step#AdamW.step") are not kernels and count nowhere
(before 2026-11-27 they were summed as kernels and the optimizer's range landed in "other" a
second time: the eager 1.1 B GPT's "other" read 49.1 ms a step where its kernels took 30.6). The wall time is timed
on steps run without the profiler, so the profiler's own overhead on the ops can make the
measured "outside ops" negative (on the 2-core CPU, a 4-layer GPT: -29 ms of a 1.9 s step). Predicted: `Estimate.compute_by_kind` (the per-node times
`cost.estimate` sums, by the node's cost kind) and `Estimate.optimizer_s`.

A kind whose measured time is well above its prediction is where the cost model is optimistic:
the table is for finding that, one GPU at a time (scripts/gpu_profile.py --by-kind).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.autograd import DeviceType

KINDS = ("matmul", "attention", "other", "optimizer")
OPTIMIZER_RANGE = "autopar.optimizer_step"
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "_scaled_mm", "linear", "matmul",
                   "_int_mm"})


def op_kind(name: str) -> str | None:
    """The kind of work of a profiled event's name; None for what is not an op (ranges,
    autograd engine frames, runtime calls)."""
    if not name.startswith(("aten::", "autopar::")):
        return None
    base = name.split("::", 1)[1]
    if "attention" in base:
        return "attention"
    return "matmul" if base in GEMMS else "other"


def _inside(event, range_name: str) -> bool:
    e = event.cpu_parent
    while e is not None:
        if e.name == range_name:
            return True
        e = e.cpu_parent
    return False


def measured_kinds(events, steps: int, device: str) -> dict[str, float]:
    """Seconds per step of each kind from a profile's events (`prof.events()`) over `steps` steps."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    out = dict.fromkeys(KINDS, 0.0)
    kernels = 0.0  # on a GPU: every kernel's time, whichever op (or none) launched it
    for e in events:
        if device == "cuda" and e.device_type == DeviceType.CUDA:
            if not getattr(e, "is_user_annotation", False):  # a range's span on the GPU's timeline is no kernel
                kernels += e.time_range.elapsed_us()
            continue
        kind = op_kind(e.name)
        if kind is None:
            continue
        t = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        out["optimizer" if _inside(e, OPTIMIZER_RANGE) else kind] += t
    # kernels no aten op claims: Triton launched from Python (autopar's fused norms, activations, loss)
    out["other"] += max(0.0, kernels - sum(out.values()))
    return {k: v / 1e6 / steps for k, v in out.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_kinds(fwd_bwd: Callable[[], Any], opt_step: Callable[[], Any], *, device: str = "cpu", steps: int = 2,
                  timed: int = 3) -> tuple[dict[str, float], float]:
    """(seconds per step by kind, the median wall seconds of a step) of a training step given as
    its two halves; run warm (the caller's warm-up steps done). `timed` unprofiled steps give
    the wall time, then `steps` more are profiled."""
    from torch.profiler import ProfilerActivity, profile, record_function

    walls = []
    for _ in range(timed):
        _sync(device)
        t0 = time.perf_counter()
        fwd_bwd()
        opt_step()
        _sync(device)
        walls.append(time.perf_counter() - t0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fwd_bwd()
            with record_function(OPTIMIZER_RANGE):
                opt_step()
        _sync(device)
    return measured_kinds(prof.events(), steps, device), statistics.median(walls)


def predicted_kinds(est) -> dict[str, float]:
    """Seconds per step of each kind as an `Estimate` prices them."""
    return {**{k: est.compute_by_kind.get(k, 0.0) for k in KINDS if k != "optimizer"}, "optimizer": est.optimizer_s}


def kind_rows(predicted: dict[str, float], predicted_step_s: float, measured: dict[str, float],
              measured_step_s: float) -> list[tuple[str, float, float]]:
    """(kind, predicted s, measured s) per kind, then "outside ops" and "step"."""
    rows = [(k, predicted.get(k, 0.0), measured.get(k, 0.0)) for k in KINDS]
    rows.append(("outside ops", predicted_step_s - sum(predicted.values()), measured_step_s - sum(measured.values())))
    rows.append(("step", predicted_step_s, measured_step_s))
    return rows


def kind_text(rows: list[tuple[str, float, float]]) -> str:
    lines = [f"{'kind':12s} {'predicted ms':>13s} {'measured ms':>12s} {'measured / predicted':>21s}"]
    for k, p, m in rows:
        ratio = f"{m / p:.2f}" if p > 1e-9 else "-"  # "outside ops" predicted as 0 minus rounding
        lines.append(f"{k:12s} {p * 1e3:13.2f} {m * 1e3:12.2f} {ratio:>21s}")
    return "\n".join(lines)
