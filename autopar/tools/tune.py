"""`autopar tune`: measure the target machine, fit the hardware profile, try the best plans for
real, keep the fastest, and say how far the cost model was from what was measured.

Phases (each leaves files in the output folder; a rerun with the same arguments skips what is
done, so an interrupted tune resumes; `fresh=True` starts over):

  1. bench      (launched world, `autopar.tools.worker` "bench")  bench/compute.json: matmul over
                shapes and dtypes, causal attention, elementwise and copy over sizes, kernel
                launch overhead, pinned host<->device copies (GPU) and the CPU's fused AdamW
                step (what offload runs on), measured on every rank at once, and the compute's
                slowdown while all-reduces over the whole world run (`microbench.run_contention`),
                selective checkpointing's host time (`microbench` "selective");
                bench/coll_*.json: each collective on each mesh axis over message sizes
  2. fit        profile_microbench.json: the base profile with its efficiency factors, peaks
                (raised where the machine beat the datasheet), intra-node link (latency and
                bandwidth, least squares on the alpha-beta formula of `autopar.cost.comm`),
                host link and host memory bandwidth (offload) and kernel overhead replaced by
                what was measured; where the base has a compute table (GEMM efficiency by
                shape, attention by seq / head_dim / causal, kernel floors), its rows are
                refitted: measured shapes replace their rows, the others scale by the
                measured / tabled ratio (`autopar.cost.compute_tables.refit_*`), and the
                matmul floor becomes the fastest small GEMM's time. A base without a table
                (cpu-gloo, hand-written profiles) keeps the flat factors alone. The intra-node
                link's contention k (`cost.overlap`) and the selective-checkpoint dispatch
                time per node (`selective_node_s`) become the measured ones.
  3. plan       candidates/c*.json: the best `top` plans under the fitted profile
                (`autopar.tools.planning.plan_model`)
  4. run        (launched world, "candidates") runs/c*.json: each plan for warm-up + timed
                steps: step time (each step's slowest rank, the median of the timed steps; on
                CPU every plan is built first and the timed steps go round-robin over the plans,
                so that a machine whose load drifts loads each plan alike) and peak memory per rank
  5. calibrate  profile.json: the fitted profile with its per-kernel overhead refitted so that
                predicted step times match the measured ones (one parameter, least squares on
                log ratios; the framework's per-op cost that a microbenchmark of one kernel does
                not see); leave-one-out errors are reported beside the fit
  6. report     plan.json (the fastest measured plan), tune_report.json and tune_report.txt:
                predicted versus measured per op class, per collective, peak memory and step
                time, with the datasheet's prediction for comparison

Only the intra-node link is fitted: the runs are on one node (inter-node figures keep the
base profile's values, and the report says so).

Reads and writes no node.meta keys.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from autopar.cost import Hardware, load_profile
from autopar.cost.comm import axis_links, bytes_sent, steps as comm_steps
from autopar.cost.compute_tables import refit_attention, refit_matmul
from autopar.cost.hardware import from_dict
from autopar.tools.microbench import (COLLECTIVE_OPS, contention_text, default_message_sizes, fit_contention,
                                      fit_selective, measured_efficiencies, predicted_seconds)
from autopar.passes.plan import Plan

STATE = "tune_state.json"


@dataclass
class TuneConfig:
    model: str
    out: str
    hardware: str = "cpu-gloo"
    mesh: dict[str, int] | None = None
    world_size: int | None = None
    batch: int | None = None
    seq: int | None = None
    top: int = 3  # plans run for real
    warmup: int = 2
    steps: int = 5
    quick: bool = True  # small microbenchmark sizes (CPU: seconds)
    sizes: list[int] | None = None  # collective message sizes in bytes
    launcher: str = "torchrun"
    device: str = "cpu"
    timeout_s: float = 1800.0
    weights: str | None = None  # a checkpoint the plans start from (each rank reads its slices)

    @property
    def world(self) -> int:
        return math.prod(self.mesh.values()) if self.mesh else int(self.world_size)

    def identity(self) -> dict[str, Any]:
        """What must match for a rerun to resume."""
        return {k: v for k, v in asdict(self).items() if k not in ("out", "launcher", "timeout_s")}


@dataclass
class TuneResult:
    out: Path
    profile: Hardware
    plan: Plan
    report: dict[str, Any]
    files: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ fitting
def _nnls_rel(cols: list[np.ndarray], t: np.ndarray) -> np.ndarray:
    """Non-negative x minimising sum_i ((sum_j cols[j][i] x_j) / t_i - 1)^2."""
    from scipy.optimize import nnls

    A = np.stack([c / t for c in cols], axis=1)
    x, _ = nnls(A, np.ones_like(t))
    return x


def _set_rate(d: dict, key_peak: tuple[str, ...], eff_key: str, rate: float, fits: dict, what: str) -> None:
    """Make peak * eff equal the measured `rate`: eff = rate / peak, or peak raised to `rate`
    (eff 1) when the machine beat the datasheet."""
    node = d
    for k in key_peak[:-1]:
        node = node[k]
    peak = float(node[key_peak[-1]])
    if rate <= 0 or not math.isfinite(rate):
        return
    if rate > peak:
        node[key_peak[-1]] = rate
        d["efficiency"][eff_key] = 1.0
        fits[what] = {"rate": rate, "datasheet_peak": peak, "peak_raised": True}
    else:
        d["efficiency"][eff_key] = rate / peak
        fits[what] = {"rate": rate, "datasheet_peak": peak, "efficiency": rate / peak}


def fit_profile(base: Hardware, compute: list[dict], colls: list[dict]) -> tuple[Hardware, dict]:
    """The base profile refitted to the measurements (see the module docstring). Returns the
    profile and what was fitted."""
    d = base.to_dict()
    d.pop("calibration", None)
    fits: dict[str, Any] = {}
    by = lambda kind, dt=None: [c for c in compute if c["kind"] == kind and (dt is None or c["dtype"] == dt)]  # noqa: E731
    main = "bf16" if base.device.kind == "cuda" else "fp32"
    # matmul: t = flops / R + c, per dtype; the main dtype sets eff.matmul, the others their peaks
    rates = {}
    for dt in sorted({c["dtype"] for c in by("matmul")}):
        items = by("matmul", dt)
        t = np.array([c["seconds"] for c in items])
        x = _nnls_rel([np.array([c["flops"] for c in items]), np.ones_like(t)], t)
        if x[0] > 0:
            rates[dt] = 1.0 / x[0]
    if main in rates:
        peak_key = base.fp32_matmul if main == "fp32" else main
        _set_rate(d, ("device", "peak_flops", peak_key), "matmul", rates[main], fits, f"matmul {main}")
        eff = d["efficiency"]["matmul"]
        for dt, r in rates.items():
            if dt != main:
                key = base.fp32_matmul if dt == "fp32" else dt
                fits[f"matmul {dt}"] = {"rate": r, "datasheet_peak": d["device"]["peak_flops"].get(key)}
                d["device"]["peak_flops"][key] = r / eff
    att = by("attention")
    if att:
        t = np.array([c["seconds"] for c in att])
        x = _nnls_rel([np.array([0.5 * c["flops"] for c in att]), np.ones_like(t)], t)
        if x[0] > 0:
            rate = 1.0 / x[0]
            dt = att[0]["dtype"]
            peak = float(d["device"]["peak_flops"][d.get("fp32_matmul", "fp32") if dt == "fp32" else dt])
            d["efficiency"]["attention"] = min(1.0, rate / peak)
            fits["attention"] = {"rate": rate, "peak": peak, "efficiency": d["efficiency"]["attention"]}
    mem = by("memory")
    if mem:
        t = np.array([c["seconds"] for c in mem])
        x = _nnls_rel([np.array([c["bytes"] for c in mem]), np.ones_like(t)], t)
        if x[0] > 0:
            _set_rate(d, ("device", "memory_bandwidth"), "memory", 1.0 / x[0], fits, "memory bandwidth")
    for kind, key, what in (("host_copy", "bandwidth", "host link (pinned copies)"),
                            ("host_step", "memory_bandwidth", "host memory (CPU fused AdamW)")):
        items = by(kind)
        if items:
            t = np.array([c["seconds"] for c in items])
            x = _nnls_rel([np.array([c["bytes"] for c in items]), np.ones_like(t)], t)
            if x[0] > 0:
                fits[what] = {"rate": 1.0 / x[0], "was": float(d["host"][key])}
                d["host"][key] = 1.0 / x[0]
    launch = by("launch")
    if launch:
        d["kernel_overhead_s"] = float(min(c["seconds"] for c in launch))
        fits["kernel launch"] = {"seconds": d["kernel_overhead_s"]}
    if base.compute is not None:
        fit_compute_table(d, compute, fits)
    # intra-node link: t = steps * alpha + sent / beta (ring formulas), over every op and size
    intra = [c for c in colls if not _spans_nodes(c, base)]
    if intra:
        t = np.array([c["seconds"] for c in intra])
        st = np.array([float(comm_steps(c["op"], c["group_size"], "ring")) for c in intra])
        sent = np.array([bytes_sent(c["op"], c["payload"], c["group_size"], "ring") for c in intra])
        x = _nnls_rel([st, sent], t)
        alpha = float(x[0])
        beta = 1.0 / x[1] if x[1] > 0 else float(d["topology"]["intra_node"]["bandwidth"])
        d["topology"]["intra_node"]["latency"] = alpha
        _set_rate(d, ("topology", "intra_node", "bandwidth"), "intra_node", beta, fits, "intra-node link")
        fits["intra-node link"]["latency"] = alpha
    sel = fit_selective(compute)
    if sel is not None:  # host time of the selective-checkpoint dispatch mode per node and pass; plain checkpointing's
        d.setdefault("host", {})["selective_checkpoint_node_s"] = sel["node_s"]
        fits["selective checkpoint"] = {**sel, "was": base.selective_node_s, "checkpoint_was": base.checkpoint_node_s}
        if "checkpoint_node_s" in sel:
            d["host"]["checkpoint_node_s"] = sel["checkpoint_node_s"]
    con = fit_contention(compute)
    if con is not None:  # measured over the world's group, on this one node: the intra-node link's k
        d["contention"] = {**d["contention"], "intra_node": con["k"]}
        fits["contention"] = {**con, "was": base.contention_for(False)}
    d["name"] = f"{base.name}-tuned"
    d["description"] = f"{base.name} fitted by autopar tune to measurements on this machine"
    d["calibration"] = {"source": "autopar tune", "base": base.name, "fits": fits}
    return from_dict(d), fits


def fit_compute_table(d: dict, compute: list[dict], fits: dict) -> None:
    """Refit profile dict `d`'s compute table (at its fitted peaks and overhead) to the measured
    `compute` items, in place; what moved goes into `fits["compute table"]`."""
    interim = from_dict(d)
    got = measured_efficiencies(compute, interim)
    table = refit_attention(refit_matmul(interim.compute, got["matmul"]), got["attention"])
    if got["matmul_floor_s"] is not None:
        table = table.with_floor(matmul=got["matmul_floor_s"])
    d["compute"] = table.to_dict()
    fits["compute table"] = {"matmul shapes": len(got["matmul"]), "attention shapes": len(got["attention"]),
                             "matmul floor_s": got["matmul_floor_s"]}


def _spans_nodes(c: dict, hw: Hardware) -> bool:
    from autopar.cost.comm import axis_spans_nodes

    return axis_spans_nodes(c["mesh"], c["axis"], hw.gpus_per_node)


# ------------------------------------------------------------------------ predictions of the runs
class Repredictor:
    """Re-cost candidate plans under other profiles (graphs rewritten and analysed once)."""

    def __init__(self, global_gm):
        self.gm = global_gm
        self.cache: dict[str, Any] = {}

    def __call__(self, plan: Plan, hw: Hardware) -> dict[str, Any]:
        from autopar.cost import analyze
        from autopar.tools.planning import predict, rank_graph, stage_plan

        p = Plan.from_json(plan.to_json())
        if p.mesh.get("pp", 1) > 1:
            stage_plan(p, self.gm, hw)  # complete split points: evaluated, not searched
        key = plan.to_json()
        if key not in self.cache:
            local, _ = rank_graph(self.gm, p, 0, with_recompute=False)
            self.cache[key] = analyze(local, hw)
        pred, _ = predict(self.gm, p, hw, gc=self.cache[key])
        return pred


def calibrate_overhead(profile: Hardware, plans: list[Plan], measured: list[float], repredict: Repredictor
                       ) -> tuple[Hardware, dict[str, Any]]:
    """Refit the per-kernel overhead so that predicted step times match `measured` (least
    squares on log ratios). Step time is affine in the overhead except where communication
    overlap changes, so two evaluations per plan give the line, and the fit is checked with a
    third. Also returns leave-one-out errors (each plan predicted with the others' fit)."""
    from dataclasses import replace

    from scipy.optimize import minimize_scalar

    o0, o1 = 0.0, 1e-4
    a = np.array([repredict(p, replace(profile, kernel_overhead_s=o0))["step_s"] for p in plans])
    b = (np.array([repredict(p, replace(profile, kernel_overhead_s=o1))["step_s"] for p in plans]) - a) / (o1 - o0)
    m = np.array(measured)

    def fit(idx: list[int]) -> float:
        if not idx:
            return profile.kernel_overhead_s
        f = lambda o: float(np.sum(np.log(np.maximum(a[idx] + b[idx] * o, 1e-12) / m[idx]) ** 2))  # noqa: E731
        return float(minimize_scalar(f, bounds=(0.0, 0.01), method="bounded", options={"xatol": 1e-9}).x)

    all_idx = list(range(len(plans)))
    o_star = fit(all_idx)
    loo = []
    for i in all_idx:
        oi = fit([j for j in all_idx if j != i]) if len(plans) > 1 else o_star
        loo.append(float((a[i] + b[i] * oi) / m[i] - 1.0))
    cal = replace(profile, kernel_overhead_s=o_star, name=profile.name.replace("-tuned", "") + "-calibrated",
                  calibration={**profile.calibration, "step_fit": {
                      "kernel_overhead_s": o_star, "microbenchmark_launch_s": profile.kernel_overhead_s,
                      "plans": len(plans), "leave_one_out_errors": loo}})
    return cal, {"kernel_overhead_s": o_star, "leave_one_out": loo}


# ------------------------------------------------------------------------ the job
def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def tune(cfg: TuneConfig, *, fresh: bool = False, say: Callable[[str], None] = print,
         event: Callable[[dict], None] | None = None) -> TuneResult:
    """Run (or resume) the tune described by `cfg` (see the module docstring)."""
    from autopar.tools.launcher import launch_job
    from autopar.tools.model_source import resolve
    from autopar.tools.planning import capture_meta, default_batch, plan_model

    out = Path(cfg.out)
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    event = event or (lambda _e: None)
    source = resolve(cfg.model)
    base = load_profile(cfg.hardware)
    if cfg.world < 1:
        raise ValueError(f"the world size must be >= 1, got {cfg.world}")
    cfg.batch = cfg.batch or default_batch(cfg.world)
    cfg.seq = cfg.seq if cfg.seq is not None else source.default_seq
    cfg.sizes = cfg.sizes or default_message_sizes(cfg.device, cfg.quick)
    state_path = out / STATE
    ident = cfg.identity()
    if state_path.exists():
        old = _load_json(state_path)
        if old.get("config") != ident:
            diff = {k: (old.get("config", {}).get(k), v) for k, v in ident.items() if old.get("config", {}).get(k) != v}
            raise ValueError(f"{out} holds a tune started with other arguments ({diff}: was, now); "
                             "pass --fresh to start over there, or choose another --out")
    state_path.write_text(json.dumps({"config": ident}, indent=2) + "\n")
    resumed: list[str] = []
    progress = str(out / "progress.jsonl")

    # 1. bench ---------------------------------------------------------------------------
    from autopar.tools.worker import coll_file

    if cfg.mesh:
        bench_meshes = [dict(cfg.mesh)]
    else:
        bench_meshes = [{"dp": cfg.world}] + ([{"dp": cfg.world // 2, "tp": 2}] if cfg.world >= 4 and cfg.world % 2 == 0
                                              else [])
    wanted = [coll_file(out, m, a, op) for m in bench_meshes for a, s in m.items() if s > 1 for op in COLLECTIVE_OPS]
    if (out / "bench" / "compute.json").exists() and all(p.exists() for p in wanted):
        resumed.append("bench")
        say("bench: done before, kept (bench/)")
    else:
        say(f"bench: microbenchmarks on {cfg.world} ranks ({cfg.launcher})")
        launch_job({"kind": "bench", "out": str(out), "progress": progress, "meshes": bench_meshes,
                    "sizes": cfg.sizes, "quick": cfg.quick, "timeout_s": 300}, cfg.world,
                   job_path=out / "jobs" / "bench.json", log_path=out / "logs" / "bench.log", launcher=cfg.launcher,
                   on_event=event, timeout_s=cfg.timeout_s)
    compute = _load_json(out / "bench" / "compute.json")["items"]
    colls = [it for p in wanted for it in _load_json(p)["items"]]

    # 2. fit -----------------------------------------------------------------------------
    fitted, fits = fit_profile(base, compute, colls)
    fitted.save(out / "profile_microbench.json")
    say("fit: " + "; ".join(_fit_line(k, v) for k, v in fits.items()))

    # 3. plan ----------------------------------------------------------------------------
    say(f"plan: capturing {source.name} on meta and searching under the fitted profile")
    gm = capture_meta(source, cfg.batch, cfg.seq)
    cand_dir = out / "candidates"
    existing = sorted(cand_dir.glob("c*.json"))
    if existing:
        plans = [Plan.from_json(p.read_text()) for p in existing]
        resumed.append("plan")
        say(f"plan: {len(plans)} candidates chosen before, kept (candidates/)")
    else:
        res = plan_model(source, mesh=cfg.mesh, world_size=None if cfg.mesh else cfg.world, hardware=fitted,
                         batch=cfg.batch, seq=cfg.seq, top=cfg.top, global_gm=gm,
                         step=lambda m: event({"task": "plan", "desc": m}))
        from autopar.tools.planning import materialise

        plans = [materialise(res, i) for i in range(min(cfg.top, len(res.candidates)))]
        cand_dir.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(plans):
            (cand_dir / f"c{i}.json").write_text(p.to_json() + "\n")
        say(f"plan: {res.planner} planner, {len(res.candidates)} candidates, running the best {len(plans)}")
    ids = [f"c{i}" for i in range(len(plans))]

    # 4. run -----------------------------------------------------------------------------
    run_dir = out / "runs"
    todo = [i for i in ids if not (run_dir / f"{i}.json").exists()]
    if not todo:
        resumed.append("run")
        say("run: every candidate measured before, kept (runs/)")
    attempts = 0
    while todo and attempts <= len(ids):
        attempts += 1
        say(f"run: {len(todo)} plans for {cfg.warmup} + {cfg.steps} steps each on {cfg.world} ranks ({cfg.launcher})")
        started: list[str] = []

        def on_event(e: dict) -> None:
            if e.get("event") == "start":
                started.append(e["id"])
            event(e)

        job = {"kind": "candidates", "out": str(out), "progress": progress, "model": cfg.model, "batch": cfg.batch,
               "seq": cfg.seq, "warmup": cfg.warmup, "steps": cfg.steps, "weights": cfg.weights,
               "hardware": str((out / "profile_microbench.json").resolve()), "timeout_s": 300,
               "plans": [{"id": i, "path": str((cand_dir / f"{i}.json").resolve())} for i in todo]}
        try:
            launch_job(job, cfg.world, job_path=out / "jobs" / "candidates.json", log_path=out / "logs" / "runs.log",
                       launcher=cfg.launcher, on_event=on_event, timeout_s=cfg.timeout_s)
        except Exception as e:  # noqa: BLE001 - the world died: blame the plan it was running, go on
            from autopar.tools.launcher import LaunchError

            if not isinstance(e, LaunchError):
                raise
            culprit = next((i for i in reversed(started) if not (run_dir / f"{i}.json").exists()), None)
            if culprit is None:
                raise
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / f"{culprit}.json").write_text(json.dumps({"id": culprit, "ok": False,
                                                                 "error": str(e)[-2000:]}) + "\n")
            say(f"run: {culprit} broke its world; recorded as failed, continuing")
        todo = [i for i in ids if not (run_dir / f"{i}.json").exists()]
    runs = {i: _load_json(run_dir / f"{i}.json") for i in ids}
    ok = [i for i in ids if runs[i].get("ok")]
    if not ok:
        raise ValueError("no candidate plan ran: " + "; ".join(f"{i}: {runs[i].get('error')}" for i in ids)
                         + f". Logs: {out / 'logs'}")

    # 5. calibrate -----------------------------------------------------------------------
    say("calibrate: fitting the per-kernel overhead to the measured step times")
    rep = Repredictor(gm)
    ok_plans = [plans[ids.index(i)] for i in ok]
    calibrated, step_fit = calibrate_overhead(fitted, ok_plans, [runs[i]["step_s"] for i in ok], rep)
    calibrated.save(out / "profile.json")

    # 6. report --------------------------------------------------------------------------
    best = min(ok, key=lambda i: runs[i]["step_s"])
    plan = plans[ids.index(best)]
    plan.predicted = rep(plan, calibrated)
    plan.extra["tune"] = {"measured_step_s": runs[best]["step_s"], "profile": "profile.json",
                          "chosen_from": len(ok)}
    plan.extra.setdefault("cli", {}).update(model=cfg.model, batch=cfg.batch, seq=cfg.seq, hardware=calibrated.name)
    (out / "plan.json").write_text(plan.to_json() + "\n")
    report = build_report(cfg, base, fitted, calibrated, compute, colls, plans, ids, runs, rep, step_fit, best)
    (out / "tune_report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = report_text(report)
    (out / "tune_report.txt").write_text(text + "\n")
    files = [str(out / f) for f in ("profile.json", "profile_microbench.json", "plan.json", "tune_report.json",
                                    "tune_report.txt")]
    return TuneResult(out, calibrated, plan, report, files, resumed)


def _fit_line(k: str, v: dict) -> str:
    if "rate" in v and ("matmul" in k or k == "attention"):
        return f"{k} {v['rate'] / 1e9:.3g} GFLOP/s"
    if k == "memory bandwidth":
        return f"memory {v['rate'] / 1e9:.3g} GB/s"
    if k == "intra-node link":
        return f"link {v['rate'] / 1e9:.3g} GB/s, {v['latency'] * 1e6:.3g} us"
    if k == "kernel launch":
        return f"launch {v['seconds'] * 1e6:.3g} us"
    if k == "contention":
        return f"contention k {v['k']:.3g} (was {v['was']:.3g})"
    if k == "selective checkpoint":
        ck = (f"; checkpoint {v['checkpoint_node_s'] * 1e6:.3g} us/node (was {v['checkpoint_was'] * 1e6:.3g})"
              if "checkpoint_node_s" in v else "")
        return f"selective checkpoint {v['node_s'] * 1e6:.3g} us/node (was {v['was'] * 1e6:.3g}){ck}"
    if k == "compute table":
        return f"compute table refitted ({v['matmul shapes']} GEMM, {v['attention shapes']} attention shapes)"
    return k


# ------------------------------------------------------------------------ the report
def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or not meas or meas != meas:
        return None
    return pred / meas - 1.0


def build_report(cfg, base, fitted, calibrated, compute, colls, plans, ids, runs, rep, step_fit, best) -> dict:
    ops = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in compute:
        groups.setdefault((c["kind"], c["dtype"]), []).append(c)
    for (kind, dt), items in groups.items():
        meas = sum(c["seconds"] for c in items)
        ds = sum(predicted_seconds(c, base) for c in items)
        pr = sum(predicted_seconds(c, fitted) for c in items)
        ops.append({"class": f"{kind} {dt}", "items": len(items), "datasheet_s": ds, "predicted_s": pr,
                    "measured_s": meas, "error": _err(pr, meas)})
    coll_rows = []
    cg: dict[tuple[str, str, str], list[dict]] = {}
    for c in colls:
        cg.setdefault((c["op"], c["axis"], json.dumps(c["mesh"])), []).append(c)
    for (op, axis, mesh_key), items in cg.items():
        mesh = json.loads(mesh_key)
        meas = sum(c["seconds"] for c in items)
        ds = sum(predicted_seconds(c, base, link=axis_links(_sized(base, mesh), mesh)[axis]) for c in items)
        pr = sum(predicted_seconds(c, fitted, link=axis_links(_sized(fitted, mesh), mesh)[axis]) for c in items)
        coll_rows.append({"collective": f"{op}@{axis}", "mesh": mesh, "sizes": len(items),
                          "bytes": [items[0]["payload"], items[-1]["payload"]], "datasheet_s": ds,
                          "predicted_s": pr, "measured_s": meas, "error": _err(pr, meas)})
    steps, memory = [], []
    loo = dict(zip([i for i in ids if runs[i].get("ok")], step_fit["leave_one_out"]))
    for i, p in zip(ids, plans):
        r = runs[i]
        row = {"plan": i, "mesh": dict(p.mesh), "zero_stage": p.zero_stage, "n_microbatches": p.n_microbatches,
               "ok": bool(r.get("ok"))}
        if not r.get("ok"):
            row["error"] = r.get("error")
            steps.append(row)
            continue
        ds, mb, cal = rep(p, base), rep(p, fitted), rep(p, calibrated)
        row.update(datasheet_s=ds["step_s"], microbench_s=mb["step_s"], predicted_s=cal["step_s"],
                   measured_s=r["step_s"], error=_err(cal["step_s"], r["step_s"]), leave_one_out_error=loo.get(i),
                   chosen=i == best)
        steps.append(row)
        memory.append({"plan": i, "mesh": dict(p.mesh), "zero_stage": p.zero_stage, "n_microbatches": p.n_microbatches,
                       "predicted_bytes": cal.get("peak_bytes"), "measured_bytes": r.get("peak_bytes"),
                       "measured_per_rank": r.get("peak_bytes_per_rank"),
                       "error": _err(cal.get("peak_bytes"), r.get("peak_bytes"))})
    return {"model": cfg.model, "world_size": cfg.world, "batch": cfg.batch, "seq": cfg.seq,
            "base_profile": base.name, "profile": calibrated.name, "chosen": best,
            "kernel_overhead_s": {"microbenchmark": fitted.kernel_overhead_s,
                                  "calibrated": calibrated.kernel_overhead_s},
            "ops": ops, "collectives": coll_rows, "memory": memory, "steps": steps,
            "contention": {"datasheet_k": base.contention_for(False), "tuned_k": fitted.contention_for(False),
                           "measured": fitted.calibration.get("fits", {}).get("contention")},
            "notes": ["datasheet = the base profile before tuning; predicted = the tuned profile: for op classes and "
                      "collectives its microbenchmark fit, for step times and memory also the per-kernel overhead "
                      "fitted to the measured steps (microbench fit = the step predicted before that refit)",
                      "only the intra-node link was measured (one node); inter-node figures are the base profile's",
                      "op class contention: a GEMM loop beside all-reduces, predicted from its time alone and k",
                      "memory on CPU: the tensor storages the plan's model, optimizer and runtime hold at the "
                      "start of a step plus the largest rise the profiler's allocation events show during it; on "
                      "GPU: torch.cuda.max_memory_allocated",
                      "step time: on CPU the plans' timed steps alternate (round-robin), so that a machine whose "
                      "load drifts loads each plan alike; the load itself ends up in the fitted per-kernel "
                      "overhead"]}


def _sized(hw: Hardware, mesh: dict) -> Hardware:
    world = math.prod(mesh.values())
    return hw.with_nodes(-(-world // hw.gpus_per_node)) if world > hw.world_size else hw


def report_text(r: dict, width: int = 120) -> str:
    """The predicted-versus-measured tables as text."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.3f} ms"

    def pct(x):
        return "-" if x is None else f"{x:+.0%}"

    def mib(x):
        return "-" if x is None else f"{x / 2**20:.2f} MiB"

    tables = []
    t = Table(title="per op class (sum over the measured shapes)")
    for c in ("op class", "shapes", "datasheet", "predicted", "measured", "error"):
        t.add_column(c, justify="left" if c == "op class" else "right")
    for o in r["ops"]:
        t.add_row(o["class"], str(o["items"]), ms(o["datasheet_s"]), ms(o["predicted_s"]), ms(o["measured_s"]),
                  pct(o["error"]))
    tables.append(t)
    t = Table(title="per collective (sum over message sizes)")
    for c in ("collective", "bytes", "datasheet", "predicted", "measured", "error"):
        t.add_column(c, justify="left" if c == "collective" else "right")
    for o in r["collectives"]:
        t.add_row(o["collective"], f"{o['bytes'][0]}..{o['bytes'][1]}", ms(o["datasheet_s"]), ms(o["predicted_s"]),
                  ms(o["measured_s"]), pct(o["error"]))
    tables.append(t)
    t = Table(title="peak memory per rank")
    for c in ("plan", "mesh", "ZeRO", "mb", "predicted", "measured", "error"):
        t.add_column(c, justify="left" if c in ("plan", "mesh") else "right")
    for m in r["memory"]:
        t.add_row(m["plan"], ",".join(f"{a}={s}" for a, s in m["mesh"].items()), str(m["zero_stage"]),
                  str(m["n_microbatches"]), mib(m["predicted_bytes"]), mib(m["measured_bytes"]), pct(m["error"]))
    tables.append(t)
    t = Table(title="step time (slowest rank, median of the timed steps; mb = micro-batches)")
    for c in ("plan", "mesh", "ZeRO", "mb", "datasheet", "microbench fit", "predicted", "measured", "error",
              "leave-one-out"):
        t.add_column(c, justify="left" if c in ("plan", "mesh") else "right")
    for s in r["steps"]:
        mesh = ",".join(f"{a}={v}" for a, v in s["mesh"].items())
        if not s["ok"]:
            t.add_row(s["plan"], mesh, str(s["zero_stage"]), str(s["n_microbatches"]), "-", "-", "-", "failed",
                      (s.get("error") or "")[:40], "")
            continue
        t.add_row(s["plan"] + (" *" if s.get("chosen") else ""), mesh, str(s["zero_stage"]), str(s["n_microbatches"]),
                  ms(s["datasheet_s"]),
                  ms(s["microbench_s"]), ms(s["predicted_s"]), ms(s["measured_s"]), pct(s["error"]),
                  pct(s["leave_one_out_error"]))
    tables.append(t)
    buf = StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for t in tables:
        con.print(t)
    k = r["kernel_overhead_s"]
    tail = [f"* = the plan kept (fastest measured): {r['chosen']}",
            f"per-kernel overhead: {k['microbenchmark'] * 1e6:.2f} us measured on one kernel, "
            f"{k['calibrated'] * 1e6:.2f} us fitted to the step times", contention_text(r.get("contention"))]
    tail += [f"note: {n}" for n in r["notes"]]
    return buf.getvalue().rstrip() + "\n" + "\n".join(tail)
