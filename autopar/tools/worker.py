"""What a launched rank runs for the command line: `python -m autopar.tools.worker job.json` under
torchrun (or `run_job(job)` inside a forked gloo world).

A job is a JSON file, one of:
  {"kind": "bench", ...}       the microbenchmarks of `autopar tune`: compute on every rank at
                               once (as training loads the machine), then each collective on
                               each axis of each listed mesh over message sizes
  {"kind": "candidates", ...}  run plans for a few real steps each: step time (of each step the
                               slowest rank; the median of the timed steps; on CPU the plans'
                               steps interleaved so that each meets the same load) and peak
                               memory per rank
  {"kind": "train", ...}       train a model under a plan for N steps (`autopar run`)

Results go to files under the job's "out" folder, one per finished item, written by rank 0,
so an interrupted job resumes where it stopped (rank 0 decides what is left and tells the
others). Rank 0 also appends progress events, one JSON object a line, to the job's
"progress" file; the launcher reads them to move its progress bars.

Devices: the job runs on the default group's device (NCCL: this rank's GPU, given to
init_process_group as device_id; gloo: the CPU). Host-side values (plans to run, step times,
peaks, errors) travel over `runtime.mesh.host_group()`, a gloo group of the whole job: NCCL
rejects CPU tensors.

Reads and writes no node.meta keys.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------ plumbing
class Events:
    """Rank 0's progress log (a no-op on other ranks)."""

    def __init__(self, path: str | None):
        self.path = path if (path and (not dist.is_initialized() or dist.get_rank() == 0)) else None

    def __call__(self, **event: Any) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")


def _write(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a killed job leaves no half-written result


def _host():
    """The job's gloo group for host-side values."""
    from autopar.runtime.mesh import host_group

    return host_group()


def _agree(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_host())
    return box[0]


def _gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_host())
    return out


def _barrier() -> None:
    dist.barrier(group=_host())


def _device() -> str:
    """The job's device type ("cuda" under NCCL, whose rank's GPU becomes current; "cpu" on gloo,
    even where a GPU is visible)."""
    from autopar.runtime.launch import local_cuda_device
    from autopar.runtime.mesh import default_device_type

    device = default_device_type()
    if device == "cuda":
        torch.cuda.set_device(local_cuda_device())
    return device


# ------------------------------------------------------------------------ bench
def coll_file(out: Path, mesh: dict[str, int], axis: str, op: str) -> Path:
    tag = "_".join(f"{a}{s}" for a, s in mesh.items())
    return out / "bench" / f"coll_{tag}_{axis}_{op}.json"


def bench(job: dict[str, Any]) -> None:
    from autopar.tools.microbench import COLLECTIVE_OPS, compute_suite, run_collective, run_compute
    from autopar.runtime.mesh import Mesh

    out, ev = Path(job["out"]), Events(job.get("progress"))
    device = _device()
    rank = dist.get_rank()
    todo = None
    if rank == 0:
        todo = {"compute": not (out / "bench" / "compute.json").exists(),
                "coll": [(m, a, op) for m in job["meshes"] for a, s in m.items() if s > 1 for op in COLLECTIVE_OPS
                         if not coll_file(out, m, a, op).exists()]}
    todo = _agree(todo)
    if todo["compute"]:
        items = compute_suite(device, job.get("quick", True))
        ev(task="compute", total=len(items), desc="compute microbenchmarks")
        results = []
        for it in items:
            _barrier()
            results.append(run_compute(it, device))
            ev(task="compute", advance=1, desc=f"{it['kind']} {it['dtype']} {it.get('shape', it.get('numel'))}")
        if rank == 0:
            _write(out / "bench" / "compute.json", {"device": device, "threads": torch.get_num_threads(),
                                                    "world_size": dist.get_world_size(), "items": results})
    sizes = job["sizes"]
    ev(task="collectives", total=len(todo["coll"]) * len(sizes), desc="collectives")
    meshes: dict[str, Mesh] = {}
    for mesh, axis, op in todo["coll"]:
        key = json.dumps(mesh)
        if key not in meshes:
            meshes[key] = Mesh(dict(mesh), device_type=device)
        group = meshes[key].group(axis)
        rows = []
        for s in sizes:
            rows.append(run_collective({"kind": "collective", "op": op, "payload": s, "axis": axis,
                                        "mesh": mesh}, group, device))
            ev(task="collectives", advance=1, desc=f"{op} on {axis} ({s} B)")
        if rank == 0:
            _write(coll_file(out, mesh, axis, op), {"mesh": mesh, "axis": axis, "op": op, "items": rows})


