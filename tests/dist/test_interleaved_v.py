"""Interleaved 1F1B with four virtual stages per rank trains exactly like one process.

A GPT of 8 layers (gpt-tiny's width) on 2 pipeline ranks with plan.extra["pp_virtual"] = 4 (what
the planner writes when it picks v = 4): 8 stages, stage s on rank s % 2, 4 micro-batches. Each
rank runs the single-process reference itself and compares its own stages: the loss of every
step, every gradient after the first step, and the parameters after 3 AdamW steps, keyed by the
model's parameter names, which the stage graphs keep. The split the stage search gives must
make 8 stages (4 per rank) and be the same on both ranks.

Tolerances: fp32, rtol 1.3e-6 and atol 1e-5 (torch.testing.assert_close's fp32 defaults,
stated): the pipeline sums the same gradients over micro-batches in another order. AdamW uses
eps=1e-6 (a rounding-noise gradient must not become an lr-sized step).
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch

import autopar
from autopar import models
from autopar.models.gpt import GPT, loss_fn
from autopar.passes.plan import Plan
from autopar.build.program import build_program
from autopar.runtime.mesh import make_mesh
from harness import world
from pipeline_parity import reference_run, train_and_compare

TOL = dict(rtol=1.3e-6, atol=1e-5)
ADAMW = dict(lr=1e-3, eps=1e-6)
MB, T, STEPS, M, V = 2, 8, 3, 4, 4


def _data(rows: int):
    (idx,), tgt = models.get("gpt-tiny").example_batch(rows, seq_len=T, generator=torch.Generator().manual_seed(1))
    return idx, tgt


torch.manual_seed(0)
_MODEL = GPT(dataclasses.replace(models.get("gpt-tiny").config, n_layers=8))
_GRAPH = autopar.capture(_MODEL, (_data(8)[0],))  # captured once in the parent; the ranks fork


def _reference(idx, tgt):
    return reference_run(_MODEL, (idx, tgt), loss_fn, steps=STEPS, adamw=ADAMW)


def _rank(rank, ws):
    mesh = make_mesh(pp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deepcopy of the captured pytree specs
        gm = copy.deepcopy(_GRAPH)
    plan = Plan(mesh={"pp": 2}, dp_axis=None, schedule="interleaved_1f1b", n_microbatches=M)
    plan.extra["pp_virtual"] = V
    program, _graphs, _records = build_program(gm, gm, plan, mesh)
    idx, tgt = _data(M * MB)
    ref_losses, ref_grads, ref_params = _reference(idx, tgt)
    opt = program.engine.make_optimizer(torch.optim.AdamW, **ADAMW)
    losses, held, _full = train_and_compare(program, opt, (idx, tgt), loss_fn, (ref_losses, ref_grads, ref_params),
                                            steps=STEPS, tol=TOL, what=f"rank {rank}")
    return {"split": list(plan.split_points), "stages": sorted(int(s) for s in program.stages), "held": held,
            "losses": losses}


def test_interleaved_1f1b_with_four_virtual_stages_on_two_ranks_matches_one_process():
    r0, r1 = world(2, _rank)
    assert r0["split"] == r1["split"] and len(r0["split"]) + 1 == 2 * V
    assert r0["stages"] == [0, 2, 4, 6] and r1["stages"] == [1, 3, 5, 7]  # stage s on rank s % 2
    assert r0["losses"] == r1["losses"]
    names = {n for n, _ in _MODEL.named_parameters()}
    assert set(r0["held"]) | set(r1["held"]) == names and not set(r0["held"]) & set(r1["held"])
