"""The parts of the memory model that tests/dist/test_memory_truth.py checks end to end, each
on one process: the cross-entropy loss around the outputs (`memory.CROSS_ENTROPY`) against the
CPU allocator, the pipeline stage cut (`cost.pipeline_memory`) and the expert-parallel rank
(`cost.expert_memory`) against what they must keep.

Measured peak: the profiler's raw allocation records replayed in time order
(tests/memory_measure.py), during forward + `F.cross_entropy` + backward of the captured graph
with the outputs held (as `model.step` holds them); the inputs and parameters exist before,
so the prediction compared is the walk's peak minus its inputs. Tolerance 10%, as
tests/unit/test_cost_peak.py (op-level workspaces are not modelled on either side).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build, capture  # noqa: E402

from autopar.cost import CROSS_ENTROPY, analyze, liveness  # noqa: E402
from autopar.cost.expert_memory import ep_memory  # noqa: E402
from autopar.cost.memory import loss_output_bytes  # noqa: E402
from autopar.cost.pipeline_memory import in_flight, stage_graph, stage_of_nodes  # noqa: E402
from autopar.cost.symbolic import evaluate  # noqa: E402
from autopar.passes.plan import Plan  # noqa: E402
from memory_measure import memory_records  # noqa: E402


def _ce_step_peak(gm, args, vocab: int) -> float:
    """Peak bytes allocated during forward + cross-entropy + backward, outputs held."""
    targets = torch.randint(0, vocab, (args[0].shape[0], args[0].shape[1]))
    gm.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = gm(*args)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        if isinstance(out, (tuple, list)):
            loss = loss + sum(o.sum() for o in out[1:] if o.is_floating_point() and o.requires_grad)
        loss.backward()
        del loss, logits, out
    cur = peak = 0
    for _t, d in memory_records(prof):
        cur += d
        peak = max(peak, cur)
    gm.zero_grad(set_to_none=True)
    return float(peak)


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny"])
def test_the_cross_entropy_loss_model_matches_the_profiled_step(name):
    model, args = build(name, batch=8, seq=32)
    gm = capture(model, args)
    gc = analyze(gm, "cpu-gloo")
    v = gc.values()
    with_loss = liveness(gc, v, loss=CROSS_ENTROPY)
    graph_only = liveness(gc, v)
    measured = _ce_step_peak(gm, args, model.config.vocab_size)
    logits = loss_output_bytes(gc, lambda x: evaluate(x, v))
    print(f"{name}: graph only {graph_only.peak - graph_only.inputs:.0f}, with the loss "
          f"{with_loss.peak - with_loss.inputs:.0f} ({with_loss.peak_node}), measured {measured:.0f}")
    # the graph alone misses the loss's working set (at the loss's backward: the log-softmax
    # output, its gradient and the logits' gradient beside the held logits)
    assert graph_only.peak - graph_only.inputs < measured - logits
    torch.testing.assert_close(with_loss.peak - with_loss.inputs, measured, rtol=0.10, atol=0)


def test_pipeline_stages_partition_the_graph_and_hand_on_their_outputs():
    model, args = build("gpt-tiny", batch=4, seq=16)
    gc = analyze(capture(model, args), "cpu-gloo")
    v = gc.values()
    stage_of = stage_of_nodes(gc, ["layers.1"])
    assert stage_of == sorted(stage_of) and set(stage_of) == {0, 1}
    first = next(i for i, n in enumerate(gc.nodes) if n.module.startswith("layers.1"))
    assert stage_of.index(1) == first  # the stage starts at the unit's first node
    s0, s1 = stage_graph(gc, stage_of, 0), stage_graph(gc, stage_of, 1)
    assert len(s0.nodes) + len(s1.nodes) == len(gc.nodes)
    assert {p.name for p in s0.params} | {p.name for p in s1.params} == {p.name for p in gc.params}
    both = {p.name for p in s0.params} & {p.name for p in s1.params}
    assert both == {"rope_cos", "rope_sin"}  # buffers read on both stages: each holds them
    sent = {t.key for t in s0.outputs}
    received = {k for k, st in s1.storages.items() if st.producer < 0 and not st.is_state}
    assert sent and sent <= received  # what stage 0 sends, stage 1 receives
    assert s1.outputs == gc.outputs
    # each stage's walk is smaller than the whole graph's, and together they hold what it holds
    whole = liveness(gc, v)
    parts = [liveness(s, v) for s in (s0, s1)]
    assert all(p.peak < whole.peak for p in parts)
    assert in_flight("1f1b", 2, 2, 0) == 2 and in_flight("1f1b", 2, 2, 1) == 1 and in_flight("gpipe", 2, 4, 1) == 4


def test_an_expert_parallel_rank_keeps_its_experts_and_their_rows():
    from autopar.search.expert import plan_experts

    import autopar

    model, args = build("moe-tiny", batch=4, seq=16)
    gm = autopar.capture(model, args)  # the expert search reads autopar's annotations
    gc = analyze(gm, "cpu-gloo")
    v = gc.values()
    ev = lambda x: evaluate(x, v)  # noqa: E731
    plan = Plan(mesh={"ep": 4}, dp_axis=None)
    plan.extra["expert"] = plan_experts(gm, {"ep": 4})
    one = ep_memory(gc, gc.params, Plan(mesh={"ep": 1}, dp_axis=None), ev)
    assert one.params == gc.params and not one.scale and not one.dropped
    m = ep_memory(gc, gc.params, plan, ev)
    experts = {n for b in plan.extra["expert"]["blocks"].values() for n in b["expert_params"]}
    kept = {p.name for p in m.params} & experts
    assert len(kept) == len(experts) // 4 and all(".experts.0." in n for n in kept)
    assert {p.name for p in m.params} - experts == {p.name for p in gc.params} - experts
    E, K = 4, 2
    by_module = {n.module for n in gc.nodes if any(k in m.scale for k in n.new_storages)}
    assert any(".experts.0" in x for x in by_module) and any(".experts.3" in x for x in by_module)
    for n in gc.nodes:
        for k in n.new_storages:
            if k in m.scale and ".experts.3" in n.module:
                assert m.scale[k] == 0.0  # another rank's expert: not run here
            elif k in m.scale and ".experts.0" in n.module:
                assert m.scale[k] == K * 4 / E  # its rows: N * K * ep / E instead of N
