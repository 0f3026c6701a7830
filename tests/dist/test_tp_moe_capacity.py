"""The reference MoE with a capacity (moe-tiny-capacity: C = min(N, ceil(cf * N * K / E)), a
size torch's symbolic shapes print as `Min(32*s0, CeilToInt(FloatTrueDiv(...)))`) trains on
tp = 2 as one process does.

The sharding ILP used to fail on that size expression (sympy could not evaluate torch's
function names: TypeError), so the planner skipped tp for this model; `search.sym_size` now
evaluates it. Here the tp search runs for h100-sxm (where it shards: on cpu-gloo a model this
small stays replicated), the plan is checked to shard parameters on tp, and a 2-rank gloo world
trains three AdamW steps in fp64 against one process on the same batches: every parameter (tp
pieces concatenated along their sharded dim) to 1e-9 absolute and relative (fp64: the tp
all-reduces change the order of sums only in the last bits), every step's loss to
MOE_LOSS_TOL = 1e-6 (the model's router softmax stays fp32 and its load-balancing term is in the
loss: one fp32 ulp at 4.9 is 4.8e-7; measured here: 7.5e-9), replicated parameters equal on both
tp ranks bit for bit.
"""
import torch

import autopar
from autopar.models import get
from harness import capture_before_fork, world

NAME, BATCH, STEPS, LR, TOL = "moe-tiny-capacity", 8, 3, 1e-2, 1e-9
MOE_LOSS_TOL = 1e-6  # the loss carries the fp32 router's load-balancing term


def _model():
    torch.manual_seed(0)
    spec = get(NAME)
    return spec.build().double(), spec


def _batches(spec):
    g = torch.Generator().manual_seed(1)
    return [spec.example_batch(BATCH, generator=g) for _ in range(STEPS)]


def _one_process():
    model, spec = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for (x,), y in _batches(spec):
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _tp2(rank, ws):
    model, spec = _model()
    batches = _batches(spec)
    pm = autopar.parallelize(model, autopar.mesh(tp=ws), example_inputs=batches[0][0][0], hardware="h100-sxm")
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    losses = []
    for (x,), y in batches:
        losses.append(pm.step((x, y), spec.loss_fn).item())
        opt.step()
        opt.zero_grad()
    tp = {k: str(lay["tp"]) for k, lay in pm.plan.param_layouts.items() if "tp" in dict(lay.axes)}
    skipped = [n for n in pm.plan.notes if "skipped" in n and "tp" in n]
    params = {k: v.detach().clone() for k, v in pm.program.module.named_parameters()}
    return losses, params, tp, skipped, bool(pm.plan.strategies.get("tp"))


def test_tp2_moe_with_capacity_matches_one_process_in_fp64_after_three_adamw_steps():
    capture_before_fork(_model()[0], _batches(_model()[1])[0][0][0])
    ref_losses, ref_params = _one_process()
    results = world(2, _tp2)
    tp = results[0][2]
    assert results[0][4], "no tp strategies in the plan"
    assert not results[0][3], results[0][3]
    sharded = sorted(k for k, p in tp.items() if p.startswith("S("))
    assert sharded, f"the tp search sharded no parameter: {tp}"
    for losses, *_ in results:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=0, atol=MOE_LOSS_TOL)
    for key, ref in ref_params.items():
        place = tp.get(key, "R")
        pieces = [r[1][key] for r in results]
        got = torch.cat(pieces, dim=int(place[2:-1])) if place.startswith("S(") else pieces[0]
        if not place.startswith("S("):
            torch.testing.assert_close(pieces[1], pieces[0], rtol=0, atol=0, msg=lambda m: f"{key} differs on tp: {m}")
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg=lambda m: f"{key} ({place}): {m}")
