"""parallelize with the joint planner's default search, on gloo, against one process.

* The reference GPT on 8 processes, planned for the cpu-gloo profile with a memory limit so
  small that no plan using one dimension fits (the test finds the largest such limit from
  the planner's own cost model, then checks it: every one-dimensional candidate, with its
  memory-minimising split and recompute, is over it): whatever multi-dimensional plan the
  search picks is carried out and must train like one process.
* The reference MoE on 4 processes with the default search and no memory limit (the planner
  picks expert parallelism when it helps: the expert pass then averages the load-balancing
  statistics over the batch axes, so the model keeps its aux loss; without an ep axis the
  batch-split aux loss is not the global one, and the variant without it is used, as the
  data-parallel tests do).

Parity: the loss of every step on every rank, and every parameter after three AdamW steps
(gathered over ZeRO, tp pieces concatenated along their sharded dim, each pipeline stage's
and expert's parameters from the rank that holds them). Tolerances as the tp and dp tests:
losses 1e-5 absolute, parameters 1e-4 (sharded sums change the order of additions, AdamW
amplifies ulps near zero gradients)."""
import dataclasses
import math

import torch

import autopar
from autopar.models import MoE, get
from autopar.models import moe as moe_mod
from autopar.search.plan_cost import Candidate, PlanCostModel
from autopar.search.planner import RUNTIME_SUPPORT, candidates, clear_cache, plan_for
from harness import capture_before_fork, world

LOSS_ATOL, PARAM_TOL, BATCH, STEPS = 1e-5, 1e-4, 8, 3


def _build(name):
    torch.manual_seed(0)
    if name == "moe-tiny-noaux":
        cfg = dataclasses.replace(get("moe-tiny").config, aux_loss_coef=0.0)
        return MoE(cfg), moe_mod.loss_fn, get("moe-tiny").example_batch
    spec = get(name)
    return spec.build(), spec.loss_fn, spec.example_batch


def _reference(name):
    model, loss_fn, batch = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = batch(BATCH, generator=g)
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _run(rank, ws, name, memory_limit):
    model, loss_fn, batch = _build(name)
    x0, _ = batch(BATCH, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.mesh(world_size=ws), example_inputs=x0, hardware="cpu-gloo",
                             memory_limit=memory_limit)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = batch(BATCH, generator=g)
        losses.append(pm.step((x, y), loss_fn).item())
        opt.step()
        opt.zero_grad()
    state = pm.engine.gather_full_state_dict()
    text = pm.plan_text()  # the planner's view is part of the printed plan
    assert "predicted" in text and str(pm.plan.mesh) in text, text
    layouts = {k: {a: str(p) for a, p in lay.axes} for k, lay in pm.plan.param_layouts.items()}
    return losses, state, layouts, pm.mesh.coords(rank), dict(pm.plan.mesh), pm.plan.predicted


def _check(results, ref_losses, ref_params):
    mesh = results[0][4]
    for losses, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=LOSS_ATOL,
                                   msg=lambda m: f"losses on {mesh}: {m}")
    for name, ref in ref_params.items():
        pieces = sorted(((c.get("tp", 0), sd[name]) for _l, sd, _lay, c, _m, _p in results
                         if name in sd and c.get("dp", 0) == 0), key=lambda t: t[0])
        assert pieces, f"no rank holds {name} (mesh {mesh})"
        place = results[0][2].get(name, {}).get("tp", "R")
        if pieces[0][1].shape == ref.shape:
            got = pieces[0][1]
        else:
            assert place.startswith("S("), f"{name}: shape {tuple(pieces[0][1].shape)} vs {tuple(ref.shape)}, {place}"
            by_tp = dict(pieces)
            got = torch.cat([by_tp[i] for i in sorted(by_tp)], int(place[2:-1]))
        torch.testing.assert_close(got, ref, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m: f"{name} on {mesh}: {m}")


def _tight_limit(name, ws):
    """The largest of a few limits (fractions of one device's need) at which no one-dimensional
    plan fits but some plan does."""
    model, _loss, batch = _build(name)
    x0, _ = batch(BATCH, generator=torch.Generator().manual_seed(1))
    gm = autopar.capture(model, x0)
    m = PlanCostModel(gm, "cpu-gloo", ws)
    one = m.evaluate(Candidate(), math.inf, recompute="none").peak_bytes
    one_d = [c for c in candidates(m, ws, {}, RUNTIME_SUPPORT) if sum(s > 1 for s in (c.tp, c.pp, c.dp, c.ep)) == 1]
    for frac in (0.3, 0.25, 0.2, 0.15, 0.12, 0.1):
        limit = frac * one
        if all(m.evaluate(c, limit, minimise="memory").peak_bytes > limit for c in one_d):
            clear_cache()
            plan, _rep = plan_for(gm, ws, "cpu-gloo", memory_limit=limit)
            return limit, plan
    raise AssertionError(f"no limit forces a multi-dimensional plan for {name} on {ws} ranks")


def test_planned_gpt_on_8_processes_matches_one_process():
    limit, plan = _tight_limit("gpt-tiny", 8)
    assert sum(s > 1 for s in plan.mesh.values()) >= 2, plan.mesh
    model, _loss, batch = _build("gpt-tiny")  # captured here for the ranks' search, not on each of 8
    capture_before_fork(model, batch(BATCH, generator=torch.Generator().manual_seed(1))[0], search_world=8)
    results = world(8, _run, "gpt-tiny", limit)
    assert results[0][4] == plan.mesh  # every rank carried out the plan the search chose here
    assert results[0][5]["source"] == "planner" and results[0][5]["peak_bytes"] <= limit
    _check(results, *_reference("gpt-tiny"))


def test_planned_moe_on_4_processes_matches_one_process():
    model, _loss, batch = _build("moe-tiny")
    x0, _ = batch(BATCH, generator=torch.Generator().manual_seed(1))
    clear_cache()
    plan, _rep = plan_for(autopar.capture(model, x0), 4, "cpu-gloo")
    name = "moe-tiny" if plan.mesh.get("ep", 1) > 1 or plan.mesh == {"dp": 1} or \
        all(a in ("tp", "pp") for a in plan.mesh) else "moe-tiny-noaux"
    model, _loss, batch = _build(name)
    capture_before_fork(model, batch(BATCH, generator=torch.Generator().manual_seed(1))[0], search_world=4)
    results = world(4, _run, name, None)
    assert results[0][4] == plan.mesh
    _check(results, *_reference(name))
