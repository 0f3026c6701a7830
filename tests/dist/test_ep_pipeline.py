"""Expert parallelism inside pipeline stages (pp x ep) through `autopar.parallelize`, and the
MoE router statistics on the pipeline path, against one process, in one gloo world of 4 ranks.

The model is moe-tiny (models/moe.py: two MoE blocks of 4 experts, top-2, dropless) with its
load-balancing loss on (aux_loss_coef 0.01). Checks, every rank comparing its own stages by the
model's parameter names:

* pp=2 x ep=2, 1F1B, one micro-batch: losses of 3 AdamW steps, the global gradient norm of the
  first step (`engine.clip_grad_norm_`: every expert counted once), every parameter after the
  steps (each ep rank holds only its 2 of the 4 experts of its stage's block), the stage graphs
  dispatch tokens (`moe.dispatch`), and `evaluate` gives the one-process loss.
* the same model trained on for 3 more steps with 2 micro-batches; pp=2 x ep=2 under the ZBV
  schedule (2 stages a rank, input and weight gradients apart) with 2 micro-batches; and
  moe-tiny-capacity (capacity factor 1: assignments dropped) under 1F1B with 2 micro-batches.
  The router statistics (and the capacity drops) are the ep group's *per micro-batch*
  (`moe_aux_stats="micro_batch"`, Megatron's recipe; the default "global" refuses micro-batches
  for this model), so the reference process computes the loss per micro-batch on the
  rows the ep group holds in it (micro-batch i = the i-th slice of every ep rank's piece of the
  batch) and averages over micro-batches.
* dp=2 x pp=2 without ep: the router statistics are averaged over dp on the pipeline path, so
  the loss is the global batch's (per dp rank, the first loss differs by ~1e-5 and the
  parameters by more).

Tolerances: fp32 (the router's softmax is fp32 in the model, so fp64 would not be uniform),
losses, norm and parameters rtol 0, atol 1e-5; AdamW lr 1e-3, eps 1e-6 (as
tests/dist/test_pipeline_parallelize.py: the default eps turns rounding noise on a near-zero
gradient into an lr-sized step).
"""
from __future__ import annotations

import scipy.optimize  # noqa: F401  (imported once here: the forked ranks start with it)
import torch

import autopar
from autopar.models import get
from harness import world

ADAMW = dict(lr=1e-3, eps=1e-6)
TOL = dict(rtol=0, atol=1e-5)
BATCH, STEPS = 8, 3


def _batches(seed: int = 1):
    spec, g = get("moe-tiny"), torch.Generator().manual_seed(seed)
    return [spec.example_batch(BATCH, generator=g) for _ in range(2 * STEPS)]


def _groups(data: int, m: int) -> list[list[int]]:
    """Rows of the global batch in each micro-batch when `data` ranks split it, then each rank
    its piece into m micro-batches: micro-batch i holds the i-th slice of every rank's piece."""
    piece, k = BATCH // data, BATCH // data // m
    return [[r * piece + i * k + j for r in range(data) for j in range(k)] for i in range(m)]


def _reference(plan: list[list[list[int]]], name: str = "moe-tiny"):
    """One process: step t's loss is the mean over plan[t]'s row groups of the loss on that group.
    Returns (losses, grad norm of the first step, parameters after 3 steps and after all)."""
    spec = get(name)
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norm, after3 = [], None, None
    for t, ((x,), y) in enumerate(_batches()[:len(plan)]):
        loss = sum(spec.loss_fn(model(x[g]), y[g]) for g in plan[t]) / len(plan[t])
        loss.backward()
        if t == 0:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if t == STEPS - 1:
            after3 = {k: v.detach().clone() for k, v in model.named_parameters()}
    final = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, norm, after3, final


