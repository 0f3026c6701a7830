"""Pipeline parallelism from a captured graph trains exactly like one process: the stage
search, the split pass and the per-rank Program (`autopar.build.program.build_program`),
for every schedule on 2 and 4 pipeline ranks (up to 8 stages), pp x dp with ZeRO 0, 1 and 3,
and gpt-tiny-tied with its embedding and head on different stages.

Every rank captures nothing: the graphs are captured once in the parent (fork carries them
into the world) and deep-copied per case. Each rank runs the single-process reference itself
and compares its own stages: the loss of every step (the same on every rank), the gradients
after the first step (ZeRO 0: full dp-averaged gradients on the parameters) and the
parameters after 3 AdamW steps (gathered over dp under ZeRO 1-3), keyed by the model's own
parameter names, which the stage graphs keep.

Tolerances: fp32, rtol 1.3e-6 and atol 1e-5 (torch.testing.assert_close's fp32 defaults,
stated): the pipeline sums the same gradients in another order (over micro-batches, over dp
ranks, a tied weight's two stages). AdamW uses eps=1e-6: with the default 1e-8 an element
whose gradient is rounding noise (~1e-9) turns that noise into an lr-sized difference.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.models.gpt import GPT, loss_fn
from autopar.passes.plan import Plan
from autopar.build.program import build_program
from autopar.runtime.collectives import COUNTER
from autopar.runtime.mesh import make_mesh
from harness import world
from pipeline_parity import reference_run, train_and_compare

TOL = dict(rtol=1.3e-6, atol=1e-5)
ADAMW = dict(lr=1e-3, eps=1e-6)
MB, T, STEPS = 2, 8, 3


def _model(name: str, n_layers: int | None = None):
    spec = models.get(name)
    torch.manual_seed(0)
    if n_layers is None:
        return spec.build()
    return GPT(dataclasses.replace(spec.config, n_layers=n_layers))


def _data(rows: int, seed: int = 1):
    (idx,), tgt = models.get("gpt-tiny").example_batch(rows, seq_len=T, generator=torch.Generator().manual_seed(seed))
    return idx, tgt


_MODELS = {key: _model(*key) for key in [("gpt-tiny", None), ("gpt-tiny-tied", None), ("gpt-tiny", 6)]}
# captured at a batch of 8 with a dynamic batch dim: the same graph runs any micro-batch size
_GRAPHS = {key: autopar.capture(m, (_data(8)[0],)) for key, m in _MODELS.items()}


def _reference(model, idx, tgt):
    return reference_run(model, (idx, tgt), loss_fn, steps=STEPS, adamw=ADAMW)


def _run_case(rank, key, mesh, schedule, m, zero=0, pins=(), infer=False):
    """Build the pipeline from the captured graph, train STEPS steps, compare with one process."""
    model = _MODELS[key]
    dp = mesh.size("dp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deepcopy of the captured pytree specs
        gm = copy.deepcopy(_GRAPHS[key])
    plan = Plan(mesh=dict(mesh.sizes), dp_axis="dp" if dp > 1 else None, zero_stage=zero, schedule=schedule,
                n_microbatches=m, split_points=list(pins))
    program, stage_graphs, records = build_program(gm, gm, plan, mesh)
    idx, tgt = _data(dp * m * MB)
    ref_losses, ref_grads, ref_params = _reference(model, idx, tgt)
    opt = program.engine.make_optimizer(torch.optim.AdamW, **ADAMW)
    what = f"{key[0]} {schedule} m={m} mesh {dict(mesh.sizes)} zero {zero} rank {rank}"
    losses, held, _full = train_and_compare(program, opt, (idx, tgt), loss_fn, (ref_losses, ref_grads, ref_params),
                                           steps=STEPS, tol=TOL, what=what, check_grads=zero == 0)
    result = {}
    if infer:  # inference through the pipeline: every pp rank gets the output of the trained model
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(ref_params[n])
        COUNTER.reset()
        logits = program(idx)
        torch.testing.assert_close(logits, ref(idx), **TOL, msg=lambda msg: f"{what}: inference: {msg}")
        result["p2p_calls"] = COUNTER.calls[("send", "pp")] + COUNTER.calls[("recv", "pp")]
    return {**result, "split": plan.split_points, "stages": sorted(int(s) for s in program.stages), "held": held,
            "n_stage_graphs": len(stage_graphs), "tied": [list(map(list, t)) for t in program.info.tied],
            "loss": round(losses[-1], 6), "pass": records[0].name}


def _two_ranks(rank, ws):
    mesh = make_mesh(pp=2)
    out = []
    for key, schedule, m in [(("gpt-tiny", None), "gpipe", 4), (("gpt-tiny", None), "1f1b", 6),
                             (("gpt-tiny", None), "interleaved_1f1b", 4), (("gpt-tiny", None), "zb_h1", 8),
                             (("gpt-tiny", None), "zbv", 4), (("gpt-tiny-tied", None), "1f1b", 4),
                             (("gpt-tiny-tied", None), "zbv", 4)]:
        r = _run_case(rank, key, mesh, schedule, m, infer=(key[0], schedule) in {("gpt-tiny", "1f1b"),
                                                                                   ("gpt-tiny-tied", "zbv")})
        out.append((key[0], schedule, r))
    # impossible requests fail on every rank with the searching rank's message
    gm = _GRAPHS[("gpt-tiny", None)]
    errors = []
    for plan, kw in [(Plan(mesh={"pp": 2}, dp_axis=None, n_microbatches=4), {"memory_limit": 4096}),
                     (Plan(mesh={"pp": 2}, dp_axis=None, n_microbatches=4, split_points=["layers.7"]), {})]:
        try:
            build_program(gm, gm, plan, mesh, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out.append(("errors", "", errors))
    return out


def test_two_pipeline_ranks_match_one_process_for_every_schedule_and_tied_embeddings():
    out = world(2, _two_ranks)
    (*r0, e0), (*r1, e1) = out
    assert e0 == e1 and "fits the memory limit of 4096 B per stage" in e0[2][0]
    assert "['layers.7'] are not pipeline units" in e0[2][1]
    assert [(k, s) for k, s, _ in r0] == [("gpt-tiny", "gpipe"), ("gpt-tiny", "1f1b"), ("gpt-tiny", "interleaved_1f1b"),
                                          ("gpt-tiny", "zb_h1"), ("gpt-tiny", "zbv"), ("gpt-tiny-tied", "1f1b"),
                                          ("gpt-tiny-tied", "zbv")]
    for (_, _, a), (_, _, b) in zip(r0, r1):
        assert a["split"] == b["split"] and a["loss"] == b["loss"]  # one search result, one loss
        assert a["pass"] == "split_pipeline" and a["n_stage_graphs"] == len(a["split"]) + 1
        assert not set(a["held"]) & set(b["held"]) or a["tied"]  # each weight on one rank unless tied
    by = {(k, s): (a, b) for (k, s, a), (_, _, b) in zip(r0, r1)}
    assert by[("gpt-tiny", "1f1b")][0]["stages"] == [0] and by[("gpt-tiny", "1f1b")][1]["stages"] == [1]
    assert by[("gpt-tiny", "interleaved_1f1b")][0]["stages"] == [0, 2]  # stage s on rank s % 2
    assert by[("gpt-tiny", "zbv")][0]["stages"] == [0, 3]  # the V
    assert len(by[("gpt-tiny", "interleaved_1f1b")][0]["split"]) == 3
    tied_2, tied_v = by[("gpt-tiny-tied", "1f1b")], by[("gpt-tiny-tied", "zbv")]
    assert tied_2[0]["tied"] == [[[0, "lm_head.weight"], [1, "lm_head.weight"]]]  # across the two ranks
    assert tied_v[0]["tied"] == [[[0, "lm_head.weight"], [3, "lm_head.weight"]]]  # both copies on rank 0
    assert "lm_head.weight" in tied_2[0]["held"] and "lm_head.weight" in tied_2[1]["held"]
    # inference: one hand-over of the hidden state between the two ranks (then a broadcast)
    assert [r["p2p_calls"] for r in by[("gpt-tiny", "1f1b")]] == [1, 1]
    assert [r["p2p_calls"] for r in tied_v] == [2, 2]  # the V: stage 0 -> 1 -> 2 -> 3 crosses twice


def _four_ranks(rank, ws):
    out = []
    pp4 = make_mesh(pp=4)
    for key, schedule, m in [(("gpt-tiny", None), "gpipe", 4), (("gpt-tiny", None), "1f1b", 8),
                             (("gpt-tiny", 6), "interleaved_1f1b", 8), (("gpt-tiny", None), "zb_h1", 6),
                             (("gpt-tiny", 6), "zbv", 8)]:
        r = _run_case(rank, key, pp4, schedule, m)
        out.append(("pp4", schedule, r["split"], r["stages"], r["loss"]))
    pp2dp2 = make_mesh(pp=2, dp=2)
    for zero, schedule in [(0, "1f1b"), (1, "zb_h1"), (3, "1f1b")]:
        r = _run_case(rank, ("gpt-tiny", None), pp2dp2, schedule, 4, zero=zero)
        out.append((f"pp2dp2 zero{zero}", schedule, r["split"], r["stages"], r["loss"]))
    dist.barrier()
    return out


def test_four_pipeline_ranks_up_to_eight_stages_and_pp2_by_dp2_with_zero_match_one_process():
    out = world(4, _four_ranks)
    for row in zip(*out):
        assert len({(x[0], x[1], tuple(x[2]), x[4]) for x in row}) == 1  # same split and loss on every rank
    r0 = out[0]
    assert [len(x[2]) + 1 for x in r0[:5]] == [4, 4, 8, 4, 8]
    assert [x[3] for x in r0[:5]] == [[0], [0], [0, 4], [0], [0, 7]]
    assert [out[r][6][3] for r in range(4)] == [[0], [0], [1], [1]]  # pp is the outer axis: ranks 0,1 hold stage 0