# ------------------------------------------------------------------------ running plans
def _cpu_step_peak(step, holder: Any) -> float:
    """Peak CPU memory of one plan during `step()`: the storages reachable from `holder` when it
    starts plus the largest rise of the profiler's allocation records replayed in time order
    (`autopar.tools.step_memory`, the measurement tests/dist/test_memory_truth.py holds the cost
    model to)."""
    from autopar.tools.step_memory import step_peak

    return step_peak(step, *holder).peak


class Session:
    """One plan built on this rank (model, parallelize, optimizer, batches), stepped on demand."""

    def __init__(self, source, plan, *, batch: int, seq: int | None, n_batches: int, hardware: str | None,
                 device: str, lr: float = 1e-3, weights: str | None = None, world_size: int | None = None):
        import autopar

        self.source, self.device = source, device
        torch.manual_seed(0)
        # with weights, the model is built on meta: each rank allocates and reads only its part
        with torch.device("meta" if weights else device):
            model = source.build()
        x0, _ = source.example_batch(batch, seq_len=seq, generator=torch.Generator().manual_seed(1), device=device)
        t0 = time.perf_counter()
        mesh = autopar.mesh(**plan.mesh, device_type=device) if plan is not None else \
            autopar.mesh(world_size=world_size or dist.get_world_size(), device_type=device)  # the joint planner
        self.pm = autopar.parallelize(model, mesh, example_inputs=x0, plan=plan, hardware=hardware, weights=weights)
        self.setup_s = time.perf_counter() - t0
        self.opt = autopar.optimizer(self.pm, torch.optim.AdamW, lr=lr)
        g = torch.Generator().manual_seed(2)
        self.data = [source.example_batch(batch, seq_len=seq, generator=g, device=device) for _ in range(n_batches)]
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.i = 0

    def _one(self):
        loss = self.pm.step(self.data[self.i % len(self.data)], self.source.loss_fn)
        self.opt.step()
        self.opt.zero_grad()
        self.i += 1
        return loss

    def step(self, timed: bool = True) -> None:
        """One training step, started together on every rank; its time recorded when `timed`."""
        _barrier()
        t, c = time.perf_counter(), time.process_time()
        loss = self._one()
        if self.device == "cuda":
            torch.cuda.synchronize()
        if timed:
            self.wall.append(time.perf_counter() - t)
            self.cpu.append(time.process_time() - c)
        self.losses.append(float(loss.item()))

    def memory(self) -> float:
        """Peak memory of one more step on this rank (bytes)."""
        _barrier()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self._one()
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated())
        return _cpu_step_peak(self._one, (self.pm, self.opt))

    def result(self, peak: float | None) -> dict[str, Any]:
        """The measurements, the same on every rank (a step ends when its slowest rank does).
        Host values: reduced over the job's gloo group (CPU tensors), never the training's."""
        wall = torch.tensor(self.wall, dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=_host())
        busy = torch.tensor(self.cpu, dtype=torch.float64)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=_host())
        peaks = _gather(peak)
        w, b = wall.tolist(), busy.tolist()
        known = [p for p in peaks if p is not None and p == p]
        return {"step_s": statistics.median(w) if w else None, "step_s_all": w, "step_s_min": min(w) if w else None,
                "cpu_s_median": statistics.median(b) if b else None, "losses": self.losses,
                "peak_bytes_per_rank": peaks, "peak_bytes": max(known) if known else None, "setup_s": self.setup_s,
                "world_size": dist.get_world_size(), "device": self.device}


