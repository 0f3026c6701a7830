"""GEMM throughput under sustained load, by the share of the device's time that GEMMs take.

The compute tables are fitted from 20-call bursts. A GPU at its power limit lowers its clock
under sustained GEMM load (one H100 SXM at 700 W: 789 TFLOP/s over 20 calls of 8192^3 bf16,
671 after 10 s, the SM clock from 1980 to 1380 MHz). A training step mixes GEMMs with
memory-bound kernels, which draw less power. This measures, for each duty (the fraction of
device time in GEMMs), the GEMMs' own TFLOP/s once the load has run for a while, with the clock
and power, by interleaving n^3 bf16 GEMMs with memory-bound adds sized to the duty:

    python scripts/gpu_power.py [--seconds 4] [--duties 1,0.85,0.7,0.5,0.3] [--out DIR]

First a ramp: GEMMs alone, TFLOP/s per ~50 ms window with time stamps (how fast the clock
falls). Each duty runs `--seconds`, after 2 s idle; its GEMMs are timed with CUDA events over
the last half. Prints one line per duty; writes the lines and the ramp to OUT/gpu_power.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch


def _reading() -> tuple[float | None, float | None]:
    try:
        return float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3
    except Exception:  # noqa: BLE001 - NVML may be unavailable: the throughput stands alone
        return None, None


def ramp(a, b, out, seconds: float) -> list[tuple[float, float, float | None, float | None]]:
    """(seconds since start, TFLOP/s, SM MHz, W) per window of GEMMs alone."""
    n = a.shape[0]
    rows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b, out=out)
        torch.cuda.synchronize()
        rows.append((t - t0, 2.0 * n**3 * 10 / (time.perf_counter() - t) / 1e12, *_reading()))
    return rows


def _seconds_each(fn, calls: int = 5) -> float:
    """Device seconds per call of `fn` over `calls` back-to-back calls (CUDA events)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3 / calls


def duty_run(a, b, out, x, y, z, duty: float, seconds: float) -> dict:
    """Interleave one GEMM with k memory-bound adds so that GEMMs take ~`duty` of the time."""
    n = a.shape[0]
    fill_s = _seconds_each(lambda: torch.add(x, y, out=z))
    gemm_s = _seconds_each(lambda: torch.mm(a, b, out=out))
    k = 0 if duty >= 1.0 else max(1, round(gemm_s * (1.0 - duty) / duty / fill_s))
    pairs, t0 = [], time.perf_counter()
    cycles = 0
    while time.perf_counter() - t0 < seconds:
        timed = time.perf_counter() - t0 >= seconds / 2
        if timed:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        torch.mm(a, b, out=out)
        if timed:
            e.record()
            pairs.append((s, e))
        for _ in range(k):
            torch.add(x, y, out=z)
        cycles += 1
        if cycles % 8 == 0:  # keep the host a few cycles ahead, not seconds
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    clock, power = _reading()
    t_gemm = statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3
    return {"duty": duty, "adds_per_gemm": k, "achieved_duty": gemm_s / (gemm_s + k * fill_s),
            "gemm_tflops": 2.0 * n**3 / t_gemm / 1e12, "burst_tflops": 2.0 * n**3 / gemm_s / 1e12,
            "clock_mhz": clock, "power_w": power}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--ramp", type=float, default=3.0)
    p.add_argument("--duties", default="1,0.85,0.7,0.5,0.3")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--out", default=os.environ.get("OUT") or "out")
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    ma, mb = (torch.randn(a.n, a.n, device=dev, dtype=dt, generator=g) for _ in range(2))
    mo = torch.empty(a.n, a.n, device=dev, dtype=dt)
    x, y = (torch.randn(1 << 27, device=dev, dtype=dt, generator=g) for _ in range(2))
    z = torch.empty_like(x)
    torch.mm(ma, mb, out=mo)
    torch.cuda.synchronize()
    lines = [f"# {torch.cuda.get_device_name()}; GEMM {a.n}^3 bf16; fill: add of 2^27 bf16 elements"]
    time.sleep(2.0)
    r = ramp(ma, mb, mo, a.ramp)
    lines.append("# ramp, GEMMs alone: seconds, TFLOP/s, SM MHz, W")
    lines += [f"ramp {t:6.3f} {tf:6.0f} {c} {w}" for t, tf, c, w in r]
    for d in (float(s) for s in a.duties.split(",") if s):
        time.sleep(2.0)
        res = duty_run(ma, mb, mo, x, y, z, d, a.seconds)
        lines.append(f"duty {res['duty']:.2f} (achieved {res['achieved_duty']:.2f}, {res['adds_per_gemm']} adds per "
                     f"GEMM): GEMM {res['gemm_tflops']:.0f} TFLOP/s sustained against {res['burst_tflops']:.0f} "
                     f"burst (ratio {res['gemm_tflops'] / res['burst_tflops']:.3f}); SM {res['clock_mhz']} MHz, "
                     f"{res['power_w']} W")
        print(lines[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_power.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1] + [ln for ln in lines if ln.startswith("duty")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
