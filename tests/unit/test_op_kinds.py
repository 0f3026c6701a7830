"""autopar.tools.op_kinds: the cost model's compute split by kind of work, against a profiled step.

`Estimate.compute_by_kind` is the estimate's own per-node compute split by the node's cost kind:
on one rank with no collectives its kinds add up to the forward and backward the estimate
prices. The profiled side is checked on a real eager step of gpt-tiny on the CPU: every aten op
the profile records is counted once, in the kind its name gives, and the optimizer's ops (inside
the optimizer range) in "optimizer". No timing is asserted, only where the time is put.
"""
from __future__ import annotations

import math

import torch

from autopar.models import get
from autopar.tools import op_kinds as K


def _tiny():
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    (x,), y = spec.example_batch(2)
    return spec, model, x, y


def test_op_kind_names():
    assert K.op_kind("aten::mm") == K.op_kind("aten::addmm") == K.op_kind("aten::bmm") == "matmul"
    assert K.op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert K.op_kind("aten::_scaled_dot_product_flash_attention_backward") == "attention"
    assert K.op_kind("aten::_efficient_attention_backward") == "attention"
    assert K.op_kind("aten::add_") == K.op_kind("aten::embedding_dense_backward") == "other"
    assert K.op_kind("autopar::rms_norm") == "other"
    for not_an_op in ("autograd::engine::evaluate_function: MmBackward0", "ProfilerStep#1", "cudaLaunchKernel",
                      K.OPTIMIZER_RANGE, "Optimizer.step#AdamW.step"):
        assert K.op_kind(not_an_op) is None


def test_estimate_splits_its_compute_by_kind():
    from autopar.capture import capture
    from autopar.cost import estimate
    from autopar.passes.plan import Plan

    spec, model, x, _ = _tiny()
    gm = capture(model, (x,))
    est = estimate(gm, Plan(mesh={"dp": 1}), "h100-sxm")
    by = est.compute_by_kind
    assert set(by) == {"matmul", "attention", "other"}
    assert by["matmul"] > 0 and by["attention"] > 0 and by["other"] > 0
    # one rank, no collectives: the kinds are the whole forward and backward
    assert math.isclose(sum(by.values()), est.fwd_s + est.bwd_s, rel_tol=1e-9)
    pred = K.predicted_kinds(est)
    assert pred["optimizer"] == est.optimizer_s > 0
    rows = K.kind_rows(pred, est.step_s, pred, est.step_s)
    assert [r[0] for r in rows] == [*K.KINDS, "outside ops", "step"]
    assert abs(rows[-2][1]) < 1e-12 * est.step_s  # nothing outside the ops at world 1 without recompute
    text = K.kind_text(rows)
    assert "matmul" in text and "1.00" in text


def test_a_profiled_eager_step_puts_every_op_in_one_kind():
    from torch.profiler import ProfilerActivity, profile, record_function

    spec, model, x, y = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def fwd_bwd():
        spec.loss_fn(model(x), y).backward()

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    fwd_bwd(), opt_step()  # warm
    kinds, wall = K.profile_kinds(fwd_bwd, opt_step, steps=2, timed=2)
    assert wall > 0
    assert kinds["matmul"] > 0 and kinds["attention"] > 0 and kinds["other"] > 0 and kinds["optimizer"] > 0
    # the same split by hand: every aten op once, by its name, the optimizer's by the range
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd()
        with record_function(K.OPTIMIZER_RANGE):
            opt_step()
    events = prof.events()
    split = K.measured_kinds(events, 1, "cpu")
    aten = [e for e in events if e.name.startswith("aten::")]
    assert math.isclose(sum(split.values()), sum(e.self_cpu_time_total for e in aten) / 1e6, rel_tol=1e-9)
    in_opt = [e for e in aten if K._inside(e, K.OPTIMIZER_RANGE)]
    assert in_opt and any("_foreach_" in e.name for e in in_opt)  # foreach AdamW's ops, all in "optimizer"
    assert math.isclose(split["optimizer"], sum(e.self_cpu_time_total for e in in_opt) / 1e6, rel_tol=1e-9)
    assert not any(K._inside(e, K.OPTIMIZER_RANGE) for e in aten if e.name == "aten::mm")  # the GEMMs are the step's


