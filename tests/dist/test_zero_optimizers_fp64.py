"""ZeRO 0-3 on 2 gloo ranks: what a plain torch optimizer may step, and fp64 models.

One world runs every check; per ZeRO stage it parallelizes an MLP with uneven rows (33 and
5 rows over 2 ranks) three times:

* fp64, `torch.optim.AdamW(pm.parameters())`, 2 micro-batches: losses of 2 steps, the
  gradients after the first backward (this rank's rows of every master) and the parameters
  after 2 steps (gathered) match one fp64 process; gradients, masters and the module's
  parameters stay fp64. Tolerances: rtol 1e-10, atol 1e-12 for all three (measured error
  ~1e-16; fp32 rounding anywhere gives ~1e-8 and fails).
* fp64, `autopar.optimizer(pm, AdamW)`: the same parity through the ZeRO-aware optimizer.
* fp32, an AdamW built over the original model's parameters: stage 0 trains them (they are
  the program's parameters) and matches one process (rtol 1e-5, atol 1e-6); stages 1-3
  raise ValueError at the first `step()`, before any parameter changes, with a message that
  names a parameter and says to use `autopar.optimizer(pm, ...)` or `pm.parameters()`.
"""
import copy

import pytest
import torch
from torch.testing import assert_close

import autopar
from autopar.models import MLP, MLPConfig
from autopar.models.mlp import loss_fn
from autopar.runtime import collectives as C
from autopar.runtime.mesh import make_mesh
from harness import world

CFG = MLPConfig(dim=12, hidden=33, n_layers=2, n_classes=5)
GLOBAL_BATCH, STEPS, LR = 8, 2, 1e-2
FP64_TOL = dict(rtol=1e-10, atol=1e-12)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def _warm_custom_ops():
    # pay the first custom-op call's import of torch's compiler stack once, before forking
    C.set_active_mesh(make_mesh(dp=1), rank=0)
    torch.ops.autopar.split(torch.ones(2), "dp", 0)
    C.set_active_mesh(None)


_warm_custom_ops()


def batches(dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, CFG.dim, generator=g).to(dtype),
             torch.randint(0, CFG.n_classes, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def build(dtype):
    torch.manual_seed(0)
    return MLP(CFG).to(dtype)


def reference(dtype):
    """One process, the whole batch: losses, gradients of the first backward, final params."""
    model, data = build(dtype), batches(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], None
    for s, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y)
        loss.backward()
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads0, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fp64_run(zero: int, plain: bool) -> dict:
    data = batches(torch.float64)
    pm = autopar.parallelize(build(torch.float64), autopar.mesh(dp=2), example_inputs=(data[0][0],),
                             zero_stage=zero, n_microbatches=2)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR) if plain else autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    losses, rows0 = [], None
    for s, batch in enumerate(data):
        losses.append(pm.step(batch, loss_fn).detach())
        if s == 0:
            rows0 = {n: (info.start, info.end, m.grad.detach().clone()) for n, info, m in pm.engine.named_shards()}
        opt.step()
        opt.zero_grad()
    dtypes = {"grads": {str(r[2].dtype) for r in rows0.values()},
              "masters": {str(p.dtype) for p in pm.parameters()},
              "module": {str(p.dtype) for p in pm.program.module.parameters()}}
    return {"losses": losses, "rows0": rows0, "params": pm.engine.gather_full_state_dict(), "dtypes": dtypes,
            "names": sorted(n for n, _ in pm.named_parameters()),
            "local_numel": sum(p.numel() for p in pm.parameters())}


def _misuse_run(zero: int) -> dict:
    data = batches(torch.float32)
    model = build(torch.float32)
    pm = autopar.parallelize(model, autopar.mesh(dp=2), example_inputs=(data[0][0],), zero_stage=zero)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # the original module's, not pm.parameters()
    out: dict = {"error": None}
    for s, batch in enumerate(data):
        pm.step(batch, loss_fn)
        before = pm.engine.gather_full_state_dict()
        try:
            opt.step()
        except ValueError as e:
            out.update(error=str(e), at_step=s, unchanged=all(torch.equal(before[k], v)
                                                                for k, v in pm.engine.gather_full_state_dict().items()))
            return out
        opt.zero_grad()
    out["params"] = pm.engine.gather_full_state_dict()
    return out


def _rank(rank, ws):
    return {z: {"plain": _fp64_run(z, plain=True), "autopar": _fp64_run(z, plain=False), "misuse": _misuse_run(z)}
            for z in range(4)}


@pytest.fixture(scope="module")
def runs():
    return world(2, _rank, timeout_s=300)


def _check_fp64(got: dict, ref) -> None:
    ref_losses, ref_grads, ref_params = ref
    for a, b in zip(got["losses"], ref_losses):
        assert a.dtype == torch.float64
        assert_close(a, b, **FP64_TOL)
    for name, (start, end, rows) in got["rows0"].items():
        assert_close(rows.reshape(-1), ref_grads[name][start:end].reshape(-1), **FP64_TOL)
    for name, p in ref_params.items():
        assert_close(got["params"][name], p, **FP64_TOL)
    assert got["dtypes"] == {"grads": {"torch.float64"}, "masters": {"torch.float64"}, "module": {"torch.float64"}}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_fp64_mlp_keeps_fp64_and_matches_one_fp64_process_under_zero_stage(runs, zero):
    ref = reference(torch.float64)
    for rank in range(2):
        _check_fp64(runs[rank][zero]["autopar"], ref)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_plain_adamw_over_pm_parameters_trains_like_one_process_under_zero_stage(runs, zero):
    ref = reference(torch.float64)
    names = sorted(n for n, _ in build(torch.float32).named_parameters())
    full = sum(p.numel() for p in build(torch.float32).parameters())
    for rank in range(2):
        got = runs[rank][zero]["plain"]
        _check_fp64(got, ref)
        assert got["names"] == names
    local = [runs[r][zero]["plain"]["local_numel"] for r in range(2)]
    # pm.parameters() is what this rank trains: everything at stage 0, its rows at 1-3
    if zero == 0:
        assert local == [full, full]
    else:
        assert sum(local) == full and min(local) < full, local


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_optimizer_over_the_original_modules_parameters_is_refused_at_its_first_step(runs, zero):
    for rank in range(2):
        got = runs[rank][zero]["misuse"]
        if zero == 0:  # the program trains the module's own parameters: allowed, and it trains
            assert got["error"] is None
            for name, p in reference(torch.float32)[2].items():
                assert_close(got["params"][name], p, **FP32_TOL)
            continue
        msg = got["error"]
        assert msg is not None and got["at_step"] == 0 and got["unchanged"], got
        assert "torch.optim.AdamW was built over 6 tensor(s) that this autopar program does not train" in msg
        assert "'layers.0.fc.weight'" in msg and f"ZeRO-{zero}" in msg
        assert "autopar.optimizer(pm, torch.optim.AdamW, ...)" in msg
        assert "torch.optim.AdamW(pm.parameters(), ...)" in msg
