"""`autopar tune` measures selective checkpointing's host time (tools/microbench.py "selective":
a chain of small ops, forward + backward, under plain and under selective checkpointing) and
writes it into the tuned profile as `selective_node_s` (cost/hardware.py), which the cost model
charges per node of a selective region in its forward and its recompute (cost/timeline.py)."""
from __future__ import annotations

import pytest

from autopar.cost import load_profile
from autopar.tools.microbench import OPS_PER_NODE, compute_suite, fit_selective, predicted_seconds, run_compute
from autopar.tools.tune import fit_profile


def test_the_selective_item_runs_here_and_the_fitted_profile_predicts_it():
    item = [i for i in compute_suite("cpu", quick=True) if i["kind"] == "selective"][0]
    got = run_compute(item, "cpu")
    # the dispatch mode costs something on every op, forward and recompute alike
    assert got["seconds"] > got["full_s"] > 0 and got["node_s"] > 0
    assert got["node_s"] == pytest.approx((got["seconds"] - got["full_s"]) / got["ops"] / 2 * OPS_PER_NODE)
    base = load_profile("cpu-gloo")
    fitted, fits = fit_profile(base, [got], [])
    assert fitted.selective_node_s == pytest.approx(got["node_s"], rel=1e-12)
    assert fits["selective checkpoint"]["was"] == base.selective_node_s
    assert predicted_seconds(got, fitted) == pytest.approx(got["seconds"], rel=1e-9)
    # the fitted figure survives the profile's JSON round trip (what tune writes, what a plan reads)
    from autopar.cost.hardware import from_dict

    assert from_dict(fitted.to_dict()).selective_node_s == fitted.selective_node_s


def test_no_selective_item_keeps_the_profiles_figure():
    assert fit_selective([{"kind": "launch", "seconds": 1e-6}]) is None
    base = load_profile("h100-sxm")
    fitted, fits = fit_profile(base, [], [])
    assert fitted.selective_node_s == base.selective_node_s and "selective checkpoint" not in fits
