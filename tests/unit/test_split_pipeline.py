"""Pipeline stages on one process: the DP split is optimal (checked against brute force),
honours pins and memory, handles virtual stages and refuses impossible requests with clear
errors; the cut stage graphs compute exactly what the whole graph computes (forward and
gradients; a tied weight's two copies sum to its gradient), stay annotated and readable.

Tolerances: the cut runs the very same ATen ops in the same order, so outputs and gradients
are compared with rtol=0, atol=0 except where a tied weight's gradient is a sum of the two
stages' parts (a different summation order: fp32 defaults rtol 1.3e-6, atol 1e-5).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import models
from autopar.models.gpt import GPT, loss_fn
from autopar.passes import ir
from autopar.passes.pass_manager import PassContext, PassManager
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import compose, pipeline_units, split_pipeline, split_stages
from autopar.build.pipeline import pipeline_shape, write_schedule_svg, write_stage_graphs
from autopar.runtime import schedules as sch
from autopar.search.stages import (Chain, LayerCost, best_split, count_chain, in_flight_per_stage, layer_costs,
                                   n_virtual_for, search_stages)

EXACT = dict(rtol=0, atol=0)
FP32 = dict(rtol=1.3e-6, atol=1e-5)
GPT_UNITS = ["tok_emb", "layers.0", "layers.1", "norm", "lm_head"]


@pytest.fixture(scope="module")
def tiny():
    """gpt-tiny, its batch and its graph (captured once: capture takes seconds)."""
    spec = models.get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    (idx,), tgt = spec.example_batch(4, seq_len=8, generator=torch.Generator().manual_seed(1))
    return model, idx, tgt, autopar.capture(model, (idx,))


@pytest.fixture(scope="module")
def tied():
    spec = models.get("gpt-tiny-tied")
    torch.manual_seed(0)
    model = spec.build()
    (idx,), tgt = spec.example_batch(4, seq_len=8, generator=torch.Generator().manual_seed(1))
    return model, idx, tgt, autopar.capture(model, (idx,))


# ---------------------------------------------------------------------------- the DP
def _brute(L, S, t, m, limit, pins):
    """Every composition of L units into S stages: (best bottleneck, best sum of squares)."""
    best = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        if not set(pins) <= set(cuts):
            continue
        starts = (0, *cuts)
        ends = (*cuts, L)
        if any(m(s, starts[s], ends[s]) > limit for s in range(S)):
            continue
        times = [t(s, starts[s], ends[s]) for s in range(S)]
        key = (max(times), sum(x * x for x in times))
        best = key if best is None or key < best else best
    return best


def _random_chain(rng: random.Random, L: int, S: int):
    f = [rng.uniform(0.5, 3.0) for _ in range(L)]
    hop = [rng.uniform(0.0, 0.8) for _ in range(L - 1)]
    st = [rng.uniform(1.0, 5.0) for _ in range(L)]
    act = [rng.uniform(0.5, 2.0) for _ in range(L)]
    k = [S - s for s in range(S)]  # 1F1B-like in-flight counts

    def t(s, i, j):
        return sum(f[i:j]) + (hop[i - 1] if s > 0 else 0.0) + (hop[j - 1] if s < S - 1 else 0.0)

    def m(s, i, j):
        return sum(st[i:j]) + k[s] * sum(act[i:j])

    return t, m


def test_dp_split_equals_brute_force_on_random_chains_with_memory_limits_and_pins():
    rng = random.Random(0)
    checked = infeasible = 0
    for trial in range(150):
        L = rng.randint(3, 9)
        S = rng.randint(1, min(4, L))
        t, m = _random_chain(rng, L, S)
        limit = rng.choice([math.inf, rng.uniform(4.0, 25.0)])
        pins = sorted(rng.sample(range(1, L), rng.randint(0, min(S - 1, 2)))) if S > 1 and rng.random() < 0.4 else []
        want = _brute(L, S, t, m, limit, pins)
        if want is None:
            with pytest.raises(ValueError, match="fits the memory limit"):
                best_split(L, S, t, m, limit, pins)
            infeasible += 1
            continue
        starts, bottleneck = best_split(L, S, t, m, limit, pins)
        ends = starts[1:] + [L]
        times = [t(s, starts[s], ends[s]) for s in range(S)]
        assert starts[0] == 0 and all(a < b for a, b in zip(starts, ends))
        assert set(pins) <= set(starts[1:])
        assert all(m(s, starts[s], ends[s]) <= limit for s in range(S))
        assert bottleneck == pytest.approx(want[0], rel=1e-12) == max(times)
        assert sum(x * x for x in times) == pytest.approx(want[1], rel=1e-9)
        checked += 1
    assert checked > 80 and infeasible > 5  # both branches really exercised


def _chain(n_layers=6, state=10.0, act=1.0, fwd=1.0, cross=0.0, heavy=None):
    layers = [LayerCost(f"layers.{i}", fwd, 2 * fwd, act, (f"w{i}",)) for i in range(n_layers)]
    states = {f"w{i}": state for i in range(n_layers)}
    if heavy is not None:
        states[f"w{heavy}"] = state * 8
    return Chain(layers, states, [cross] * (n_layers - 1))


def test_balanced_split_of_identical_layers_and_a_memory_limit_moves_the_cut():
    free = search_stages(_chain(), 2, schedule="1f1b", n_microbatches=4, hardware="cpu-gloo", memory_limit=1e9)
    assert free.split_points == ["layers.3"] and free.stage_time_s == [9.0, 9.0]
    assert free.in_flight == [2, 1] and free.stage_memory == [30 + 2 * 3, 30 + 3]
    # layer 1 is heavy (80 bytes of state): with 100 bytes a stage, stage 0 must stop before layer 2
    tight = search_stages(_chain(heavy=1), 2, schedule="1f1b", n_microbatches=4, hardware="cpu-gloo",
                          memory_limit=100)
    assert tight.split_points == ["layers.2"]
    assert max(tight.stage_memory) <= 100 and tight.stage_time_s == [6.0, 12.0]
    assert tight.rank_memory == tight.stage_memory  # one stage per rank


def test_gpipe_holds_every_micro_batch_and_1f1b_only_the_pipeline_depth():
    c = _chain(n_layers=4)
    g = search_stages(c, 2, schedule="gpipe", n_microbatches=6, hardware="cpu-gloo", memory_limit=1e9)
    o = search_stages(c, 2, schedule="1f1b", n_microbatches=6, hardware="cpu-gloo", memory_limit=1e9)
    assert g.in_flight == [6, 6] and o.in_flight == [2, 1]
    assert g.stage_memory[0] == 20 + 6 * 2 and o.stage_memory[0] == 20 + 2 * 2


def test_pinned_split_points_are_kept_and_the_rest_is_searched(tiny):
    _, _, _, gm = tiny
    chain = layer_costs(gm, "cpu-gloo", microbatch=1)
    assert [x.name for x in chain.layers] == GPT_UNITS
    r = search_stages(chain, 3, schedule="1f1b", n_microbatches=4, hardware="cpu-gloo", pins=["lm_head"])
    assert "lm_head" in r.split_points and len(r.split_points) == 2
    full = search_stages(chain, 3, schedule="1f1b", n_microbatches=4, hardware="cpu-gloo", pins=["norm", "layers.0"])
    assert full.split_points == ["layers.0", "norm"]
    assert full.stage_units == [["tok_emb"], ["layers.0", "layers.1"], ["norm", "lm_head"]]


def test_impossible_requests_are_clear_value_errors(tiny):
    _, _, _, gm = tiny
    chain = layer_costs(gm, "cpu-gloo", microbatch=1)
    kw = dict(schedule="1f1b", n_microbatches=4, hardware="cpu-gloo")
    with pytest.raises(ValueError, match=r"6 pipeline stages .* need at least 6 units .* has 5"):
        search_stages(chain, 6, **kw)
    with pytest.raises(ValueError, match=r"6 pipeline stages \(3 ranks x 2 per rank\) need at least 6 units"):
        search_stages(chain, 3, n_virtual=2, **{**kw, "schedule": "interleaved_1f1b"})
    with pytest.raises(ValueError, match=r"\['layers.7'\] are not pipeline units"):
        search_stages(chain, 2, pins=["layers.7"], **kw)
    with pytest.raises(ValueError, match="first unit"):
        search_stages(chain, 2, pins=["tok_emb"], **kw)
    with pytest.raises(ValueError, match="2 pinned split points .* 2 \\(2 ranks"):
        search_stages(chain, 2, pins=["norm", "lm_head"], **kw)
    with pytest.raises(ValueError, match=r"fits the memory limit of 1000 B per stage: the best split needs "
                                         r"[0-9.]+ (MiB|B) on its fullest stage \([0-9.]+x\)"):
        search_stages(chain, 2, memory_limit=1000, **kw)
    with pytest.raises(ValueError, match="need at least 4 units"):
        best_split(3, 4, lambda s, i, j: 1.0)


def test_virtual_stages_interleave_and_each_gets_a_share_of_the_device(tiny):
    _, _, _, gm = tiny
    chain = layer_costs(gm, "cpu-gloo", microbatch=1)
    assert n_virtual_for("zbv") == 2 and n_virtual_for("1f1b") == 1 and n_virtual_for("interleaved_1f1b", 8, 4) == 2
    inter = sch.interleaved_1f1b(2, 4, 2)
    # from the grid: rank 0 runs 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 ...: stage 0 holds 4 before
    # 0B0, stage 2 at most 2; rank 1 runs 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 ...: stage 1 3, stage 3 1
    assert in_flight_per_stage(inter) == [4, 3, 2, 1]
    r = search_stages(chain, 2, n_virtual=2, schedule="interleaved_1f1b", n_microbatches=4, hardware="cpu-gloo")
    assert r.n_stages == 4 and len(r.split_points) == 3 and r.in_flight == [4, 3, 2, 1]
    assert r.rank_memory[0] <= r.memory_limit and len(r.rank_memory) == 2
    z = search_stages(chain, 2, n_virtual=2, schedule="zbv", n_microbatches=4, hardware="cpu-gloo")
    assert z.n_stages == 4 and z.schedule == "ZBV"


# ---------------------------------------------------------------------------- the cut
def _grads(module, idx, tgt):
    module.zero_grad(set_to_none=True)
    out = module(idx)
    out = out[0] if isinstance(out, tuple) else out
    loss = loss_fn(out, tgt)
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters(remove_duplicate=False)}


def test_stage_graphs_compute_the_whole_graph_exactly_and_stay_annotated(tiny):
    model, idx, tgt, gm = tiny
    assert [u.name for u in pipeline_units(gm)] == GPT_UNITS
    split = split_stages(gm, ["layers.1", "lm_head"])
    assert split.info.stage_units == (("tok_emb", "layers.0"), ("layers.1", "norm"), ("lm_head",))
    s0, s1, s2 = split.stages
    assert [n for n, _ in s2.named_parameters()] == ["lm_head.weight"]  # each stage owns what it reads
    assert all(n.startswith("layers.1.") or n == "norm.weight" for n, _ in s1.named_parameters())
    assert "def forward(self, add_3):" in s1.code  # placeholders named after what they carry
    assert "torch.ops.aten.sym_size.int(add_3, 0)" in s1.code  # the batch size re-read, not sent
    for g in split.stages:
        assert ir.unannotated_ops(g) == []
    ref_out, ref_grads = _grads(gm, idx, tgt)
    pm = PassManager([split_pipeline])
    pipe = pm.run(gm, PassContext(plan=Plan(mesh={"pp": 3}, dp_axis=None, split_points=["lm_head", "layers.1"]),
                                  mesh_sizes={"pp": 3}))
    assert type(pipe).__name__ == "PipelineGraph" and pm.records[0].changed
    out, grads = _grads(pipe, idx, tgt)
    torch.testing.assert_close(out, ref_out, **EXACT)
    assert len(grads) == len(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n.split(".", 1)[1]], **EXACT)
    torch.testing.assert_close(out, model(idx).detach(), **EXACT)


def test_without_split_points_the_pass_leaves_the_graph_alone(tiny):
    gm = tiny[3]
    assert split_pipeline(gm, PassContext(plan=Plan(mesh={"dp": 1}), mesh_sizes={"dp": 1})) is gm


def test_a_tied_embedding_and_head_on_two_stages_are_two_copies_reported_as_a_pair(tied):
    model, idx, tgt, gm = tied
    split = split_stages(gm, ["norm"])
    assert split.info.tied == (((0, "lm_head.weight"), (1, "lm_head.weight")),)
    a = split.stages[0].get_parameter("lm_head.weight")
    b = split.stages[1].get_parameter("lm_head.weight")
    assert a is not b and torch.equal(a, b)

    pipe = compose(gm, split)
    ref_out, ref_grads = _grads(gm, idx, tgt)
    out, grads = _grads(pipe, idx, tgt)
    torch.testing.assert_close(out, ref_out, **EXACT)
    torch.testing.assert_close(grads["stage0.lm_head.weight"] + grads["stage1.lm_head.weight"],
                               ref_grads["lm_head.weight"], **FP32)


class _Shared(nn.Module):
    """Three blocks that all read one root parameter: tied across up to three stages."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x) * self.scale
        return x


