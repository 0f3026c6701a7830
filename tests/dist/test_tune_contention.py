"""The contention microbenchmark of `autopar tune` (issue 22 item 3) on a 2-rank gloo world.

`microbench.run_contention` times a GEMM loop alone and beside async all-reduces over the
world; its k must be finite, >= 0, and what its own raw times give (the median of the covered
rank x repeat samples, clamped). `tune.fit_profile` must carry that k into the refitted
profile's intra-node link (and only there), through save and load, and the report line must
print it beside the datasheet's. No timing is asserted: k on a shared CPU is whatever it is.
"""
import math
import statistics

from harness import world

from autopar.cost import load_profile
from autopar.cost.hardware import MAX_CONTENTION


def _bench(rank, n):
    from autopar.tools.microbench import compute_suite, run_compute

    items = [it for it in compute_suite("cpu", quick=True) if it["kind"] == "contention"]
    assert len(items) == 1, items  # inside a world of 2+ ranks the suite measures contention once
    return run_compute({**items[0], "repeats": 5, "window_s": 0.02}, "cpu")


def test_contention_microbenchmark_fits_k_from_its_own_timings_and_tune_carries_it(tmp_path):
    from autopar.tools.microbench import compute_suite, contention_text, fit_contention, predicted_seconds
    from autopar.tools.tune import fit_profile

    assert not [it for it in compute_suite("cpu", quick=True) if it["kind"] == "contention"]  # one process: none
    r0, r1 = world(2, _bench)
    assert r0["k"] == r1["k"] and r0["times"] == r1["times"]  # every rank computes the same figure from all ranks
    t = r0["times"]
    assert len(t["alone_s"]) == 2 and all(len(row) == 5 for row in t["alone_s"] + t["with_s"])
    assert all(x > 0 and math.isfinite(x) for row in t["alone_s"] + t["with_s"] for x in row)
    assert r0["covered"] > 0, r0  # the collectives stayed in flight through some loop at least
    samples = [w / a - 1 for ra, rw, rc in zip(t["alone_s"], t["with_s"], t["covered"])
               for a, w, c in zip(ra, rw, rc) if c > 0]
    assert math.isclose(r0["k_raw"], statistics.median(samples), rel_tol=1e-12) and r0["k_spread"]["samples"] == len(samples)
    assert math.isfinite(r0["k"]) and r0["k"] == min(MAX_CONTENTION, max(0.0, r0["k_raw"])) >= 0
    assert r0["k_spread"]["min"] <= r0["k_raw"] <= r0["k_spread"]["max"]

    base = load_profile("cpu-gloo").with_contention(0.0, 0.05)  # a known inter-node figure that must stay
    fitted, fits = fit_profile(base, [r0], [])
    assert fits["contention"]["k"] == r0["k"] and fits["contention"]["was"] == 0.0
    assert fitted.contention_for(False) == r0["k"] and fitted.contention_for(True) == 0.05
    fitted.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.contention == fitted.contention and again.calibration["fits"]["contention"]["k"] == r0["k"]
    # the report's op-class row: the loop alone slowed by the profile's k while the collectives run
    assert predicted_seconds(r0, base) == r0["alone_s"]
    assert predicted_seconds(r0, fitted) >= r0["alone_s"]
    line = contention_text({"datasheet_k": 0.0, "tuned_k": fitted.contention_for(False),
                            "measured": fit_contention([r0])})
    assert f"measured {r0['k']:.3f}" in line and "datasheet 0" in line, line
    assert "not measured" in contention_text({"datasheet_k": 0.0, "tuned_k": 0.0, "measured": None})
