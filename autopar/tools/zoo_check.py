"""Run the model zoo (`autopar.models.zoo`): parity on gloo at tiny size, plans at real size.

`parity(row)` runs, for each of the row's meshes, one fresh gloo world of that many CPU
processes: `autopar.parallelize` (the planner when the mesh is `world_size=N`), three AdamW
steps on the global batch, the global gradient norm of the first step, and the full state
dict after the steps (`autopar.export_state_dict`, parameters and buffers such as batch-norm
statistics); then the same steps on one process with the same seed and batches. Each mesh
gets its own world, so a failure is that mesh's alone. In the same world every mesh also
runs from a meta build (each rank materializing only its part, from the modules' own init or
the seed's state dict) and must match the same reference. The tiny model is captured once in
this process before the worlds fork (`autopar.capture_cache`: the meta and the real build, in
every rank, reuse that graph; each rank still materializes, plans, rewrites and trains on its
own). Rank 0 writes `model.dump()` and the
plan text; every rank its program.

`plan_real(row)` builds the row at its published size on the meta device, captures it and
runs the joint planner for a cluster (default 64 H100s: `h100-64`), and reports the plan
text, capture and search seconds; peak RAM is the process's, so run one row per process
(benchmarks/bench_zoo.py does).

Tolerances (fp32): loss 1e-5 absolute every step, gradient norm 1e-5 relative, parameters
and buffers after 3 steps 1e-4 absolute (as the data- and tensor-parallel tests: AdamW with
eps=1e-6 at lr 1e-2, where rounding-order noise on near-zero gradients moves a weight by up
to ~1% of a step). fp64 rows: loss 1e-6, gradient norm 1e-9 relative, parameters 1e-6
(transformers computes some ops in fp32 whatever the model's dtype: the rotary tables, Gemma's
RMSNorm; Adam amplifies their rounding on near-zero gradients: Gemma-2 at dp2 x tp2, 2.1e-7).

It reads and writes no `node.meta` keys.
"""
from __future__ import annotations

import os
import resource
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autopar.models import zoo

STEPS, BATCH, SEQ, LR, EPS = 3, 8, 16, 1e-2, 1e-6
TOLERANCES = {"float32": {"loss": 1e-5, "grad_norm_rel": 1e-5, "param": 1e-4},
              "float64": {"loss": 1e-6, "grad_norm_rel": 1e-9, "param": 1e-6}}


@dataclass
class MeshResult:
    row: str
    asked: dict  # the mesh asked for ({"world_size": 4} runs the planner)
    ok: bool = False
    error: str = ""
    mesh: dict = field(default_factory=dict)  # the mesh that ran
    loss_diff: float = float("nan")
    grad_norm_rel: float = float("nan")
    param_diff: float = float("nan")
    worst_param: str = ""
    missing: list = field(default_factory=list)
    tolerances: dict = field(default_factory=dict)
    plan_text: str = ""
    dump_files: list = field(default_factory=list)
    seconds: float = 0.0
    from_meta: bool = False  # this mesh also ran from a meta build, with the same result

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.asked.items())
        if self.error and not self.mesh:
            return f"{self.row:14s} {mesh:14s} ERROR {self.error.strip().splitlines()[-1][:160]}"
        ran = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        return (f"{self.row:14s} {mesh:14s} ran {ran:18s} loss {self.loss_diff:.1e} grad-norm {self.grad_norm_rel:.1e} "
                f"params {self.param_diff:.1e} {'OK' if self.ok else 'FAIL'} ({self.seconds:.1f} s)")


def _world_size(asked: dict) -> int:
    if "world_size" in asked:
        return int(asked["world_size"])
    n = 1
    for v in asked.values():
        n *= int(v)
    return n


def _call(model, x):
    return model(**x) if isinstance(x, dict) else model(*x)


def _train(sp, pm, model):
    import autopar  # noqa: PLC0415

    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR, eps=EPS)
    g = torch.Generator().manual_seed(1)
    losses, norm = [], None
    for i in range(STEPS):
        x, y = sp.example_batch(BATCH, seq_len=SEQ, generator=g)
        losses.append(float(pm.step((x, y), sp.loss_fn)))
        if i == 0:
            norm = float(pm.engine.clip_grad_norm_(1e9))
        opt.step()
        opt.zero_grad()
    return losses, norm, autopar.export_state_dict(pm, like=model)