def test_a_weight_read_on_three_stages_is_one_tied_group_and_bad_split_points_are_refused():
    torch.manual_seed(0)
    gm = autopar.capture(_Shared(), (torch.randn(2, 4),))
    assert [u.name for u in pipeline_units(gm)] == ["blocks.0", "blocks.1", "blocks.2"]
    three = split_stages(gm, ["blocks.1", "blocks.2"])
    assert three.info.tied == (((0, "scale"), (1, "scale"), (2, "scale")),)
    x = torch.randn(2, 4)
    pipe = compose(gm, three)
    ref = torch.autograd.grad(gm(x)[0].sum(), [gm.get_parameter("scale")])[0]
    copies = [pipe.get_parameter(f"stage{s}.scale") for s in range(3)]
    assert len({id(c) for c in copies}) == 3  # each later stage holds its own copy
    got = torch.autograd.grad(pipe(x)[0].sum(), copies)
    torch.testing.assert_close(sum(got), ref, **FP32)  # the executor gives every copy this sum
    two = split_stages(gm, ["blocks.2"])  # on two stages it is a tied pair
    assert two.info.tied == (((0, "scale"), (1, "scale")),)
    with pytest.raises(ValueError, match=r"\['blocks.9'\] are not pipeline units"):
        split_stages(gm, ["blocks.9"])
    with pytest.raises(ValueError, match="first unit"):
        split_stages(gm, ["blocks.0"])
    with pytest.raises(ValueError, match="twice"):
        split_stages(gm, ["blocks.1", "blocks.1"])


