"""The joint planner's cp plan, carried out by `autopar.parallelize` on 4 gloo ranks, against one
process.

A GPT (fp64, 256 tokens a row, 2 rows) is planned for 4 ranks of the cpu-gloo profile under a
2 MiB limit, where no plan without cp fits (tests/unit/test_planner_context.py checks that
with the planner itself): the planner picks a mesh with a cp axis and an exchange, and writes
the Plan (mesh, ZeRO stage over dp+cp, recompute, fusions, `plan.extra["context"]`). Every
rank runs that Plan through `parallelize(plan=...)`: the rewritten program must hold the
planned exchange (ring_attention or ulysses_attention, no plain attention) and train like one
process: the loss of each of three AdamW steps and every parameter after them within 1e-9 in
float64 (as tests/dist/test_context_parallel.py: the exchange only reorders sums).
"""
import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.capture import capture
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.search.planner import clear_cache, plan_for
from harness import world
from reference_train import adamw_steps

BATCH, SEQ, STEPS, TOL, LIMIT = 2, 256, 3, 1e-9, 2 * 2**20


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


def _train(rank, ws, plan_json):
    plan = Plan.from_json(plan_json)
    batches = _batches()
    pm = autopar.parallelize(_build(), autopar.mesh(**plan.mesh), plan=plan, example_inputs=batches[0][0],
                             hardware="cpu-gloo")
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    losses = []
    for x, y in batches:
        losses.append(pm.step((x, y), _loss).item())
        opt.step()
        opt.zero_grad()
    code = "".join(m.code for m in pm.graph_module.modules() if hasattr(m, "code"))
    return losses, pm.engine.gather_full_state_dict(), pm.mesh.coords(rank), code, dict(pm.plan.mesh)


@pytest.fixture(scope="module")
def planned():
    return _planned()


@pytest.fixture(scope="module")
def results(planned):
    return world(4, _train, planned.to_json(), timeout_s=600)


def test_the_planner_puts_a_cp_axis_on_the_long_sequence(planned):
    assert planned.mesh.get("cp", 1) > 1, planned.mesh
    assert planned.extra["context"]["method"] in ("ring", "ulysses")


def test_the_planned_cp_plan_trains_like_one_process_after_three_adamw_steps(planned, results):
    ref_losses, ref_params = _reference()
    method = planned.extra["context"]["method"]
    for losses, _sd, _coords, code, mesh in results:
        assert mesh == planned.mesh
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=TOL)
        assert f"{method}_attention" in code and "scaled_dot_product_attention" not in code, method
    holder = next(r for r in results if r[2].get("dp", 0) == 0 and r[2].get("cp", 0) == 0)
    for name, ref in ref_params.items():
        torch.testing.assert_close(holder[1][name], ref, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
