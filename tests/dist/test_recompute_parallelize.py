"""`parallelize(..., memory_budget=...)` recomputes activations and still trains like one
process: dp=2, tp=2 and pp=2 (regions inside the stages) at budget 0.3 (reference GPT, three AdamW steps; losses to 1e-5,
parameters to 1e-4 as the other parity tests; recomputation itself is bit-exact on one
process, tests/unit/test_recompute.py)."""
import torch

import autopar
from autopar.models import get
from autopar.passes.recompute import CheckpointRegion
from harness import world


def _reference():
    spec = get("gpt-tiny")
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
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _run(rank, ws):
    spec = get("gpt-tiny")
    out = []
    for kw in ({"dp": ws}, {"tp": ws}, {"pp": ws}):
        torch.manual_seed(0)
        model = spec.build()
        x0, _ = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
        pm = autopar.parallelize(model, autopar.mesh(**kw), example_inputs=x0, memory_budget=0.3,
                                 hardware="h100-sxm", n_microbatches=2 if "pp" in kw else None)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = spec.example_batch(8, generator=g)
            losses.append(pm.step((x, y), spec.loss_fn).item())
            opt.step()
            opt.zero_grad()
        regions = sum(1 for m in pm.program.module.modules() if isinstance(m, CheckpointRegion))
        params = {k: v.detach() for k, v in pm.program.module.named_parameters()} if "pp" not in kw else {}
        out.append((kw, losses, dict(pm.plan.recompute), regions, params,
                    {k: str(l) for k, l in pm.plan.param_layouts.items()}))
    return out


def test_memory_budget_recomputes_and_matches_one_process():
    ref_losses, ref_params = _reference()
    res = world(2, _run)
    for kw, losses, modes, regions, params, layouts in res[0]:
        assert any(v != "none" for v in modes.values()), f"{kw}: budget 0.3 chose no recomputation: {modes}"
        assert regions > 0, f"{kw}: no checkpoint region in the program"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        if "dp" in kw:
            for k, ref in ref_params.items():
                torch.testing.assert_close(params[k], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kw} {k}: {m}")