def test_pipeline_shape_reads_the_schedule_and_refuses_too_many_split_points():
    assert pipeline_shape(Plan(mesh={"pp": 2}, dp_axis=None)) == ("1f1b", 2, 1)
    assert pipeline_shape(Plan(mesh={"pp": 2}, dp_axis=None, schedule="zbv")) == ("zbv", 2, 2)
    p = Plan(mesh={"pp": 2}, dp_axis=None, schedule="interleaved_1f1b", split_points=["a", "b", "c", "d", "e"])
    assert pipeline_shape(p) == ("interleaved_1f1b", 2, 3)
    with pytest.raises(ValueError, match="3 split points make 4 stages"):
        pipeline_shape(Plan(mesh={"pp": 2}, dp_axis=None, split_points=["a", "b", "c"]))
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pipeline_shape(Plan(mesh={"pp": 2}, dp_axis=None, schedule="wavy"))


def test_schedule_picture_and_stage_dumps_are_written_and_deterministic(tmp_path, tiny):
    gm = tiny[3]
    plan = Plan(mesh={"pp": 2}, dp_axis=None, schedule="1f1b", n_microbatches=4)
    from autopar.build.pipeline import choose_stages
    from autopar.runtime.mesh import Mesh

    choose_stages(gm, plan, Mesh({"pp": 2}))
    assert plan.split_points == ["layers.1"] and plan.extra["pipeline"]["stage_units"][1][-1] == "lm_head"
    assert Plan.from_json(plan.to_json()).extra["pipeline"] == plan.extra["pipeline"]  # plain data
    a = write_schedule_svg(plan, str(tmp_path / "a"))
    b = write_schedule_svg(plan, str(tmp_path / "b"))
    assert [open(x).read() for x in a] == [open(x).read() for x in b]
    svg, grid = (open(x).read() for x in a)
    assert svg.startswith("<svg") and "rank 1" in svg and "1F1B" in svg
    assert sch.Schedule.from_grid(grid) == sch.one_f_one_b(2, 4)
    files = write_stage_graphs(split_stages(gm, plan.split_points).stages, str(tmp_path / "s"), plan)
    assert [f.rsplit("/", 1)[1] for f in files] == ["stage0.py", "stage1.py"]
    assert "# pipeline stage 1 of 2: units layers.1 .. lm_head" in open(files[1]).read()
    assert write_schedule_svg(Plan(mesh={"dp": 2}), str(tmp_path / "none")) == []


