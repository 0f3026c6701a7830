"""Expert parallelism through `autopar.parallelize`: a mesh with an `ep` axis on the reference
MoE (load-balancing loss on) trains like one process — losses of three AdamW steps to 1e-5 —
at ep=2 and dp=2 x ep=2. (Parameters, gradients, capacity drops and the dispatch round trip
are checked in tests/dist/test_expert_parallel.py.)"""
import torch

import autopar
from autopar.models import get
from harness import world


def _reference():
    spec = get("moe-tiny")
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = spec.example_batch(8, generator=g)
        loss = spec.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(rank, ws, kw):
    spec = get("moe-tiny")
    torch.manual_seed(0)
    model = spec.build()
    x0, _ = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.mesh(**kw), example_inputs=x0)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = spec.example_batch(8, generator=g)
        losses.append(pm.step((x, y), spec.loss_fn).item())
        opt.step()
        opt.zero_grad()
    a2a = sum(1 for n in pm.graph_module.graph.nodes if "dispatch" in str(n.target))
    return losses, a2a, pm.plan.extra["expert"]["blocks"] is not None


def test_ep2_and_dp2_ep2_match_one_process_with_the_aux_loss():
    ref = _reference()
    for n, kw in ((2, {"ep": 2}), (4, {"dp": 2, "ep": 2})):
        for losses, a2a, planned in world(n, _run, kw):
            assert planned and a2a > 0, f"{kw}: no expert dispatch in the program"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0, atol=1e-5,
                                       msg=lambda m: f"{kw}: {m}")
