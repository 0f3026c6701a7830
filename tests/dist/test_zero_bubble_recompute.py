"""Activation recomputation under the zero-bubble schedules (zb_h1, zbv) trains like one process
(issue 21: recompute x every pipeline schedule).

A checkpoint region (passes/recompute.py) allows one backward, and zb_h1 / zbv split a stage's
backward into I (input gradients) and W (weight gradients), two passes. A stage that holds
regions therefore runs its whole backward at its I's place and no W
(`runtime.schedules.fuse_backward`, runtime/pipeline.py); the other stages keep the split.

One spawned world of 4 gloo ranks (dp2 x pp2) runs every cell through `autopar.parallelize`:
the reference GPT in float64, three AdamW steps at lr 1e-2, four micro-batches, against one
process on the same batches: every step's loss and every exported parameter within 1e-9 (the
strategies only reorder sums; recompute is bit-exact), the tied pair's copies exactly equal.
Cells: zb_h1 with full + selective regions on both stages (ZeRO 0); zb_h1 with a region on
stage 0 only (ZeRO 2: stage 1 keeps I/W); zbv with selective regions on all four stages
(ZeRO 3); zbv with tied weights and full regions on the rank holding stages 0 and 3 only (ZeRO
1: the other rank keeps I/W); zb_h1 with tied weights and `memory_budget=0.3` (the budget's
own recompute choice, ZeRO 2).

fp16 loss scaling: gpt-tiny in fp16 ("fp16-mixed", fp32 masters, dynamic loss scale) under zb_h1
x ZeRO 1 with full + selective regions on both stages, against the same plan without recompute
in the same world (its stages keep I/W): every step's loss, skip verdict and loss scale, and the
exported masters, bit for bit (recompute replays the same fp16 ops, and the fused backward
accumulates each micro-batch's gradients in the same order as W; measured equal).

Each cell also checks that the program is what it names: the plan's schedule, a recompute
that is not "none", checkpoint regions in the stages, each region's body entered twice per
micro-batch (its forward and its recompute), the executor running the named schedule with
exactly the stages holding regions fused (their I -> B, no W) and `backward_weight` called
once per micro-batch of every other stage.
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from harness import capture_before_fork, world
from reference_train import token_batches

import autopar

BATCH, SEQ, STEPS, LR, M, TOL = 8, 16, 3, 1e-2, 4, 1e-9


def _config(name):
    from autopar.models.gpt import GPTConfig

    return dataclasses.replace(GPTConfig.tiny(), tie_embeddings=name.endswith("-tied"),
                               n_layers=4 if name.startswith("gpt4") else 2)


CONFIGS = {name: _config(name) for name in ("gpt", "gpt-tied", "gpt4", "gpt4-tied")}
SPLITS = {"gpt": ["layers.1"], "gpt-tied": ["layers.1"], "gpt4": ["layers.1", "layers.2", "layers.3"],
          "gpt4-tied": ["layers.1", "layers.2", "layers.3"]}


def _build(name, dtype=torch.float64):
    from autopar.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(CONFIGS[name]).to(dtype)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


@functools.cache
def _reference(name):
    model = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


CELLS = [  # (cell, model, schedule, recompute pin or None, parallelize keywords)
    ("zb_h1 full+selective Z0", "gpt", "zb_h1", {"layers.0": "full", "layers.1": "selective"}, dict(zero_stage=0)),
    ("zb_h1 stage 0 only Z2", "gpt", "zb_h1", {"layers.0": "selective"}, dict(zero_stage=2)),
    ("zbv selective Z3", "gpt4", "zbv", {f"layers.{i}": "selective" for i in range(4)}, dict(zero_stage=3)),
    ("zbv tied rank 0 only Z1", "gpt4-tied", "zbv", {"layers.0": "full", "layers.3": "full"}, dict(zero_stage=1)),
    ("zb_h1 tied budget Z2", "gpt-tied", "zb_h1", None, dict(zero_stage=2, memory_budget=0.3)),
]
FP16_CELLS = [("fp16 recompute", {"layers.0": "full", "layers.1": "selective"}), ("fp16 no recompute", None)]


def _fp16_cells(tmp) -> dict:
    """zb_h1 x ZeRO 1 in fp16-mixed with and without recompute (see the module docstring)."""
    from autopar.passes.recompute import CheckpointRegion

    out = {}
    for i, (cell, rc) in enumerate(FP16_CELLS):
        batches = _batches()
        pins = {"schedule": "zb_h1", "fusions": [], "split_points": SPLITS["gpt"], **({"recompute": rc} if rc else {})}
        pm = autopar.parallelize(_build("gpt", torch.float16), autopar.mesh(dp=2, pp=2),
                                 example_inputs=(batches[0][0],), n_microbatches=M, zero_stage=1, pins=pins)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        losses, skipped, scales = [], [], []
        for x, y in batches:
            losses.append(pm.step(((x,), y), _loss).item())
            opt.step()
            opt.zero_grad()
            skipped.append(pm.engine.last_step_skipped)
            scales.append(float(pm.engine.loss_scale))
        sd = autopar.export_state_dict(pm, f"{tmp}/fp16_{i}.pt")
        regions = sum(isinstance(m, CheckpointRegion) for mod in pm.program.stages.values() for m in mod.modules())
        out[cell] = dict(losses=losses, skipped=skipped, scales=scales, sd={k: v.clone() for k, v in sd.items()},
                         regions=regions, precision=(pm.plan.param_dtype, pm.plan.master_dtype))
    return out


def _cells(rank, ws, tmp):
    from autopar.passes.recompute import CheckpointRegion
    from autopar.runtime import pipeline
    from autopar.runtime.schedules import fuse_backward, make_schedule

    executors, w_calls = [], []
    step0, bw0 = pipeline.PipelineExecutor.step, pipeline.backward_weight

    def step(self, *a, **k):  # which executor ran: its schedule and fused stages are checked
        executors.append(self)
        return step0(self, *a, **k)

    def backward_weight(state):
        w_calls.append(1)
        return bw0(state)

    pipeline.PipelineExecutor.step, pipeline.backward_weight = step, backward_weight
    out = {}
    for i, (cell, name, schedule, rc, kw) in enumerate(CELLS):
        executors.clear()
        w_calls.clear()
        batches = _batches()
        pins = {"schedule": schedule, "fusions": [], "split_points": SPLITS[name]}
        if rc is not None:
            pins["recompute"] = rc
        try:
            pm = autopar.parallelize(_build(name), autopar.mesh(dp=2, pp=2), example_inputs=(batches[0][0],),
                                     n_microbatches=M, pins=pins, **kw)
        except ValueError as e:  # reported per cell, so that one refusal does not hide the others
            out[cell] = f"refused: {e}"
            continue
        regions = {int(s): [m for m in mod.modules() if isinstance(m, CheckpointRegion)]
                   for s, mod in pm.program.stages.items()}  # this rank's stages
        entered = {id(r): 0 for rs in regions.values() for r in rs}
        for rs in regions.values():
            for r in rs:
                r.body.register_forward_pre_hook(lambda mod, args, r=r: entered.__setitem__(id(r), entered[id(r)] + 1))
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        losses = []
        try:
            for x, y in batches:
                losses.append(pm.step(((x,), y), _loss).item())
                opt.step()
                opt.zero_grad()
        except Exception as e:  # noqa: BLE001 - a failing cell is reported, the world goes on to the next
            out[cell] = f"failed: {type(e).__name__}: {e}"
            continue
        ex = executors[-1]
        want = fuse_backward(make_schedule(schedule, 2, M, 2 if schedule == "zbv" else None),
                             [s for s, rs in regions.items() if rs])
        sd = autopar.export_state_dict(pm, f"{tmp}/cell{i}.pt")
        out[cell] = dict(
            losses=losses, sd={k: v.clone() for k, v in sd.items()}, schedule=pm.plan.schedule,
            recompute=dict(pm.plan.recompute), ex_schedule=ex.schedule.name == want.name, fused=list(ex.fused_stages),
            regions={s: len(rs) for s, rs in regions.items()},
            entered=sorted(set(entered.values())), runs_want=ex.schedule.actions == want.actions,
            split=[s for s in ex.modules if s not in ex.fused_stages],
            kinds={s: sorted({a.kind.value for a in ex.schedule.actions[ex.pp_rank] if a.stage == s})
                   for s in ex.modules},
            w_calls=len(w_calls))
    out.update(_fp16_cells(tmp))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    for name in CONFIGS:  # the forked ranks find these in autopar's capture memo
        capture_before_fork(_build(name), (_batches()[0][0],))
    return world(4, _cells, str(tmp_path_factory.mktemp("zero_bubble_recompute")), timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_zero_bubble_cell_with_recompute_matches_one_process_after_three_adamw_steps(results, cell):
    name, schedule, rc, _kw = next(c[1:] for c in CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    for rank, g in enumerate(got):
        where = (cell, rank)
        assert g["schedule"] == schedule and g["ex_schedule"], (where, g["schedule"])
        assert any(v != "none" for v in g["recompute"].values()), (where, g["recompute"])
        if rc is not None:
            assert {k: v for k, v in g["recompute"].items() if v != "none"} == rc, (where, g["recompute"])
        # the stages holding regions, and only they, run their backward whole (B, no I/W)
        assert g["fused"] == sorted(s for s, n in g["regions"].items() if n), (where, g["fused"], g["regions"])
        assert g["runs_want"], f"{where}: the executor does not run {schedule} with stages {g['fused']} fused"
        for s, kinds in g["kinds"].items():
            assert kinds == (["B", "F"] if s in g["fused"] else ["F", "I", "W"]), (where, s, kinds)
        # every region's body ran twice per micro-batch of every step: forward, then its recompute
        assert g["entered"] in ([], [2 * M * STEPS]), (where, g["entered"])
        assert g["w_calls"] == M * STEPS * len(g["split"]), (where, g["w_calls"], g["split"])
    assert sum(bool(g["fused"]) for g in got) >= 2, f"{cell}: no pp rank recomputes: {[g['regions'] for g in got]}"
    if name == "gpt4-tied":  # one pp rank fused, the other keeps the zero-bubble split
        assert any(g["split"] and g["w_calls"] for g in got), f"{cell}: no rank kept I/W"
    ref_losses, ref_params = _reference(name)
    f64 = functools.partial(torch.tensor, dtype=torch.float64)  # float32 would hide 1e-9
    for g in got:
        torch.testing.assert_close(f64(g["losses"]), f64(ref_losses), rtol=0, atol=TOL)
    sd = got[0]["sd"]  # rank 0 holds the export
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].to(ref.dtype), ref, rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{cell} {k}: {m}")
    if name.endswith("-tied"):
        torch.testing.assert_close(sd["lm_head.weight"], sd["tok_emb.weight"], rtol=0, atol=0)


def test_fp16_loss_scaled_zero_bubble_with_recompute_equals_the_same_plan_without_it(results):
    for rank, r in enumerate(results):
        with_rc, without = r["fp16 recompute"], r["fp16 no recompute"]
        assert with_rc["regions"] > 0 and without["regions"] == 0, (rank, with_rc["regions"], without["regions"])
        assert "16" in str(with_rc["precision"][0]) and "32" in str(with_rc["precision"][1]), with_rc["precision"]
        assert with_rc["skipped"] == without["skipped"] and with_rc["scales"] == without["scales"], \
            (rank, with_rc["skipped"], without["skipped"], with_rc["scales"], without["scales"])
        assert not all(with_rc["skipped"]), f"rank {rank}: every step skipped, nothing was compared"
        torch.testing.assert_close(torch.tensor(with_rc["losses"]), torch.tensor(without["losses"]), rtol=0, atol=0)
    a, b = results[0]["fp16 recompute"]["sd"], results[0]["fp16 no recompute"]["sd"]
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