def test_a_larger_gpt_is_cut_into_eight_stages_at_block_edges():
    cfg = dataclasses.replace(models.get("gpt-tiny").config, n_layers=6)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    gm = autopar.capture(model, (idx,))
    r = search_stages(gm, 4, n_virtual=2, schedule="interleaved_1f1b", n_microbatches=8, hardware="cpu-gloo",
                      microbatch=1)
    assert len(r.split_points) == 7 and all(p in {u.name for u in pipeline_units(gm)} for p in r.split_points)
    split = split_stages(gm, r.split_points)
    out = split.stages[0](idx)
    for st in split.stages[1:]:
        out = st(*out)
    torch.testing.assert_close(out[0], model(idx), **EXACT)


def test_without_the_cost_model_a_chain_counts_nodes_and_sees_the_tied_weight_on_both_ends(tied):
    gm = tied[3]
    c = count_chain(gm)
    assert [x.name for x in c.layers] == GPT_UNITS
    assert c.layers[1].fwd_s == c.layers[2].fwd_s > c.layers[3].fwd_s > 0  # identical blocks, a smaller norm
    assert c.layers[0].params == c.layers[4].params == ("lm_head.weight",)
    assert c.state_bytes["lm_head.weight"] == 128 * 64 * 16
    r = search_stages(c, 2, schedule="1f1b", n_microbatches=2, hardware="cpu-gloo", memory_limit=math.inf)
    assert r.split_points == ["layers.1"]


