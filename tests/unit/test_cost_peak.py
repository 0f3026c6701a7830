"""The liveness walk's peak against the CPU allocator as torch.profiler records it.

`torch.profiler.profile(profile_memory=True)` records every CPU allocation and free: per op
its own net allocation (`self_cpu_memory_usage`) and frees outside ops as `[memory]` events.
Replayed in time order they give the memory in use during one forward + backward of the
captured graph; its maximum is the measured peak. The inputs and parameters exist before the
profile starts, so the prediction compared is the walk's peak minus the inputs (parameter
gradients are allocated during backward and are in both).

The loss is a weighted sum with fixed random weights, so the outputs get dense gradients,
as the walk assumes (a cross-entropy loss gives dense ones too). Sizes (batch 8, sequence 32)
make activations, not the tiny models' parameters, dominate. Tolerance 10%: op-level
replay nets out workspaces inside ops, which the walk does not model either.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build, capture, float_outputs  # noqa: E402

from autopar.cost import analyze, liveness  # noqa: E402


def measured_peak(gm, args) -> tuple[float, float]:
    """(peak bytes in use during forward + backward, bytes in use at the end)."""
    weights = [torch.randn_like(o) for o in float_outputs(gm(*args))]
    gm.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outs = float_outputs(gm(*args))
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        del outs
        loss.backward()
        del loss
    events = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in prof.events())
    cur = peak = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    gm.zero_grad(set_to_none=True)
    return peak, cur


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "vit-tiny", "hf-gpt2", "hf-mixtral"])
def test_liveness_peak_matches_the_profiled_cpu_allocations(name):
    model, args = build(name, batch=8, seq=32)
    gm = capture(model, args)
    gc = analyze(gm, "cpu-gloo")
    live = liveness(gc, gc.values())
    peak, end = measured_peak(gm, args)
    print(f"{name}: predicted {live.peak - live.inputs:.0f} ({live.peak_phase} at {live.peak_node}), measured {peak}")
    assert end == live.param_grads  # what is left after backward: exactly the parameter gradients
    torch.testing.assert_close(float(live.peak - live.inputs), float(peak), rtol=0.10, atol=0)
