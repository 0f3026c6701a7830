"""Fixes found by real-size MoE planning (benchmarks/bench_moe_scale.py).

* Speed: gradient buckets grouped in runs of equal buckets (`plan_comm.buckets`) are the same
  buckets as those formed one at a time (the data-parallel sync is priced from them).
* Memory: the gradient of a view of a parameter (the transposed expert weights that a grouped
  matmul reads) is the parameter's gradient, not one more buffer: the liveness walk's peak of
  a small MoE whose expert weights dominate matches the CPU allocations torch.profiler records
  (before the fix the walk counted one expert weight's gradient twice: 32 % over).
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from autopar.search.plan_comm import buckets as _buckets

sys.path.insert(0, os.path.dirname(__file__))

MB = 2**20


def one_at_a_time(ready, caps):
    """The bucketing as the runtime forms it, one bucket per yield (the specification)."""
    cap = caps[0]
    cur_t, cur_p, cur_g = 0.0, 0.0, 0.0
    for when, p, g in ready:
        if p <= 0:
            continue
        while p > 0:
            room = cap - cur_p
            take = min(p, room) if cur_p > 0 or p <= cap else cap
            frac = take / p
            cur_p += take
            cur_g += g * frac
            cur_t = when
            p -= take
            g -= g * frac
            if cur_p >= cap * (1 - 1e-12):
                yield cur_t, cur_p, cur_g
                cur_p = cur_g = 0.0
                cap = caps[1]
    if cur_p > 0:
        yield cur_t, cur_p, cur_g


def expand(runs):
    return [(t, p, g) for t, p, g, n in runs for _ in range(n)]


def units(seed: int, n: int = 40):
    """Backward-ordered units: small ones (norms), bucket-sized ones, and MoE layers of hundreds
    of buckets' worth, some without a gather payload."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.uniform(0.0, 1e-3)
        p = rng.choice([rng.uniform(0, 2) * MB, rng.uniform(10, 60) * MB, rng.uniform(1e3, 5e3) * MB, 0.0])
        out.append((t, p, p * rng.choice([0.0, 0.5, 1.0])))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caps", [(1 * MB, 25 * MB), (25 * MB, 25 * MB), (4 * MB, 7.5 * MB)])
def test_bucket_runs_expand_to_the_buckets_formed_one_at_a_time(seed, caps):
    ready = units(seed)
    got, want = expand(_buckets(ready, caps)), list(one_at_a_time(ready, caps))
    assert len(got) == len(want)
    for (t1, p1, g1), (t2, p2, g2) in zip(got, want):
        assert t1 == t2
        assert p1 == pytest.approx(p2, rel=1e-9, abs=1e-3)
        assert g1 == pytest.approx(g2, rel=1e-9, abs=1e-3)


def test_a_unit_of_many_buckets_is_one_run_not_one_yield_per_bucket():
    caps = (1 * MB, 25 * MB)
    runs = list(_buckets([(0.0, 1 * MB, 0.0), (1.0, 25_000 * MB, 25_000 * MB)], caps))
    assert len(runs) <= 4
    assert sum(n for *_, n in runs) == 1 + 1000
    assert sum(p * n for _, p, _, n in runs) == pytest.approx(25_001 * MB)


def test_liveness_of_grouped_experts_counts_each_weight_gradient_once():
    transformers = pytest.importorskip("transformers")
    from cost_helpers import capture  # noqa: PLC0415
    from test_cost_peak import measured_peak  # noqa: PLC0415

    from autopar.cost import analyze, liveness  # noqa: PLC0415

    torch.manual_seed(0)
    # 64 experts of 64 x 64 x 3 weights, 16 tokens: the expert weights' gradients are the peak
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      moe_intermediate_size=64, num_experts=64, num_experts_per_tok=2,
                                      max_position_embeddings=64, use_cache=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).train()
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = capture(model, (x,))
    gc = analyze(gm, "cpu-gloo")
    live = liveness(gc, gc.values())
    peak, end = measured_peak(gm, (x,))
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    assert expert_bytes > 0.9 * end  # the experts' gradients are what is measured
    assert end == live.param_grads
    torch.testing.assert_close(float(live.peak - live.inputs), float(peak), rtol=0.02, atol=0)
