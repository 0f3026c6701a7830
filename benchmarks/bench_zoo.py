"""The zoo at real size: capture on the meta device and plan for a 64-GPU H100 cluster.

For each row of `autopar.models.zoo` (the published size: GPT-2 XL, Llama-3-8B, Mistral-7B,
Qwen2-7B, Mixtral-8x7B, BERT-large, T5-large, ViT-L/16, ResNet-50), in a fresh process of
its own (so that peak RAM is that row's): build under `torch.device("meta")`, capture, run the
joint planner for 64 devices (`h100-64`: 8 nodes of 8 H100 SXM), lower the chosen plan (rank
0's passes and the pipeline split, on meta) and write its dump to out/zoo/<row>/, and print
the plan, its predicted step time and memory, the capture, search and dump seconds and the
process's peak resident memory. The reference point is the model itself: a meta capture holds no weights,
so peak RAM is what autopar's graph, cost tables and search take.

    python benchmarks/bench_zoo.py                 # every row that can be built here
    python benchmarks/bench_zoo.py hf-llama --plan # one row, with its full plan text
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(name: str, world: int, hardware: str, show_plan: bool, dump_root: str | None) -> None:
    from autopar.tools.zoo_check import plan_real

    r = plan_real(name, world_size=world, hardware=hardware,
                  dump_dir=os.path.join(dump_root, name) if dump_root else None)
    if show_plan:
        print(r.text, file=sys.stderr)
    d = r.to_dict()
    d.pop("text")
    print("RESULT " + json.dumps(d))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="*", help="zoo rows (default: all)")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--hardware", default="h100-64")
    ap.add_argument("--plan", action="store_true", help="print each row's full plan text")
    ap.add_argument("--dump", default="out/zoo", help="lower each plan (rank 0's passes, pipeline split) and "
                    "write its dump under DUMP/<row>/ ('' to skip); the RAM column includes it")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one, a.world_size, a.hardware, a.plan, a.dump or None)
        return 0
    from autopar.models import zoo

    rows = a.rows or [n for n in zoo.names() if not zoo.get(n).breadth]
    print(f"zoo at real size: meta capture + joint planner for {a.world_size} devices ({a.hardware}); "
          "one process per row")
    print(f"{'row':14s} {'model':36s} {'params':>7s} {'batch x seq':>12s} {'plan':26s} {'step':>9s} {'peak/GPU':>9s} "
          f"{'capture':>8s} {'search':>7s} {'dump':>6s} {'RAM':>7s}")
    failed = 0
    for name in rows:
        why = zoo.get(name).available()
        if why:
            print(f"{name:14s} not run: {why}")
            continue
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--world-size", str(a.world_size),
                            "--hardware", a.hardware, "--dump", a.dump] + (["--plan"] if a.plan else []),
                           capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if a.plan:
            print(p.stderr.split("RESULT")[0][-6000:])
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            failed += 1
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{name:14s} FAILED ({wall:.0f} s): {err[:200]}")
            continue
        r = json.loads(line[-1][len("RESULT "):])
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        bs = f"{r['batch']} x {r['seq']}" if r["seq"] else f"{r['batch']}"
        size = f"{r['params_b']:6.2f}B" if r["params_b"] >= 1 else f"{r['params_b'] * 1e3:6.0f}M"
        print(f"{name:14s} {r['model'][:36]:36s} {size:>7s} {bs:>12s} {mesh:26s} {r['step_s'] * 1e3:7.0f}ms "
              f"{r['peak_gib']:7.1f}GiB {r['capture_s']:7.1f}s {r['search_s']:6.1f}s {r['dump_s']:5.1f}s "
              f"{r['peak_rss_gib']:5.2f}GiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
