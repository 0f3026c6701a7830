"""Table D of docs/support_matrix.md (precision modes): the cells no test trained, through
`autopar.parallelize` on gloo against one process running the same precision recipe.

Two worlds (forked, ~0.1 s each):

* 2 ranks, dp=2, gpt-tiny, against the recipe split as dp splits it (`_recipe(..., parts=2)`):
  "fp16-mixed" (an fp16 model: fp16 compute, fp32 masters and AdamW, fp32 gradient reduction,
  dynamic loss scaling at its default 2**16, asserted never to skip here) under ZeRO 0 and with
  offload under ZeRO 1 and 3; pure "bf16" (a bf16 model with precision="bf16": bf16 parameters,
  gradients, gradient reduction and AdamW states, no masters) under ZeRO 0-3 and with offload
  under ZeRO 2. Recipe per step: each dp half's forward/backward through a 16-bit copy of the
  masters (fp16: the fp32 loss times the scale S before its backward, as the program applies it
  (runtime/zero_optim.py `loss_scale_factor`), divided out in fp32), the two halves'
  gradients averaged (fp32 for the mixed modes; bf16 for pure bf16, whose (g0 + g1) / 2 of two
  bf16 values rounds once, in either order), AdamW (fp32 on the masters; bf16 on the bf16
  parameters for pure bf16). Both sides run the same 16-bit ops on the same shapes; the
  tolerances (`EXACT_*`) are tests/dist/test_pipeline_fp16.py's: losses rtol / atol 1e-5,
  parameters rtol 1e-5 / atol 1e-6 (fp32 masters), and one bf16 ulp (rtol 8e-3, atol 1e-5)
  for the bf16 parameters of pure bf16, which round every step. Measured (CPU, torch 2.13,
  2026-11-26): every parameter of all eight cells bit-equal to the recipe's.

* 4 ranks: fp16-mixed and pure bf16, each with tp (dp2 x tp2, planned for h100-sxm, whose
  profile shards gpt-tiny on tp), ep (moe-tiny, dp2 x ep2, its load-balancing loss on and
  computed over the global batch) and cp (dp2 x cp2, ring); pure bf16 with pp (pp2 x dp2,
  1f1b, ZeRO 1, 2 micro-batches; fp16-mixed under pp is tests/dist/test_pipeline_fp16.py's);
  against the whole-batch one-process recipe of the same precision (`parts=1`): the parallel
  program runs its 16-bit sums in another order and on other shapes (tp shards, cp chunks,
  expert dispatch, stages, per-rank rows), so, as tests/dist/test_compose_sp_mp.py holds
  bf16-mixed: every step's loss within `MP_LOSS` relative and, per parameter tensor, the
  distance between the two runs' final values at most `MP_PARAM` of the distance the recipe
  moved it (the cells' measured shares are printed; see `MP_PARAM`).

Each cell also checks what the program is: the plan's precision fields, the dtypes of the
tensors the optimizer steps, the loss scale and that no step was skipped (fp16), the engine's
ZeRO stage and offload, tp-sharded parameters, expert dispatch, the ring exchange.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from harness import capture_before_fork, world
from reference_train import assert_within_move, token_batches

import autopar

BATCH, SEQ, STEPS, LR, S16 = 8, 16, 3, 1e-2, 2.0**16
EXACT_LOSS = dict(rtol=1e-5, atol=1e-5)
EXACT_PARAM = dict(rtol=1e-5, atol=1e-6)
BF16_PARAM = dict(rtol=8e-3, atol=1e-5)  # one bf16 ulp: pure bf16 parameters round at every step
MP_LOSS = 0.02  # relative, every step (as test_compose_sp_mp.py)
# |p - p_ref| / |p_ref - p_0| per parameter tensor; test_compose_sp_mp.py measured 5.7-6.4 % for a
# legitimate batch split in bf16 and 80-120 % for a missing dp reduction; fp16 has 3 more bits
MP_PARAM = 0.30
H100 = {"hardware": "h100-sxm"}
CONFIGS = {}


def _build(name, dtype):
    torch.manual_seed(0)
    if name == "moe":
        from autopar.models import MoE, MoEConfig

        return MoE(CONFIGS.setdefault(name, MoEConfig.tiny())).to(dtype)
    from autopar.models.gpt import GPT, GPTConfig

    return GPT(CONFIGS.setdefault(name, GPTConfig.tiny())).to(dtype)  # one config object: the capture memo


def _loss(out, y):
    logits, aux = (out, 0.0) if isinstance(out, torch.Tensor) else (out[0], out[1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)) + aux


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


# (cell, model, model dtype, mesh, parallelize keywords, expected (param, master, optim) dtypes)
FP16 = (torch.float16, ("fp16", "fp32", "fp32"))
BF16 = (torch.bfloat16, ("bf16", None, "bf16"))
EXACT_CELLS = [  # 2 ranks, dp=2
    ("fp16-mixed x Z0", "gpt", *FP16, dict(zero_stage=0)),
    ("fp16-mixed x Z1 x off", "gpt", *FP16, dict(zero_stage=1, offload=True)),
    ("fp16-mixed x Z3 x off", "gpt", *FP16, dict(zero_stage=3, offload=True)),
    ("bf16 x Z0", "gpt", *BF16, dict(zero_stage=0, precision="bf16")),
    ("bf16 x Z1", "gpt", *BF16, dict(zero_stage=1, precision="bf16")),
    ("bf16 x Z2", "gpt", *BF16, dict(zero_stage=2, precision="bf16")),
    ("bf16 x Z3", "gpt", *BF16, dict(zero_stage=3, precision="bf16")),
    ("bf16 x Z2 x off", "gpt", *BF16, dict(zero_stage=2, offload=True, precision="bf16")),
]
MESH_CELLS = [  # 4 ranks: (cell, model, dtype, dtypes, mesh, keywords, what the program must hold)
    ("fp16-mixed x tp", "gpt", *FP16, dict(dp=2, tp=2), dict(zero_stage=1, **H100), ["tp"]),
    ("fp16-mixed x ep", "moe", *FP16, dict(dp=2, ep=2), dict(zero_stage=1), ["dispatch"]),
    ("fp16-mixed x cp", "gpt", *FP16, dict(dp=2, cp=2), dict(context_method="ring"), ["ring_attention"]),
    ("bf16 x tp", "gpt", *BF16, dict(dp=2, tp=2), dict(zero_stage=1, precision="bf16", **H100), ["tp"]),
    ("bf16 x ep", "moe", *BF16, dict(dp=2, ep=2), dict(zero_stage=1, precision="bf16"), ["dispatch"]),
    ("bf16 x cp", "gpt", *BF16, dict(dp=2, cp=2), dict(context_method="ring", precision="bf16"), ["ring_attention"]),
    ("bf16 x pp", "gpt", *BF16, dict(pp=2, dp=2), dict(zero_stage=1, precision="bf16", n_microbatches=2,
                                                       pins={"schedule": "1f1b"}), ["pp"]),
]


def _train(name, dtype, mesh_kw, kw):
    batches = _batches()
    pm = autopar.parallelize(_build(name, dtype), autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],), **kw)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    losses, skipped, scales = [], [], []
    for x, y in batches:
        losses.append(pm.step(((x,), y), _loss).item())
        opt.step()
        opt.zero_grad()
        skipped.append(bool(getattr(pm.engine, "last_step_skipped", False)))
        scales.append(getattr(pm.engine, "loss_scale", None))
    code = "".join(m.code for m in pm.program.modules() if hasattr(m, "code"))
    engines = getattr(pm.engine, "engines", {0: pm.engine}).values()  # a pipeline: one engine a stage
    facts = {"fields": (pm.plan.param_dtype, pm.plan.master_dtype, pm.plan.optim_dtype),
             "stepped": sorted({str(t.dtype) for g in opt.param_groups for t in g["params"]}),
             "skipped": skipped, "scales": scales, "zero": sorted({e.stage for e in engines}),
             "offload": sorted({bool(e.offload) for e in engines}),
             "pp": pm.plan.mesh.get("pp", 1) > 1 and bool(pm.plan.split_points),
             "tp": any(any(a == "tp" and str(p) != "R" for a, p in lay.axes) for lay in pm.plan.param_layouts.values()),
             "dispatch": "dispatch" in code, "ring_attention": "ring_attention" in code}
    return pm, losses, facts


def _exact_world(rank, ws, tmp):
    out = {}
    for i, (cell, name, dtype, _dt, kw) in enumerate(EXACT_CELLS):
        try:
            pm, losses, facts = _train(name, dtype, dict(dp=ws), kw)
        except Exception as e:  # noqa: BLE001 - reported per cell, so that one failure does not hide the others
            out[cell] = f"failed: {type(e).__name__}: {e}"
            continue
        sd = autopar.export_state_dict(pm, f"{tmp}/exact{i}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, facts)
    return out


def _mesh_world(rank, ws, tmp):
    out = {}
    for i, (cell, name, dtype, _dt, mesh_kw, kw, _holds) in enumerate(MESH_CELLS):
        try:
            pm, losses, facts = _train(name, dtype, mesh_kw, kw)
        except Exception as e:  # noqa: BLE001
            out[cell] = f"failed: {type(e).__name__}: {e}"
            continue
        sd = autopar.export_state_dict(pm, f"{tmp}/mesh{i}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, facts)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    for name, dtype, cp in sorted({(c[1], c[2], False) for c in EXACT_CELLS} |
                                  {(c[1], c[2], "cp" in c[4]) for c in MESH_CELLS}, key=str):
        capture_before_fork(_build(name, dtype), (_batches()[0][0],), cp=cp)
    tmp = str(tmp_path_factory.mktemp("compose_precision"))
    return {"exact": world(2, _exact_world, tmp, timeout_s=600), "mesh": world(4, _mesh_world, tmp, timeout_s=600)}


def _recipe(name, dtype, parts):
    """One process, the cell's precision recipe written out (module docstring): (losses, first
    and final values of the tensors the optimizer steps, by name)."""
    pure = dtype == torch.bfloat16
    masters = _build(name, dtype) if pure else _build(name, dtype).float()  # fp32: exact copies
    first = {k: v.detach().clone() for k, v in masters.named_parameters()}
    opt = torch.optim.AdamW(masters.parameters(), lr=LR)
    scale = 1.0 if pure else S16
    losses = []
    for x, y in _batches():
        low = copy.deepcopy(masters).to(dtype)
        step = []
        for r in range(parts):
            rows = slice(r * BATCH // parts, (r + 1) * BATCH // parts)
            out = low(x[rows])
            loss = _loss(out, y[rows])
            (loss * scale).backward()  # fp16: the fp32 loss scaled, as the program does (zero_optim.loss_scale_factor)
            step.append(loss.detach().float())
            for m, p in zip(masters.parameters(), low.parameters()):
                g = p.grad.clone() if pure else p.grad.float() / scale
                m.grad = g if m.grad is None else m.grad + g
            low.zero_grad()
        for m in masters.parameters():
            m.grad /= parts
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step).mean().item())
    return losses, first, {k: v.detach().clone() for k, v in masters.named_parameters()}


def _check_facts(cell, dtype, fields, got, kw):
    for rank, (_l, _sd, f) in enumerate(got):
        assert f["fields"] == fields, (cell, rank, f["fields"])
        assert f["stepped"] == (["torch.bfloat16"] if dtype == torch.bfloat16 else ["torch.float32"]), (cell, f)
        assert f["zero"] == [kw.get("zero_stage", 0)] and f["offload"] == [bool(kw.get("offload"))], (cell, rank, f)
        if dtype == torch.float16:  # the default scale fits this model: no step skipped, the scale kept
            assert f["skipped"] == [False] * STEPS and f["scales"] == [S16] * STEPS, (cell, rank, f)


@pytest.mark.parametrize("cell", [c[0] for c in EXACT_CELLS])
def test_precision_cell_on_dp2_matches_the_one_process_recipe(results, cell):
    name, dtype, fields, kw = next(c[1:] for c in EXACT_CELLS if c[0] == cell)
    got = [r[cell] for r in results["exact"]]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    _check_facts(cell, dtype, fields, got, kw)
    ref_losses, _first, ref = _recipe(name, dtype, parts=2)
    for losses, *_ in got:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), **EXACT_LOSS)
    sd = got[0][1]
    assert set(ref) <= set(sd), sorted(set(ref) - set(sd))
    tol = BF16_PARAM if dtype == torch.bfloat16 else EXACT_PARAM
    for k, want in ref.items():
        assert sd[k].dtype == want.dtype, (cell, k, sd[k].dtype, want.dtype)
        torch.testing.assert_close(sd[k], want, **tol, msg=lambda m, k=k: f"{cell} {k}: {m}")


@pytest.mark.parametrize("cell", [c[0] for c in MESH_CELLS])
def test_16_bit_precision_with_a_model_parallel_axis_matches_the_one_process_recipe(results, cell):
    name, dtype, fields, _mesh, kw, holds = next(c[1:] for c in MESH_CELLS if c[0] == cell)
    got = [r[cell] for r in results["mesh"]]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    _check_facts(cell, dtype, fields, got, kw)
    for rank, (_l, _sd, f) in enumerate(got):
        missing = [h for h in holds if not f[h]]
        assert not missing, f"{cell} rank {rank}: the program lacks {missing}"
    ref_losses, first, ref = _recipe(name, dtype, parts=1)
    for losses, *_ in got:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=MP_LOSS, atol=0)
    assert_within_move(got[0][1], first, ref, MP_PARAM, cell)
