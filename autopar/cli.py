"""The `autopar` command line.

    autopar demo  [--model gpt-tiny] [--world-size 4] [--steps 5] [--out out/demo]
        parallelise a reference model on a local CPU (gloo) world, train a few steps, print
        the plan and each step's loss next to a one-process run of the same model, and write
        a dump. This is the quick-start job.
    autopar capture --model llama3-70b [--seq 128]
        capture a model on the meta device and print the time, peak RAM and op counts.

Exit codes: 0 success, 1 parity failure, 2 bad usage or input.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import Counter


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
    import torch

    from autopar.runtime.launch import run_world

    if a.batch % a.world_size:
        print(f"error: --batch {a.batch} does not divide by --world-size {a.world_size}", file=sys.stderr)
        return 2
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


def cmd_capture(a) -> int:
    import torch

    import autopar
    from autopar.models import get

    spec = get(a.model)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(a.batch, seq_len=a.seq, device="meta")
    gm = autopar.capture(model, inputs)
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    ops = Counter(str(n.target).replace("aten.", "") for n in gm.graph.nodes if n.op == "call_function")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.model}: {n_params / 1e9:.2f} B parameters, captured on meta by "
          f"{gm.meta['autopar_capture']['path']} in {dt:.1f} s, peak RAM {rss:.2f} GiB, "
          f"{len(gm.graph.nodes)} nodes")
    for op, n in ops.most_common(8):
        print(f"  {n:>6}  {op}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Make a PyTorch model train on many devices.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    d = sub.add_parser("demo", help="parallelise a reference model on a local CPU world, train, check parity")
    d.add_argument("--model", default="gpt-tiny", help="reference model name (autopar.models.names())")
    d.add_argument("--world-size", type=int, default=4, help="number of local gloo processes")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--batch", type=int, default=8, help="global batch size")
    d.add_argument("--zero-stage", type=int, default=0)
    d.add_argument("--out", default="out/demo", help="dump directory")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("capture", help="capture a (real-size) reference model on meta; print time and RAM")
    c.add_argument("--model", default="llama3-70b")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seq", type=int, default=128)
    c.set_defaults(fn=cmd_capture)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.cmd is None:
        a = parser.parse_args(["demo", *(argv or [])])
    try:
        return a.fn(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
