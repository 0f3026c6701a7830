"""The joint planner recomputes blocks "selective" where that is faster than recomputing them whole.

`search.plan_selective`: a block recomputed "selective" keeps its GEMMs' outputs and replays the
rest (norms, pointwise ops, attention computed unfused: its score matrix is what it frees). The
planner evaluates a plan that recomputes blocks both ways and keeps the faster
(`PlanCostModel.evaluate`). A 2-block GPT-3 block stack (benchmarks/bench_published.py's `GPT3`,
width 4096, 32 heads, 4 x 2048 tokens, on meta) on h100-sxm with the attention priced unfused
(sdpa "math": the score matrix is kept, 2.6 GiB a block): a block replays 5.8 ms selective
against 8.4 ms whole, and frees 0.25 GiB less. So under a limit both fit, the planner writes
"selective" (with `Plan.extra["recompute_save"]`, the GEMMs' node keys); under a limit only the
whole recompute fits, "full", which replays more (a smaller budget never recomputes less). Each
written plan's predicted step, peak and recompute equal `cost.estimate`'s to 1e-6, and the
report names the other way with its figure.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from bench_module import load_bench

import autopar
from autopar.cost import estimate, load_profile
from autopar.search.planner import plan_for

RTOL = 1e-6
PINS = {"n_microbatches": 1}  # one micro-batch: recompute, not accumulation, is what frees memory


@functools.lru_cache(maxsize=1)
def _setup():
    bench = load_bench("bench_published")
    with torch.device("meta"):
        model = bench.GPT3(4096, 32, 2, vocab=1024, seq=2048).to(torch.bfloat16)
    gm = autopar.capture(model, (torch.empty(4, 2048, dtype=torch.long, device="meta"),))
    hw = load_profile("h100-sxm")
    hw = dataclasses.replace(hw, kernels={**hw.kernels, "sdpa": "math", "sdpa_math_upcast": False})
    return gm, hw


def _plan(limit=1e15, **pins):
    gm, hw = _setup()
    return plan_for(gm, 1, hw, pins={**PINS, **pins}, memory_limit=limit, top_k=1)


def _agrees(plan) -> None:
    gm, hw = _setup()
    e = estimate(gm, dataclasses.replace(plan, fusions=[]), hw, batch_is_global=True)
    for got, want, what in ((plan.predicted["step_s"], e.step_s, "step"), (plan.predicted["peak_bytes"],
                            e.memory["peak"], "peak"), (plan.predicted["recompute_s"], e.recompute_s, "recompute")):
        assert abs(got - want) <= RTOL * abs(want), (what, got, want)


def test_selective_is_chosen_where_it_is_faster_and_full_where_only_it_fits():
    peak = {rc: _plan(recompute=rc)[0].predicted for rc in ("none", "full", "selective")}
    # the figures the docstring states: selective frees less than full, and replays less
    assert peak["full"]["peak_bytes"] < peak["selective"]["peak_bytes"] < peak["none"]["peak_bytes"]
    assert 0 < peak["selective"]["recompute_s"] < peak["full"]["recompute_s"]

    loose, report = _plan(0.9 * peak["none"]["peak_bytes"])
    assert loose.recompute and set(loose.recompute.values()) == {"selective"}, loose.recompute
    saved = loose.extra["recompute_save"]
    assert set(saved) == set(loose.recompute)
    assert all(k.split(":")[1].startswith("linear") for keys in saved.values() for k in keys)  # the GEMMs only
    assert loose.predicted["fits"] and loose.predicted["peak_bytes"] <= 0.9 * peak["none"]["peak_bytes"]
    _agrees(loose)
    why = " ".join(report.reasons())
    assert "selective" in why and "full replays" in why, why  # the whole recompute named, and its replay time
    # the same blocks recomputed whole: it fits too, and is slower
    whole, _ = _plan(0.9 * peak["none"]["peak_bytes"], recompute={u: "full" for u in loose.recompute})
    assert whole.predicted["fits"] and whole.predicted["step_s"] > loose.predicted["step_s"]

    tight, _ = _plan(0.99 * peak["selective"]["peak_bytes"])
    assert tight.recompute and set(tight.recompute.values()) == {"full"}, tight.recompute
    assert "recompute_save" not in tight.extra
    assert tight.predicted["recompute_s"] > loose.predicted["recompute_s"]  # a smaller budget recomputes more
    _agrees(tight)


def test_recompute_pins_take_selective_and_a_mix_of_the_two_ways():
    plan, _ = _plan(recompute="selective")
    assert set(plan.recompute.values()) == {"selective"} and len(plan.recompute) == 2
    _agrees(plan)
    mixed, _ = _plan(recompute={"layers.0": "full", "layers.1": "selective"})
    assert mixed.recompute == {"layers.0": "full", "layers.1": "selective"}
    assert set(mixed.extra["recompute_save"]) == {"layers.1"}
    _agrees(mixed)
    with pytest.raises(ValueError, match="'selective'"):
        _plan(recompute="partial")


def test_a_fixed_mesh_reads_one_recompute_mode_as_every_block_and_trains_the_same():
    """`parallelize(mesh(dp=1), pins={"recompute": "selective"})` (no planner: a fixed mesh) gives
    every block the mode, with the nodes the planner's selective keeps
    (`build.recompute_plan.pinned_recompute`); "full" likewise without a list, "none" nothing;
    {module: "selective"} gets the planner's nodes too. The regions run: three AdamW steps give
    the losses of the plain run."""
    from autopar.passes.recompute import CheckpointRegion

    from test_one_rank_zero import _train  # gpt-tiny on mesh(dp=1), three AdamW steps

    _, want = _train()
    for mode in ("full", "selective"):
        pm, losses = _train(pins={"recompute": mode})
        assert pm.plan.recompute == {"layers.0": mode, "layers.1": mode}
        assert ("recompute_save" in pm.plan.extra) == (mode == "selective")
        regions = [m for m in pm.program.modules() if isinstance(m, CheckpointRegion)]
        assert len(regions) == 2 and all(r.selective == (mode == "selective") for r in regions)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0.0)
    pm, _ = _train(pins={"recompute": "none"})
    assert not pm.plan.recompute
    # {module: mode}: as given; a selective module keeps the planner's nodes too (not the pass's default)
    pm, losses = _train(pins={"recompute": {"layers.1": "selective"}})
    assert pm.plan.recompute == {"layers.1": "selective"}
    assert pm.plan.extra["recompute_save"]["layers.1"] == selective_keys_of("layers.1")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0.0)


def selective_keys_of(block: str) -> list[str]:
    """The node keys the joint planner keeps in `block` of gpt-tiny (`search.plan_selective`)."""
    from autopar.models import get
    from autopar.search.plan_cost import PlanCostModel
    from autopar.search.plan_selective import selective_keys

    spec = get("gpt-tiny")
    torch.manual_seed(0)
    x, _ = spec.example_batch(8, seq_len=16)
    return selective_keys(PlanCostModel(autopar.capture(spec.build(), x), "cpu-gloo", 1), block)
