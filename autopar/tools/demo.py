"""`autopar demo`: the quick-start job. Parallelise a reference model on a local gloo world,
train a few steps, print the losses next to one process's and the parameters' largest
difference, and write a dump. Exit 0 on parity, 1 otherwise.

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import sys
import time

def _demo_rank(rank: int, world_size: int, model_name: str, steps: int, batch: int, out: str, zero_stage: int):
    import torch

    import autopar
    from autopar.models import get

    spec = get(model_name)
    torch.manual_seed(0)
    model = spec.build()
    gen = torch.Generator().manual_seed(1)
    x0, _ = spec.example_batch(batch, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.mesh(dp=world_size), example_inputs=x0, zero_stage=zero_stage)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    losses = []
    for _ in range(steps):
        x, y = spec.example_batch(batch, generator=gen)
        losses.append(pm.step((x, y), spec.loss_fn).item())
        opt.step()
        opt.zero_grad()
    files = pm.dump(out)
    params = {k: v.detach().clone() for k, v in pm.program.module.named_parameters()}
    return {"losses": losses, "plan": pm.plan_text() if rank == 0 else "", "files": files, "params": params}


def _one_process(model_name: str, steps: int, batch: int):
    import torch

    from autopar.models import get

    spec = get(model_name)
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = spec.example_batch(batch, generator=gen)
        loss = spec.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def cmd_demo(a) -> int:
    from autopar.runtime.launch import run_world

    if a.batch % a.world_size:
        print(f"error: --batch {a.batch} does not divide by --world-size {a.world_size}", file=sys.stderr)
        return 2
    from autopar import parallelize  # noqa: F401 - autopar's public names load on first use: here, not in each rank
    t0 = time.perf_counter()
    results = run_world(a.world_size, _demo_rank, a.model, a.steps, a.batch, a.out, a.zero_stage)
    t_par = time.perf_counter() - t0
    ref_losses, ref_params = _one_process(a.model, a.steps, a.batch)
    print(results[0]["plan"])
    print(f"\n{a.model}: {a.world_size} processes (gloo) vs one process, AdamW lr 1e-2, global batch {a.batch}")
    print(f"{'step':>4}  {'autopar loss':>14}  {'one-process loss':>16}  {'|diff|':>9}")
    for i, (l, r) in enumerate(zip(results[0]["losses"], ref_losses)):
        print(f"{i:>4}  {l:>14.6f}  {r:>16.6f}  {abs(l - r):>9.2e}")
    worst = max((results[r]["params"][k] - v).abs().max().item() for r in range(a.world_size)
                for k, v in ref_params.items())
    loss_ok = all(abs(l - r) <= 1e-5 + 1e-4 * abs(r) for l, r in zip(results[0]["losses"], ref_losses))
    ok = loss_ok and worst <= 1e-4
    print(f"parameters after {a.steps} steps: max |autopar - one process| = {worst:.2e} over all ranks "
          f"(tolerance 1e-4)")
    print(f"parity: {'OK' if ok else 'FAILED'}   (parallel run {t_par:.1f} s)")
    files = sorted({f for r in results for f in r["files"]})
    print(f"dump written: {', '.join(files)}")
    return 0 if ok else 1
