"""The build's stage search prices the plan's loss on the last stage (issue 22): under
`Plan.loss_parallel` with a vocab-sharded head the loss keeps one shard-sized buffer through
its backward (`cost.loss_memory.VOCAB_PARALLEL`), not cross-entropy's log-softmax and its
gradient beside the logits (`cost.memory.CROSS_ENTROPY`); `build.pipeline.choose_stages` passes
`cost.loss_memory.loss_model` of the plan to `search.stages.search_stages`.

gpt-tiny (global batch 8 x 32 tokens), the joint planner's tp2 x pp2 1F1B plan with loss_parallel
pinned, its split cleared and searched again by `choose_stages`: the last rank's memory is the
stage search's under VOCAB_PARALLEL, less than under CROSS_ENTROPY (measured 2026-11-26: 1.102
against 1.165 MiB); the first rank's is the same under both.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import build  # noqa: E402

import autopar  # noqa: E402
from autopar.build.pipeline import choose_stages  # noqa: E402
from autopar.cost import analyze, load_profile  # noqa: E402
from autopar.cost.loss_memory import VOCAB_PARALLEL, loss_model  # noqa: E402
from autopar.cost.memory import CROSS_ENTROPY  # noqa: E402
from autopar.search.candidate import candidates  # noqa: E402
from autopar.search.plan_write import write_plan  # noqa: E402
from autopar.search.planner import DEFAULT_HEADROOM, RUNTIME_SUPPORT, _Search  # noqa: E402
from autopar.search.stages import layer_costs, search_stages  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def test_the_stage_search_prices_the_vocab_parallel_loss_of_a_loss_parallel_plan():
    model, args = build("gpt-tiny", batch=8, seq=32)
    gm = autopar.capture(model, args)
    hw = load_profile("cpu-gloo")
    s = _Search(gm, hw, 4, {"loss_parallel": True}, DEFAULT_HEADROOM * hw.device.memory_bytes, None, 1, "adamw",
                dict(RUNTIME_SUPPORT), None)
    c = next(c for c in candidates(s.model, 4, s.pins, s.support)
             if c.tp == 2 and c.pp == 2 and c.schedule == "1f1b" and c.micro == 4)
    ev = s._evaluate(c)
    plan = write_plan(s, ev, s._report(ev, [ev], 0.0))
    gc = analyze(gm, hw)
    assert plan.loss_parallel and loss_model(gc, plan) == VOCAB_PARALLEL
    plan.split_points = []
    res = choose_stages(gm, plan, SimpleNamespace(device_type="cpu"), hardware=hw)
    chain = layer_costs(gm, hw, gc=gc, microbatch=8 // plan.n_microbatches, zero_stage=plan.zero_stage, dp=plan.dp)
    kw = dict(schedule="1f1b", n_microbatches=plan.n_microbatches, hardware=hw, mesh=plan.mesh, memory_limit=None)
    vp = search_stages(chain, 2, loss=VOCAB_PARALLEL, **kw)
    ce = search_stages(chain, 2, loss=CROSS_ENTROPY, **kw)
    assert res.split_points == vp.split_points
    assert res.rank_memory == vp.rank_memory
    assert vp.rank_memory[0] == ce.rank_memory[0] and vp.rank_memory[1] < ce.rank_memory[1], (vp.rank_memory,
                                                                                            ce.rank_memory)
