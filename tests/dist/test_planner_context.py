"""The joint planner's cp plan, carried out by `autopar.parallelize` on 4 gloo ranks, against one
process.

A GPT (fp64, 256 tokens a row, 2 rows) is planned for 4 ranks of the cpu-gloo profile under a
2.25 MiB limit, where no plan without cp fits (tests/unit/test_planner_context.py checks that
with the planner itself): the planner picks a mesh with a cp axis and an exchange, and writes
the Plan (mesh, ZeRO stage over dp+cp, recompute, fusions, `plan.extra["context"]`). Every
rank runs that Plan through `parallelize(plan=...)`: the rewritten program must hold the
planned exchange (ring_attention or ulysses_attention, no plain attention) and train like one
process: the loss of each of three AdamW steps and every parameter after them within 1e-9 in
float64 (as tests/dist/test_context_parallel.py: the exchange only reorders sums).

The same model through the default door, `autopar.parallelize(model, autopar.mesh(world_size=4),
example_inputs=...)` with no limit: parallelize captures the token sequence symbolic for the
planner (`autopar.capture.capture_for_search`), which puts a cp axis next to dp for 2 rows of 256
tokens (dp cannot split 2 rows 4 ways), and the plan trains like one process (same tolerance).
A short sequence (gpt-tiny, 8 rows of 16 tokens) on the same door keeps cp off, as the cost
model says, and whatever plan is chosen trains like one process on the symbolic-sequence graph;
so does tp2 x pp2 pinned on it (the tensor-parallel pipeline on a symbolic sequence: losses).
"""
import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.capture import capture
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.search.planner import clear_cache, plan_for
from harness import capture_before_fork, world
from reference_train import adamw_steps

BATCH, SEQ, STEPS, TOL, LIMIT = 2, 256, 3, 1e-9, 2.25 * 2**20


def _build():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=SEQ)
    return GPT(cfg).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))  # next-token targets, shifted outside the model
    return out


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _reference():
    losses, model = adamw_steps(_build(), _batches(), _loss, lr=1e-2)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _planned() -> Plan:
    gm = capture(_build(), (_batches()[0][0],), dynamic_seq=True)
    clear_cache()
    plan, _report = plan_for(gm, 4, "cpu-gloo", memory_limit=LIMIT)
    return plan


def _short_build():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny()).double()


def _short_batches():
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (8, 17), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _train(rank, ws, plan_json, build=_build, batches=_batches, pins=None):
    plan = Plan.from_json(plan_json) if plan_json else None
    mesh = autopar.mesh(**plan.mesh) if plan else autopar.mesh(world_size=ws)  # None: the joint planner's door
    batches = batches()
    pm = autopar.parallelize(build(), mesh, plan=plan, example_inputs=batches[0][0], hardware="cpu-gloo", pins=pins)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    losses = []
    for x, y in batches:
        losses.append(pm.step((x, y), _loss).item())
        opt.step()
        opt.zero_grad()
    code = "".join(m.code for m in pm.graph_module.modules() if hasattr(m, "code"))
    src = pm.program if hasattr(pm.program, "gather_full_state_dict") else pm.engine  # a pipeline: its stages'
    return (losses, src.gather_full_state_dict(), pm.mesh.coords(rank), code, dict(pm.plan.mesh),
            pm.capture_info.get("sequence"), pm.plan.extra.get("context", {}).get("method"))


def _worlds(rank, ws, plan_json):
    return {"given": _train(rank, ws, plan_json), "searched": _train(rank, ws, None),
            "short": _train(rank, ws, None, _short_build, _short_batches),
            "short tp x pp": _train(rank, ws, None, _short_build, _short_batches, {"tp": 2, "pp": 2})}


@pytest.fixture(scope="module")
def planned():
    return _planned()


@pytest.fixture(scope="module")
def runs(planned):
    # the joint planner's captures, once here (the given plan's was made by `planned`): the forked
    # ranks reuse them from autopar's capture memo
    for build, batches in ((_build, _batches), (_short_build, _short_batches)):
        capture_before_fork(build(), batches()[0][0], search_world=4)
    return world(4, _worlds, planned.to_json(), timeout_s=600)


@pytest.fixture(scope="module")
def results(runs):
    return [r["given"] for r in runs]


def test_the_planner_puts_a_cp_axis_on_the_long_sequence(planned):
    assert planned.mesh.get("cp", 1) > 1, planned.mesh
    assert planned.extra["context"]["method"] in ("ring", "ulysses")


def test_the_planned_cp_plan_trains_like_one_process_after_three_adamw_steps(planned, results):
    ref_losses, ref_params = _reference()
    method = planned.extra["context"]["method"]
    for losses, _sd, _coords, code, mesh, *_capture in results:
        assert mesh == planned.mesh
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
        assert f"{method}_attention" in code and "scaled_dot_product_attention" not in code, method
    holder = next(r for r in results if r[2].get("dp", 0) == 0 and r[2].get("cp", 0) == 0)
    for name, ref in ref_params.items():
        torch.testing.assert_close(holder[1][name], ref, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_parallelize_on_a_world_size_mesh_plans_cp_for_the_long_sequence_and_trains_like_one_process(runs):
    got = [r["searched"] for r in runs]
    ref_losses, ref_params = _reference()
    for losses, _sd, _coords, code, mesh, sequence, method in got:
        assert sequence == {"dynamic": True, "why": ""}, sequence
        assert mesh.get("cp", 1) > 1 and method in ("ring", "ulysses"), (mesh, method)
        assert f"{method}_attention" in code and "scaled_dot_product_attention" not in code, method
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
    holder = next(r for r in got if r[2].get("dp", 0) == 0 and r[2].get("cp", 0) == 0)
    for name, ref in ref_params.items():
        torch.testing.assert_close(holder[1][name], ref, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_a_short_sequence_keeps_cp_off_and_its_plan_trains_like_one_process_on_the_symbolic_graph(runs):
    got = [r["short"] for r in runs]
    ref_losses, model = adamw_steps(_short_build(), _short_batches(), _loss, lr=1e-2)
    for losses, _sd, _coords, _code, mesh, sequence, _method in got:
        assert sequence == {"dynamic": True, "why": ""} and mesh.get("cp", 1) == 1, (sequence, mesh)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
    full = {k: v for r in got if r[2].get("dp", 0) == 0 and r[2].get("tp", 0) == 0 for k, v in r[1].items()}
    for name, ref in model.named_parameters():
        torch.testing.assert_close(full[name], ref.detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_a_tensor_parallel_pipeline_trains_like_one_process_on_the_symbolic_sequence_graph(runs):
    ref_losses, _model = adamw_steps(_short_build(), _short_batches(), _loss, lr=1e-2)
    for losses, _sd, _coords, _code, mesh, sequence, _method in (r["short tp x pp"] for r in runs):
        assert mesh == {"pp": 2, "tp": 2} and sequence == {"dynamic": True, "why": ""}, (mesh, sequence)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
