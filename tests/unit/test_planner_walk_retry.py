"""A pipeline split whose per-unit memory fits but whose walk (estimate's, the truth) is over
the limit is costed again with the limit lowered by the difference, so that recompute frees it
(`PlanCostModel._evaluate`, walk_retry). The retried plan is then judged by its walk against the
real limit: one that fits is timed, not returned as "over the memory limit" because its walk is
over the lowered limit, which only steered the recompute choice. (Found on the Megatron 530B row
under zbv with the vocab-parallel loss: selective 42.3 s, was priced infinite.)

The walk is made to exceed the per-unit model by a fixed amount (`pipeline_rank_peaks` wrapped:
what the walk adds in the real case is the stage's working set the per-unit model leaves out).
"""
from __future__ import annotations

import math

import torch

import autopar.search.plan_cost as PC
from autopar.capture import capture
from autopar.cost import load_profile
from autopar.models import GPT, GPTConfig
from autopar.search.candidate import Candidate


def test_a_retried_split_that_fits_its_walk_under_the_real_limit_is_timed(monkeypatch):
    cfg = GPTConfig(vocab_size=8192, dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=4096, max_seq_len=1024)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    gm = capture(model, (torch.empty(2, 1024, dtype=torch.long, device="meta"),))
    model = PC.PlanCostModel(gm, load_profile("h100-sxm"), 2, global_batch=16)
    c = Candidate(tp=1, pp=2, dp=1, zero=0, micro=8, schedule="1f1b")
    free = model.evaluate(c, PC.INF, recompute="none")
    whole = model.evaluate(c, PC.INF, recompute="full")
    assert whole.peak_bytes < free.peak_bytes
    gap = free.peak_bytes - whole.peak_bytes
    limit = whole.peak_bytes + 0.5 * gap  # recompute needed, some of it
    delta = 0.3 * gap  # what the walk adds over the per-unit model here

    real = PC.pipeline_rank_peaks
    monkeypatch.setattr(PC, "pipeline_rank_peaks", lambda *a, **k: [x + delta for x in real(*a, **k)])
    ev = model.evaluate(c, limit, recompute="auto")  # the walk over: retried with a lower limit
    assert math.isfinite(ev.step_s) and ev.feasible and ev.recompute, (ev.step_s, ev.notes)
    assert ev.peak_bytes <= limit * (1 + 1e-9) and ev.limit_bytes == limit
    # the retry itself, at lowered limits across the range: its walk is judged against the real
    # limit (lowered + delta). Where the walk lands between the two it is timed, not refused.
    between = 0
    for i in range(1, 16):
        lowered = whole.peak_bytes + gap * i / 16
        r = model._evaluate(c, lowered, "full", pins=(), recompute="auto", minimise="time", cutoff=None,
                            memory_only=False, walk_retry=False, walk_limit=lowered + delta)
        if r.peak_bytes <= (lowered + delta) * (1 + 1e-9):
            assert math.isfinite(r.step_s), (i, r.notes)
            between += r.peak_bytes > lowered * (1 + 1e-9)
    assert between  # some retries land over the lowered limit and under the real one: those the fix times
