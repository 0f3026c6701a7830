"""A pipeline stage's memory walk with checkpoint regions (issue 22, item 6): `cost.timeline` on a
stage graph (`cost.pipeline_memory.stage_graph`, whose nodes keep their indices in the whole
graph) and `cost.pipeline_memory.stage_walk` / `stage_regions`, which `cost.estimate` and the
planner's pipeline memory both use.

Checked on gpt-tiny (global batch 8 x 32 tokens) split into 2 and 4 stages:
  - without regions the timeline of a stage graph is its `memory.liveness` walk (the timeline's
    guarantee, now on graphs whose first node index is not 0): peak, forward end, gradients;
  - the regions cut to the stages recompute, together, what the whole graph's regions recompute
    (FLOPs to 1e-12, seconds to 1e-9: a region lies inside one stage; selective regions recompute
    no matmul, so their FLOPs are 0 in the FlopCounterMode convention), and so does
    `cost.timeline.region_recompute` per region, without the walk (what the planner sums);
  - a stage holding a region keeps less at its forward end (the region's input, not its
    activations) and recomputes something; a stage with none walks as before.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import analyze, load_profile  # noqa: E402
from autopar.cost.memory import CROSS_ENTROPY, HELD_OUTPUTS, liveness  # noqa: E402
from autopar.cost.pipeline_memory import stage_graph, stage_of_nodes, stage_regions, stage_walk  # noqa: E402
from autopar.cost.timeline import region_recompute, regions_for, timeline  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
SPLITS = [["layers.1"], ["layers.0", "layers.1", "norm"]]


@pytest.fixture(scope="module")
def gc():
    model, args = build("gpt-tiny", batch=8, seq=32)
    return analyze(autopar.capture(model, args), load_profile("cpu-gloo"))


def _stages(gc, split):
    stage_of = stage_of_nodes(gc, split)
    graphs = [stage_graph(gc, stage_of, s) for s in range(max(stage_of) + 1)]
    return [(g, CROSS_ENTROPY if s == len(graphs) - 1 else HELD_OUTPUTS) for s, g in enumerate(graphs)]


def _close(a: float, b: float, rtol: float = 1e-12) -> None:
    torch.testing.assert_close(torch.tensor(float(a), dtype=torch.float64), torch.tensor(float(b), dtype=torch.float64),
                               rtol=rtol, atol=0.0)


@pytest.mark.parametrize("split", SPLITS)
def test_a_stage_graphs_timeline_without_regions_is_its_liveness_walk(gc, split):
    values = gc.values()
    stages = _stages(gc, split)
    assert [g.nodes[0].index > 0 for g, _loss in stages] == [False] + [True] * (len(stages) - 1)
    for g, loss in stages:
        for pre in (False, True):
            tl = timeline(g, (), values, grads_preallocated=pre, loss=loss)
            lv = liveness(g, values, grads_preallocated=pre, loss=loss)
            _close(tl.peak, lv.peak)
            _close(tl.forward_end, lv.forward_end)
            _close(tl.param_grads, lv.param_grads)
        w = stage_walk(g, values, param_grad_bytes=None, storage_divisor=None, loss=loss, later=True)
        assert w.recompute_s == 0.0 and w.first == pytest.approx(liveness(g, values, loss=loss).peak, rel=1e-12)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("split", SPLITS)
def test_regions_cut_to_stages_recompute_what_the_whole_graph_recomputes(gc, split, mode):
    values = gc.values()
    regions = regions_for(gc, {"layers.0": mode, "layers.1": mode})
    whole = timeline(gc, regions, values, keep_points=False, loss=CROSS_ENTROPY)
    assert whole.recompute_s > 0 and whole.recomputed_nodes > 0
    flops, secs, holding = 0.0, 0.0, 0
    for g, loss in _stages(gc, split):
        regs = stage_regions(regions, g)
        plain = stage_walk(g, values, param_grad_bytes=None, storage_divisor=None, loss=loss, later=False)
        w = stage_walk(g, values, param_grad_bytes=None, storage_divisor=None, loss=loss, later=False, regions=regs)
        flops += w.recompute_flops
        secs += w.recompute_s
        if regs:
            holding += 1
            assert {i for r in regs for i in r.nodes} <= {n.index for n in g.nodes}
            assert w.held < plain.held and w.recompute_s > 0, (split, mode, w, plain)
        else:
            assert w == plain
    assert holding == 2  # one stage per layer here
    _close(flops, whole.recompute_flops)
    _close(secs, whole.recompute_s, 1e-9)  # the same nodes' times, summed per stage
    # per region without the walk (what the planner sums per recomputed block)
    per = [region_recompute(gc, r, values) for r in regions]
    _close(sum(f for f, _s, _n in per), whole.recompute_flops)
    _close(sum(s_ for _f, s_, _n in per), whole.recompute_s, 1e-9)
    assert sum(n for _f, _s, n in per) == whole.recomputed_nodes
