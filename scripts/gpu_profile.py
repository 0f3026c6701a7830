"""Where a step's time goes, on one GPU: eager PyTorch against autopar's programs.

For the ~1.1 B GPT of scripts/gpu_check.py (bf16, batch 4 x 2048), each variant is timed in
two phases (forward + backward, then the optimizer step, each between synchronisations) and
profiled for two steps with torch.profiler. It prints one line per variant and writes, per
variant, the top operators by self device time, by self CPU time and by input shape to
OUT/profile_<name>.txt.
With --by-kind each variant also gets the cost model's step split by kind of work (GEMMs,
attention, other ops, optimizer, outside ops) against the profiled one (autopar.tools.op_kinds):
where the prediction is short, by kind. Predicted with the h100-sxm profile (--profile).
With --sustained S it first runs an 8192^3 bf16 GEMM loop for S seconds and prints its TFLOP/s over
the first 20 calls (what the compute tables are fitted from) against after S seconds, with the SM
clock and power (`sustained_gemm`): whether a GPU at its power limit slows under training's load.

    python scripts/gpu_profile.py [--only eager,pure,mixed,recompute,offload] [--out DIR] [--launch] [--sync-debug]
                                  [--by-kind] [--profile NAME] [--sustained SECONDS]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import Ctx, _batches, _build, gpt_config  # noqa: E402

VARIANTS = {
    "eager": None,
    "pure": {"precision": "bf16"},
    "mixed": {},
    "recompute": {"memory_budget": 0.5},
    "offload": {"zero_stage": 3, "offload": True},
}


def _phases(fwd_bwd, opt_step, n: int) -> tuple[float, float]:
    fb, op = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt_step()
        torch.cuda.synchronize()
        fb.append(t1 - t0)
        op.append(time.perf_counter() - t1)
    return statistics.median(fb), statistics.median(op)


def _sync_points(fn) -> list[str]:
    """The places (innermost frames outside torch) of every synchronising CUDA call in fn()."""
    import collections
    import traceback
    import warnings

    seen: collections.Counter = collections.Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
        seen[f"{str(message)[:60]} @ {where}"] += 1

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    return [f"{n:4d}x {k}" for k, n in seen.most_common(20)]


def launch_costs() -> list[str]:
    """Host microseconds per call of small (launch-bound) ops: the fused kernels against torch,
    plain and under a selective-checkpoint policy (what `memory_budget` recompute runs)."""
    import functools

    import torch.nn.functional as F
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from autopar.runtime import kernels

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    policy = functools.partial(create_selective_checkpoint_contexts, lambda *_a, **_k: CheckpointPolicy.PREFER_RECOMPUTE)
    cases = {
        "rms_norm triton fwd": lambda: kernels.rms_norm(x, w),
        "rms_norm torch fwd": lambda: F.rms_norm(x, (4096,), w),
        "swiglu triton fwd+bwd": lambda: kernels.swiglu(x, a).sum().backward(),
        "swiglu torch fwd+bwd": lambda: (F.silu(x) * a).sum().backward(),
        "swiglu triton fwd+bwd, plain checkpoint": lambda: checkpoint(kernels.swiglu, x, a, use_reentrant=False).sum().backward(),
        "swiglu triton fwd+bwd, selective checkpoint": lambda: checkpoint(
            kernels.swiglu, x, a, use_reentrant=False, context_fn=policy).sum().backward(),
        "swiglu torch fwd+bwd, selective checkpoint": lambda: checkpoint(
            lambda u, v: F.silu(u) * v, x, a, use_reentrant=False, context_fn=policy).sum().backward(),
    }
    out = []
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t) / 200
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 200
        out.append(f"{name:48s} host {host * 1e6:8.1f} us/call, wall {wall * 1e6:8.1f} us/call")
    return out


def predicted_estimate(model, pm, example, profile: str):
    """The cost model's estimate of the variant's step: the eager model captured and costed as
    one rank with no masters (torch's AdamW over its bf16 parameters); an autopar variant's
    global graph under its plan, as build/predict.py costs it."""
    from autopar.capture import capture
    from autopar.cost import estimate
    from autopar.passes.plan import Plan

    if pm is None:
        return estimate(capture(model, (example,)), Plan(mesh={"dp": 1}), profile, master_dtype=None)
    return estimate(pm.global_graph, pm.plan, profile, batch_is_global=True)


def sustained_gemm(device: str = "cuda", n: int = 8192, seconds: float = 3.0, dtype=torch.bfloat16) -> dict:
    """Throughput of back-to-back n^3 GEMMs at first and once the device has run them for
    `seconds`: the compute tables are fitted from short bursts (20 calls), a training step runs
    for minutes, and a GPU at its power limit lowers its clock under sustained load. Four input
    pairs in rotation (not one pair the cache keeps). Returns {"burst_tflops", "sustained_tflops",
    "ratio", "windows": [(seconds since start, TFLOP/s)], "clock_mhz": (at start, at end) or None,
    "power_w": likewise}: the figures a sustained-clock correction of the tables would rest on."""
    gen = torch.Generator(device=device).manual_seed(0)
    pairs = [(torch.randn(n, n, device=device, dtype=dtype, generator=gen),
              torch.randn(n, n, device=device, dtype=dtype, generator=gen)) for _ in range(4)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    probe = (lambda f: f()) if device == "cuda" else (lambda f: None)

    def reading():
        try:
            return probe(torch.cuda.clock_rate), probe(torch.cuda.power_draw)
        except Exception:  # noqa: BLE001 - NVML may be unavailable: the throughput stands alone
            return None, None

    def window(calls: int) -> float:
        sync()
        t = time.perf_counter()
        for i in range(calls):
            a, b = pairs[i % 4]
            torch.mm(a, b, out=out)
        sync()
        return 2.0 * n**3 * calls / (time.perf_counter() - t) / 1e12

    window(3)  # warm: handles, the first launch
    clock0, power0 = reading()
    burst = window(20)
    windows, t0 = [], time.perf_counter()
    per = max(1, int(0.05 * burst * 1e12 / (2.0 * n**3)))  # calls in ~50 ms
    while time.perf_counter() - t0 < seconds:
        windows.append((time.perf_counter() - t0, window(per)))
    clock1, power1 = reading()
    tail = [r for t, r in windows if t >= 0.75 * seconds] or [windows[-1][1]]
    sustained = statistics.median(tail)
    return {"burst_tflops": burst, "sustained_tflops": sustained, "ratio": sustained / burst, "windows": windows,
            "clock_mhz": (clock0, clock1) if clock0 is not None else None,
            "power_w": (power0 / 1e3, power1 / 1e3) if power0 is not None else None}


def run(name: str, out: Path, steps: int, sync_debug: bool = False, by_kind: str | None = None) -> str:
    import autopar
    from autopar.models.gpt import loss_fn
    from autopar.tools import op_kinds

    ctx = Ctx(False, torch.device("cuda", 0), out)
    cfg = gpt_config(False)
    data = _batches(cfg, 2, 4, 2048, ctx.device)
    model = _build(cfg, ctx, torch.bfloat16)
    opts = VARIANTS[name]
    state = {"i": 0}
    pm = None
    if opts is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def fwd_bwd():
            (x,), y = data[state["i"] % 2]
            state["i"] += 1
            loss_fn(model(x), y).backward()
        extra = ""
    else:
        pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=data[0][0][0], **opts)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)

        def fwd_bwd():
            (x,), y = data[state["i"] % 2]
            state["i"] += 1
            pm.step(((x,), y), loss_fn)
        pred = pm.plan.predicted.get("estimate", pm.plan.predicted)
        extra = (f" pred_ms={pred.get('step_s', 0) * 1e3:.0f} recompute={ {m: list(pm.plan.recompute.values()).count(m) for m in set(pm.plan.recompute.values())} } "
                 f"fusions={pm.plan.fusions} master={pm.plan.master_dtype} offload={pm.plan.offload}")

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    _phases(fwd_bwd, opt_step, 2)  # warm-up
    syncs = _sync_points(lambda: (fwd_bwd(), opt_step())) if sync_debug else []
    fb, op = _phases(fwd_bwd, opt_step, steps)
    torch.cuda.reset_peak_memory_stats()
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            fwd_bwd()
            with record_function(op_kinds.OPTIMIZER_RANGE):
                opt_step()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    ka = prof.key_averages()
    text = (f"# {name}: fwd+bwd {fb * 1e3:.1f} ms, optimizer {op * 1e3:.1f} ms, peak {peak:.1f} GiB{extra}\n\n"
            + ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
            + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
            + "\n\n# by input shape (two steps): which GEMM and attention shapes the device time goes to\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=40,
                                                                 max_name_column_width=40, max_shapes_column_width=90))
    kinds = ""
    if by_kind:
        est = predicted_estimate(model, pm, data[0][0][0], by_kind)
        rows = op_kinds.kind_rows(op_kinds.predicted_kinds(est), est.step_s,
                                  op_kinds.measured_kinds(prof.events(), 2, "cuda"), fb + op)
        kinds = (f"\n# {name} by kind of work, predicted ({by_kind}) against measured (self device time of two "
                 f"profiled steps; step: the unprofiled median)\n" + op_kinds.kind_text(rows))
        text += "\n" + kinds
    if sync_debug:
        text += f"\n\n# {len(syncs)} host-device synchronisations in one step, by place\n" + "\n".join(syncs)
    (out / f"profile_{name}.txt").write_text(text)
    return text.splitlines()[0] + kinds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.environ.get("OUT") or "out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--launch", action="store_true", help="also time small launch-bound calls (host cost per op)")
    p.add_argument("--sync-debug", action="store_true", help="list where one step synchronises host and device")
    p.add_argument("--by-kind", action="store_true", help="the step by kind of work, predicted against measured")
    p.add_argument("--profile", default="h100-sxm", help="the hardware profile --by-kind predicts with")
    p.add_argument("--sustained", type=float, default=0.0, metavar="S",
                   help="first, an 8192^3 bf16 GEMM loop for S seconds: burst against sustained TFLOP/s, clock, power")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from autopar.runtime.launch import free_port, init_job_process_group

    torch.cuda.set_device(0)
    os.environ.setdefault("LOCAL_RANK", "0")
    init_job_process_group("nccl", timeout_s=300, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                           world_size=1)
    lines = []
    if a.launch:
        try:
            lines = launch_costs()
        except Exception as e:  # the variants below still run
            lines = [f"# launch costs: FAILED {type(e).__name__}: {e}"]
    if a.sustained > 0:
        r = sustained_gemm("cuda", 8192, a.sustained)
        lines.append(f"# sustained GEMM 8192^3 bf16: {r['burst_tflops']:.0f} TFLOP/s over the first 20 calls, "
                     f"{r['sustained_tflops']:.0f} after {a.sustained:g} s (ratio {r['ratio']:.3f}); SM clock MHz "
                     f"{r['clock_mhz']}, power W {r['power_w']}")
    print("\n".join(lines), flush=True)
    for name in [n for n in a.only.split(",") if n]:
        try:
            lines.append(run(name, out, a.steps if name != "offload" else 2, a.sync_debug,
                             a.profile if a.by_kind else None))
        except Exception as e:  # one variant's failure must not hide the others
            lines.append(f"# {name}: FAILED {type(e).__name__}: {e}")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
