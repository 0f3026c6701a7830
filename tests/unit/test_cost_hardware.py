"""Hardware profiles load, validate, inherit, and say what is wrong."""
from __future__ import annotations

import json

import pytest

from autopar.cost import load_profile, profile_names


def test_every_shipped_profile_loads_with_datasheet_figures():
    names = profile_names()
    for needed in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "h100-8x", "h100-64", "cpu-gloo"):
        assert needed in names
    for n in names:
        hw = load_profile(n)
        assert hw.name == n and hw.device.memory_bytes > 0 and hw.device.memory_bandwidth > 0
        assert hw.peak("bf16") > 0 and hw.peak("fp32") > 0
    h100, h200 = load_profile("h100-sxm"), load_profile("h200")
    assert h100.peak("bf16") == pytest.approx(989.4e12) and h100.device.memory_bandwidth == pytest.approx(3.35e12)
    assert h200.peak("bf16") == h100.peak("bf16") and h200.device.memory_bandwidth == pytest.approx(4.8e12)
    assert load_profile("a100-80gb").peak("bf16") == pytest.approx(312e12)
    c = load_profile("h100-64")
    assert (c.nodes, c.gpus_per_node, c.world_size) == (8, 8, 64)
    assert c.inter_node.bandwidth == pytest.approx(400e9 / 8)  # 400 Gb/s per GPU
    assert load_profile("cpu-gloo").kernels["sdpa"] == "cpu"


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        load_profile("h900")
    assert "h100-sxm" in str(e.value) and "cpu-gloo" in str(e.value)


def test_a_profile_file_can_extend_a_shipped_one_and_calibration_overwrites_efficiency(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"name": "mine", "extends": "h100-sxm", "topology": {"nodes": 4},
                             "efficiency": {"matmul": 0.5}}))
    hw = load_profile(p)
    assert hw.world_size == 32 and hw.eff("matmul") == 0.5 and hw.eff("memory") == load_profile("h100-sxm").eff("memory")
    tuned = hw.calibrated(matmul=0.61, inter_node=0.9)
    out = tmp_path / "tuned.json"
    tuned.save(out)
    back = load_profile(out)
    assert back.eff("matmul") == 0.61 and back.calibration["source"] == "calibrated" and back.world_size == 32


def test_bad_values_are_value_errors_naming_them(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"name": "bad", "extends": "h100-sxm", "efficiency": {"matmul": 1.7}}))
    with pytest.raises(ValueError, match="matmul"):
        load_profile(p)
    p.write_text(json.dumps({"name": "bad", "extends": "h100-sxm", "kernels": {"sdpa": "fastest"}}))
    with pytest.raises(ValueError, match="sdpa"):
        load_profile(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError):
        load_profile("h100-sxm").calibrated(matmul=0)
