"""Pairs (and triples) of strategies that docs/support_matrix.md listed as untested, trained
through `autopar.parallelize` on 4 gloo ranks against one process: ZeRO x recompute / cp /
fusions / pp, offload x tp / recompute / cp / ep / tied / fusions / micro-batches, fusions x tp
/ recompute / cp / ep / pp / tied / micro-batches, cp x tied / micro-batches, recompute x tied,
ep x ZeRO-3 with the load-balancing loss on, ep x tied embeddings. (ep x recompute, refused here
before issue 21, trains now: tests/dist/test_moe_context_recompute.py.)

One spawned world runs every cell. Each cell: the reference GPT (or MoE) in float64, three
AdamW steps at lr 1e-2 on the same batches as one process; the loss of every step within
1e-9, and every parameter after the steps (the full state dict exported from the parallel
model, `autopar.export_state_dict`) within 1e-9: the strategies only reorder sums. Fusions run
their torch reference on the CPU (the rewrite is what is checked here; the kernels are checked
compiled on a GPU by tests/unit/test_kernels.py), and the test asserts each cell's program
really holds what the cell names (fused calls, checkpoint regions, the cp exchange, expert
dispatch, ZeRO shards).
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from harness import capture_before_fork, world
from reference_train import adamw_steps, token_batches

BATCH, SEQ, STEPS, TOL = 8, 16, 3, 1e-9
FUSIONS = ["add_rms_norm", "rms_norm", "rope", "swiglu", "cross_entropy"]


def _build(name):
    torch.manual_seed(0)
    if name in ("moe", "moe-tied"):
        import dataclasses

        from autopar.models import MoE, MoEConfig

        return MoE(dataclasses.replace(MoEConfig.tiny(), tie_embeddings=name == "moe-tied")).double()
    from autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig.tiny()
    if name == "gpt-tied":
        import dataclasses

        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    return GPT(cfg).double()


def _loss(out, y):
    logits, aux = (out, 0.0) if isinstance(out, torch.Tensor) else (out[0], out[1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) + aux


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


@functools.cache  # one per model, shared by its cells (the tests only read it)
def _reference(name):
    losses, model = adamw_steps(_build(name), _batches(), _loss, lr=1e-2)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


H100 = {"hardware": "h100-sxm"}  # plans that shard the tiny models on tp (gloo's profile replicates them)
CELLS = [  # (cell, model, mesh, parallelize keywords, what the program must hold)
    ("Z3 x rc", "gpt", dict(dp=4), dict(zero_stage=3, memory_budget=0.0), ["region"]),
    ("Z1 x rc", "gpt", dict(dp=4), dict(zero_stage=1, memory_budget=0.3), ["region"]),
    ("Z1 x cp", "gpt", dict(dp=2, cp=2), dict(zero_stage=1, context_method="ring"), ["ring_attention"]),
    ("Z2 x cp", "gpt", dict(dp=2, cp=2), dict(zero_stage=2, context_method="ulysses"), ["ulysses_attention"]),
    ("off x tp", "gpt", dict(dp=2, tp=2), dict(zero_stage=1, offload=True, **H100), ["tp"]),
    ("off x rc", "gpt", dict(dp=4), dict(zero_stage=3, offload=True, memory_budget=0.0), ["region"]),
    ("tp x fus", "gpt", dict(dp=2, tp=2), dict(pins={"fusions": FUSIONS}, **H100), ["tp", "swiglu", "rope"]),
    ("rc x fus", "gpt", dict(dp=4), dict(memory_budget=0.0, pins={"fusions": FUSIONS}), ["region", "swiglu"]),
    ("cp x fus", "gpt", dict(dp=2, cp=2), dict(context_method="ring", pins={"fusions": FUSIONS}),
     ["ring_attention", "swiglu"]),
    ("ep x Z3 (aux loss on)", "moe", dict(dp=2, ep=2), dict(zero_stage=3), ["dispatch"]),
    ("dp x tie x fus", "gpt-tied", dict(dp=4), dict(pins={"fusions": FUSIONS}), ["swiglu"]),
    # triples: each covers three pairs at once
    ("dp x off", "gpt", dict(dp=4), dict(zero_stage=0, offload=True), []),
    ("Z2 x rc x fus", "gpt", dict(dp=4), dict(zero_stage=2, memory_budget=0.3, pins={"fusions": FUSIONS}),
     ["region", "swiglu"]),
    ("Z3 x fus x mb", "gpt", dict(dp=4), dict(zero_stage=3, n_microbatches=2, pins={"fusions": FUSIONS}), ["swiglu"]),
    ("off x cp x Z3", "gpt", dict(dp=2, cp=2), dict(zero_stage=3, offload=True, context_method="ring"),
     ["ring_attention"]),
    ("off x ep", "moe", dict(dp=2, ep=2), dict(zero_stage=1, offload=True), ["dispatch"]),
    ("ep x fus", "moe", dict(dp=2, ep=2), dict(pins={"fusions": FUSIONS}), ["dispatch", "rope"]),
    ("ep x tie", "moe-tied", dict(dp=2, ep=2), dict(zero_stage=1), ["dispatch"]),
    ("off x tie x fus x mb", "gpt-tied", dict(dp=4), dict(zero_stage=1, offload=True, n_microbatches=2,
                                                           pins={"fusions": FUSIONS}), ["swiglu"]),
    ("cp x tie x mb", "gpt-tied", dict(dp=2, cp=2), dict(context_method="ulysses", n_microbatches=2),
     ["ulysses_attention"]),
    ("rc x tie", "gpt-tied", dict(dp=4), dict(memory_budget=0.0), ["region"]),
    ("Z2 x pp", "gpt", dict(dp=2, pp=2), dict(zero_stage=2, n_microbatches=2), []),
    ("pp x fus", "gpt", dict(dp=2, pp=2), dict(n_microbatches=2, pins={"fusions": FUSIONS}), ["swiglu"]),
    # micro-batches with tp and with recompute outside a pipeline (one stage: the program's own loop)
    ("tp x rc x mb", "gpt", dict(dp=2, tp=2), dict(n_microbatches=2, memory_budget=0.3, **H100), ["tp", "region"]),
]


def _cells(rank, ws, tmp):
    out = {}
    for cell, name, mesh_kw, kw, _holds in CELLS:
        model = _build(name)
        batches = _batches()
        try:
            pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],), **kw)
        except ValueError as e:  # reported per cell, so that one refusal does not hide the others
            out[cell] = f"refused: {e}"
            continue
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for x, y in batches:
            losses.append(pm.step(((x,), y), _loss).item())
            opt.step()
            opt.zero_grad()
        code = "".join(m.code for m in pm.graph_module.modules() if hasattr(m, "code"))
        holds = {"region": any(type(m).__name__ == "CheckpointRegion" for m in pm.graph_module.modules()),
                 "tp": any(any(a == "tp" and str(p) != "R" for a, p in lay.axes)
                           for lay in pm.plan.param_layouts.values()),
                 "dispatch": "dispatch" in code, "ring_attention": "ring_attention" in code,
                 "ulysses_attention": "ulysses_attention" in code, "swiglu": "swiglu" in code,
                 "rope": "rope" in code}
        sd = autopar.export_state_dict(pm, f"{tmp}/{cell.replace(' ', '_')}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, holds)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # each structure (model x cp or not) captured once here: the forked ranks reuse the graph
    for name, cp in sorted({(c[1], "cp" in c[2]) for c in CELLS}):
        capture_before_fork(_build(name), (_batches()[0][0],), cp=cp)
    return world(4, _cells, str(tmp_path_factory.mktemp("compose")), timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_pair_matches_one_process_after_three_adamw_steps(results, cell):
    name, holds = next((c[1], c[4]) for c in CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    ref_losses, ref_params = _reference(name)
    for losses, _sd, have in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
        missing = [h for h in holds if not have[h]]
        assert not missing, f"{cell}: the program lacks {missing}: {have}"
    sd = got[0][1]  # rank 0 holds the export
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].to(ref.dtype), ref, rtol=TOL, atol=TOL, msg=lambda m: f"{cell} {k}: {m}")
