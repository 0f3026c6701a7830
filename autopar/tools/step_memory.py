"""Per-rank peak CPU memory of one whole training step, as the allocator saw it.

`step_peak(step, *roots)` measures one call of `step()` (forward + backward + optimizer step +
zero_grad of a parallelised program) on this process:

  measured peak = alive + max over time of the replayed allocation deltas during `step()`

  alive     the bytes of the CPU tensor storages reachable from `roots` (the ParallelModel and
            its optimizer) when the profile starts: parameters, their gradients, masters,
            optimizer states, the flat buffers the engines own, buffers. Each storage once
            (deduplicated by its data pointer: views, tied weights and flat-buffer slices share
            one); reached through containers, attributes and closures, never a function's module
            globals. Tensors the caller holds apart from the roots (the batch) are not counted.
  deltas    every CPU allocation and free recorded by `torch.profiler.profile(profile_memory=True)`
            during `step()`, each with its own timestamp (the profiler's raw `[memory]` records,
            `prof.profiler.kineto_results.events()`), replayed in time order. The per-op
            aggregates (`FunctionEvent.self_cpu_memory_usage`) are NOT used: they fold every
            record inside an op's interval into the op's start, and a `record_function` such as
            `Optimizer.step` is an op, so a temporary freed inside the optimizer step would be
            counted at the step's start, before its allocation. Only records of this rank's
            threads that the profiler follows are seen (the calling thread; autograd runs CPU
            backward there); allocations inside gloo's own worker threads are not.

A free of a storage allocated before the profile started (last step's state replaced, a
gradient dropped by zero_grad) is a negative delta against `alive`, which counts it, so the
replay stays consistent as long as every storage freed during the step was reachable from the
roots; `StepPeak.low` (the replay's minimum) below -alive would show one that was not.

Used by `autopar tune` (autopar/tools/worker.py, the candidates' peak on a CPU) and by the
memory-truth tests (tests/dist/test_memory_truth.py). Reads and writes no node.meta keys.
Imports only torch.
"""
from __future__ import annotations

import gc
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

MEMORY_RECORD = "[memory]"  # the profiler's name for one allocation (+) or free (-) record
_NOT_WALKED = (type, types.ModuleType, str, bytes, int, float, bool)  # a root may be one; nothing they reach is counted


@dataclass
class StepPeak:
    """One step's memory on this rank (bytes)."""

    alive: float  # reachable from the roots when the step starts
    peak: float  # alive + the largest rise during the step
    end: float  # alive + the net change over the step
    low: float  # the replay's lowest point relative to alive (>= -alive when consistent)
    records: int  # allocation/free records replayed
    by_kind: dict[str, float] = field(default_factory=dict)  # alive split: params / grads / other


def _cell_contents(c) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def alive_storages(*roots: Any) -> dict[int, tuple[int, str]]:
    """data_ptr -> (bytes, kind) of the CPU storages reachable from `roots`; kind is "params"
    (an nn.Parameter's storage), "grads" (a `.grad`'s) or "other" (states, flat buffers ...),
    the first way each storage was reached."""
    seen: set[int] = set()
    out: dict[int, tuple[int, str]] = {}
    stack: list[tuple[Any, str | None]] = [(r, None) for r in roots]
    is_tracked, referents = gc.is_tracked, gc.get_referents
    while stack:
        o, via = stack.pop()
        if o is None or id(o) in seen or isinstance(o, _NOT_WALKED):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:
                if o.device.type == "cpu" and not o.is_meta:
                    st = o.untyped_storage()
                    ptr = st.data_ptr()
                    if ptr and ptr not in out:
                        kind = via or ("params" if isinstance(o, torch.nn.Parameter) else "other")
                        out[ptr] = (int(st.nbytes()), kind)
            except (RuntimeError, NotImplementedError):  # fake or functional tensors own no memory
                pass
            if o.grad is not None:
                stack.append((o.grad, "grads"))
            continue
        if isinstance(o, types.FunctionType):
            stack += [(_cell_contents(c), None) for c in (o.__closure__ or ())]
            stack += [(d, None) for d in (o.__defaults__ or ())]
            continue
        if isinstance(o, types.MethodType):
            stack.append((o.__self__, None))
            continue
        # an object the collector does not track (a number, a string, a tuple or dict of only
        # such objects) reaches no tensor, function or method (all tracked): never pushed, the
        # same storages, ~40 % less time (a pp2 gpt-tiny ParallelModel and optimizer: 0.028 -> 0.016 CPU-s)
        stack += [(r, None) for r in referents(o) if is_tracked(r)]
    return out


def memory_records(prof) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every CPU allocation record of a finished profile, in time order."""
    res = prof.profiler.kineto_results
    recs = [(e.start_ns(), e.nbytes()) for e in res.events()
            if e.name() == MEMORY_RECORD and e.device_type() in (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)]
    recs.sort(key=lambda r: r[0])
    return recs


def step_peak(step: Callable[[], Any], *roots: Any) -> StepPeak:
    """Measure one `step()` (see the module docstring). The step's return value is dropped."""
    gc.collect()
    storages = alive_storages(*roots)
    alive = float(sum(b for b, _ in storages.values()))
    by_kind: dict[str, float] = {}
    for b, kind in storages.values():
        by_kind[kind] = by_kind.get(kind, 0.0) + b
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cur = peak = low = 0.0
    recs = memory_records(prof)
    for _t, d in recs:
        cur += d
        peak = max(peak, cur)
        low = min(low, cur)
    return StepPeak(alive=alive, peak=alive + peak, end=alive + cur, low=low, records=len(recs), by_kind=by_kind)


__all__ = ["StepPeak", "alive_storages", "memory_records", "step_peak"]