def test_the_schedule_dump_draws_recomputing_stages_fused_under_zero_bubble(tmp_path):
    """Under zb_h1 a stage holding checkpoint regions runs its backward whole (B at its I's
    place, no W: runtime/pipeline.py); the dump draws that schedule, not the split one."""
    from autopar.build.pipeline import recomputing_stages

    units = [["embed", "layers.0"], ["layers.1", "norm", "lm_head"]]
    plan = Plan(mesh={"pp": 2}, dp_axis=None, schedule="zb_h1", n_microbatches=4, split_points=["layers.1"],
                recompute={"layers.1": "full", "layers.0": "none"})
    plan.extra["pipeline"] = {"stage_units": units}
    assert recomputing_stages(plan, units) == [1]
    assert recomputing_stages(Plan(mesh={"pp": 2}, dp_axis=None, recompute={"layers.1.mlp": "selective"}), units) == [1]
    grid = open(write_schedule_svg(plan, str(tmp_path))[1]).read()
    drawn = sch.Schedule.from_grid(grid)
    kinds = {s: {a.kind for acts in drawn.actions for a in acts if a.stage == s} for s in (0, 1)}
    assert kinds[1] == {sch.Kind.F, sch.Kind.B} and {sch.Kind.I, sch.Kind.W} <= kinds[0], kinds
    plan.recompute = {}
    split = sch.Schedule.from_grid(open(write_schedule_svg(plan, str(tmp_path / "split"))[1]).read())
    assert sch.Kind.W in {a.kind for acts in split.actions for a in acts if a.stage == 1}