def _run_rank(rank: int, ws: int, name: str, asked: dict, opts: dict, dump_dir: str | None, style: str,
              also_meta: bool = False):
    import autopar  # noqa: PLC0415

    sp = zoo.spec(name, "tiny", style)
    x0, _ = sp.example_batch(BATCH, seq_len=SEQ, generator=torch.Generator().manual_seed(1))
    meta = None
    torch.manual_seed(0)
    model = sp.build()
    if also_meta:  # the same mesh, the model built on meta and filled rank by rank
        from autopar.build.init_replay import constructor_draws  # noqa: PLC0415

        with torch.device("meta"):
            meta_model = sp.build()
        # the modules' own init where it replays exactly; else the seed-0 weights as a state dict
        weights = autopar.ModuleInit(seed=0, dtype=torch.float32) if not constructor_draws(meta_model) else \
            {k: v.detach().clone() for k, v in model.state_dict().items()}
        pm = autopar.parallelize(meta_model, autopar.mesh(**asked), example_inputs=x0, weights=weights, **opts)
        meta = _train(sp, pm, meta_model)
    pm = autopar.parallelize(model, autopar.mesh(**asked), example_inputs=x0, **opts)
    losses, norm, sd = _train(sp, pm, model)
    files = pm.dump(dump_dir) if dump_dir else []
    text = pm.plan_text() if rank == 0 else ""
    return losses, norm, sd, dict(pm.plan.mesh), text, files, meta


