"""Parameter, gradient and optimizer-state bytes against the tensors torch really creates:
the parameters, their .grad after a backward, and the state dict of torch.optim after one
step (including Adam's per-parameter `step` scalar). Mixed precision keeps fp32 master
copies that the optimizer updates; ZeRO shards are built as torch.chunk pieces of dim 0 of
each parameter (the runtime ZeRO engine's convention, checked against its `shard_info`; the
engine's own `memory_bytes()` is compared in tests/dist/test_cost_counter.py) and stepped by
a real optimizer, one rank at a time.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from cost_helpers import captured, float_outputs  # noqa: E402

from autopar.cost import analyze, model_states, params_of  # noqa: E402


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nbytes([v]) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def _train_step(model, args, opt):
    sum(o.float().sum() for o in float_outputs(model(*args))).backward()
    opt.step()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
}


@pytest.mark.parametrize("name", ["gpt-tiny-tied", "moe-tiny", "hf-llama"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_states_equal_the_tensors_after_an_optimizer_step(name, opt_name):
    model, args, gm = captured(name)
    params = [p for p in gm.parameters()]  # the captured module's own parameters (tied: once)
    opt = OPTIMIZERS[opt_name](params)
    _train_step(gm, args, opt)
    got = model_states(analyze(gm, "cpu-gloo").params, opt)
    assert got.params == _nbytes(params)
    assert got.grads == _nbytes(p.grad for p in params if p.grad is not None)
    assert got.optimizer == _state_bytes(opt)
    assert got.buffers == _nbytes(gm.buffers())
    assert got.master == 0
    assert model_states(params_of(gm), opt).to_dict() == got.to_dict()
    opt.zero_grad(set_to_none=True)


def test_mixed_precision_counts_bf16_params_and_grads_and_fp32_master_and_states():
    model, args, gm = captured("gpt-tiny", torch.bfloat16)
    params = list(gm.parameters())
    master = [p.detach().float().requires_grad_() for p in params]  # fp32 master weights
    opt = torch.optim.AdamW(master, lr=1e-3)
    sum(o.float().sum() for o in float_outputs(gm(*args))).backward()
    for m, p in zip(master, params):
        m.grad = p.grad.float()
    opt.step()
    got = model_states(analyze(gm, "cpu-gloo").params, "adamw", master_dtype=torch.float32)
    assert got.params == _nbytes(params) and got.grads == _nbytes(p.grad for p in params)
    assert got.master == _nbytes(master)
    assert got.optimizer == _state_bytes(opt)
    assert got.total == _nbytes(params) + _nbytes(p.grad for p in params) + _nbytes(master) + _state_bytes(opt) \
        + _nbytes(gm.buffers())
    gm.zero_grad(set_to_none=True)


def _rows_piece(p: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s torch.chunk piece of dim 0 (a 0-d tensor is one row), empty past the end."""
    chunks = torch.chunk(p.detach().reshape(-1) if p.dim() == 0 else p.detach(), dp, dim=0)
    return chunks[rank] if rank < len(chunks) else p.detach().reshape(-1, *p.shape[1:])[:0]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [3, 5])
def test_zero_shards_equal_the_dim0_rows_each_rank_keeps(stage, dp):
    # as runtime.zero shards (and FSDP2): rows of dim 0, torch.chunk convention. gpt-tiny's
    # dim-0 sizes (128, 64, 32) divide by neither 3 nor 5: the last ranks' pieces are short
    _, _, gm = captured("gpt-tiny")
    infos = analyze(gm, "cpu-gloo").params
    params = list(gm.parameters())
    for rank in range(dp):
        shards = [torch.nn.Parameter(_rows_piece(p, dp, rank).clone()) for p in params]
        for s in shards:
            s.grad = torch.ones_like(s)
        opt = torch.optim.AdamW(shards, lr=1e-3)  # every master, empty ones too, as the engine does
        opt.step()
        got = model_states(infos, "adamw", zero_stage=stage, dp=dp, rank=rank)
        full_params = _nbytes(params)
        assert got.optimizer == _state_bytes(opt), rank
        assert got.grads == (_nbytes(s.grad for s in shards) if stage >= 2 else full_params)
        assert got.params == (_nbytes(shards) if stage == 3 else full_params)
    # the pieces add up to the model over the ranks: nothing padded, nothing lost
    per_rank = [model_states(infos, "adamw", zero_stage=3, dp=dp, rank=r).params for r in range(dp)]
    assert sum(per_rank) == _nbytes(params) and len(set(per_rank)) > 1


def test_uneven_dim0_follows_the_zero_engine_not_the_flattened_tensor():
    # a (5, 3) weight over 4 ranks: rows 2, 2, 1, 0, so 6, 6, 3, 0 elements (the engine's
    # ShardInfo); a split of the 15 flattened elements would give 4, 4, 4, 3. A 0-d parameter
    # is one row, held by rank 0. Empty pieces still get AdamW's step scalar (the engine hands
    # the optimizer every master).
    from autopar.cost.graph import ParamInfo
    from autopar.cost.memory import padded_numel, row_shard_numel
    from autopar.runtime.zero_shard import FlatLayout, shard_info

    shapes = {"w": (5, 3), "b": (3,), "scale": (), "big": (10, 2, 5)}
    infos = [ParamInfo(n, int(torch.Size(s).numel()), torch.float32, True, False, None, 0, "", s)
             for n, s in shapes.items()]
    for dp in (2, 3, 4):
        for rank in range(dp):
            runtime = [shard_info(n, s, dp, rank) for n, s in shapes.items()]
            for info, (n, s) in zip(runtime, shapes.items()):
                assert row_shard_numel(s, dp, rank) == info.local_numel, (n, dp, rank)
                assert padded_numel(s, dp) == info.padded_numel, (n, dp)
            assert sum(padded_numel(s, dp) for s in shapes.values()) == FlatLayout(runtime, dp).S
            got = model_states(infos, "adamw", zero_stage=3, dp=dp, rank=rank)
            mine = sum(i.local_numel for i in runtime)
            assert (got.params, got.grads) == (4 * mine, 4 * mine)
            assert got.optimizer == 2 * 4 * mine + 4 * len(shapes)
    assert [row_shard_numel((5, 3), 4, r) for r in range(4)] == [6, 6, 3, 0]
    assert [row_shard_numel((3,), 4, r) for r in range(4)] == [1, 1, 1, 0]
    assert [row_shard_numel((), 2, r) for r in range(2)] == [1, 0]


def test_zero_divides_states_as_the_zero_paper_says_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020): 2 + 2 + 12 bytes per parameter with fp16 weights, fp32
    # master, momentum and variance; stage 1 divides the 12, stage 2 also the gradients' 2,
    # stage 3 everything. Checked on one large parameter (chunking is exact there).
    from autopar.cost.graph import ParamInfo

    n, dp = 1 << 20, 8
    p = [ParamInfo("w", n, torch.bfloat16, True, False, None, 0, "", (n,))]
    per = {s: model_states(p, "adamw", zero_stage=s, dp=dp, master_dtype=torch.float32) for s in range(4)}
    step = 4  # Adam's step scalar
    assert per[0].total == 16 * n + step
    assert per[1].total == 2 * n + 2 * n + 12 * n // dp + step
    assert per[2].total == 2 * n + (2 + 12) * n // dp + step
    assert per[3].total == 16 * n // dp + step
