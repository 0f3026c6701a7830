"""Real-size planning of the largest public mixture-of-experts models on 256 and 2,048 H100s.

    python benchmarks/bench_moe_scale.py                          # every model, 256 and 2,048 GPUs
    python benchmarks/bench_moe_scale.py --models deepseek-v3-671b --gpus 2048
    python benchmarks/bench_moe_scale.py --quick                  # DeepSeek-V3 671B on 256 GPUs only

Each model is built with transformers from its published configuration (the values are written
out below; nothing is downloaded), in bf16 under `torch.device("meta")`, captured with
`autopar.capture` (2 rows of `--seq` tokens; the batch dim stays symbolic), and planned by the
joint planner (`autopar.search.planner.plan_for`) for each GPU count on `h100-sxm` widened to
GPUs / 8 nodes (`Hardware.with_nodes`, as benchmarks/bench_published.py does), every dimension
searched: tp x pp x dp x ep, ZeRO stage, micro-batches, schedule, stage split, recompute.
Plans as data: expert parallelism with pipelines and recompute with ep/pp are allowed (`ALLOW`),
which the runtime cannot all carry out yet.

Global batch (sequences of `--seq` = 4096 tokens): 1,024 (4.2 M tokens) on 256 GPUs and 4,096
(16.8 M tokens) on 2,048 GPUs by default (`--batch` overrides; DeepSeek-V3 trained with 15.36 M
tokens per step on 2,048 H800s).

Every model runs in a child process of its own (capture once, then one plan per GPU count), so
that the peaks of two models never mix. Per phase the child samples its resident memory (VmRSS
from /proc/self/status every 10 ms on a thread: the peak of that phase alone) and also reports
`resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end of the phase (the process's peak so far,
which includes earlier phases). The reference point is the model itself: its bf16 weights
(printed in the "weights" column) never exist here.

Columns per (model, GPUs): capture s and its RSS peak, plan s (wall time, with the process's CPU
seconds and the load average at its start: the CPU seconds hold under load) and its RSS peak (the
graph is still held), the chosen mesh (dp / tp / pp / ep), ZeRO stage, micro-batches, schedule, recomputed
units, predicted step time, predicted peak per GPU (of the 90 % limit), tokens/s/GPU and MFU as
the cost model counts them (its FLOP count of the captured graph: the routed experts' grouped
matmuls at top-k rows). Then, per model, the search's statistics and the target check (600B-class
planning in under 60 s). Reads and writes no node.meta itself.

Run time on the shared 2-core machine (load 5-7 from others, 2026-11-25): about 22 minutes for
the three models on both GPU counts (captures 1.5-5 min each, which torch.export dominates;
plans 1-2 min each); `--quick` about 6 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOW = {"ep": True, "ep_with_pp": True, "recompute_with_pp": True, "recompute_with_ep": True}
DEFAULT_BATCH = {256: 1024, 2048: 4096}  # sequences of --seq tokens per step
TARGET_S = 60.0  # a 600B-class MoE plans in under this (issue 25)

# Published configurations (the config.json of each release on the Hugging Face hub, values
# written out; rope scaling and multi-token-prediction layers, which do not change the trained
# parameter count of the main model or its FLOPs at seq 4096, are left out).
MODELS: dict[str, dict] = {
    # Qwen/Qwen3-235B-A22B: 94 layers, every layer MoE (128 experts, top 8), GQA 64 q / 4 kv heads
    "qwen3-235b-a22b": dict(
        config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", published_b=235,
        kw=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
                num_key_value_heads=4, head_dim=128, moe_intermediate_size=1536, num_experts=128,
                num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, norm_topk_prob=True,
                rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])),
    # zai-org/GLM-4.5: 92 layers (first 3 dense), 160 routed + 1 shared experts, top 8, 96 q / 8 kv heads
    "glm-4.5-355b": dict(
        config="Glm4MoeConfig", model="Glm4MoeForCausalLM", published_b=355,
        kw=dict(hidden_size=5120, intermediate_size=12288, num_hidden_layers=92, num_attention_heads=96,
                num_key_value_heads=8, head_dim=128, moe_intermediate_size=1536, n_routed_experts=160,
                n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                vocab_size=151552, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})),
    # deepseek-ai/DeepSeek-V3: 61 layers (first 3 dense), 256 routed + 1 shared experts, top 8 in 4 of
    # 8 groups, MLA (q_lora 1536, kv_lora 512, rope 64 + nope 128, v 128), 128 heads
    "deepseek-v3-671b": dict(
        config="DeepseekV3Config", model="DeepseekV3ForCausalLM", published_b=671,
        kw=dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                first_k_dense_replace=3, norm_topk_prob=True, vocab_size=129280, max_position_embeddings=163840,
                rms_norm_eps=1e-6, tie_word_embeddings=False)),
}


class PhasePeak:
    """Peak VmRSS of the process over one phase, sampled every `period_s` on a thread."""

    def __init__(self, period_s: float = 0.01):
        self.period, self._stop, self.peak = period_s, threading.Event(), 0

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.now()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def emit(d: dict) -> None:
    print("RESULT " + json.dumps(d), flush=True)


def one(name: str, gpus: list[int], seq: int, batch: int | None) -> None:
    """The child: build, capture, plan for each GPU count; one RESULT line per phase."""
    import torch
    import transformers as T

    from autopar.capture import capture
    from autopar.cost import load_profile
    from autopar.search.planner import clear_cache, plan_for

    spec = MODELS[name]
    cfg = getattr(T, spec["config"])(**spec["kw"], use_cache=False)
    with PhasePeak() as ph:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = getattr(T, spec["model"])(cfg).to(torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        gm = capture(model, (torch.empty(2, seq, dtype=torch.long, device="meta"),))
        t_cap = time.perf_counter() - t0
    del model
    emit({"phase": "capture", "model": name, "params": n_params, "build_s": t_build, "capture_s": t_cap,
          "rss_peak": ph.peak, "maxrss": maxrss(), "nodes": len(gm.graph.nodes)})
    for n in gpus:
        rows = batch or DEFAULT_BATCH.get(n, n * 2)
        hw = load_profile("h100-sxm").with_nodes(-(-n // 8))
        clear_cache()
        out = {"phase": "plan", "model": name, "gpus": n, "batch": rows, "seq": seq}
        with PhasePeak() as ph:
            t0, c0, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
            try:
                plan, rep = plan_for(gm, n, hw, global_batch=rows, allow=ALLOW, top_k=3)
            except Exception as e:  # noqa: BLE001 - reported in the table
                plan, rep = None, None
                out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            out["plan_s"] = time.perf_counter() - t0
            # CPU seconds of this process: what the plan costs on a free core, whatever the load
            out.update(plan_cpu_s=time.process_time() - c0, load=load)
        out.update(rss_peak=ph.peak, maxrss=maxrss())
        if plan is not None:
            m, p = plan.mesh, plan.predicted
            rc = plan.recompute
            out.update(mesh=dict(m), zero=plan.zero_stage, micro=plan.n_microbatches, schedule=plan.schedule,
                       recompute=(len(rc) if isinstance(rc, dict) else str(rc)), step_s=p["step_s"],
                       peak_bytes=p["peak_bytes"], limit_bytes=p["memory_limit_bytes"], mfu=p["mfu"],
                       tokens_per_s=p["tokens_per_s"], bubble=p["bubble"], compute_s=p["compute_s"],
                       comm={a: {k: float(v) for k, v in d.items()} for a, d in p["comm_per_axis"].items()},
                       memory={k: float(v) for k, v in p["memory_bytes"].items()},
                       search=rep.search, top=[f"{b['label']} {b['step_s']:.3f}s" for b in rep.alternatives[:3]],
                       ep_reason=rep.reason("ep") if "ep" in rep.dimensions else "")
        emit(out)


def mesh_label(r: dict) -> str:
    m = r["mesh"]
    s = f"dp{m.get('dp', 1)} tp{m.get('tp', 1)} pp{m.get('pp', 1)} ep{m.get('ep', 1)} Z{r['zero']} mb{r['micro']}"
    if m.get("pp", 1) > 1 and r.get("schedule"):
        s += f" {r['schedule']}"
    if r.get("recompute") not in (0, "none", "None", None):
        s += f" rc{r['recompute']}"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--gpus", default="256,2048", help="comma-separated GPU counts (multiples of 8)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, help="global batch in sequences (default 1,024 on 256 GPUs, 4,096 on 2,048)")
    ap.add_argument("--quick", action="store_true", help="DeepSeek-V3 671B on 256 GPUs only")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    gpus = [int(x) for x in a.gpus.split(",")]
    if a.one:
        one(a.one, gpus, a.seq, a.batch)
        return 0
    models = ["deepseek-v3-671b"] if a.quick else a.models.split(",")
    if a.quick:
        gpus = [256]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown models {bad}; choose from {list(MODELS)}")
    import torch
    import transformers

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; h100-sxm x (GPUs / 8) nodes; seq {a.seq}; bf16 meta capture; one process "
          "per model; planner allow " + ",".join(k for k, v in ALLOW.items() if v))
    head = ["model", "params", "GPUs", "batch", "capture s", "cap RSS", "plan s", "plan RSS", "plan",
            "step s", "peak/GPU GiB", "tok/s/GPU", "MFU"]
    rows, notes, failed = [head], [], 0
    for name in models:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--gpus", ",".join(map(str, gpus)),
                            "--seq", str(a.seq)] + (["--batch", str(a.batch)] if a.batch else []),
                           capture_output=True, text=True, cwd=ROOT)
        res = [json.loads(ln[len("RESULT "):]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for r in res:  # as they come, for a long run; the table follows
            print("  " + json.dumps({k: v for k, v in r.items() if k not in ("comm", "memory", "search")}),
                  file=sys.stderr, flush=True)
        cap = next((r for r in res if r["phase"] == "capture"), None)
        if cap is None:
            failed += 1
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            rows.append([name, "-", "-", "-", "FAILED", "-", "-", "-", err[:160]] + ["-"] * 4)
            notes.append(f"{name}: capture failed ({time.perf_counter() - t0:.0f} s):\n"
                         + "\n".join(p.stderr.strip().splitlines()[-15:]))
            continue
        for r in res:
            if r["phase"] != "plan":
                continue
            base = [name, f"{cap['params'] / 1e9:.1f}B", f"{r['gpus']:,}", f"{r['batch']}x{r['seq']}",
                    f"{cap['capture_s']:.1f}", f"{cap['rss_peak'] / 2**30:.2f}G",
                    f"{r['plan_s']:.1f} ({r.get('plan_cpu_s', 0):.1f} cpu, load {r.get('load', 0):.1f})",
                    f"{r['rss_peak'] / 2**30:.2f}G"]
            if "error" in r:
                failed += 1
                rows.append(base + ["ERROR: " + r["error"][:120]] + ["-"] * 4)
                notes.append(f"{name} on {r['gpus']}: {r['error']}")
                continue
            rows.append(base + [mesh_label(r), f"{r['step_s']:.2f}",
                                f"{r['peak_bytes'] / 2**30:.1f}/{r['limit_bytes'] / 2**30:.0f}",
                                f"{r['tokens_per_s'] / r['gpus']:,.0f}", f"{r['mfu']:.1%}"])
            s = r["search"]
            comm = ", ".join(f"{ax} {d.get('time_s', 0):.2f}s ({d.get('exposed_s', 0):.2f} exposed)"
                             for ax, d in r["comm"].items())
            mem = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in r["memory"].items() if v > 2**28)
            notes.append(f"{name} on {r['gpus']}: {s.get('candidates')} candidates, {s.get('evaluated')} costed, "
                         f"{s.get('pruned_bound')} pruned by bound, {s.get('no_fit')} do not fit, ILPs "
                         f"{s.get('ilp_seconds', 0):.1f} s for tp {s.get('tp_solved')}; compute {r['compute_s']:.2f} s,"
                         f" bubble {r['bubble']:.1%}; comm per axis: {comm}; memory GiB: {mem}; process maxrss "
                         f"{r['maxrss'] / 2**30:.2f} GiB" + (f"; runners-up: {r['top'][1:]}" if r.get("top") else "")
                         + (f"; ep: {r['ep_reason'][:1000]}" if r.get("ep_reason") else ""))
            if cap["params"] > 500e9 and r["plan_s"] > TARGET_S:
                notes.append(f"{name} on {r['gpus']}: plan {r['plan_s']:.1f} s is OVER the {TARGET_S:.0f} s target")
        if p.returncode:
            failed += 1
            notes.append(f"{name}: child exited {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-5:]))
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    for x in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())
    print("capture s: model build on meta excluded; plan s: wall (CPU seconds of the process, load average at the "
          "start); RSS: peak VmRSS of the phase (the plan phase still holds the "
          "graph); peak/GPU: predicted peak of the fullest rank / the 90 % limit; MFU and tok/s/GPU as the cost "
          "model counts them")
    for n in notes:
        print("note " + n)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
