"""`cost.estimate` prices the fusions that run (autopar/cost/fused_graph.py): a plan's fusions on
a GPU profile are costed on a copy of the graph fused by the fuse pass itself, with the plan's
node keys carried over; on a CPU profile the fused calls run their torch references and are
costed unfused. And a fused kernel is not a collective: recompute regions recompute it
(`cost.timeline.communicates`, as `passes.recompute.is_collective` decides).

Graph: the reference GPT, bf16, on the meta device (width 512, 2 blocks, 512 tokens, batch 4),
captured with a dynamic batch as `autopar.parallelize` captures it. Profile h100-sxm.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.fx as fx

from autopar.capture import capture
from autopar.cost import analyze, estimate, load_profile
from autopar.cost.fused_graph import fused_copy
from autopar.cost.timeline import communicates, regions_for
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.fuse import fuse
from autopar.passes.pass_manager import PassContext
from autopar.passes.plan import Plan
from autopar.runtime.mesh import make_mesh
from autopar.search.shard_search import search_sharding

CFG = GPTConfig(vocab_size=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=512)
FUSIONS = ["add_rms_norm", "rope", "swiglu"]
HW = "h100-sxm"


@functools.cache
def graph() -> fx.GraphModule:
    with torch.device("meta"):
        model = GPT(CFG).to(torch.bfloat16)
    return capture(model, (torch.randint(0, CFG.vocab_size, (4, 512)),))


def _fused_by_the_pass(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """What the rank runs: the fuse pass on its own copy of the graph."""
    from autopar.build.program import rank_copy

    return fuse(rank_copy(gm), PassContext(plan=plan, mesh_sizes=dict(plan.mesh), coords={}))


def test_the_estimate_of_a_plan_with_fusions_is_the_estimate_of_the_fused_graph():
    gm = graph()
    nodes_before = len(gm.graph.nodes)
    plan = Plan(mesh={"dp": 1}, fusions=FUSIONS)
    fused = estimate(gm, plan, HW, batch_is_global=True)
    unfused = estimate(gm, dataclasses.replace(plan, fusions=[]), HW, batch_is_global=True)
    ran = _fused_by_the_pass(gm, plan)
    assert len([n for n in ran.graph.nodes if "autopar.runtime.kernels" in str(n.target)]) or \
        ran.meta.get("autopar_fusions"), "the pass fused nothing: the test would compare equal graphs"
    want = estimate(ran, dataclasses.replace(plan, fusions=[]), HW, batch_is_global=True)
    assert fused.step_s == pytest.approx(want.step_s, rel=1e-12)
    assert fused.memory["peak"] == pytest.approx(want.memory["peak"], rel=1e-12)
    assert fused.memory["activations"] == pytest.approx(want.memory["activations"], rel=1e-12)
    # the fused kernels move fewer bytes and save less for backward (swiglu: its two inputs, not
    # the gate's activation too): both smaller than unfused
    assert fused.step_s < unfused.step_s
    assert fused.memory["activations"] < unfused.memory["activations"]
    assert any(n.startswith("fusions: ") and "matches" in n for n in fused.notes), fused.notes
    assert len(gm.graph.nodes) == nodes_before and not gm.meta.get("autopar_fusions")  # the original untouched


def test_a_cpu_profile_costs_the_fusions_unfused_and_says_why():
    gm = graph()
    plan = Plan(mesh={"dp": 1}, fusions=FUSIONS)
    e = estimate(gm, plan, "cpu-gloo", batch_is_global=True)
    bare = estimate(gm, dataclasses.replace(plan, fusions=[]), "cpu-gloo", batch_is_global=True)
    assert (e.step_s, e.memory["peak"]) == (bare.step_s, bare.memory["peak"])
    assert any("torch references" in n for n in e.notes), e.notes


def test_a_graph_costed_as_an_analysis_alone_is_costed_unfused_and_says_so():
    gm = graph()
    plan = Plan(mesh={"dp": 1}, fusions=FUSIONS)
    e = estimate(analyze(gm, HW), plan, HW, batch_is_global=True)
    bare = estimate(gm, dataclasses.replace(plan, fusions=[]), HW, batch_is_global=True)
    assert e.step_s == bare.step_s
    assert any("no graph to fuse" in n for n in e.notes), e.notes


def test_tensor_parallel_layouts_follow_the_nodes_into_the_fused_copy():
    gm = graph()
    mesh = make_mesh(tp=2)
    plan = Plan(mesh=dict(mesh.sizes), dp_axis=None, fusions=FUSIONS)
    search_sharding(plan, gm, mesh, HW)
    assert plan.node_layouts
    hw = load_profile(HW)
    copy, rekeyed, n, _ = fused_copy(gm, plan, hw)
    assert n > 0
    old = {x.name: x.key for x in analyze(gm, hw).nodes}
    new = {x.name: x.key for x in analyze(copy, hw).nodes}
    kept = [name for name in new if name in old and old[name] in plan.node_layouts]
    assert kept
    for name in kept:  # a node the fusion left keeps its layout under its new key
        assert rekeyed.node_layouts[new[name]] == plan.node_layouts[old[name]], name
    calls = [d["node"] for d in copy.meta["autopar_fusions"]]
    anchors = [d["anchor"] for d in copy.meta["autopar_fusions"]]
    for call, anchor in zip(calls, anchors):  # a fused call takes its anchor's layout
        if old.get(anchor) in plan.node_layouts:
            assert rekeyed.node_layouts[new[call]] == plan.node_layouts[old[anchor]], call
    tp_fused = estimate(gm, plan, HW, batch_is_global=True)
    tp_bare = estimate(gm, dataclasses.replace(plan, fusions=[]), HW, batch_is_global=True)
    one = estimate(gm, Plan(mesh={"dp": 1}, fusions=FUSIONS), HW, batch_is_global=True)
    assert tp_fused.memory["activations"] < tp_bare.memory["activations"]
    # the fused copy is still costed on one rank's shards (without its layouts it would be 1.0)
    share, bare_share = (e.memory["activations"] / one_e.memory["activations"]
                         for e, one_e in ((tp_fused, one), (tp_bare, estimate(gm, Plan(mesh={"dp": 1}), HW,
                                                                                  batch_is_global=True))))
    assert share < 0.7 and share == pytest.approx(bare_share, abs=0.05), (share, bare_share)


def test_a_fused_kernel_is_recomputed_not_kept_like_a_collective():
    gm = graph()
    hw = load_profile(HW)
    copy, _plan, _n, _ = fused_copy(gm, Plan(mesh={"dp": 1}, fusions=FUSIONS), hw)
    gc = analyze(copy, hw)
    fused = [n for n in gc.nodes if n.op.startswith("autopar.runtime.kernels.")]
    assert fused and not any(communicates(n) for n in fused)
    region = regions_for(gc, {"layers.0": "selective"}, {"layers.0": []})[0]
    assert region.save == frozenset()  # nothing named, nothing kept: fused calls included
    reduce = analyze(_with_all_reduce(), hw)
    assert any(communicates(n) for n in reduce.nodes if n.op.startswith("autopar.all_reduce"))


def _with_all_reduce() -> fx.GraphModule:
    from autopar.runtime import collectives  # noqa: F401 - registers torch.ops.autopar

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    y = g.call_function(torch.ops.autopar.all_reduce.default, (x, "sum", "tp"))
    y.meta["val"] = torch.empty(4, 8)
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_planners_plan_carries_its_figures_with_the_fusions_priced():
    """The planner ranks unfused; the plan it returns also says what its fusions change:
    `plan.predicted["with_fusions"]` = its figures + (estimate fused - estimate unfused)."""
    from autopar.search.plan_write import unfused
    from autopar.search.planner import clear_cache, plan_for

    gm = graph()
    clear_cache()
    plan, _ = plan_for(gm, 2, HW)
    assert plan.fusions, "the fusion search chose nothing: the test would check nothing"
    pr = plan.predicted
    fused = estimate(gm, plan, HW, batch_is_global=True)
    bare = estimate(gm, unfused(plan), HW, batch_is_global=True)
    got = pr["with_fusions"]
    assert got["step_s"] == pytest.approx(pr["step_s"] + fused.step_s - bare.step_s, rel=1e-9)
    assert got["peak_bytes"] == pytest.approx(pr["peak_bytes"] + fused.memory["peak"] - bare.memory["peak"], rel=1e-9)
    assert got["step_s"] < pr["step_s"] and got["peak_bytes"] <= pr["peak_bytes"]  # equal where the peak is not where a fusion saves
    assert any(n.startswith("with its fusions") for n in plan.notes)
    clear_cache()
    cpu, _ = plan_for(gm, 2, "cpu-gloo")
    assert not cpu.fusions and "with_fusions" not in cpu.predicted  # no Triton there: nothing to price


def test_no_fusion_spans_a_pipeline_cut_and_the_estimate_fuses_at_the_split_the_build_saw():
    """An add + norm at a cut would move the residual sum into the next stage (which would then
    receive both addends): the fuse pass keeps every match inside one stage, and the cost model
    fuses at the split points the build fused with (`plan.extra["fusion_split_points"]`: a
    split chosen later, at the cut, was not seen)."""
    from autopar.passes.fuse import plan_matches
    from autopar.passes.split_pipeline import stage_of_nodes

    gm = graph()
    whole = plan_matches(gm, Plan(mesh={"dp": 1}, fusions=FUSIONS))
    split = Plan(mesh={"pp": 2}, dp_axis=None, fusions=FUSIONS, split_points=["layers.1"], schedule="1f1b")
    cut = plan_matches(gm, split)
    stage = stage_of_nodes(gm, ["layers.1"])
    crossing = [m for m in whole if len({stage[n] for n in m.nodes if n in stage}) > 1]
    assert [m.rule for m in crossing] == ["add_rms_norm"]  # the residual add of block 0 + block 1's norm
    assert len(cut) == len(whole) - 1 and all(len({stage[n] for n in m.nodes if n in stage}) == 1 for m in cut)
    hw = load_profile(HW)
    assert fused_copy(gm, split, hw)[2] == len(cut)
    seen_none = dataclasses.replace(split, extra={"fusion_split_points": []})  # the split came at the cut
    assert fused_copy(gm, seen_none, hw)[2] == len(whole)
    ran = PassContext(plan=split, mesh_sizes={"pp": 2}, coords={})
    from autopar.build.program import rank_copy

    fused = fuse(rank_copy(gm), ran)
    assert len(fused.meta["autopar_fusions"]) == len(cut)
