"""The optimizer step's bytes (`cost.optimizer_step.step_bytes`) count the casts that run.

A bf16 gpt-tiny trained "bf16-mixed" at world 1 (fp32 masters beside bf16 parameters) against
the same model trained pure "bf16" (the update in place): counted with a dispatch mode, the mixed
run's training step converts each parameter's gradient bf16 -> fp32 once more than the pure run
does (the cast into the master's gradient), and its optimizer step converts every master fp32 ->
bf16 once (the write-back into the parameter), where the pure run converts nothing. Those are
the two terms `step_bytes` adds for separate masters (read 2 + write 4 bytes a gradient element,
read 4 + write 2 a parameter element), beside the update's own (masters and states read and
written, master gradients read); without masters the parameters are read and written in place.
`cost.estimate`'s optimizer seconds are those bytes over the profile's memory bandwidth.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from autopar.models import get
from autopar.runtime._torch_compat import TorchDispatchMode

import autopar
from autopar.cost import estimate, load_profile
from autopar.cost.optimizer_step import step_bytes


class _Casts(TorchDispatchMode):
    """Elements converted between dtypes, by (source, destination) dtype."""

    def __init__(self):
        super().__init__()
        self.elems: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and args[0].dtype != args[1].dtype:
            self.elems[(args[1].dtype, args[0].dtype)] += args[1].numel()
        elif func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype != args[0].dtype:
            self.elems[(args[0].dtype, out.dtype)] += out.numel()
        return out


def _casts(precision: str):
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    batches = [spec.example_batch(8, seq_len=16, generator=g) for _ in range(2)]
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=batches[0][0], precision=precision)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm.step(batches[0], spec.loss_fn)  # the first step makes the optimizer states
    opt.step()
    opt.zero_grad()
    in_step, in_opt = _Casts(), _Casts()
    with in_step:
        pm.step(batches[1], spec.loss_fn)
    with in_opt:
        opt.step()
    return pm, [p.numel() for p in model.parameters()], in_step.elems, in_opt.elems


def test_mixed_precision_casts_each_gradient_in_and_each_master_out_once_a_step():
    mixed, sizes, step_m, opt_m = _casts("bf16-mixed")
    _pure, sizes2, step_p, opt_p = _casts("bf16")
    assert sizes == sizes2
    n = sum(sizes)
    up, down = (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)
    assert step_m[up] - step_p[up] == n  # each gradient cast into its master's, once
    assert step_m[down] == step_p[down]  # the forward and backward convert alike
    assert opt_m[down] == n and not opt_p  # each master written back into its parameter, once

    # the bytes priced: the update (masters and two AdamW states, with AdamW's 4-byte step per
    # tensor, read and written, the master gradients read), the casts in (bf16 read, fp32
    # written) and out (fp32 read, bf16 written)
    hw = load_profile("cpu-gloo")
    e = estimate(mixed.global_graph, mixed.plan, hw, batch_is_global=True)
    states = 8 * n + 4 * len(sizes)
    want = 2 * (4 * n + states) + 4 * n + (2 * n + 4 * n) + (4 * n + 2 * n)
    assert step_bytes(4 * n, states, 2 * n, 6 * n, 4 * n) == want
    assert e.optimizer_s == pytest.approx(want / (hw.device.memory_bandwidth * hw.eff("memory")), rel=1e-9)
    # pure bf16: parameters (and their two states, bf16 too) updated in place, gradients read
    assert step_bytes(0, 4 * n, 2 * n, 2 * n, 0) == 2 * (2 * n + 4 * n) + 2 * n
