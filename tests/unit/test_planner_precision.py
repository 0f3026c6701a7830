"""The planner prices the precision and the offload that run (issue 22, item 5).

The planner's model states come from `cost.memory.plan_states` (the function `cost.estimate`
uses), at the Plan's param / master / reduce / optimizer-state dtypes; compute runs at the
compute dtype's peak; the fields it priced are the ones it writes into the Plan; and when no
plan fits without offload (and offload was not forbidden) it plans with masters and optimizer
states on the host, prices the copies and the CPU step, and says why.
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost import analyze, estimate, load_profile
from autopar.cost.memory import plan_states
from autopar.models import GPT, GPTConfig
from autopar.passes.plan import precision_fields
from autopar.search.plan_write import unfused
from autopar.search.planner import clear_cache, plan_for

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

HW = "h100-sxm"


@functools.lru_cache(maxsize=None)
def captured(dtype: torch.dtype = torch.float32, batch: int = 8):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    model = GPT(cfg).to(dtype)
    return autopar.capture(model, (torch.randint(0, 128, (batch, 32)),))


def _counts(gm):
    trained = [p for p in analyze(gm, HW).params if p.requires_grad and not p.is_buffer]
    return sum(p.numel for p in trained), len(trained)


def _plan(gm, world=1, **kw):
    clear_cache()
    return plan_for(gm, world, HW, **kw)[0]


def test_a_bf16_model_is_planned_bf16_mixed_with_masters_grads_and_states_at_their_dtypes():
    gm = captured(torch.bfloat16)
    n, k = _counts(gm)
    plan = _plan(gm)
    assert (plan.param_dtype, plan.master_dtype, plan.reduce_dtype, plan.optim_dtype) == ("bf16", "fp32", "fp32",
                                                                                          "fp32")
    mem = plan.predicted["memory_bytes"]
    assert mem["params"] == 2 * n  # bf16 parameters
    assert mem["master"] == 4 * n  # fp32 masters
    assert mem["grads"] == 2 * n + 4 * n  # the model's bf16 gradients and the masters' fp32 ones (the engine's)
    assert mem["optimizer"] == 2 * 4 * n + 4 * k  # two fp32 Adam states and a step per parameter
    # one truth: the same bytes as cost.estimate prices for the plan the planner wrote (as it
    # ranks it: unfused; the build's plan.predicted["estimate"] prices the fusions)
    est = estimate(gm, unfused(plan), HW).memory
    for cat in ("params", "grads", "master", "optimizer"):
        assert mem[cat] == pytest.approx(est[cat], rel=1e-6), cat
    assert plan.predicted["step_s"] == pytest.approx(estimate(gm, unfused(plan), HW).step_s, rel=1e-6)
    assert any(n_.startswith("precision priced: parameters and compute bf16, masters fp32") for n_ in plan.notes)


def test_pure_bf16_keeps_no_masters_and_needs_less_memory_than_bf16_mixed():
    gm = captured(torch.bfloat16)
    n, k = _counts(gm)
    mixed = _plan(gm)
    pure = _plan(gm, precision=precision_fields("bf16"))
    assert pure.master_dtype is None and pure.param_dtype == "bf16"
    mem = pure.predicted["memory_bytes"]
    assert mem["master"] == 0 and mem["grads"] == 2 * n and mem["optimizer"] == 2 * 2 * n + 4 * k
    assert pure.predicted["peak_bytes"] < mixed.predicted["peak_bytes"]
    # the difference is the masters and the wider states, at least (the masters' gradients exist
    # only after backward, not at the activation peak: cost.estimate's walk, which the planner follows)
    assert mixed.predicted["peak_bytes"] - pure.predicted["peak_bytes"] >= 4 * n + 2 * 2 * n


def test_an_fp32_model_planned_bf16_mixed_computes_at_the_bf16_peak():
    gm = captured(torch.float32)
    # the roofline without the profile's compute table: at this size (64-wide GEMMs) every kernel
    # sits on the table's per-kernel floor whatever its dtype (as on the GPU); the peak shows here
    hw = load_profile(HW).with_compute(None)
    clear_cache()
    fp32 = plan_for(gm, 1, hw)[0]
    clear_cache()
    mixed = plan_for(gm, 1, hw, precision=precision_fields("bf16-mixed"))[0]
    assert fp32.param_dtype is None and fp32.predicted["compute_dtype"] == "fp32"
    assert mixed.param_dtype == "bf16" and mixed.predicted["compute_dtype"] == "bf16"
    assert mixed.predicted["compute_s"] < fp32.predicted["compute_s"]
    # MFU is against the compute dtype's peak: the same FLOPs over a 14.8x larger peak
    ratio = (fp32.predicted["mfu"] * fp32.predicted["step_s"]) / (mixed.predicted["mfu"] * mixed.predicted["step_s"])
    assert ratio == pytest.approx(hw.peak("bf16") / hw.peak("fp32"), rel=1e-6)
    assert mixed.predicted["step_s"] == pytest.approx(estimate(gm, unfused(mixed), hw).step_s, rel=1e-6)


def test_gradient_reduction_is_priced_at_the_reduce_dtype():
    gm = captured(torch.bfloat16)
    pins = {"dp": 2, "zero_stage": 0}
    fp32_reduce = _plan(gm, 2, pins=pins)
    bf16_reduce = _plan(gm, 2, pins=pins, precision={**precision_fields("bf16-mixed"), "reduce_dtype": "bf16"})
    assert fp32_reduce.reduce_dtype == "fp32" and bf16_reduce.reduce_dtype == "bf16"
    sent32 = fp32_reduce.predicted["bytes_sent_per_axis"]["dp"]
    sent16 = bf16_reduce.predicted["bytes_sent_per_axis"]["dp"]
    assert sent32 == pytest.approx(2 * sent16, rel=1e-6)
    assert sent32 == pytest.approx(estimate(gm, fp32_reduce, HW).bytes_per_axis["dp"]["sent"], rel=1e-6)


@functools.lru_cache(maxsize=None)
def _offload_limits():
    """(least peak without offload, least peak with it), every block recomputed, world 1."""
    gm = captured(torch.bfloat16, 2)
    pins = {"recompute": "full"}
    off = _plan(gm, pins=pins, precision={"offload": False}).predicted["peak_bytes"]
    on = _plan(gm, pins=pins, precision={"offload": True}).predicted["peak_bytes"]
    return off, on


def test_offload_is_chosen_only_when_no_plan_fits_without_it_and_then_priced():
    gm = captured(torch.bfloat16, 2)
    need_off, need_on = _offload_limits()
    assert need_on < need_off
    limit = (need_off + need_on) / 2
    plan = _plan(gm, memory_limit=limit)  # offload not given: the planner decides
    assert plan.offload is True and plan.predicted["offload"] is True
    assert plan.predicted["peak_bytes"] <= limit
    assert plan.predicted["memory_bytes"]["master"] == 0 and plan.predicted["memory_bytes"]["optimizer"] == 0
    assert plan.predicted["memory_bytes"]["offloaded"] > 0
    assert any(n.startswith("offload: chosen, because no plan fits") for n in plan.notes)
    # priced as cost.estimate prices it: copies over the host link and a CPU step
    est = estimate(gm, plan, HW)
    assert plan.predicted["optimizer_s"] == pytest.approx(est.optimizer_s, rel=1e-6)
    assert est.memory["offloaded"] == pytest.approx(plan.predicted["memory_bytes"]["offloaded"], rel=1e-6)
    roomy = _plan(gm)
    assert roomy.offload is False and any(n.startswith("offload: not chosen") for n in roomy.notes)
    assert plan.predicted["optimizer_s"] > roomy.predicted["optimizer_s"]
    # forbidden: no plan, and the message says why
    with pytest.raises(ValueError, match="fits the memory limit"):
        _plan(gm, memory_limit=limit, precision={"offload": False})


def test_the_host_bandwidth_of_a_profile_prices_the_offloaded_step(tmp_path):
    gm = captured(torch.bfloat16, 2)
    d = load_profile(HW).to_dict()
    assert d["host"]["bandwidth"] > 0  # the documented default when a profile has no "host" section
    slow = dict(d, name="h100-slow-host", host={"bandwidth": d["host"]["bandwidth"] / 10,
                                                 "memory_bandwidth": d["host"]["memory_bandwidth"]})
    path = tmp_path / "slow.json"
    import json

    path.write_text(json.dumps(slow))
    clear_cache()
    best = plan_for(gm, 1, HW, precision={"offload": True})[0]
    fast = best.predicted["optimizer_s"]
    clear_cache()
    slow_s = plan_for(gm, 1, str(path), precision={"offload": True})[0].predicted["optimizer_s"]
    assert slow_s > fast
    n, _k = _counts(gm)
    # only the copies slow down, as runtime/offload.py moves the tensors: fp32 gradients (the
    # reduce dtype) down, fp32 masters up (cast on the device), twice under ZeRO-3 (the
    # forward's gather and the backward's re-gather)
    ups = 2 if best.zero_stage == 3 else 1
    copies = n * (4 + 4 * ups) / d["host"]["bandwidth"]
    assert slow_s - fast == pytest.approx(9 * copies, rel=1e-6)


def test_plan_states_is_what_the_estimate_counts():
    gm = captured(torch.bfloat16)
    params = analyze(gm, HW).params
    for name in ("bf16", "bf16-mixed"):
        for offload in (False, True):
            prec = precision_fields(name, offload)
            st = plan_states(params, "adamw", precision=prec)
            plan = _plan(gm, precision=prec)
            est = estimate(gm, plan, HW).memory
            assert est["params"] == st.params and est["master"] == st.master and est["grads"] == st.grads
