"""Pipeline x tensor (x data) parallelism through `autopar.parallelize`: pp=2 x tp=2 on 4
processes and pp=2 x dp=2 x tp=2 on 8, the reference GPT, 1F1B with 4 micro-batches, against
one process (losses every step, parameters after three AdamW steps, tp shards gathered).

Tolerances as the tensor-parallel tests: losses 1e-5 absolute, parameters 1e-4 absolute (the
sharded sums change the order of additions; AdamW amplifies ulps near zero gradients)."""
import torch

import autopar
from autopar.models import get
from harness import capture_before_fork, world

LOSS_ATOL, PARAM_TOL, BATCH, STEPS = 1e-5, 1e-4, 8, 3


def _reference():
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = spec.example_batch(BATCH, generator=g)
        loss = spec.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _run(rank, ws, mesh_kw):
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    x0, _ = spec.example_batch(BATCH, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=x0, hardware="h100-sxm",
                             pins={"schedule": "1f1b"}, n_microbatches=4)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = spec.example_batch(BATCH, generator=g)
        losses.append(pm.step((x, y), spec.loss_fn).item())
        opt.step()
        opt.zero_grad()
    layouts = {k: {a: str(p) for a, p in lay.axes} for k, lay in pm.plan.param_layouts.items()}
    files = []
    if rank == 0:
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            written = pm.dump(d)
            files = sorted(os.path.basename(f) for f in written if os.path.getsize(f) > 0)
            svg = open(os.path.join(d, "schedule.svg")).read()
            assert svg.startswith("<svg") or "<svg" in svg[:200]
    return losses, pm.engine.gather_full_state_dict(), layouts, pm.mesh.coords(rank), pm.plan.split_points, files


def _check(results):
    ref_losses, ref_params = _reference()
    layouts = results[0][2]
    assert any(v.get("tp", "R") != "R" for v in layouts.values()), "the plan shards nothing on tp"
    assert results[0][4], "no pipeline split"
    files = results[0][5]
    for want in ("plan.json", "schedule.svg", "schedule.txt", "stage0.py", "stage1.py", "rank0_program.py"):
        assert want in files, f"dump lacks {want}: {files}"
    for losses, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=LOSS_ATOL)
    for name, ref in ref_params.items():
        pieces = sorted((c.get("tp", 0), sd[name]) for _l, sd, _lay, c, _s, _f in results
                        if name in sd and c.get("dp", 0) == 0)
        assert pieces, f"no rank holds {name}"
        place = layouts.get(name, {}).get("tp", "R")
        got = torch.cat([p for _, p in pieces], int(place[2:-1])) if place.startswith("S(") else pieces[0][1]
        torch.testing.assert_close(got, ref, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m: f"{name}: {m}")


def _capture_once():
    """The ranks find gpt-tiny's graph in the capture memo (harness.capture_before_fork) instead of
    each of 4 or 8 tracing it again."""
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    capture_before_fork(spec.build(), spec.example_batch(BATCH, generator=torch.Generator().manual_seed(1))[0])


def test_pp2_tp2_matches_one_process():
    _capture_once()
    _check(world(4, _run, {"pp": 2, "tp": 2}))


def test_pp2_dp2_tp2_on_8_processes_matches_one_process():
    _capture_once()
    _check(world(8, _run, {"pp": 2, "dp": 2, "tp": 2}))
