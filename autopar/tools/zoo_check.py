"""Run the model zoo (`autopar.models.zoo`): parity on gloo at tiny size, plans at real size.

`parity(row)` runs, for each of the row's meshes, on a gloo world of that many CPU processes:
`autopar.parallelize` (the planner when the mesh is `world_size=N`), three AdamW steps on the
global batch, the global gradient norm of the first step, and the full state dict after the
steps (`autopar.export_state_dict`, parameters and buffers such as batch-norm statistics);
then the same steps on one process with the same seed and batches. The meshes of one world
size run one after another in one world (each from a fresh model, seed and plan); if that
world fails, each of its meshes runs again in a world of its own, so a failure is that
mesh's alone. In the same world every mesh also runs from a meta build (each rank
materializing only its part, from the modules' own init or the seed's state dict) and must
match the same reference. The tiny model is captured once in this process before the worlds
fork, also as the joint planner captures it for a `world_size` mesh (`autopar.capture_cache`:
the meta and the real build, in every rank, reuse those graphs; each rank still
materializes, plans, rewrites and trains on its own). Rank 0 writes `model.dump()` and the
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

import torch

from autopar.models import zoo

STEPS, BATCH, SEQ, LR, EPS = 3, 8, 16, 1e-2, 1e-6
# fp32 "param" 1e-4: on this CPU (2026-11-26, torch 2.13, AVX-512) the hf-llama / hf-mistral tiny rows
# one-process floor (these STEPS, BATCH, SEQ, LR, EPS) is 3.1e-5 with the batch split in 2 (dp=2's
# order), 3.4e-5 from fp64 and 6.4e-5 with every Linear's contraction summed in 2 halves (tp=2's
# order): AdamW's m / sqrt(v) turns last-bit differences of near-zero gradients into lr-sized steps,
# and dp2 x tp2 measured 1.42e-4. Those two rows therefore train in fp64 (1e-14 off on every mesh,
# models/zoo.py), where a real bug cannot hide under rounding; the other fp32 rows pass at 1e-4.
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
    shared_world_error: str = ""  # the row's shared world failed (then this mesh ran in its own world)

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


def _capture_before_fork(name: str, style: str, search_worlds=()) -> None:
    """Capture the row's tiny model here, as every rank's `parallelize` captures it: ranks
    forked from this process then find the graph in `autopar.capture_cache` instead of each
    tracing it again (2 captures a rank, 4 ranks a world). `search_worlds`: the world sizes of
    the row's `world_size` meshes, whose joint planner captures for its search (a symbolic
    sequence: `capture_for_search`), captured too. Every fusion rule is matched on each graph
    here, so that the kernels' output types (a torch reference run on fake tensors each: 0.05-0.07
    CPU-s a graph for hf-llama tiny, 0.002 warm) are in the fusion memo the ranks inherit
    (`passes.rules.fusion_match`): the ranks' fusion search matches the same graphs. Nothing is
    captured where ranks do not fork from this process (a GPU build of torch starts them from a
    fork server: each captures)."""
    from autopar.capture import capture_for_search  # noqa: PLC0415
    from autopar.runtime.launch import default_start_method  # noqa: PLC0415

    if (os.environ.get("AUTOPAR_START_METHOD") or default_start_method("gloo")) != "fork":
        return
    from autopar import capture  # noqa: PLC0415
    sp = zoo.spec(name, "tiny", style)
    x0, _ = sp.example_batch(BATCH, seq_len=SEQ, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = sp.build()
    args, kwargs = ((), dict(x0)) if isinstance(x0, dict) else (tuple(x0) if isinstance(x0, (tuple, list)) else (x0,), {})
    from autopar.passes.rules.fusion_table import find_matches  # noqa: PLC0415

    try:
        find_matches(capture(model, args, example_kwargs=kwargs))
        for n in search_worlds:
            find_matches(capture_for_search(model, args, n, example_kwargs=kwargs))
    except Exception:  # noqa: BLE001 - only a speed-up: the ranks report any real failure
        pass


def _run_cells(rank: int, ws: int, cells: list) -> list:
    """Several meshes of one world size in one world, one after another: [(seconds, _run_rank's
    answer)] per cell. A rank that raises fails the world (the caller then runs each cell alone)."""
    out = []
    for cell in cells:
        t0 = time.perf_counter()
        res = _run_rank(rank, ws, *cell)
        out.append((time.perf_counter() - t0, res))
    return out


def parity(name: str, meshes=None, dump_root: str | None = None, timeout_s: float = 300.0,
           style: str = "positional", shared_world: bool = True) -> list[MeshResult]:
    """Every mesh of the row (or `meshes`: [(mesh kwargs, parallelize options)]) against one process;
    `style="labels"` feeds `{"input_ids", "labels"}` and trains on the model's own loss.

    `shared_world`: the meshes of one world size run in one world, one after another (a fresh
    world costs its ranks' first build: measured about twice the row's time under load);
    should that world fail, each of its meshes runs again in its own world, so that a failure
    is still that mesh's alone, and `MeshResult.shared_world_error` keeps what the shared
    world said. False: one world per mesh."""
    from autopar.runtime.launch import run_world  # noqa: PLC0415

    row = zoo.get(name)
    why = row.available()
    if why:
        raise zoo.RowUnavailable(f"{name}: {why}")
    tol = TOLERANCES[row.dtype]
    from autopar import parallelize  # noqa: F401 - autopar's public names load on first use: here, not in each rank
    ref = _reference(name, style)
    todo = list(meshes if meshes is not None else row.meshes)
    also_meta = meshes is None  # every mesh of the row also runs from a meta build, in the same world
    _capture_before_fork(name, style, sorted({int(a["world_size"]) for a, _o in todo if "world_size" in a}))
    cells, dumps = [], []
    for asked, opts in todo:
        tag = "_".join(f"{k}{v}" for k, v in asked.items())
        dumps.append(os.path.join(dump_root, name, tag) if dump_root else None)
        cells.append((name, dict(asked), dict(opts), dumps[-1], style, also_meta))
    answers: list = [None] * len(todo)  # per mesh: (seconds, per-rank results) or (seconds, exception)
    shared_error = [""] * len(todo)
    by_size: dict[int, list[int]] = {}
    for i, (asked, _opts) in enumerate(todo):
        by_size.setdefault(_world_size(asked), []).append(i)
    for ws, idx in by_size.items():
        if shared_world and len(idx) > 1:
            try:
                res = run_world(ws, _run_cells, [cells[i] for i in idx], timeout_s=timeout_s * len(idx),
                                collective_timeout_s=60.0)
            except Exception as e:  # noqa: BLE001 - each mesh then runs alone below
                for i in idx:
                    shared_error[i] = "".join(traceback.format_exception_only(type(e), e))
            else:
                for j, i in enumerate(idx):
                    answers[i] = (res[0][j][0], [per_rank[j][1] for per_rank in res])
                continue
        for i in idx:
            t0 = time.perf_counter()
            try:
                res = run_world(ws, _run_rank, *cells[i], timeout_s=timeout_s, collective_timeout_s=60.0)
            except Exception as e:  # noqa: BLE001 - reported per mesh, the row goes on
                res = e
            answers[i] = (time.perf_counter() - t0, res)
    out = []
    for i, (asked, _opts) in enumerate(todo):
        r = MeshResult(name, dict(asked), tolerances=dict(tol), shared_world_error=shared_error[i])
        r.seconds, res = answers[i]
        if isinstance(res, Exception):
            r.error = "".join(traceback.format_exception_only(type(res), res))
        else:
            _compare(r, res, ref, tol)
        out.append(r)
    return out


def _compare(r: MeshResult, res: list, ref: tuple, tol: dict) -> None:
    """Fill `r` from the ranks' answers for one mesh against the one-process reference."""
    ref_losses, ref_norm, ref_sd = ref
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