def test_an_idle_optimizer_and_a_step_without_attention_measure_zero_there():
    a, b = torch.randn(256, 256), torch.randn(256, 256, requires_grad=True)
    kinds, _ = K.profile_kinds(lambda: (a @ b).sum().backward(), lambda: None, steps=1, timed=1)
    assert kinds["matmul"] > 0 and kinds["attention"] == 0.0 and kinds["optimizer"] == 0.0
    try:
        K.measured_kinds([], 0, "cpu")
    except ValueError as e:
        assert "steps" in str(e)
    else:
        raise AssertionError("steps=0 was accepted")


def test_on_a_gpu_kernels_no_aten_op_claims_count_as_other():
    """The CUDA branch, on events shaped as torch.profiler gives them: an aten op with its kernel's
    self device time, that kernel as a device event, and a Triton kernel launched from Python
    (no aten op above it): the kinds sum to the kernels' time, the orphan in "other". The span an
    optimizer's `record_function` range leaves on the GPU's timeline (a user annotation, device
    type CUDA, as torch 2.11 gives it on an H100) is no kernel: counted, it put the optimizer's
    time into "other" a second time."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, dev, us, self_dev=0.0, parent=None, annotation=False):
        return NS(name=name, device_type=dev, time_range=NS(elapsed_us=lambda: us), self_device_time_total=self_dev,
                  self_cpu_time_total=5.0, cpu_parent=parent, is_user_annotation=annotation)

    opt = ev(K.OPTIMIZER_RANGE, DeviceType.CPU, 0.0)
    events = [ev("aten::mm", DeviceType.CPU, 12.0, self_dev=100.0), ev("sm90_xmma_gemm", DeviceType.CUDA, 100.0),
              ev("_rms_norm_fwd_kernel", DeviceType.CUDA, 30.0),  # Triton, launched from Python
              ev("aten::_fused_adamw_", DeviceType.CPU, 3.0, self_dev=40.0, parent=opt),
              ev("multi_tensor_apply_kernel", DeviceType.CUDA, 40.0), opt,
              ev("Optimizer.step#AdamW.step", DeviceType.CUDA, 45.0, annotation=True)]
    got = K.measured_kinds(events, 1, "cuda")
    assert got == {"matmul": 100e-6, "attention": 0.0, "other": 30e-6, "optimizer": 40e-6}
    assert K.measured_kinds(events, 1, "cpu")["other"] == 0.0  # on the CPU the ops' CPU time, no kernels


def test_an_autopar_step_splits_the_same_way():
    """What scripts/gpu_profile.py --by-kind does for an autopar variant, at world 1 on the CPU:
    the engine's optimizer step inside the range lands in "optimizer", and the plan's estimate
    (its global graph, as build/predict.py costs it) splits its compute by kind."""
    import autopar
    from autopar.cost import estimate

    spec, model, x, y = _tiny()
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x, precision="bf16-mixed")
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)

    def fwd_bwd():
        pm.step(((x,), y), spec.loss_fn)

    def opt_step():
        opt.step()
        opt.zero_grad()

    fwd_bwd(), opt_step()
    kinds, wall = K.profile_kinds(fwd_bwd, opt_step, steps=1, timed=1)
    assert wall > 0 and kinds["matmul"] > 0 and kinds["optimizer"] > 0 and kinds["other"] > 0
    est = estimate(pm.global_graph, pm.plan, "cpu-gloo", batch_is_global=True)
    pred = K.predicted_kinds(est)
    assert pred["optimizer"] == est.optimizer_s > 0 and pred["matmul"] > 0
    assert math.isclose(sum(est.compute_by_kind.values()), est.fwd_s + est.bwd_s, rel_tol=1e-9)