def _params(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters by the model's names (the stage index prefix dropped)."""
    return {k.split(".", 1)[1]: v.detach().clone() for k, v in pm.program.module.named_parameters()}


def _train(pm, steps, m, first_norm=False):
    spec = get("moe-tiny")
    if "_test_opt" not in pm.__dict__:  # one optimizer for the model's whole training
        pm.__dict__["_test_opt"] = autopar.optimizer(pm, torch.optim.AdamW, **ADAMW)
    opt = pm.__dict__["_test_opt"]
    losses, norm = [], None
    for x, y in steps:
        losses.append(pm.step((x, y), spec.loss_fn, n_microbatches=m).item())
        if first_norm and norm is None:
            norm = pm.engine.clip_grad_norm_(1e9)
        opt.step()
        opt.zero_grad()
    return losses, norm


def _build(mesh, name="moe-tiny", schedule=None, **kw):
    """`parallelize` on moe-tiny; fusions pinned off (their search is a third of a build here,
    and they are checked elsewhere)."""
    spec = get(name)
    torch.manual_seed(0)
    x0, _ = spec.example_batch(BATCH, generator=torch.Generator().manual_seed(1))
    pins = {"fusions": [], **({"schedule": schedule} if schedule else {})}
    kw.setdefault("moe_aux_stats", "micro_batch")  # router statistics per micro-batch (see the docstring)
    return autopar.parallelize(spec.build(), autopar.mesh(**mesh), example_inputs=x0, pins=pins, **kw)


def _rank(rank, ws):
    out = {}
    batches = _batches()
    # pp=2 x ep=2, 1F1B: one micro-batch, then two
    pm = _build({"pp": 2, "ep": 2})
    ep = pm.mesh.coords(rank)["ep"]
    mine = [s for s in pm.stage_graphs if next(iter(s.parameters())).device.type != "meta"]
    out["dispatches"] = sum(1 for s in mine for n in s.graph.nodes if "dispatch" in str(n.target))
    out["experts"] = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in _params(pm) if ".experts." in k})
    out["ep"] = ep
    out["one"] = _train(pm, batches[:STEPS], 1, first_norm=True) + (_params(pm),)
    out["two"] = _train(pm, batches[STEPS:], 2)[0], _params(pm)
    spec = get("moe-tiny")
    x, y = batches[0]
    pm.eval()
    out["eval"] = pm.evaluate((x, y), spec.loss_fn).item()
    # pp=2 x ep=2, ZBV: two stages per rank, two micro-batches
    pm = _build({"pp": 2, "ep": 2}, schedule="zbv", n_microbatches=2)
    out["zbv_stages"] = len(pm.program.stages), pm.plan.split_points
    out["zbv"] = _train(pm, batches[:STEPS], 2)[0], _params(pm)
    # pp=2 x ep=2, capacity mode: the drops of each micro-batch are the ep group's
    pm = _build({"pp": 2, "ep": 2}, name="moe-tiny-capacity", n_microbatches=2)
    out["capacity"] = _train(pm, batches[:STEPS], 2)[0], _params(pm)
    # dp=2 x pp=2, no ep: router statistics averaged over dp on the pipeline path
    pm = _build({"dp": 2, "pp": 2})
    out["dp_pp"] = _train(pm, batches[:STEPS], 1)[0], _params(pm)
    return out


def _close(got: dict, want: dict, what: str) -> None:
    assert got, f"{what}: no parameters on this rank"
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], **TOL, msg=lambda m, k=k: f"{what}, {k}: {m}")


def test_pp2_ep2_moe_matches_one_process_with_the_aux_loss_per_micro_batch_and_dp_pp_router_stats():
    # the capacity case must drop something, or it would not check the drops
    spec = get("moe-tiny-capacity")
    torch.manual_seed(0)
    (x,), _ = _batches()[0]
    assert spec.build().dropped_assignments(x[_groups(2, 2)[0]]).any()
    full = [[list(range(BATCH))]] * STEPS
    ref_losses, ref_norm, ref_after3, _ = _reference(full)
    ep_mb = _groups(2, 2)  # ep=2 ranks, 2 micro-batches
    ref_more, _, _, ref_more_final = _reference(full + [ep_mb] * STEPS)
    ref_zbv, _, _, ref_zbv_final = _reference([ep_mb] * STEPS)
    ref_cap, _, _, ref_cap_final = _reference([ep_mb] * STEPS, "moe-tiny-capacity")
    for name in ("moe-tiny", "moe-tiny-capacity"):  # captured once here: the forked ranks reuse the graphs
        torch.manual_seed(0)
        autopar.capture(get(name).build(), _batches()[0][0])
    ranks = world(4, _rank)
    for rank, out in enumerate(ranks):
        who = f"rank {rank}"
        assert out["dispatches"] > 0, f"{who}: no expert dispatch in this rank's stages"
        assert out["experts"] == [2 * out["ep"], 2 * out["ep"] + 1], f"{who}: holds experts {out['experts']}"
        losses, norm, params = out["one"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                                   msg=lambda m: f"{who}, pp2 x ep2 losses: {m}")
        torch.testing.assert_close(norm.reshape(()), ref_norm, **TOL, msg=lambda m: f"{who}, gradient norm: {m}")
        _close(params, ref_after3, f"{who}, pp2 x ep2 after 3 steps")
        losses, params = out["two"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_more[STEPS:]), **TOL,
                                   msg=lambda m: f"{who}, 2 micro-batches: {m}")
        _close(params, ref_more_final, f"{who}, pp2 x ep2 after 3 more steps on 2 micro-batches")
        assert out["zbv_stages"][0] == 2, f"{who}: zbv stages {out['zbv_stages']}"
        for case, ref, final in (("zbv", ref_zbv, ref_zbv_final), ("capacity", ref_cap, ref_cap_final)):
            losses, params = out[case]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), **TOL,
                                       msg=lambda m, case=case: f"{who}, {case}: {m}")
            _close(params, final, f"{who}, {case} pp2 x ep2")
        losses, params = out["dp_pp"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                                   msg=lambda m: f"{who}, dp2 x pp2: {m}")
        _close(params, ref_after3, f"{who}, dp2 x pp2")
    # the eval loss is the one-process loss of the model after its 6 steps on batch 0
    spec = get("moe-tiny")
    torch.manual_seed(0)
    model = spec.build()
    model.load_state_dict(ref_more_final)
    model.eval()
    (x,), y = _batches()[0]
    with torch.no_grad():
        want = spec.loss_fn(model(x), y).item()
    for rank, out in enumerate(ranks):
        assert abs(out["eval"] - want) <= TOL["atol"], f"rank {rank}: evaluate {out['eval']} vs one process {want}"
