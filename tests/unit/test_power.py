"""Sustained load (issue 22, compute): a compute table's power rows, a graph's GEMM duty, and
the hardware both cost models run it on (`cost.power`). The rows are bursts' ratio to
sustained throughput by duty; the planner's tables and `cost.estimate` apply one ratio to one
graph and still agree to 1e-6."""
import json

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.cost import analyze, estimate, load_profile
from autopar.cost.compute_tables import table_from_dict
from autopar.cost.power import graph_duty, sustained
from autopar.passes.plan import Plan


def _table(power):
    return table_from_dict({"power": power}, "test")


def test_power_rows_interpolate_clamp_and_round_trip():
    t = _table({"rows": [[1.0, 0.8], [0.5, 1.0]]})
    assert t.power == ((0.5, 1.0), (1.0, 0.8))  # sorted by duty
    assert t.sustained_ratio(0.2) == 1.0 and t.sustained_ratio(1.0) == pytest.approx(0.8)
    assert t.sustained_ratio(0.75) == pytest.approx(0.9)
    assert table_from_dict(t.to_dict(), "again").power == t.power
    assert table_from_dict({}, "none").sustained_ratio(1.0) == 1.0  # no rows: bursts hold


@pytest.mark.parametrize("bad", [{"rows": []}, {"rows": [[1.2, 0.9]]}, {"rows": [[0.9, 1.1]]}, {"rows": [[0.5]]},
                                 {"rows": [[0.5, 1.0], [0.5, 0.9]]}, [[0.5, 1.0]]])
def test_bad_power_rows_are_refused_with_the_format(bad):
    with pytest.raises(ValueError, match="power"):
        _table(bad)


class _Gemms(nn.Module):
    """Linears alone (duty near 1), or each followed by pointwise ops (duty lower)."""

    def __init__(self, width, pointwise):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(3))
        self.pointwise = pointwise

    def forward(self, x):
        for lin in self.layers:
            x = lin(x)
            if self.pointwise:
                x = torch.tanh(x) * torch.sigmoid(x) + x
        return x


def _graph(width=2048, rows=2048, pointwise=False):
    with torch.device("meta"):
        m = _Gemms(width, pointwise).to(torch.bfloat16)
        x = torch.empty(rows, width, dtype=torch.bfloat16, requires_grad=False)
    return capture(m, (x,))


def _profile(tmp_path, rows, name="throttled", overhead=None, **device):
    d = {"name": name, "extends": "h100-sxm", "compute": {"power": {"rows": rows}}}
    if overhead is not None:
        d["kernel_overhead_s"] = overhead
    if device:
        d["device"] = device
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_duty_is_the_gemm_share_and_the_ratio_follows_it(tmp_path):
    hw = load_profile("h100-sxm")
    gemm_only, mixed = analyze(_graph(), hw), analyze(_graph(pointwise=True), hw)
    d_gemm, d_mixed = graph_duty(gemm_only, hw), graph_duty(mixed, hw)
    assert 0.95 < d_gemm <= 1.0 and 0.0 < d_mixed < d_gemm - 0.1, (d_gemm, d_mixed)
    prof = load_profile(_profile(tmp_path, [[0.0, 1.0], [1.0, 0.5]]))
    assert sustained(prof, gemm_only).power_ratio == pytest.approx(1.0 - 0.5 * d_gemm)
    assert sustained(prof, mixed).power_ratio == pytest.approx(1.0 - 0.5 * d_mixed)
    twice = sustained(sustained(prof, mixed), mixed)  # the duty is taken at bursts: idempotent
    assert twice.power_ratio == sustained(prof, mixed).power_ratio
    a100 = load_profile("a100-80gb")  # no power rows: bursts
    assert sustained(a100, gemm_only) is a100


def test_estimate_runs_gemms_at_the_sustained_ratio(tmp_path):
    """A compute-bound graph's matmul seconds grow by exactly 1 / ratio (launch overhead set to
    0: it is host time, not throttled); its other kernels' not."""
    gm = _graph(width=4096, rows=8192)
    burst = estimate(gm, Plan(mesh={"dp": 1}), _profile(tmp_path, [[0.0, 1.0]], "burst", overhead=0))
    slow = estimate(gm, Plan(mesh={"dp": 1}), _profile(tmp_path, [[0.0, 0.8]], "slow", overhead=0))
    assert slow.compute_by_kind["matmul"] == pytest.approx(burst.compute_by_kind["matmul"] / 0.8, rel=1e-9)
    assert slow.compute_by_kind["other"] == pytest.approx(burst.compute_by_kind["other"], rel=1e-9)
    assert any("sustained load" in n for n in slow.notes) and not any("sustained load" in n for n in burst.notes)


def test_the_planner_prices_the_same_sustained_ratio_as_estimate(tmp_path):
    """Every one-stage candidate on a profile whose power rows matter (a device slow enough that
    the tiny GPT's GEMMs are compute-bound, throttled to half): planner = estimate to 1e-6."""
    from tests.unit.test_one_cost_model import _agree, _capture

    gm = _capture("gpt-tiny")
    slow_device = {"peak_flops": {"fp32": 2e9, "tf32": 2e9, "bf16": 4e9, "fp16": 4e9, "fp8": 8e9, "fp64": 1e9}}
    half = _profile(tmp_path, [[0.0, 0.5]], "half", **slow_device)
    whole = _profile(tmp_path, [[0.0, 1.0]], "whole", **slow_device)
    plan = Plan(mesh={"dp": 1})
    assert estimate(gm, plan, half).step_s > 1.3 * estimate(gm, plan, whole).step_s  # the ratio matters here
    done = _agree(gm, half, world=4)
    assert len(done) >= 6
