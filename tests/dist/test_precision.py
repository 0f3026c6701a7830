"""Precision and offload through `autopar.parallelize` on a 2-rank gloo world: "bf16-mixed" under
ZeRO 0-3 and "fp16-mixed" (dynamic loss scaling) match one process running the same recipe by
hand; offload trains to the same numbers; the engine holds the bytes the cost model predicts
from the same Plan fields; a pure precision that does not match the model is refused.

The hand-written recipe per step: every rank's half of the batch through a 16-bit copy of the
fp32 masters (inputs cast to 16 bits, loss on the 16-bit output), its 16-bit gradients cast
to fp32 and averaged over the two halves (the fp32 gradient reduction), fp32 AdamW on the
masters. fp16 multiplies the fp32 loss by the scale S = 2**16 before its backward (as
torch.amp.GradScaler does) and divides the gradients by it in fp32.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

import autopar
from autopar.capture import capture
from autopar.cost import estimate
from harness import world

WS, BATCH, STEPS, LR = 2, 8, 3, 1e-2
# The distributed run and the hand recipe do the same 16-bit forward/backward on the same
# halves and the same fp32 average ((g0 + g1) / 2 is exact in either order) and AdamW, so
# they agree to fp32 rounding; the tolerances leave room for a different 16-bit GEMM
# blocking between the exported graph and eager: parameters 1e-5 abs / 1e-4 rel after three
# steps (0.1% of one step's move at lr 1e-2), losses to one bf16 ulp at their scale.
P_RTOL, P_ATOL, LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5, 8e-3, 1e-3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _loss(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)) for _ in range(STEPS)]


def _by_hand(dtype: torch.dtype, scale: float = 1.0):
    """One process, the mixed recipe written out (see the module docstring)."""
    masters = _model()
    opt = torch.optim.AdamW(masters.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        low = copy.deepcopy(masters).to(dtype)
        halves = []
        for r in range(WS):
            rows = slice(r * BATCH // WS, (r + 1) * BATCH // WS)
            out = low(x[rows].to(dtype))
            loss = _loss(out, y[rows])
            (loss * scale).backward()  # fp16: the fp32 loss scaled, as the program does
            halves.append(loss.detach().float())
            for m, p in zip(masters.parameters(), low.parameters()):
                g = p.grad.float() / scale
                m.grad = g if m.grad is None else m.grad + g
            low.zero_grad()
        for m in masters.parameters():
            m.grad /= WS
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(halves).mean())
    return torch.stack(losses), {k: v.detach().clone() for k, v in masters.named_parameters()}


def _train(rank, ws, precision, zero, offload=False):
    pm = autopar.parallelize(_model(), autopar.mesh(dp=ws), example_inputs=torch.zeros(BATCH, 16),
                             zero_stage=zero, precision=precision, offload=offload)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    losses = []
    for x, y in _batches():
        losses.append(pm.step((x, y), _loss).detach().float())
        opt.step()
        opt.zero_grad()
    full = pm.engine.gather_full_state_dict()
    return pm, torch.stack(losses), full


def _states(engine) -> dict[str, int]:
    got = engine.memory_bytes()
    return {"params": got["params"], "optimizer": got["optimizer"]}


def _precision_world(rank, ws):
    out = {"pm_dtypes": {}, "memory": {}, "predicted": {}}
    for zero in (0, 1, 2, 3):
        pm, losses, full = _train(rank, ws, "bf16-mixed", zero)
        out[("bf16-mixed", zero)] = (losses, full)
        out["pm_dtypes"][zero] = sorted({str(p.dtype) for p in pm.program.module.parameters()})
        out["fields"] = (pm.plan.param_dtype, pm.plan.master_dtype, pm.plan.reduce_dtype, pm.plan.optim_dtype)
        # what the engine holds against what the cost model predicts from the same Plan
        # (model states do not depend on the batch; the engine counts masters as optimizer state)
        pred = estimate(capture(_model(), (torch.zeros(BATCH // ws, 16),)), pm.plan, "cpu-gloo").memory
        out["memory"][zero] = _states(pm.engine)
        out["predicted"][zero] = {"params": pred["params"], "optimizer": pred["master"] + pred["optimizer"]}
        if zero in (1, 3):
            _, losses_off, full_off = _train(rank, ws, "bf16-mixed", zero, offload=True)
            out[("offload", zero)] = (losses_off, full_off)
    pm, losses, full = _train(rank, ws, "fp16-mixed", 2)
    out["fp16"] = (losses, full, pm.engine.loss_scale, pm.engine.last_step_skipped)
    # a bf16 model without a precision trains bf16-mixed (fp32 masters); precision="bf16" keeps it pure
    for asked in (None, "bf16"):
        pm = autopar.parallelize(_model().to(torch.bfloat16), autopar.mesh(dp=ws),
                                 example_inputs=torch.zeros(BATCH, 16, dtype=torch.bfloat16), precision=asked)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        x, y = _batches()[0]
        loss = float(pm.step((x.to(torch.bfloat16), y), _loss))
        opt.step()
        masters = sorted({str(t.dtype) for g in opt.param_groups for t in g["params"]})
        out[("bf16 model", asked)] = ((pm.plan.param_dtype, pm.plan.master_dtype), masters, loss)
    try:
        autopar.parallelize(_model(), autopar.mesh(dp=ws), example_inputs=torch.zeros(BATCH, 16), precision="bf16")
    except ValueError as e:
        out["pure_error"] = str(e)
    return out


def test_bf16_mixed_under_every_zero_stage_and_fp16_mixed_match_the_hand_written_recipe_and_offload_changes_nothing():
    results = world(WS, _precision_world)
    ref_losses, ref_params = _by_hand(torch.bfloat16)
    ref16_losses, ref16_params = _by_hand(torch.float16, scale=2.0**16)
    for rank, res in enumerate(results):
        assert res["fields"] == ("bf16", "fp32", "fp32", "fp32")
        for zero in (0, 1, 2, 3):
            if zero < 3:  # stage 3's module holds the fp32 master rows; it gathers bf16 copies per unit
                assert res["pm_dtypes"][zero] == ["torch.bfloat16"], (rank, zero)
            losses, full = res[("bf16-mixed", zero)]
            torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL)
            assert {k: v.dtype for k, v in full.items()} == {k: torch.float32 for k in ref_params}
            torch.testing.assert_close(full, ref_params, rtol=P_RTOL, atol=P_ATOL, msg=lambda m: f"zero {zero}: {m}")
            assert res["memory"][zero] == res["predicted"][zero], (rank, zero)
        for zero in (1, 3):  # offload: the same arithmetic on CPU copies, so the same bits
            torch.testing.assert_close(res[("offload", zero)][0], res[("bf16-mixed", zero)][0], rtol=0, atol=0)
            torch.testing.assert_close(res[("offload", zero)][1], res[("bf16-mixed", zero)][1], rtol=0, atol=0)
        losses, full, scale, skipped = res["fp16"]
        assert scale == 2.0**16 and not skipped
        torch.testing.assert_close(losses, ref16_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL)
        torch.testing.assert_close(full, ref16_params, rtol=P_RTOL, atol=P_ATOL)
        fields, masters, loss = res[("bf16 model", None)]
        assert fields == ("bf16", "fp32") and masters == ["torch.float32"] and loss == loss, (fields, masters, loss)
        fields, masters, loss = res[("bf16 model", "bf16")]
        assert fields == ("bf16", None) and masters == ["torch.bfloat16"] and loss == loss, (fields, masters, loss)
        assert "param_dtype 'bf16'" in res["pure_error"] and "'bf16-mixed'" in res["pure_error"]
