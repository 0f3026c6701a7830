"""Recompute search: solve time on a 2,000-node graph, and the timeline's predictions against
a real training step at several budgets.

Part 1. The reference GPT with enough blocks for >= 2,000 analysed nodes, captured on meta,
planned at a 0.5 budget by `plan_recompute` (the chain DP with its proven gap; target < 10 s).
Reference in the same run: the exact MILP (HiGHS) on the same model and budget, with a time
limit; printed as time and cost ratios.

Part 2. The reference GPT and transformers' Llama (4 blocks, batch 4 x 32, fp32, CPU), at
budgets 1.0, 0.7, 0.5, 0.3 and full recomputation: predicted vs measured saved bytes
(saved_tensors_hooks + the selective cache), recompute FLOPs (FlopCounterMode), peak (the CPU
allocator's events from torch.profiler), and the measured step time relative to no
checkpointing (the reference measured in the same run).

Part 3. Checkpointing's host time: `autopar.parallelize` (world 1, gloo, cpu-gloo profile) of a
16-block GPT at width 64, where ops are tiny and the host dominates, with no recompute, every
block fully checkpointed and every block selective (its matmuls kept): the measured step against
`plan.predicted["step_s"]`, whose recompute term includes the selective dispatch mode's host time
(the profile's `selective_node_s`, cost/hardware.py) but not plain checkpointing's own.

Usage: python benchmarks/bench_recompute.py [--layers 38] [--milp-seconds 30] [--part 3]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.cost import analyze
from autopar.cost.timeline import regions_for, timeline
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.pass_manager import PassContext
from autopar.passes.plan import Plan
from autopar.passes.recompute import observe_cached, recompute
from autopar.build.recompute_plan import plan_recompute
from autopar.search.recompute import build_chain, solve_dp, solve_milp

aten = torch.ops.aten
CPU_FLASH = {  # FlopCounterMode has no formula for the CPU flash kernels; torch's own flash formulas
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_backward_flop_count(g, q, k, v),
}  # fmt: skip


def gpt(layers: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    with torch.device(device):
        return GPT(cfg)


def llama() -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            use_cache=False))


def loss_of(outs) -> torch.Tensor:
    return sum(o.float().sum() for o in outs if o.is_floating_point())


def saved_bytes(gm, args) -> int:
    state = {t.untyped_storage().data_ptr() for t in list(gm.parameters()) + list(gm.buffers())}
    seen: dict[int, int] = {}

    def record(t):
        st = t.untyped_storage()
        if st.data_ptr() not in state:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with observe_cached(record), torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        loss = loss_of(gm(*args))
    loss.backward()
    gm.zero_grad(set_to_none=True)
    return sum(seen.values())


def flops(gm, args) -> int:
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as fc:
        loss_of(gm(*args)).backward()
    gm.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def peak_bytes(gm, args) -> int:
    weights = [torch.randn_like(o) for o in gm(*args) if o.is_floating_point()]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outs = [o for o in gm(*args) if o.is_floating_point()]
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        del outs
        loss.backward()
        del loss
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted((e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"),
                            key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    cur = peak = 0
    for e in events:
        cur += e["args"]["Bytes"]
        peak = max(peak, cur)
    gm.zero_grad(set_to_none=True)
    return peak


def step_seconds(gm, args, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        loss_of(gm(*args)).backward()
        best = min(best, time.perf_counter() - t0)
        gm.zero_grad(set_to_none=True)
    return best


def part1(layers: int, milp_seconds: float) -> None:
    model = gpt(layers, device="meta")
    x = torch.zeros(4, 32, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    gm = autopar.capture(model, (x,))
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    modes, rep = plan_recompute(gm, 0.5)
    t_plan = time.perf_counter() - t0
    gc = analyze(gm, "cpu-gloo")
    chain = build_chain(gm, gc, hardware="cpu-gloo")
    budget = rep.budget_bytes
    t0 = time.perf_counter()
    dp = solve_dp(chain, budget)
    t_dp = time.perf_counter() - t0
    t0 = time.perf_counter()
    mi = solve_milp(chain, budget, time_limit_s=milp_seconds)
    t_milp = time.perf_counter() - t0
    print(f"part 1: reference GPT, {layers} blocks: {len(gm.graph.nodes)} graph nodes, {len(gc.nodes)} analysed, "
          f"{chain.n_binaries} binaries, {len(chain.candidates)} candidate layers")
    print(f"  capture                                {t_capture:7.2f} s (not part of the solve)")
    print(f"  plan_recompute(gm, 0.5), all of it     {t_plan:7.2f} s = {t_plan / 10.0:.2f} x the 10 s target; "
          f"{rep.solver['method']} {rep.solver['status']}, gap {rep.solver['gap']:.2%}, "
          f"{rep.solver['iterations']} timeline check(s)")
    print(f"  DP alone on the chain model            {t_dp:7.2f} s, cost {dp.cost_s * 1e3:.4f} ms, bound "
          f"{dp.bound_s * 1e3:.4f} ms, gap {dp.gap:.2%}")
    print(f"  exact MILP (HiGHS, {milp_seconds:.0f} s limit)          {t_milp:7.2f} s, cost {mi.cost_s * 1e3:.4f} ms "
          f"({mi.status}, gap {mi.gap:.2%})")
    print(f"  DP / MILP: time {t_dp / t_milp:.3f}, cost {dp.cost_s / mi.cost_s:.4f}")
    print(f"  plan: {sum(v == 'full' for v in modes.values())} full, {sum(v == 'selective' for v in modes.values())} "
          f"selective, {sum(v == 'none' for v in modes.values())} none; predicted peak "
          f"{rep.predicted_peak / 2**20:.2f} MiB of a {rep.budget_bytes / 2**20:.2f} MiB budget")


def part2() -> None:
    print("part 2: predictions against a real step (CPU, fp32, batch 4 x 32)")
    print(f"  {'model':6} {'budget':>6} {'saved pred':>11} {'measured':>11} {'ratio':>7} {'re-FLOPs pred':>13} "
          f"{'measured':>11} {'peak pred':>11} {'measured':>11} {'ratio':>7} {'step / none':>11}")
    for name, build in (("gpt", lambda: gpt(4)), ("llama", llama)):
        model = build().train()
        idx = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
        gm = autopar.capture(model, (idx,))
        gc = analyze(gm, "cpu-gloo")
        base_flops = flops(gm, (idx,))
        base_time = step_seconds(gm, (idx,))
        for b in (1.0, 0.7, 0.5, 0.3, "full"):
            if b == "full":
                modes = {k: "full" for k in plan_recompute(gm, 1.0)[0]}
                save = {}
                tl = timeline(gc, regions_for(gc, modes))
            else:
                modes, rep = plan_recompute(gm, b)
                save, tl = rep.save, rep.timeline
            plan = Plan(mesh={"dp": 1}, recompute=modes, extra={"recompute_save": save})
            g = recompute(copy.deepcopy(gm), PassContext(plan=plan, mesh_sizes={"dp": 1}))
            s = saved_bytes(g, (idx,))
            f = flops(g, (idx,)) - base_flops
            p = peak_bytes(g, (idx,))
            t = step_seconds(g, (idx,))
            pred_peak = tl.peak - tl.inputs
            print(f"  {name:6} {b!s:>6} {tl.saved:11.0f} {s:11d} {s / tl.saved:7.4f} {tl.recompute_flops:13.0f} "
                  f"{f:11d} {pred_peak:11.0f} {p:11d} {p / pred_peak:7.4f} {t / base_time:11.3f}")


def part3() -> None:
    import statistics  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from autopar.models.gpt import loss_fn  # noqa: PLC0415

    print("part 3: checkpointing's host time (parallelize, world 1, cpu-gloo; GPT 16 blocks at width 64, "
          "batch 2 x 16)")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = GPTConfig(vocab_size=256, dim=64, n_layers=16, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = ((ids[:, :-1],), ids[:, 1:])
    print(f"  {'recompute':10} {'measured ms':>11} {'predicted ms':>12} {'ratio':>7} {'of it recompute ms':>18}")
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        pins = {} if mode == "none" else {"recompute": {f"layers.{i}": mode for i in range(cfg.n_layers)}}
        pm = autopar.parallelize(GPT(cfg), autopar.mesh(dp=1), example_inputs=batch[0][0], pins=pins)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)

        def step():
            pm.step(batch, loss_fn)
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        times = []
        for _ in range(15):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        meas, pred = statistics.median(times), pm.plan.predicted["step_s"]
        print(f"  {mode:10} {meas * 1e3:11.2f} {pred * 1e3:12.2f} {pred / meas:7.3f} "
              f"{pm.plan.predicted['recompute_s'] * 1e3:18.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=38, help="GPT blocks for part 1 (38: >= 2,000 analysed nodes)")
    ap.add_argument("--milp-seconds", type=float, default=30.0, help="time limit of the reference MILP")
    ap.add_argument("--part", type=int, choices=(1, 2, 3), action="append", help="run only this part (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    parts = set(args.part or (1, 2, 3))
    if 1 in parts:
        part1(args.layers, args.milp_seconds)
    if 2 in parts:
        part2()
    if 3 in parts:
        part3()


if __name__ == "__main__":
    main()
