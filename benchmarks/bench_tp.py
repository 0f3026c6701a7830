"""Tensor-parallel step time of autopar against DTensor's `parallelize_module` with the same
placements, same model, same world, same job; and the sharding search time on a
Llama-3-70B-size graph for tp=8.

    python benchmarks/bench_tp.py [--world-size 2] [--steps 8] [--dim 256] [--layers 4] [--no-70b]

Each rank builds the same GPT twice. One copy goes through `autopar.parallelize` with the
Megatron placements pinned on the weights (wq, wk, wv, w1, w3 column-parallel: S(0);
wo, w2 row-parallel: S(1)); the search solves the activations around them. The other goes
through `parallelize_module` with ColwiseParallel / RowwiseParallel on the same linears
(heads per rank adjusted as torchtitan does). Forward + backward + AdamW steps alternate
between the two in rounds so machine noise hits both alike; prints the median step times
and the ratio autopar / DTensor (target <= 1.0).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _rank(rank, ws, steps, dim, layers, batch, seq):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import autopar
    from autopar.models import GPT, GPTConfig, gpt
    from autopar.runtime.collectives import COUNTER
    from autopar.runtime.placement import Layout, S

    cfg = GPTConfig(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=4 * dim,
                    max_seq_len=seq)
    torch.manual_seed(0)
    m1, m2 = GPT(cfg), GPT(cfg)
    m2.load_state_dict(m1.state_dict())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    col = ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3")
    row = ("attn.wo", "ffn.w2")
    pins = {}
    for i in range(layers):
        for name in col:
            pins[f"layers.{i}.{name}.weight"] = Layout.of({"tp": S(0)})
        for name in row:
            pins[f"layers.{i}.{name}.weight"] = Layout.of({"tp": S(1)})
    t0 = time.perf_counter()
    pm = autopar.parallelize(m1, autopar.mesh(tp=ws), example_inputs=x, pins={"param_layouts": pins})
    t_par = time.perf_counter() - t0
    opt1 = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)

    dmesh = init_device_mesh("cpu", (ws,))
    for blk in m2.layers:
        parallelize_module(blk, dmesh, {**{n: ColwiseParallel() for n in col}, **{n: RowwiseParallel() for n in row}})
        blk.attn.n_heads //= ws
        blk.attn.n_kv_heads //= ws
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-4)

    def step_autopar():
        pm.step((x, y), gpt.loss_fn)
        opt1.step()
        opt1.zero_grad()

    def step_dtensor():
        loss = gpt.loss_fn(m2(x), y)
        loss.backward()
        opt2.step()
        opt2.zero_grad()

    # same numbers first: one step each from the same weights gives the same loss
    with torch.no_grad():
        l1 = gpt.loss_fn(pm(x), y).item()
        l2 = gpt.loss_fn(m2(x), y).item()
    for f in (step_autopar, step_dtensor):
        f()
    COUNTER.reset()
    step_autopar()
    counted = {k: v["calls"] for k, v in COUNTER.snapshot().items()}
    times = {"autopar": [], "dtensor": []}
    for _ in range(steps):
        for name, f in (("autopar", step_autopar), ("dtensor", step_dtensor)):
            dist.barrier()
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, (l1, l2), counted, t_par, pm.plan.notes[0]


def _search_70b(tp: int = 8):
    from autopar.capture import capture
    from autopar.models import get
    from autopar.search.shard_ilp import solve_sharding

    spec = get("llama3-70b")
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(1, seq_len=4096, device="meta")
    t0 = time.perf_counter()
    gm = capture(model, inputs)
    t_cap = time.perf_counter() - t0
    sol = solve_sharding(gm, "tp", tp, mesh={"dp": 8, "tp": tp}, hardware="h100-64")
    return t_cap, sol


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-70b", action="store_true")
    a = ap.parse_args(argv)
    sys.path.insert(0, "tests")
    from autopar.runtime.launch import run_world

    res = run_world(a.world_size, _rank, a.steps, a.dim, a.layers, a.batch, a.seq, timeout_s=900)
    med, (l1, l2), counted, t_par, note = res[0]
    params = 12 * a.dim * a.dim * a.layers + 2 * 2048 * a.dim
    print(f"GPT ~{params / 1e6:.1f} M params, gloo, tp={a.world_size}, batch {a.batch} x {a.seq}, "
          f"median of {a.steps} steps (torch {torch.__version__})")
    print(f"  same weights, first loss: autopar {l1:.6f}  DTensor {l2:.6f}")
    print(f"  parallelize (capture + search + rewrite): {t_par:.2f} s; {note}")
    print(f"  collectives per autopar step: {counted}")
    print(f"  autopar tp step:              {med['autopar'] * 1e3:8.1f} ms")
    print(f"  DTensor parallelize_module:   {med['dtensor'] * 1e3:8.1f} ms")
    print(f"  ratio autopar / DTensor:      {med['autopar'] / med['dtensor']:.3f}   (target <= 1.0)")
    if not a.no_70b:
        t_cap, sol = _search_70b()
        print(f"llama3-70b (seq 4096), tp=8 on h100-64: capture {t_cap:.1f} s; search {sol.seconds:.2f} s "
              f"(target < 10 s); {sol.summary()}")


if __name__ == "__main__":
    main()