def run_plan(source, plan, *, batch: int, seq: int | None, warmup: int, steps: int, hardware: str | None,
             device: str, measure_memory: bool = True, lr: float = 1e-3, ev=None, weights: str | None = None,
             save: str | None = None) -> dict[str, Any]:
    """Train `source` under `plan` (None: the joint planner's for this world) for warmup + steps
    steps, from `weights` when given (a checkpoint read slice by slice), then write the trained
    weights as a Hugging Face checkpoint to `save` when given; returns the measurements (every rank)."""
    ev = ev or (lambda **_: None)
    s = Session(source, plan, batch=batch, seq=seq, n_batches=warmup + steps + 1, hardware=hardware, device=device,
                lr=lr, weights=weights)
    for i in range(warmup + steps):
        s.step(timed=i >= warmup)
        ev(task="steps", advance=1, desc=f"step {i + 1}/{warmup + steps}")
    peak = s.memory() if measure_memory else None
    res = s.result(peak)
    res["mesh"] = dict(s.pm.plan.mesh)
    if save:
        import autopar  # noqa: PLC0415

        res["saved"] = autopar.save_pretrained(s.pm, save)
    return res


def _fail(c: dict, e: BaseException) -> dict[str, Any]:
    return {"id": c["id"], "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def _agree_errors(res: dict[str, Any]) -> dict[str, Any]:
    """A result that failed on any rank fails on all (rank 0 writes it)."""
    errs = _gather(res.get("error"))
    first = next((e for e in errs if e), None)
    if first and res.get("ok", True):
        return {"id": res["id"], "ok": False, "error": "failed on another rank: " + first}
    return res


def candidates(job: dict[str, Any]) -> None:
    """Run the job's plans. With `interleave` (the default on CPU, where the machine's load drifts)
    every plan is built first and the timed steps go round-robin over the plans, so that each
    plan's steps meet the same load; otherwise (GPUs: one plan's memory at a time) plan after
    plan."""
    from autopar.tools.model_source import resolve
    from autopar.passes.plan import Plan

    out, ev = Path(job["out"]), Events(job.get("progress"))
    device = _device()
    source = resolve(job["model"])
    todo = None
    if dist.get_rank() == 0:
        todo = [c for c in job["plans"] if not (out / "runs" / f"{c['id']}.json").exists()]
    todo = _agree(todo)
    warmup, steps = job["warmup"], job["steps"]
    interleave = job.get("interleave", device == "cpu")
    ev(task="runs", total=len(todo) * (warmup + steps + 1), desc="running plans")
    opts = dict(batch=job["batch"], seq=job["seq"], n_batches=warmup + steps + 1, hardware=job.get("hardware"),
                weights=job.get("weights"),
                device=device)

    def finish(c, res):
        res = _agree_errors(res)
        if dist.get_rank() == 0:
            _write(out / "runs" / f"{c['id']}.json", res)
        ev(task="runs", event="done", id=c["id"], ok=res["ok"])

    if not interleave:
        for c in todo:
            ev(task="runs", event="start", id=c["id"], desc=f"{c['id']}: building")
            try:
                s = Session(source, Plan.from_json(Path(c["path"]).read_text()), **opts)
                for i in range(warmup + steps):
                    s.step(timed=i >= warmup)
                    ev(task="runs", advance=1, desc=f"{c['id']}: step {i + 1}/{warmup + steps}")
                res = {**s.result(s.memory()), "id": c["id"], "ok": True}
                ev(task="runs", advance=1, desc=f"{c['id']}: memory step")
                del s
            except Exception as e:  # noqa: BLE001 - recorded; the other plans still run
                res = _fail(c, e)
            finish(c, res)
        return
    sessions: dict[str, Session | dict] = {}
    for c in todo:
        ev(task="runs", event="start", id=c["id"], desc=f"{c['id']}: building")
        try:
            sessions[c["id"]] = Session(source, Plan.from_json(Path(c["path"]).read_text()), **opts)
        except Exception as e:  # noqa: BLE001 - recorded; the other plans still run
            sessions[c["id"]] = _fail(c, e)
        built = _gather(isinstance(sessions[c["id"]], Session))
        if not all(built) and isinstance(sessions[c["id"]], Session):
            sessions[c["id"]] = {"id": c["id"], "ok": False, "error": "failed on another rank while building"}
    live = [c for c in todo if isinstance(sessions[c["id"]], Session)]
    for i in range(warmup + steps):
        for c in live:
            ev(task="runs", event="start", id=c["id"], desc=f"{c['id']}: step {i + 1}/{warmup + steps}")
            sessions[c["id"]].step(timed=i >= warmup)
            ev(task="runs", advance=1, desc=f"{c['id']}: step {i + 1}/{warmup + steps}")
    for c in todo:
        s = sessions[c["id"]]
        if isinstance(s, Session):
            ev(task="runs", event="start", id=c["id"], desc=f"{c['id']}: memory step")
            res = {**s.result(s.memory()), "id": c["id"], "ok": True, "interleaved_with": len(live)}
            ev(task="runs", advance=1, desc=f"{c['id']}: memory step")
        else:
            res = s
        finish(c, res)
        sessions[c["id"]] = res  # drop the plan's model and groups while the world is still up
    del s
    gc.collect()
    _barrier()


# ------------------------------------------------------------------------ train (autopar run)
def train(job: dict[str, Any]) -> None:
    from autopar.tools.model_source import resolve
    from autopar.passes.plan import Plan

    device = _device()
    source = resolve(job["model"])
    plan = Plan.from_json(Path(job["plan"]).read_text()) if job.get("plan") else None
    res = run_plan(source, plan, batch=job["batch"], seq=job["seq"], warmup=0, steps=job["steps"],
                   hardware=job.get("hardware"), device=device, measure_memory=False, lr=job.get("lr", 1e-3),
                   weights=job.get("weights"), save=job.get("save"))
    if dist.get_rank() == 0:
        print(f"trained {source.name} on {res['mesh']} for {job['steps']} steps ({device}, "
              f"world {res['world_size']}, setup {res['setup_s']:.1f} s"
              + (f", weights from {job['weights']}" if job.get("weights") else "") + ")")
        print(f"{'step':>4}  {'loss':>10}  {'time':>10}")
        for i, (loss, t) in enumerate(zip(res["losses"], res["step_s_all"])):
            print(f"{i:>4}  {loss:>10.4f}  {t * 1e3:>7.1f} ms")
        sys.stdout.flush()
        if job.get("save"):
            print(f"saved a Hugging Face checkpoint to {job['save']} ({len(res.get('saved', []))} files)")
        if job.get("result"):
            _write(Path(job["result"]), {k: v for k, v in res.items()})


JOBS = {"bench": bench, "candidates": candidates, "train": train}


def run_job(job: dict[str, Any]) -> None:
    """Run `job` on this rank (torch.distributed must be initialised)."""
    try:
        fn = JOBS[job["kind"]]
    except KeyError:
        raise ValueError(f"unknown job kind {job.get('kind')!r}; known: {sorted(JOBS)}") from None
    fn(job)


def forked(rank: int, world_size: int, job: dict[str, Any]) -> None:
    """Entry for `autopar.runtime.launch.run_world` (the fork launcher)."""
    run_job(job)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun ... -m autopar.tools.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    from autopar.runtime.launch import init_job_process_group

    init_job_process_group(timeout_s=float(job.get("timeout_s", 300)))  # NCCL with device_id where a GPU is
    try:
        run_job(job)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # leave without interpreter teardown: background threads of the process-group backends can
    # abort a clean exit ("terminate called without an active exception") after the job is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
