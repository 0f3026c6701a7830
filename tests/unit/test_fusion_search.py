"""The cost-based choice of fusions (autopar/search/fusion.py) and the fuse pass carrying out
exactly the plan's entries (passes/fuse.py).

Graphs: the reference GPT at a mid size (width 1024, 2 blocks, 1024 tokens, bf16) captured on
the meta device, where bytes rather than launches decide; and gpt-tiny on CPU for the pass.
Times are the cost model's (h100-sxm profile unless a test says otherwise); one test checks a
fused time against the formula written out by hand, at two calibrations of the profile.
"""
from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autopar.models as M
from autopar.capture import capture
from autopar.cost import analyze, estimate, load_profile
from autopar.models.gpt import GPT, GPTConfig, loss_fn
from autopar.passes.fuse import fuse
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.rules.fusion_table import find_matches, parse_entry
from autopar.search.fusion import FusionChoice, fusion_entries, fusion_notes, plan_fusions

MID = GPTConfig(vocab_size=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=2816,
                max_seq_len=1024)


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return loss_fn(self.model(idx), targets)


@functools.cache
def mid_graph(with_loss: bool = False) -> fx.GraphModule:
    with torch.device("meta"):
        model = GPT(MID)
        model = (WithLoss(model) if with_loss else model).to(torch.bfloat16)
    idx = torch.empty(2, 1024, dtype=torch.long, device="meta")
    return capture(model, (idx, idx) if with_loss else (idx,))


