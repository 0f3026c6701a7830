"""Pipeline cells of the support matrix that were refused or unshown, trained through
`autopar.parallelize` on 4 gloo ranks (pp2 x dp2) against one process:

  * tied weights (gpt-tiny-tied: the embedding on the first stage, the LM head on the last)
    under ZeRO 1, 2 (with offload: masters apart from the parameters, in CPU memory) and 3,
    on different pp ranks (1f1b, gpipe, interleaved_1f1b) and on one
    rank (zbv puts stages 0 and 3 together); the tied gradient is summed on the engines'
    masters (runtime/pipeline_tied.py), and both copies must stay equal;
  * recomputation (memory_budget=0: checkpoint regions in the stage programs) under gpipe and
    interleaved_1f1b (1f1b is shown by tests/dist/test_recompute_parallelize.py; zb_h1 / zbv
    are refused by design, tests/unit/test_support_matrix.py);
  * pp2 x dp2 under gpipe, interleaved_1f1b and zbv (the cells above and one zbv ZeRO-2 cell
    without tied weights), with ZeRO 1, 2 and 3 (pp x ZeRO-2 among them);
  * tied weights with bf16-mixed (bf16 parameters, fp32 masters) under ZeRO 1 and ZeRO 3,
    against a one-process recipe with the same precision semantics;
  (fp16-mixed with tied weights under pp, refused here before issue 21's one-scale pipelines,
  trains in tests/dist/test_pipeline_fp16.py.)

fp64 cells: the reference GPT in float64, three AdamW steps at lr 1e-2 on the same batches as
one process; every step's loss and every exported parameter (`autopar.export_state_dict`)
within 1e-9 (the strategies only reorder sums). Each cell also asserts that the program holds
what the cell names: the schedule and stages per rank, the ZeRO stage of every stage engine,
the tied pair's stages (and whether they sit on different pp ranks), checkpoint regions in
every stage program that holds a transformer block.

bf16-mixed cells: the one-process recipe written out (`_bf16_recipe`): fp32 masters; per step
and per dp half, a bf16 copy of the masters with the tied weight held twice (one copy per use,
as the two stages hold it), each micro-batch's bf16 forward/backward seeded with 1/M, the
micro-batch gradients accumulated as the engine does (bf16 on `.grad` for ZeRO 1, fp32 for
ZeRO 3's accumulation buffer), cast to fp32, averaged over the dp halves, the two copies'
gradients summed in fp32, fp32 AdamW. Both sides run the same bf16 ops on the same shapes, so
they agree to fp32 rounding of the sums' order (measured on CPU, torch 2.13: bit-equal losses
and parameters); tolerances: losses rtol 1e-5 / atol 1e-5, parameters rtol 1e-5 / atol 1e-6
(tighter than tests/dist/test_precision.py's, which leave room for another GEMM blocking; a tied
weight's gradient accumulated in one bf16 tensor instead of summed in fp32 moves parameters by up
to 1.6e-2 after three steps, measured).
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.passes import ir
from autopar.passes.recompute import CheckpointRegion
from harness import capture_before_fork, world
from reference_train import adamw_steps, token_batches

BATCH, SEQ, STEPS, LR, M, TOL = 8, 16, 3, 1e-2, 2, 1e-9
DP = 2
B16_LOSS = dict(rtol=1e-5, atol=1e-5)
B16_PARAM = dict(rtol=1e-5, atol=1e-6)


def _config(name):
    from autopar.models.gpt import GPTConfig

    cfg = GPTConfig.tiny()
    return dataclasses.replace(cfg, tie_embeddings=True) if name == "gpt-tied" else cfg


CONFIGS = {name: _config(name) for name in ("gpt", "gpt-tied")}


def _build(name, dtype=torch.float64):
    from autopar.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(CONFIGS[name]).to(dtype)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


@functools.cache  # one per model, shared by its cells (the tests only read it)
def _reference(name):
    losses, model = adamw_steps(_build(name), _batches(), _loss, lr=LR)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bf16_recipe(acc: str):
    """One process, bf16-mixed under pp2 x dp2 with M micro-batches, written out (see the
    module docstring); `acc`: the dtype micro-batch gradients accumulate in ("bf16" | "fp32")."""
    masters = _build("gpt-tied", torch.bfloat16).float()  # the engine's masters: exact fp32 copies
    opt = torch.optim.AdamW(masters.parameters(), lr=LR)
    names = [n for n, _ in masters.named_parameters()]  # tok_emb.weight once: it is lm_head.weight too
    losses = []
    for x, y in _batches():
        grads = {n: torch.zeros_like(p) for n, p in masters.named_parameters()}
        head_grad = torch.zeros_like(masters.lm_head.weight)
        step_losses = []
        for r in range(DP):
            low = _build("gpt-tied", torch.float32)
            low.load_state_dict(masters.state_dict())
            low = low.to(torch.bfloat16)  # parameters and the RoPE tables, as in the bf16 model's capture
            low.lm_head.weight = torch.nn.Parameter(low.tok_emb.weight.detach().clone())  # the last stage's copy
            rows = slice(r * BATCH // DP, (r + 1) * BATCH // DP)
            xr, yr = x[rows], y[rows]
            summed = {}
            for mb in range(M):
                mrows = slice(mb * xr.shape[0] // M, (mb + 1) * xr.shape[0] // M)
                loss = _loss(low(xr[mrows]), yr[mrows])
                loss.backward(torch.full((), 1.0 / M, dtype=loss.dtype))
                step_losses.append(loss.detach().float())
                if acc == "fp32":
                    for n, p in list(low.named_parameters()):
                        summed[n] = summed.get(n, 0) + p.grad.float()
                    low.zero_grad()
            if acc == "bf16":
                summed = {n: p.grad.float() for n, p in low.named_parameters()}
            for n in names:
                grads[n] += summed[n] / DP
            head_grad += summed["lm_head.weight"] / DP
        for n, p in masters.named_parameters():
            p.grad = grads[n] + (head_grad if n == "tok_emb.weight" else 0)
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step_losses).mean().item())
    return losses, {k: v.detach().clone() for k, v in masters.state_dict().items()}


CELLS = [  # (cell, model, schedule, parallelize keywords, what the program must hold)
    ("pp x tie x Z1 (1f1b)", "gpt-tied", "1f1b", dict(zero_stage=1), ["tied_apart"]),
    ("pp x tie x Z2 x off (gpipe)", "gpt-tied", "gpipe", dict(zero_stage=2, offload=True), ["tied_apart", "offload"]),
    ("pp x tie x Z3 (interleaved_1f1b)", "gpt-tied", "interleaved_1f1b", dict(zero_stage=3), ["tied_apart"]),
    ("pp x tie x Z3 (zbv, one rank)", "gpt-tied", "zbv", dict(zero_stage=3), ["tied_together"]),
    ("pp x rc x Z2 (gpipe)", "gpt", "gpipe", dict(zero_stage=2, memory_budget=0.0), ["region"]),
    ("pp x rc x Z1 (interleaved_1f1b)", "gpt", "interleaved_1f1b", dict(zero_stage=1, memory_budget=0.0),
     ["region"]),
    ("pp x dp x Z2 (zbv)", "gpt", "zbv", dict(zero_stage=2), []),
]
B16_CELLS = [  # (cell, schedule, ZeRO stage, micro-batch accumulation dtype of that engine)
    ("pp x tie x bf16-mixed x Z1 (1f1b)", "1f1b", 1, "bf16"),
    ("pp x tie x bf16-mixed x Z3 (gpipe)", "gpipe", 3, "fp32"),
]


def _holds(pm) -> dict:
    """What this rank's program really is: schedule, stages, ZeRO stages, tied pair, regions."""
    prog = pm.program
    tied = [[list(m) for m in t] for t in prog.tied]
    ranks = [sorted({prog.stage_to_rank[s] for s, _ in t}) for t in prog.tied]
    stage_facts = {}
    for s, mod in prog.stages.items():
        graphs = [m for m in mod.modules() if hasattr(m, "graph")]  # the stage and its regions' bodies
        mods = {ir.module_path(n) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        regions = [m for m in mod.modules() if isinstance(m, CheckpointRegion)]
        stage_facts[int(s)] = {"block": any(m.startswith("layers.") for m in mods), "regions": len(regions)}
    return {"schedule": prog.schedule_name, "n_virtual": prog.n_virtual, "dp": prog.dp,
            "zero": sorted({e.stage for e in prog.engine.engines.values()}),
            "offload": sorted({bool(e.offload) for e in prog.engine.engines.values()}),
            "k": sorted({e.k for e in prog.engine.engines.values()}), "tied": tied, "tied_ranks": ranks,
            "stages": stage_facts, "recompute": {k: v for k, v in pm.plan.recompute.items() if v != "none"}}


def _tied_copies(pm) -> dict:
    """{stage: full value} of the tied weight's copies on this rank's stages, gathered over dp
    from the stage engines' masters (collective over dp: every rank of a pp index calls it)."""
    prog = pm.program
    out = {}
    for s, name in (prog.tied[0] if prog.tied else ()):
        if str(s) in prog.stages:
            out[s] = prog.engine.engines[s].gather_full_state_dict()[name].clone()
    return out


def _train(pm, batches):
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    losses = []
    for x, y in batches:
        losses.append(pm.step(((x,), y), _loss).item())
        opt.step()
        opt.zero_grad()
    return losses


def _cells(rank, ws, tmp):
    out = {}
    mesh_kw = dict(pp=2, dp=DP)
    for cell, name, schedule, kw, _holds_names in CELLS:
        batches = _batches()
        try:
            pm = autopar.parallelize(_build(name), autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],),
                                     n_microbatches=M, pins={"schedule": schedule, "fusions": []}, **kw)
        except ValueError as e:  # reported per cell, so that one refusal does not hide the others
            out[cell] = f"refused: {e}"
            continue
        losses = _train(pm, batches)
        copies = _tied_copies(pm)
        sd = autopar.export_state_dict(pm, f"{tmp}/{cell.split(' (')[0].replace(' ', '_')}_{schedule}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, _holds(pm), copies)
    for cell, schedule, zero, _acc in B16_CELLS:
        batches = _batches()
        pm = autopar.parallelize(_build("gpt-tied", torch.bfloat16), autopar.mesh(**mesh_kw),
                                 example_inputs=(batches[0][0],), n_microbatches=M, zero_stage=zero,
                                 precision="bf16-mixed", pins={"schedule": schedule, "fusions": []})
        losses = _train(pm, batches)
        holds = _holds(pm)
        engines = pm.program.engine.engines.values()  # ZeRO-3 holds fp32 shards, gathered in the units' dtype
        holds["param_dtypes"] = sorted({str(u.dtype) for e in engines for u in e.units} if zero == 3 else
                                       {str(p.dtype) for m in pm.program.stages.values() for p in m.parameters()})
        holds["master_dtypes"] = sorted({str(sl.master.dtype) for e in engines for sl in e.slots})
        copies = _tied_copies(pm)
        sd = autopar.export_state_dict(pm, f"{tmp}/b16_{zero}_{schedule}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, holds, copies)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # capture each model structure once here: the forked ranks find it in autopar's capture memo
    for name, dtype in (("gpt", torch.float64), ("gpt-tied", torch.float64), ("gpt-tied", torch.bfloat16)):
        capture_before_fork(_build(name, dtype), (_batches()[0][0],))
    return world(4, _cells, str(tmp_path_factory.mktemp("pipeline_compose")), timeout_s=600)


def _check_program(cell, schedule, zero, holds_names, got):
    for _losses, _sd, have, copies in got:
        assert have["schedule"] == schedule and have["dp"] == DP and have["k"] == [DP], f"{cell}: {have}"
        assert have["n_virtual"] == (2 if schedule in ("interleaved_1f1b", "zbv") else 1), f"{cell}: {have}"
        assert have["zero"] == [zero], f"{cell}: engines at ZeRO {have['zero']}, the cell names {zero}"
        assert have["offload"] == ["offload" in holds_names], f"{cell}: engines offloaded: {have['offload']}"
        if "tied_apart" in holds_names or "tied_together" in holds_names:
            assert len(have["tied"]) == 1 and len({s for s, _ in have["tied"][0]}) == 2, f"{cell}: {have['tied']}"
            assert len(have["tied_ranks"][0]) == (2 if "tied_apart" in holds_names else 1), f"{cell}: {have}"
            # every copy this rank holds is the same tensor after the steps (exactly)
            vals = list(copies.values())
            for v in vals[1:]:
                torch.testing.assert_close(v, vals[0], rtol=0, atol=0)
        if "region" in holds_names:
            assert have["recompute"], f"{cell}: budget 0 chose no recomputation"
            for s, f in have["stages"].items():
                assert f["regions"] > 0 or not f["block"], f"{cell}: stage {s} holds a block but no checkpoint region"
    if "tied_apart" in holds_names or "tied_together" in holds_names:
        # across ranks: every copy (the first stage's and the last stage's) holds one value
        vals = [(s, v) for *_x, c in got for s, v in c.items()]
        if "tied_together" in holds_names:
            assert any(len(c) == 2 for *_x, c in got), f"{cell}: no rank holds both copies"
        assert len({s for s, _ in vals}) == 2, f"{cell}: the ranks reported copies of stages {[s for s, _ in vals]}"
        for s, v in vals[1:]:
            torch.testing.assert_close(v, vals[0][1], rtol=0, atol=0,
                                       msg=lambda m: f"{cell}: stage {s}'s copy differs from stage {vals[0][0]}'s: {m}")
    if "region" in holds_names:
        assert sum(f["regions"] for *_x, have, _c in got for f in have["stages"].values()) > 0, cell


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_pipeline_cell_matches_one_process_after_three_adamw_steps(results, cell):
    name, schedule, kw, holds = next((c[1], c[2], c[3], c[4]) for c in CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    _check_program(cell, schedule, kw["zero_stage"], holds, got)
    ref_losses, ref_params = _reference(name)
    for losses, *_rest in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
    sd = got[0][1]  # rank 0 holds the export
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].to(ref.dtype), ref, rtol=TOL, atol=TOL, msg=lambda m: f"{cell} {k}: {m}")


@pytest.mark.parametrize("cell", [c[0] for c in B16_CELLS])
def test_tied_bf16_mixed_pipeline_matches_the_one_process_recipe(results, cell):
    schedule, zero, acc = next((c[1], c[2], c[3]) for c in B16_CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    _check_program(cell, schedule, zero, ["tied_apart"], got)
    for *_x, have, _c in got:
        assert have["param_dtypes"] == ["torch.bfloat16"] and have["master_dtypes"] == ["torch.float32"], have
    ref_losses, ref_params = _bf16_recipe(acc)
    for losses, *_rest in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **B16_LOSS)
    sd = got[0][1]
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].float(), ref, **B16_PARAM, msg=lambda m: f"{cell} {k}: {m}")
