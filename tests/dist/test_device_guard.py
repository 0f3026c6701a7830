"""Collectives run on the group's device: a CPU check for the class of bug NCCL rejects.

Under NCCL a CPU tensor on the default group or a mesh group fails ("No backend type
associated with device type cpu"), and host-side values must go over a gloo group made for
them (`runtime.mesh.host_group`). On gloo that mistake passes silently, so these tests run
real paths on a 2-rank gloo world under `tests/device_guard.DeviceGuard`, which rejects any
collective whose tensor was made on the host (no device named) but sent over a device group,
or a non-CPU tensor sent over a host group (see its docstring for the exact rule):

* the API: parallelize + step + optimizer step + checkpoint save / load + export_state_dict
  at dp=2, then ZeRO-3 at dp=2, tp=2 and pp=2 (two micro-batches), each a real step, a save
  and a load;
* the command-line worker: a `candidates` job (what `autopar tune` runs: building, interleaved
  timed steps, the memory step, `result()`), `run_plan` (what `autopar run` trains with), and
  the collective microbenchmarks of `autopar tune` on a mesh group.

Each world returns the violations with their call sites; the test also checks that host and
device collectives both ran (a guard that saw nothing would pass anything). A unit test shows
the guard rejects the exact mistake that failed on the H100: an all-reduce of a host tensor
on the default group.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from harness import world

MODEL = "gpt-tiny"
BATCH, SEQ = 4, 16


def _spec():
    from autopar import models

    return models.get(MODEL)


def _batch(i: int):
    return _spec().example_batch(BATCH, seq_len=SEQ, generator=torch.Generator().manual_seed(10 + i))


def _train(pm, opt, steps: int = 1) -> list[float]:
    out = []
    for i in range(steps):
        out.append(float(pm.step(_batch(i), _spec().loss_fn).item()))
        opt.step()
        opt.zero_grad()
    return out


def _api_paths(rank: int, ws: int, tmp: str):
    import autopar
    from device_guard import DeviceGuard

    torch.manual_seed(0)
    with DeviceGuard("cpu") as guard:
        x, _ = _batch(0)
        model = _spec().build()
        pm = autopar.parallelize(model, autopar.mesh(dp=ws), example_inputs=x)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
        losses = _train(pm, opt, 2)
        autopar.save(pm, os.path.join(tmp, "dp"), optimizer=opt, step=2)
        autopar.load(pm, os.path.join(tmp, "dp"), optimizer=opt)
        full = autopar.export_state_dict(pm, like=model)
        meshes = []
        # h100-sxm: gloo's profile would (rightly) keep a tiny model replicated at tp=2
        for name, axes, opts in (("z3", {"dp": ws}, {"zero_stage": 3}), ("tp", {"tp": ws}, {"hardware": "h100-sxm"}),
                                 ("pp", {"pp": ws}, {"n_microbatches": 2})):
            torch.manual_seed(0)
            pm2 = autopar.parallelize(_spec().build(), autopar.mesh(**axes), example_inputs=x, **opts)
            opt2 = autopar.optimizer(pm2, torch.optim.AdamW, lr=1e-3)
            _train(pm2, opt2, 1)
            autopar.save(pm2, os.path.join(tmp, name), optimizer=opt2)
            autopar.load(pm2, os.path.join(tmp, name), optimizer=opt2)
            meshes.append(dict(pm2.plan.mesh))
        dist.barrier()
    return {"violations": guard.violations, "calls": dict(guard.calls), "losses": losses,
            "exported": len(full), "meshes": meshes}


def _worker_paths(rank: int, ws: int, tmp: str):
    from autopar.tools import worker
    from autopar.tools.microbench import run_collective
    from autopar.tools.model_source import resolve
    from autopar.passes.plan import Plan
    from autopar.runtime.mesh import Mesh
    from device_guard import DeviceGuard

    plan_path = os.path.join(tmp, "plan.json")
    with DeviceGuard("cpu") as guard:
        job = {"kind": "candidates", "model": MODEL, "plans": [{"id": "c0", "path": plan_path}],
               "out": os.path.join(tmp, "tune"), "batch": BATCH, "seq": SEQ, "warmup": 1, "steps": 2,
               "interleave": False}
        worker.run_job(job)
        res = worker.run_plan(resolve(MODEL), Plan.from_json(open(plan_path).read()), batch=BATCH, seq=SEQ,
                              warmup=0, steps=1, hardware=None, device=worker._device(), measure_memory=False)
        mesh = Mesh({"dp": ws}, device_type="cpu")
        timed = [run_collective({"kind": "collective", "op": op, "payload": 4096}, mesh.group("dp"), "cpu")
                 for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")]
    return {"violations": guard.violations, "calls": dict(guard.calls), "run_plan": res,
            "timed": [t["seconds"] for t in timed]}


def _kinds(calls: dict) -> set[str]:
    return {kind for (_, kind) in calls}


def test_parallelize_step_optimizer_checkpoint_and_export_send_no_host_tensor_over_a_device_group(tmp_path):
    out = world(2, _api_paths, str(tmp_path))
    for r, res in enumerate(out):
        assert res["violations"] == [], f"rank {r}:\n" + "\n".join(res["violations"])
        assert _kinds(res["calls"]) == {"host", "device"}, res["calls"]  # both kinds were checked
        assert all(l == l for l in res["losses"]) and res["meshes"] == [{"dp": 2}, {"tp": 2}, {"pp": 2}]
    assert out[0]["exported"] > 0


def test_the_tune_and_run_worker_send_host_values_over_the_host_group_only(tmp_path):
    from autopar.tools.model_source import resolve
    from autopar.tools.planning import materialise, plan_model

    # the plan the worker runs, made as `autopar plan --mesh dp=2 --out plan.json` makes it
    planned = plan_model(resolve(MODEL), mesh={"dp": 2}, hardware="cpu-gloo", batch=BATCH, seq=SEQ)
    (tmp_path / "plan.json").write_text(materialise(planned, 0).to_json())
    out = world(2, _worker_paths, str(tmp_path))
    for r, res in enumerate(out):
        assert res["violations"] == [], f"rank {r}:\n" + "\n".join(res["violations"])
        assert _kinds(res["calls"]) == {"host", "device"}, res["calls"]
        assert res["run_plan"]["step_s"] > 0 and all(t > 0 for t in res["timed"])
    got = json.loads((tmp_path / "tune" / "runs" / "c0.json").read_text())
    assert got["ok"] and got["step_s"] > 0 and got["world_size"] == 2, got


def _host_tensor_on_default_group(rank: int, ws: int):
    from autopar.runtime.mesh import host_group
    from device_guard import DeviceGuard

    with DeviceGuard("cpu") as guard:
        wall = torch.tensor([0.1 * (rank + 1)], dtype=torch.float64)  # a host value, as worker.result() had it
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the default group: NCCL on a GPU
        rejected = list(guard.violations)
        again = torch.tensor([0.1 * (rank + 1)], dtype=torch.float64)
        dist.all_reduce(again, op=dist.ReduceOp.MAX, group=host_group())  # the fix: the host group
        placed = torch.ones(2).to(torch.device("cpu"))  # placed on the group's device explicitly
        dist.all_reduce(placed)
    return rejected, guard.violations[len(rejected):], float(again), placed.tolist()


def test_the_guard_rejects_a_host_tensor_on_the_default_group_and_accepts_the_host_group():
    for rejected, later, again, placed in world(2, _host_tensor_on_default_group):
        assert len(rejected) == 1 and "all_reduce" in rejected[0] and "test_device_guard.py" in rejected[0], rejected
        assert later == []
        assert again == 0.2 and placed == [2.0, 2.0]


def _mesh_device_with_a_gpu_visible(rank: int, ws: int):
    import autopar
    from autopar.tools import worker

    torch.cuda.is_available = lambda: True  # as on the GPU machine; this forked rank only
    return autopar.mesh(dp=ws).device_type, worker._device()


def test_a_gloo_world_stays_on_the_cpu_where_a_gpu_is_visible_and_planning_picks_the_gpu(monkeypatch):
    from autopar.runtime.launch import default_start_method
    from autopar.runtime.mesh import make_mesh

    # a forked gloo world must never touch CUDA ("Cannot re-initialize CUDA in forked subprocess")
    assert world(2, _mesh_device_with_a_gpu_visible) == [("cpu", "cpu")] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_mesh(dp=8).device_type == "cuda"  # no process group: planning for the GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    # a GPU build of torch forks gloo worlds from a fork server (autograd refuses a plain fork)
    gpu_build = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    assert default_start_method("nccl") == "spawn"
    assert default_start_method("gloo") == ("forkserver" if gpu_build else "fork")