@functools.cache
def tiny_graph() -> tuple[fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    spec = M.get("gpt-tiny")
    (x,), _ = spec.example_batch(2, generator=torch.Generator().manual_seed(0))
    return capture(spec.build(), (x,)), x


def test_fusions_are_kept_only_where_the_cost_model_predicts_a_gain():
    fusions, rows = plan_fusions(mid_graph(), "h100-sxm")
    by_rule = {r.rule: r for r in rows}
    # aten.rms_norm is already one fused kernel on CUDA: same traffic, same launches, no gain
    rms = by_rule["rms_norm"]  # (the fused one also writes its per-row statistics: 0.02% more)
    assert not rms.applied and abs(rms.saving_s) < 1e-3 * rms.unfused_s
    assert "no gain" in by_rule["rms_norm"].reason
    for rule in ("add_rms_norm", "rope", "swiglu"):  # fewer bytes and launches than the unfused ops
        assert all(r.applied and r.saving_s > 0 for r in rows if r.rule == rule), rule
    for r in rows:
        assert r.applied == (r.saving_s > 0.01 * r.unfused_s)
    assert fusions == ["add_rms_norm", "rope", "swiglu"]
    notes = fusion_notes(rows)
    assert any(n.startswith("fusion swiglu: fused at 2 of 2 sites, predicted saving") for n in notes)
    assert any(n.startswith("fusion rms_norm: not fused at 1 sites (no gain") for n in notes)


def test_a_fused_time_is_the_kernels_traffic_over_the_calibrated_bandwidth_plus_two_launches():
    gm = mid_graph()
    swiglu = [m for m in find_matches(gm, ["swiglu"])][0]
    a = swiglu.args[0].meta["val"]
    n = 2 * 1024 * MID.ffn_dim  # elements of the gate (B, T, ffn_dim)
    assert tuple(a.shape[1:]) == (1024, MID.ffn_dim)
    base = load_profile("h100-sxm")
    for hw in (base, base.calibrated(memory=0.4)):
        _, rows = plan_fusions(gm, hw, rules=["swiglu"])
        bw = hw.device.memory_bandwidth * hw.eff("memory")
        # forward reads gate and up, writes the product; backward reads the gradient, gate and
        # up and writes both input gradients: 3 + 5 tensors of n bf16 elements, one launch each
        want = 8 * n * 2 / bw + 2 * hw.kernel_overhead_s
        assert rows[0].module == "layers.0.ffn"
        assert rows[0].fused_s == pytest.approx(want, rel=1e-9)


def test_linear_cross_entropy_trades_time_for_memory_and_is_taken_when_memory_is_preferred():
    gm = mid_graph(with_loss=True)
    _, rows = plan_fusions(gm, "h100-sxm", rules=["linear_cross_entropy"])
    (row,) = rows
    # the unfused loss keeps the log-softmax of 2048 tokens x 4096 classes (bf16) for backward,
    # the fused one three fp32 numbers per token instead
    logits = 2048 * 4096 * 2
    assert logits - 2048 * 12 <= row.saved_bytes <= logits
    assert not row.applied and "prefer_memory" in row.reason  # recomputing the logits costs time
    fusions, rows = plan_fusions(gm, "h100-sxm", rules=["linear_cross_entropy"], prefer_memory=True)
    assert fusions == ["linear_cross_entropy"] and rows[0].applied and "frees" in rows[0].reason


def test_batch_split_costs_the_per_rank_batch():
    gm = mid_graph()
    _, whole = plan_fusions(gm, "h100-sxm", rules=["swiglu"])
    _, half = plan_fusions(gm, "h100-sxm", rules=["swiglu"], batch_split=2)
    ovh = 2 * load_profile("h100-sxm").kernel_overhead_s
    assert half[0].fused_s - ovh == pytest.approx((whole[0].fused_s - ovh) / 2, rel=1e-9)
    with pytest.raises(ValueError, match="batch_split=0"):
        plan_fusions(gm, "h100-sxm", batch_split=0)


def test_entries_name_a_rule_bare_only_when_all_its_groups_are_fused():
    def row(rule, module, applied):
        return FusionChoice(rule, module, 1, 2.0, 1.0 if applied else 3.0, 0.0, applied, "")

    rows = [row("swiglu", "layers.0.ffn", True), row("swiglu", "layers.1.ffn", True),
            row("rope", "layers.0.attn", True), row("rope", "layers.1.attn", False),
            row("cross_entropy", "", True), row("softmax", "a", False)]
    assert fusion_entries(rows) == ["cross_entropy", "rope@layers.0.attn", "swiglu"]


def test_fuse_applies_exactly_the_plan_entries_and_keeps_the_outputs():
    gm, x = tiny_graph()

    def run(fusions):
        g = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        g.meta.update(gm.meta)
        plan = Plan(mesh={"dp": 1}, fusions=fusions)
        return PassManager([fuse]).run(g, PassContext(plan=plan, mesh_sizes={"dp": 1}))

    fused = run(["swiglu@layers.0.*", "rope"])
    made = Counter((f["rule"], f["module"]) for f in fused.meta["autopar_fusions"])
    assert made == {("swiglu", "layers.0.ffn"): 1, ("rope", "layers.0.attn"): 2, ("rope", "layers.1.attn"): 2}
    torch.testing.assert_close(fused(x), gm(x), atol=1e-5, rtol=1e-5)
    untouched = run([])
    assert untouched.code == gm.code and "autopar_fusions" not in untouched.meta
    root_only = run(["rms_norm@"])  # "rule@" names the root module: the first norm is in layers.0
    assert "autopar_fusions" not in root_only.meta


def test_unknown_fusion_rule_is_a_value_error_naming_the_rules():
    gm, _ = tiny_graph()
    with pytest.raises(ValueError, match="unknown fusion rule 'swigl'.*swiglu"):
        fuse(gm, PassContext(plan=Plan(mesh={"dp": 1}, fusions=["swigl"]), mesh_sizes={"dp": 1}))
    assert parse_entry("rope@model.layers.*") == ("rope", "model.layers.*")
    assert parse_entry("rope") == ("rope", None)


def test_plan_fusions_is_deterministic_and_round_trips_through_the_plan_and_fuse():
    gm, x = tiny_graph()
    first = plan_fusions(gm, "h100-sxm")
    assert plan_fusions(gm, "h100-sxm") == first
    fusions, rows = first
    plan = Plan(mesh={"dp": 1}, fusions=fusions)
    assert Plan.from_json(plan.to_json()).fusions == fusions
    g = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    g.meta.update(gm.meta)
    fused = PassManager([fuse]).run(g, PassContext(plan=plan, mesh_sizes={"dp": 1}))
    made = Counter(f["rule"] for f in fused.meta.get("autopar_fusions", []))
    want = Counter()
    for r in rows:
        if r.applied:
            want[r.rule] += r.sites
    assert made == want and sum(want.values()) > 0
    torch.testing.assert_close(fused(x), gm(x), atol=1e-5, rtol=1e-5)
    # the fused graph is still costed: the analysis sees every fused call as one op
    assert len(analyze(fused, "h100-sxm").nodes) < len(analyze(gm, "h100-sxm").nodes)


def test_nothing_is_fused_for_a_cpu_profile_where_the_fused_op_is_its_torch_reference():
    gm, _ = tiny_graph()
    fusions, rows = plan_fusions(gm, "cpu-gloo")
    assert fusions == [] and rows and all(not r.applied and "no Triton kernels" in r.reason for r in rows)


def test_the_step_estimate_of_the_fused_graph_drops_by_the_predicted_saving():
    # two formulations: plan_fusions' per-kernel traffic model, and the estimate of the
    # rewritten graph through the cost rules registered for the fused calls
    gm = mid_graph()
    fusions, rows = plan_fusions(gm, "h100-sxm")
    g = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    g.meta.update(gm.meta)
    fused = PassManager([fuse]).run(g, PassContext(plan=Plan(mesh={"dp": 1}, fusions=fusions), mesh_sizes={"dp": 1}))
    gc = analyze(fused, "h100-sxm")
    assert not gc.unknown_ops and not gc.unknown_saved  # every fused call has its rules
    plan = Plan(mesh={"dp": 1})
    drop = estimate(gm, plan, "h100-sxm").summary()["step_s"] - estimate(fused, plan, "h100-sxm").summary()["step_s"]
    predicted = sum(r.saving_s for r in rows if r.applied)
    assert predicted > 0 and drop == pytest.approx(predicted, rel=0.05)


def test_float64_graphs_are_not_fused_and_the_references_keep_float64():
    """The Triton kernels take fp32 / bf16 / fp16: a float64 graph keeps its ops (found by the
    zoo: GPT-NeoX in fp64 under a fused plan drifted by 1e-8 through fp32 references)."""
    with torch.device("meta"):
        model = GPT(MID).to(torch.float64)
    gm = capture(model, (torch.empty(2, 1024, dtype=torch.long, device="meta"),))
    fusions, rows = plan_fusions(gm, "h100-sxm")
    assert fusions == [] and rows
    assert all(not r.applied and "not float64" in r.reason for r in rows)
    from autopar.runtime.kernels.activations import swiglu_reference
    from autopar.runtime.kernels.norms import layer_norm_reference, rms_norm_reference
    from autopar.runtime.kernels.softmax import softmax_reference

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(4, 16, dtype=torch.float64, generator=g) for _ in range(3))
    F = torch.nn.functional
    exact = dict(rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(rms_norm_reference(x, w[0], 1e-6), F.rms_norm(x, (16,), w[0], 1e-6), **exact)
    torch.testing.assert_close(layer_norm_reference(x, w[0], b[0]), F.layer_norm(x, (16,), w[0], b[0]), **exact)
    torch.testing.assert_close(swiglu_reference(x, w), F.silu(x) * w, **exact)
    torch.testing.assert_close(softmax_reference(x), torch.softmax(x, -1), **exact)
