"""`autopar tune` measures selective checkpointing's host time (tools/microbench.py "selective":
a chain of small ops, forward + backward, under plain and under selective checkpointing) and
writes it into the tuned profile as `selective_node_s` (cost/hardware.py), which the cost model
charges per node of a selective region in its forward and its recompute (cost/timeline.py); and
plain checkpointing's own host time per node (`checkpoint_node_s`), charged over every
checkpointed region."""
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
    # plain checkpointing's own host time: what the checkpointed run costs beyond the plain run and
    # one more forward (measured 12.3 us per node on this 2-core host, 2026-11-27)
    assert got["full_s"] > got["none_s"] > got["fwd_s"] > 0 and got["checkpoint_node_s"] > 0
    assert got["checkpoint_node_s"] == pytest.approx(
        (got["full_s"] - got["none_s"] - got["fwd_s"]) / got["ops"] * OPS_PER_NODE)
    assert fitted.checkpoint_node_s == pytest.approx(got["checkpoint_node_s"], rel=1e-12)
    assert from_dict(fitted.to_dict()).checkpoint_node_s == fitted.checkpoint_node_s


def test_a_checkpointed_region_pays_the_checkpoints_host_time_per_node():
    """cost.timeline charges `checkpoint_node_s` over every node of a checkpointed region, full or
    selective, and a selective one its dispatch mode on top, in both passes."""
    import dataclasses

    from cost_helpers import captured

    from autopar.cost.timeline import region_recompute, regions_for

    _, _, gm = captured("gpt-tiny")
    from autopar.cost import analyze

    hw = load_profile("cpu-gloo")
    gc = analyze(gm, hw)
    (full,) = regions_for(gc, {"layers.0": "full"})
    zero = dataclasses.replace(hw, checkpoint_node_s=0.0, selective_node_s=0.0)
    base = region_recompute(gc, full, hardware=zero)[1]
    got = region_recompute(gc, full, hardware=dataclasses.replace(zero, checkpoint_node_s=1e-3))[1]
    assert got - base == pytest.approx(len(full.nodes) * 1e-3)
    sel = dataclasses.replace(full, save=frozenset(list(full.nodes)[:1]))
    both = dataclasses.replace(zero, checkpoint_node_s=1e-3, selective_node_s=1e-2)
    assert region_recompute(gc, sel, hardware=both)[1] - region_recompute(gc, sel, hardware=zero)[1] == pytest.approx(
        len(full.nodes) * (1e-3 + 2 * 1e-2))


def test_no_selective_item_keeps_the_profiles_figure():
    assert fit_selective([{"kind": "launch", "seconds": 1e-6}]) is None
    base = load_profile("h100-sxm")
    fitted, fits = fit_profile(base, [], [])
    assert fitted.selective_node_s == base.selective_node_s and "selective checkpoint" not in fits
