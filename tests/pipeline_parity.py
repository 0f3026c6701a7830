"""The pipeline parity loop the pipeline tests share: train a pipeline rank's Program a few steps on one
batch and compare with one process's losses, first-step gradients and final parameters."""
from __future__ import annotations

import torch


def train_and_compare(program, opt, batch, loss_fn, ref, *, steps: int, tol: dict, what: str,
                      check_grads: bool = True) -> tuple[list[float], list[str], dict]:
    """Run `steps` steps of `program` (zero_grad, step, opt.step) on `batch` and assert them equal
    to `ref` = (losses, first-step grads, params after the steps) within `tol`. Returns (losses,
    the parameter names this rank holds, the gathered full state dict)."""
    ref_losses, ref_grads, ref_params = ref
    losses = []
    for k in range(steps):
        opt.zero_grad()
        losses.append(program.step(batch, loss_fn).item())
        if k == 0 and check_grads:
            for s, mod in program.stages.items():
                for n, p in mod.named_parameters():
                    torch.testing.assert_close(p.grad, ref_grads[n], **tol,
                                               msg=lambda msg: f"{what}: grad of stage {s} {n}: {msg}")
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol,
                               msg=lambda msg: f"{what}: losses: {msg}")
    full = program.engine.gather_full_state_dict()
    held = sorted({n for mod in program.stages.values() for n, _ in mod.named_parameters()})
    for n in held:
        torch.testing.assert_close(full[n].float(), ref_params[n], **tol,
                                   msg=lambda msg: f"{what}: {n} after {steps} steps: {msg}")
    return losses, held, full


def reference_run(model, batch, loss_fn, *, steps: int, adamw: dict) -> tuple[list[float], dict, dict]:
    """One process: a copy of `model` trained `steps` AdamW steps on `batch` = (x, y). Returns
    (losses, first-step gradients, parameters after the steps), tied names listed under each name."""
    import copy

    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses, grads0 = [], None
    for k in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        losses.append(loss.item())
        if k == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
    return losses, grads0, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
