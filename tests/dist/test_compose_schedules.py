"""Table B of docs/support_matrix.md (pipeline schedules): the cells no test trained, through
`autopar.parallelize` on 4 gloo ranks against one process, in one spawned world:

  * pp x tp under gpipe, interleaved_1f1b, zb_h1 and zbv (pp2 x tp2; planned for h100-sxm,
    whose cost profile shards gpt-tiny on tp, where gloo's replicates it; 1f1b is
    tests/dist/test_parallelize_3d.py's);
  * tied weights under zb_h1 (gpt-tiny-tied, the embedding and the LM head on the two pp ranks);
  * offload under interleaved_1f1b, zb_h1, zbv and 1f1b (pp2 x dp2, ZeRO 1, 2, 3, 2);
  * gradient clipping (`pm.engine.clip_grad_norm_`) with tied weights under ZeRO 1, 2 and 3 in a
    pipeline: the tied weight's two copies counted once in the norm (the one-process reference
    is `torch.nn.utils.clip_grad_norm_` over the model's parameters, where the tied weight is
    one tensor). The clip bites: every reference step's norm is above `CLIP`, and the norm each
    rank returns is compared with the reference's at every step. These cells carry the offload
    cells above (interleaved_1f1b x ZeRO 1, zb_h1 x ZeRO 2, zbv x ZeRO 3, where zbv holds both
    copies on one rank and the others on two); one more clips gpt-tiny (untied) under 1f1b x
    ZeRO 2 with offload.

Every cell: the reference GPT in float64, three AdamW steps at lr 1e-2 on the same batches as
one process, two micro-batches; every step's loss and every exported parameter
(`autopar.export_state_dict`) within 1e-9 (the strategies only reorder sums), the tied pair's
two exported copies exactly equal, and the program checked to be what the cell names: the
plan's schedule, the stages per rank (two under interleaved_1f1b and zbv), every stage engine's
ZeRO stage and offload, tp-sharded parameters for the tp cells.
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from harness import capture_before_fork, world
from reference_train import token_batches

import autopar

BATCH, SEQ, STEPS, LR, M, TOL = 8, 16, 3, 1e-2, 2, 1e-9
CLIP = 0.5  # below every step's gradient norm of the reference (asserted), so clipping acts
H100 = {"hardware": "h100-sxm"}


def _config(name):
    from autopar.models.gpt import GPTConfig

    return dataclasses.replace(GPTConfig.tiny(), tie_embeddings=name == "gpt-tied")


CONFIGS = {name: _config(name) for name in ("gpt", "gpt-tied")}  # one object each: the capture memo keys by it


def _build(name):
    from autopar.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(CONFIGS[name]).double()


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


@functools.cache  # one per (model, clip), shared by its cells (the tests only read it)
def _reference(name, clip):
    model = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in _batches():
        loss = _loss(model(x), y)
        loss.backward()
        if clip:  # model.parameters() holds the tied weight once
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


CELLS = [  # (cell, model, mesh, schedule, parallelize keywords, clip)
    ("pp x tp (gpipe)", "gpt", dict(pp=2, tp=2), "gpipe", dict(**H100), False),
    ("pp x tp (interleaved_1f1b)", "gpt", dict(pp=2, tp=2), "interleaved_1f1b", dict(**H100), False),
    ("pp x tp (zb_h1)", "gpt", dict(pp=2, tp=2), "zb_h1", dict(**H100), False),
    ("pp x tp (zbv)", "gpt", dict(pp=2, tp=2), "zbv", dict(**H100), False),
    ("pp x tie x Z1 (zb_h1)", "gpt-tied", dict(pp=2, dp=2), "zb_h1", dict(zero_stage=1), False),
    ("pp x tie x off x Z1 x clip (interleaved_1f1b)", "gpt-tied", dict(pp=2, dp=2), "interleaved_1f1b",
     dict(zero_stage=1, offload=True), True),
    ("pp x tie x off x Z2 x clip (zb_h1)", "gpt-tied", dict(pp=2, dp=2), "zb_h1", dict(zero_stage=2, offload=True),
     True),
    ("pp x tie x off x Z3 x clip (zbv)", "gpt-tied", dict(pp=2, dp=2), "zbv", dict(zero_stage=3, offload=True), True),
    ("pp x off x Z2 x clip (1f1b)", "gpt", dict(pp=2, dp=2), "1f1b", dict(zero_stage=2, offload=True), True),
]


def _holds(pm) -> dict:
    engines = pm.engine.engines  # {stage: that stage's ZeRO engine} on this rank
    return {"schedule": pm.plan.schedule, "stages": sorted(engines),
            "zero": sorted({e.stage for e in engines.values()}),
            "offload": sorted({bool(e.offload) for e in engines.values()}),
            "tp_sharded": sum(any(a == "tp" and str(p) != "R" for a, p in lay.axes)
                              for lay in pm.plan.param_layouts.values())}


def _cells(rank, ws, tmp):
    out = {}
    for i, (cell, name, mesh_kw, schedule, kw, clip) in enumerate(CELLS):
        batches = _batches()
        try:
            pm = autopar.parallelize(_build(name), autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],),
                                     n_microbatches=M, pins={"schedule": schedule, "fusions": []}, **kw)
        except ValueError as e:  # reported per cell, so that one refusal does not hide the others
            out[cell] = f"refused: {e}"
            continue
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        losses, norms = [], []
        try:
            for x, y in batches:
                losses.append(pm.step(((x,), y), _loss).item())
                if clip:
                    norms.append(float(pm.engine.clip_grad_norm_(CLIP)))
                opt.step()
                opt.zero_grad()
        except Exception as e:  # noqa: BLE001 - a failing cell is reported, the world goes on to the next
            out[cell] = f"failed: {type(e).__name__}: {e}"
            continue
        sd = autopar.export_state_dict(pm, f"{tmp}/cell{i}.pt")
        out[cell] = (losses, norms, {k: v.clone() for k, v in sd.items()}, _holds(pm))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    for name in CONFIGS:  # the forked ranks find these in autopar's capture memo
        capture_before_fork(_build(name), (_batches()[0][0],))
    return world(4, _cells, str(tmp_path_factory.mktemp("compose_schedules")), timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_schedule_cell_matches_one_process_after_three_adamw_steps(results, cell):
    name, mesh_kw, schedule, kw, clip = next(c[1:] for c in CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    n_virtual = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    for rank, (_l, _n, _sd, have) in enumerate(got):
        assert have["schedule"] == schedule and len(have["stages"]) == n_virtual, (cell, rank, have)
        assert have["zero"] == [kw.get("zero_stage", 0)], (cell, rank, have)
        assert have["offload"] == [bool(kw.get("offload"))], (cell, rank, have)
        assert ("tp" in mesh_kw) == (have["tp_sharded"] > 0), (cell, rank, have)
    ref_losses, ref_norms, ref_params = _reference(name, clip)
    if clip:
        assert min(ref_norms) > CLIP, f"the reference's norms {ref_norms} do not exceed {CLIP}: clipping tests nothing"
    for losses, norms, _sd, _h in got:
        f64 = functools.partial(torch.tensor, dtype=torch.float64)  # float32 would hide 1e-9
        torch.testing.assert_close(f64(losses), f64(ref_losses), rtol=0, atol=TOL)
        torch.testing.assert_close(f64(norms), f64(ref_norms), rtol=TOL, atol=TOL)
    sd = got[0][2]  # rank 0 holds the export
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].to(ref.dtype), ref, rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{cell} {k}: {m}")
    if name == "gpt-tied":  # the two stages' copies, exported from each, are one value
        torch.testing.assert_close(sd["lm_head.weight"], sd["tok_emb.weight"], rtol=0, atol=0)
