"""scripts/gpu_profile.py's sustained GEMM check, run on the CPU at a small size: it times a
burst of 20 calls, then ~50 ms windows for the time asked, and reports the later windows'
median against the burst (on a GPU, with the SM clock and power: whether the device slows
under sustained load, which the compute tables' 20-call measurements would not show). The CPU
has no clock or power reading: those come back None. No timing is asserted beyond its being
positive and the ratio being the two figures' quotient."""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import torch  # noqa: E402

from gpu_profile import sustained_gemm  # noqa: E402


def test_sustained_gemm_reports_burst_and_sustained_throughput():
    r = sustained_gemm("cpu", n=128, seconds=0.3, dtype=torch.float32)
    assert r["burst_tflops"] > 0 and r["sustained_tflops"] > 0
    assert math.isclose(r["ratio"], r["sustained_tflops"] / r["burst_tflops"])
    assert r["windows"] and all(t >= 0 and x > 0 for t, x in r["windows"])
    assert [t for t, _ in r["windows"]] == sorted(t for t, _ in r["windows"])
    assert r["windows"][-1][0] < 0.3  # windows start within the time asked
    assert r["clock_mhz"] is None and r["power_w"] is None  # no NVML reading on the CPU
