"""ZeRO over one data-parallel rank (autopar/build/program.py, runtime/program.py
`shard_one_rank`): nothing is sharded, so `parallelize` runs the plain engine, as
`cost.estimate` prices dp = 1, and says so in the plan's notes; offloading keeps its ZeRO-3
engine (it holds no parameter on the device at rest). On one H100 the ZeRO-3 engine at world 1
took 148-153 ms a step against 116-123 for the plain one, its gathers being copies
(benchmarks/RESULTS.md, 2026-11-26)."""
from __future__ import annotations

import torch

import autopar
from autopar.models import get


def _train(**kw):
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    g = torch.Generator().manual_seed(1)
    batches = [spec.example_batch(8, seq_len=16, generator=g) for _ in range(3)]
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=batches[0][0], **kw)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    losses = []
    for b in batches:
        losses.append(float(pm.step(b, spec.loss_fn)))
        opt.step()
        opt.zero_grad()
    return pm, losses


def test_zero_stages_over_one_data_parallel_rank_run_the_plain_engine_and_say_so():
    plain, want = _train(zero_stage=0)
    assert type(plain.program.engine).__name__ == "DataParallelEngine"
    for stage in (1, 2, 3):
        pm, losses = _train(zero_stage=stage)
        assert pm.plan.zero_stage == stage and pm.program.zero_stage == 0
        assert type(pm.program.engine).__name__ == "DataParallelEngine"
        assert any(n.startswith(f"zero_stage={stage} over one data-parallel rank") for n in pm.plan.notes)
        assert losses == want  # the same program: bit-equal losses over three AdamW steps


def test_offload_keeps_the_zero3_engine_on_one_rank():
    pm, _ = _train(zero_stage=3, offload=True)
    assert pm.program.zero_stage == 3 and type(pm.program.engine).__name__ == "ShardedEngine"
    assert not any("over one data-parallel rank" in n for n in pm.plan.notes)