def _reference(name: str, style: str):
    sp = zoo.spec(name, "tiny", style)
    torch.manual_seed(0)
    model = sp.build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    g = torch.Generator().manual_seed(1)
    losses, norm = [], None
    for i in range(STEPS):
        x, y = sp.example_batch(BATCH, seq_len=SEQ, generator=g)
        loss = sp.loss_fn(_call(model, x), y)
        loss.backward()
        if i == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _capture_before_fork(name: str, style: str) -> None:
    """Capture the row's tiny model here, as every rank's `parallelize` captures it: ranks
    forked from this process then find the graph in `autopar.capture_cache` instead of each
    tracing it again (2 captures a rank, 4 ranks a world, one world a mesh). Ranks started by
    a fork server (a GPU build of torch) capture it themselves."""
    from autopar import capture  # noqa: PLC0415
    sp = zoo.spec(name, "tiny", style)
    x0, _ = sp.example_batch(BATCH, seq_len=SEQ, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = sp.build()
    if isinstance(x0, dict):
        capture(model, (), example_kwargs=dict(x0))
    else:
        capture(model, tuple(x0) if isinstance(x0, (tuple, list)) else (x0,))


def parity(name: str, meshes=None, dump_root: str | None = None, timeout_s: float = 300.0,
           style: str = "positional") -> list[MeshResult]:
    """Every mesh of the row (or `meshes`: [(mesh kwargs, parallelize options)]) against one process;
    `style="labels"` feeds `{"input_ids", "labels"}` and trains on the model's own loss."""
    from autopar.runtime.launch import run_world  # noqa: PLC0415

    row = zoo.get(name)
    why = row.available()
    if why:
        raise zoo.RowUnavailable(f"{name}: {why}")
    tol = TOLERANCES[row.dtype]
    ref_losses, ref_norm, ref_sd = _reference(name, style)
    _capture_before_fork(name, style)
    out = []
    todo = list(meshes if meshes is not None else row.meshes)
    also_meta = meshes is None  # every mesh of the row also runs from a meta build, in the same world
    for asked, opts in todo:
        r = MeshResult(name, dict(asked), tolerances=dict(tol))
        tag = "_".join(f"{k}{v}" for k, v in asked.items())
        dump_dir = os.path.join(dump_root, name, tag) if dump_root else None
        t0 = time.perf_counter()
        try:
            res = run_world(_world_size(asked), _run_rank, name, dict(asked), dict(opts), dump_dir, style,
                            also_meta, timeout_s=timeout_s, collective_timeout_s=60.0)
        except Exception as e:  # noqa: BLE001 - reported per mesh, the row goes on
            r.error = "".join(traceback.format_exception_only(type(e), e))
            r.seconds = time.perf_counter() - t0
            out.append(r)
            continue
        r.seconds = time.perf_counter() - t0
        losses, norm, sd, r.mesh, r.plan_text, _, meta = res[0]
        r.dump_files = sorted({os.path.basename(f) for *_x, files, _m in res for f in files})
        r.loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        r.grad_norm_rel = abs(norm - ref_norm) / max(abs(ref_norm), 1e-30)
        worst, r.missing = ("", 0.0), sorted(k for k in ref_sd if k not in sd)
        for k, v in ref_sd.items():
            if k in sd and v.is_floating_point():
                d = float((sd[k].double() - v.double()).abs().max()) if v.numel() else 0.0
                if d > worst[1] or not worst[0]:
                    worst = (k, d)
        r.worst_param, r.param_diff = worst
        r.error = _mismatch(losses, ref_losses, norm, ref_norm, sd, ref_sd, tol, r.missing)
        if meta is not None and not r.error:
            r.from_meta = True
            m_losses, m_norm, m_sd = meta
            bad = _mismatch(m_losses, ref_losses, m_norm, ref_norm, m_sd, ref_sd, tol,
                            sorted(k for k in ref_sd if k not in m_sd))
            r.error = f"built on meta (autopar.ModuleInit): {bad}" if bad else ""
        r.ok = not r.error
        out.append(r)
    return out


def _mismatch(losses, ref_losses, norm, ref_norm, sd, ref_sd, tol, missing) -> str:
    """'' when everything is within tolerance, else what torch.testing.assert_close said."""
    from torch.testing import assert_close  # noqa: PLC0415

    try:
        assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64),
                     atol=tol["loss"], rtol=0, msg=lambda m: f"losses per step: {m}")
        assert_close(norm, ref_norm, atol=0, rtol=tol["grad_norm_rel"], msg=lambda m: f"gradient norm: {m}")
        for k, v in ref_sd.items():
            if k in sd and v.is_floating_point():
                assert_close(sd[k].double(), v.double(), atol=tol["param"], rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    except AssertionError as e:
        return f"parity: {e}"
    return f"missing from the parallel state dict: {missing[:5]}" if missing else ""


# --- real size ----------------------------------------------------------------------------------
@dataclass
class RealPlan:
    row: str
    model: str
    params_b: float
    world_size: int
    hardware: str
    batch: int
    seq: int | None
    mesh: dict
    step_s: float
    peak_gib: float
    capture_s: float
    search_s: float
    peak_rss_gib: float
    text: str
    dump_s: float = 0.0  # lowering the plan and writing its dump (0 when not asked)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_real(name: str, *, world_size: int = 64, hardware: str = "h100-64", top: int = 3,
              dump_dir: str | None = None) -> RealPlan:
    """Capture the row at its published size on meta and plan it for `world_size` devices; with
    `dump_dir`, also lower the plan (rank 0's passes, the pipeline split) and write its dump, which
    shows that the plan is one the passes can carry out."""
    from autopar.tools.model_source import ModelSource  # noqa: PLC0415
    from autopar.tools.plan_view import plan_text  # noqa: PLC0415
    from autopar.tools.planning import plan_model  # noqa: PLC0415

    row = zoo.get(name)
    sp = zoo.spec(name, "real")
    src = ModelSource(name, name, "zoo", sp.build, sp.example_batch, sp.loss_fn, "cross-entropy of the logits",
                      row.real_seq)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in sp.build().parameters())
    r = plan_model(src, world_size=world_size, hardware=hardware, batch=row.real_batch, seq=row.real_seq, top=top)
    best = r.best
    dump_s = 0.0
    if dump_dir:
        from autopar.tools.plan_dump import write_dump  # noqa: PLC0415

        t0 = time.perf_counter()
        write_dump(r, dump_dir, top=top)
        dump_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return RealPlan(name, row.real_name, n_params / 1e9, world_size, hardware, row.real_batch, row.real_seq,
                    dict(best.plan.mesh), float(best.step_s), float(best.peak_bytes) / 2**30,
                    float(r.seconds.get("capture_s", 0.0)), float(r.seconds.get("search_s", 0.0)), rss,
                    plan_text(r, top), dump_s)


__all__ = ["MeshResult", "RealPlan", "TOLERANCES", "parity", "plan_real"]
