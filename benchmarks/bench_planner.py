"""Joint-planner time on real-size models: Llama-3-70B on 512 H100s and Llama-3.1-405B on
16,384 H100s, every dimension searched (tp x pp x dp factorisation, ZeRO stage, micro-batches,
schedule, stage split with recompute per stage, the sharding ILP per tp degree).

    python benchmarks/bench_planner.py [--only 70b|405b] [--exhaustive]

Each model is built on the meta device and captured (autopar.capture), then planned
(`autopar.search.planner.plan_for`); the times printed are capture, planning and their sum,
against the targets (30 s for 70B / 512, 60 s for 405B / 16,384: capture included). With
`--exhaustive` the same cost model is also run on every candidate with no pruning (the
reference the search's bounds must not lose to): the ratio search / exhaustive and whether
both chose the same plan are printed.
"""
from __future__ import annotations

import argparse
import time

import torch

# plans as data, for clusters this machine does not have; recompute inside pipeline stages runs
# (search.planner.RUNTIME_SUPPORT["recompute_with_pp"] is True): allowed here whatever that flag says
ALLOW = {"recompute_with_pp": True}
TARGETS = {"70b": ("llama3-70b", 512, "h100-512", 8192, 1024, 30.0),
           "405b": ("llama3-405b", 16384, None, 8192, 2048, 60.0)}


def _capture(name: str, seq: int):
    from autopar.capture import capture
    from autopar.models import get

    spec = get(name)
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(2, seq_len=seq, device="meta")  # 2 rows: the batch dim stays symbolic
    t0 = time.perf_counter()
    gm = capture(model, inputs)
    return gm, time.perf_counter() - t0


def _exhaustive(gm, world, hw, global_batch):
    """Every candidate costed, no bounds: the reference for the search's pruning."""
    from autopar.search.planner import RUNTIME_SUPPORT, _Search, candidates

    t0 = time.perf_counter()
    s = _Search(gm, hw, world, {}, 0.9 * hw.device.memory_bytes, global_batch, 1, "adamw",
                {**RUNTIME_SUPPORT, **ALLOW}, None)
    best = None
    n = 0
    for c in candidates(s.model, world, {}, s.support):
        ev = s._evaluate(c)
        n += 1
        if ev is not None and ev.feasible and (best is None or ev.step_s < best.step_s):
            best = ev
    return best, n, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(TARGETS))
    ap.add_argument("--exhaustive", action="store_true")
    a = ap.parse_args(argv)
    from autopar.cost import load_profile
    from autopar.search.planner import clear_cache, plan_for

    print(f"torch {torch.__version__}")
    for key, (name, world, profile, seq, batch, target) in TARGETS.items():
        if a.only and key != a.only:
            continue
        hw = load_profile(profile) if profile else load_profile("h100-sxm").with_nodes(world // 8)
        gm, t_cap = _capture(name, seq)
        clear_cache()
        t0 = time.perf_counter()
        plan, rep = plan_for(gm, world, hw, global_batch=batch, allow=ALLOW)
        t_plan = time.perf_counter() - t0
        total = t_cap + t_plan
        s = rep.search
        print(f"{name} on {world} x {hw.device.name} ({hw.name}), global batch {batch} x {seq} tokens:")
        print(f"  capture {t_cap:6.1f} s + plan {t_plan:6.1f} s = {total:6.1f} s; target {target:.0f} s "
              f"(ratio {total / target:.2f}, {'ok' if total <= target else 'OVER'})")
        print(f"  plan / capture time {t_plan / t_cap:.2f} (the machine's load scales both)")
        print(f"  search: {s['candidates']} candidates, {s['evaluated']} costed, {s['pruned_bound']} pruned by bound, "
              f"{s['no_fit']} do not fit; sharding ILPs {s['ilp_seconds']:.1f} s for tp in {s['tp_solved']}")
        c = rep.chosen
        print(f"  chosen: {c['label']}; predicted step {c['step_s']:.3f} s, {c['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {c['mfu']:.1%}, peak {c['peak_bytes'] / 2**30:.1f} GiB of {rep.memory_limit / 2**30:.1f} GiB")
        for line in rep.reasons():
            print(f"    - {line[:220]}")
        t1 = time.perf_counter()
        plan_for(gm, world, hw, global_batch=batch, allow=ALLOW)
        print(f"  planned again from the cache in {time.perf_counter() - t1:.3f} s")
        if a.exhaustive:
            best, n, t_ex = _exhaustive(gm, world, hw, batch)
            same = best is not None and best.candidate.label() == c["label"]
            print(f"  exhaustive (same cost model, no pruning): {n} candidates in {t_ex:.1f} s; "
                  f"search / exhaustive time {t_plan / t_ex:.2f}; best {best.candidate.label() if best else None} "
                  f"at {best.step_s if best else float('nan'):.4f} s vs search {c['step_s']:.4f} s "
                  f"({'same plan' if same else 'different plan'})")


if __name__ == "__main__":
    main()
