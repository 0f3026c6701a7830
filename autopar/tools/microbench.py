"""Measure what the cost model assumes about a machine: the microbenchmarks of `autopar tune`.

  compute_suite(device, quick)   matmul throughput over shapes and dtypes, causal attention,
                                 elementwise (vector) and copy (memory bandwidth) over sizes,
                                 the launch overhead of a tiny kernel, and what offload runs
                                 on: pinned host<->device copies (on a GPU) and the CPU's
                                 fused AdamW step (host memory bandwidth)
  run_compute(item, device)      time one item of that suite
  collective_suite(sizes)        every collective the runtime issues, over message sizes
  run_collective(item, group)    time one collective on a process group (max over its ranks)
  predicted_seconds(item, hw)    what the cost model's roofline says the item takes on `hw`,
                                 with the same formula `autopar.cost.estimate` uses per node
                                 (the profile's compute table by shape, its floors)
  measured_efficiencies(items, hw)  the GEMM and attention efficiencies the items reached and
                                 the matmul floor they show: what `autopar tune` refits the
                                 profile's compute table with
  contention_item(device, quick) / run_contention(item, group, device)
                                 the compute slowdown under communication (`cost.overlap`'s k):
                                 a GEMM loop timed alone, then while async all-reduces over
                                 `group` (issued through the loop 4x as fast as they complete,
                                 so a backlog is always in flight) run on the same devices;
                                 k = t_with / t_alone - 1 per rank and repeat; the median of
                                 the covered samples (collectives in flight through the whole
                                 loop; all samples when none was, and "covered" says 0),
                                 clamped to [0, MAX_CONTENTION], with their spread and the raw
                                 times.
                                 `compute_suite` adds the item when it runs inside a world of 2+
                                 ranks (the bench job), whose default group it then uses
  fit_contention(items)          the k that measured items give, with its spread (None: none)
  selective item / fit_selective(items)
                                 the host time of torch's selective-checkpoint dispatch mode: a
                                 chain of small ops run forward + backward under plain
                                 checkpointing and under selective checkpointing (everything
                                 recomputed); the difference per op and pass, times the ATen ops
                                 per captured node (OPS_PER_NODE), is the profile's
                                 `selective_node_s` (cost/hardware.py)

On a GPU the matmul items span small (256^2..1024^2, launch-bound), medium and large GEMMs and
the shapes of a transformer layer, each timed as a burst (0.3 s idle first, ~20 ms of calls:
before the power limit lowers the clock; the table's power rows price sustained load); attention spans seq 512 / 2048 / 8192 at head_dim 64 and
128, causal and not: the axes of the compute table (autopar/cost/compute_tables.py).

The contention item is timed with wall clocks on CPU (gloo's threads share the cores with
the GEMMs: that is what it measures there) and with CUDA events on the compute stream on a GPU
(NCCL's kernels share the SMs); the GPU path is the same code under NCCL, untested on a GPU.

Every item is a plain dict (JSON-ready) that gets a "seconds" entry when measured. Payloads
follow `autopar.cost.comm`: the tensor handed to the collective on one rank (all-gather: the
local shard). Times are medians over repeats after warm-up; a collective's time is the slowest
rank's (all-reduce MAX of each rank's median), which is what a step waits for.

Reads and writes no node.meta keys.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.cost import Hardware
from autopar.cost.comm import collective_time
from autopar.cost.hardware import MAX_CONTENTION
from autopar.cost.node_time import NodeTimer
from autopar.cost.overlap import slowdown

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SELECTIVE_OPS = 200  # ops in the selective item's chain
# ATen ops the selective dispatch mode sees per captured graph node: 1742 in the forward of 16
# blocks of 54 nodes (autopar's GPT at width 64, torch 2.13, counted with cProfile, 2026-11-27)
OPS_PER_NODE = 2.0
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


# ------------------------------------------------------------------------ suites
def compute_suite(device: str, quick: bool) -> list[dict[str, Any]]:
    """The compute items for a device ("cpu" or "cuda"); `quick` keeps CPU runs to seconds."""
    gpu = device == "cuda"
    items: list[dict[str, Any]] = []
    sizes = [256, 512, 1024, 2048, 4096, 8192] if gpu else ([64, 128, 256, 384] if quick else [64, 128, 256, 512, 1024])
    dtypes = ["bf16", "fp16", "fp32"] if gpu else ["fp32", "bf16"]
    for dt in dtypes:
        slow = not gpu and dt != "fp32"  # CPU half precision runs ~50x slower without AMX: keep it small
        for s in (sizes[:2] if slow else sizes):
            items.append({"kind": "matmul", "dtype": dt, "shape": [s, s, s]})
        if slow:
            continue
        # the skinny shapes of a transformer layer: tokens x width x width
        for m, k, n in ([(8192, 4096, 4096), (8192, 4096, 14336)] if gpu else [(256, 64, 64), (256, 64, 128),
                                                                               (512, 128, 512)]):
            items.append({"kind": "matmul", "dtype": dt, "shape": [m, k, n]})
    att = ([(16, 32, 512, 128), (4, 32, 2048, 128), (1, 32, 8192, 128), (4, 32, 2048, 64), (1, 32, 8192, 64)]
           if gpu else [(8, 4, 32, 16), (4, 4, 128, 32), (2, 8, 256, 64)])
    for causal in (True, False):
        for b, h, s, d in (att if causal or gpu else att[-1:]):
            items.append({"kind": "attention", "dtype": "bf16" if gpu else "fp32", "shape": [b, h, s, d],
                          "causal": causal})
    numels = [2**20, 2**24, 2**27] if gpu else ([2**12, 2**16, 2**20, 2**22] if quick else
                                                [2**12, 2**16, 2**20, 2**23])
    for n in numels:
        items.append({"kind": "vector", "dtype": "fp32", "numel": n})
        items.append({"kind": "memory", "dtype": "fp32", "numel": n})
    items.append({"kind": "launch", "dtype": "fp32", "numel": 1})
    items.append({"kind": "selective", "dtype": "fp32", "ops": SELECTIVE_OPS})
    if gpu:  # offload's copies: pinned host memory <-> the device, each direction
        for n in (2**24, 2**26):
            for direction in ("h2d", "d2h"):
                items.append({"kind": "host_copy", "dtype": "fp32", "numel": n, "direction": direction})
    for n in ([2**24, 2**26] if gpu else [2**20, 2**22] if quick else [2**22, 2**24]):
        items.append({"kind": "host_step", "dtype": "fp32", "numel": n})  # offload's CPU update
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        items.append(contention_item(device, quick))  # run by every rank at once, as the bench job does
    return items


def contention_item(device: str, quick: bool) -> dict[str, Any]:
    """The contention microbenchmark: a GEMM of a transformer layer's size (GPU: 8192 x 4096 x
    4096 bf16; CPU: the largest quick square, fp32) beside all-reduces of a large bucket."""
    gpu = device == "cuda"
    return {"kind": "contention", "dtype": "bf16" if gpu else "fp32",
            "shape": [8192, 4096, 4096] if gpu else [384, 384, 384], "op": "all_reduce",
            "payload": 2**28 if gpu else (2**22 if quick else 2**24), "repeats": 7 if quick else 15,
            "window_s": 0.005 if gpu else 0.04}


def collective_suite(sizes: list[int]) -> list[dict[str, Any]]:
    return [{"kind": "collective", "op": op, "payload": int(s)} for op in COLLECTIVE_OPS for s in sizes]


def default_message_sizes(device: str, quick: bool) -> list[int]:
    if device == "cuda":
        return [2**k for k in range(12, 31, 3)]  # 4 KiB .. 1 GiB
    return [2**k for k in (range(10, 23, 4) if quick else range(10, 25, 2))]  # 1 KiB .. 4 MiB (16 MiB)


# ------------------------------------------------------------------------ timing
BURST_REST_S = 0.3  # idle before a GPU GEMM / attention item: the clock back up from the last item's load
BURST_BUDGET_S = 0.02  # and its timed calls: within the first ~30 ms, before the power limit lowers the clock


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, device: str, *, min_repeats: int = 5, budget_s: float = 0.15) -> float:
    fn()
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(1000, int(0.01 / once)))  # batch tiny kernels so the timer's resolution is no issue
    repeats = max(min_repeats, min(50, int(budget_s / (once * inner))))
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def run_compute(item: dict[str, Any], device: str) -> dict[str, Any]:
    """`item` with its measured "seconds" (and the work it did: flops, bytes)."""
    dt = DTYPES[item["dtype"]]
    kind = item["kind"]
    out = dict(item)
    if kind == "matmul":
        m, k, n = item["shape"]
        a, b = torch.randn(m, k, device=device, dtype=dt), torch.randn(k, n, device=device, dtype=dt)
        fn = lambda: torch.mm(a, b)  # noqa: E731
        out.update(flops=2.0 * m * k * n, bytes=float((m * k + k * n + m * n) * a.element_size()))
    elif kind == "attention":
        b, h, s, d = item["shape"]
        q, k_, v = (torch.randn(b, h, s, d, device=device, dtype=dt) for _ in range(3))
        causal = bool(item.get("causal", True))
        fn = lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=causal)  # noqa: E731
        out.update(flops=4.0 * b * h * s * s * d, bytes=float(4 * b * h * s * d * q.element_size()))
    elif kind in ("vector", "memory", "launch"):
        x = torch.randn(item["numel"], device=device, dtype=dt)
        y = torch.randn_like(x)
        z = torch.empty_like(x)
        if kind == "memory":
            fn = lambda: z.copy_(x)  # noqa: E731
            out.update(flops=0.0, bytes=float(2 * x.numel() * x.element_size()))
        else:
            fn = lambda: torch.add(x, y, out=z)  # noqa: E731
            out.update(flops=float(x.numel()), bytes=float(3 * x.numel() * x.element_size()))
    elif kind == "host_copy":
        n = item["numel"]
        host = torch.randn(n, dtype=dt).pin_memory()
        dev = torch.randn(n, device=device, dtype=dt)
        src, dst = (host, dev) if item["direction"] == "h2d" else (dev, host)
        fn = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        out.update(flops=0.0, bytes=float(n * host.element_size()))
    elif kind == "contention":
        return run_contention(item, None, device)
    elif kind == "selective":
        return _run_selective(out, device)
    elif kind == "host_step":
        # the offloaded update (runtime/offload.py): fused AdamW over fp32 masters on the CPU;
        # bytes as cost.optimizer_step.offload_step_seconds counts them (master + 2 states read and
        # written, the gradient read)
        n = item["numel"]
        p = torch.nn.Parameter(torch.randn(n, dtype=dt))
        p.grad = torch.randn(n, dtype=dt) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-6, fused=True)
        fn = opt.step
        device = "cpu"
        out.update(flops=0.0, bytes=float(n * (2 * 3 * p.element_size() + p.element_size())))
    else:
        raise ValueError(f"unknown microbenchmark kind {kind!r}")
    if device == "cuda" and kind in ("matmul", "attention"):
        # a burst, as the compute table's rows are: a GPU at its power limit slows within ~50 ms of
        # GEMM load (an H100 SXM: 789 -> 716 TFLOP/s by 50 ms, 671 after seconds), so rest first and
        # time ~20 ms; sustained load is the table's power rows' business (cost/power.py)
        time.sleep(BURST_REST_S)
        out["seconds"] = _median_time(fn, device, min_repeats=3, budget_s=BURST_BUDGET_S)
    else:
        out["seconds"] = _median_time(fn, device)
    return out


def _run_selective(out: dict[str, Any], device: str) -> dict[str, Any]:
    """The selective item: a chain of `ops` small ops (linear, sin, mul, add), forward and
    backward without checkpointing, under plain checkpointing and under selective checkpointing
    that recomputes every op (torch.utils.checkpoint's dispatch mode, as passes/recompute.py runs
    a region), and its forward alone. `node_s`: the dispatch mode's host time per node and pass
    over plain checkpointing; `checkpoint_node_s`: plain checkpointing's per node beyond the
    forward it runs again (its saved-tensor hooks and their replay)."""
    import functools  # noqa: PLC0415

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: PLC0415

    n = int(out["ops"])
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, 8, device=device, requires_grad=True)

    def body(h, weight):
        for _ in range(n // 4):
            h = F.linear(h, weight).sin() * 0.5 + 0.1
        return h

    policy = functools.partial(create_selective_checkpoint_contexts,
                               lambda ctx, func, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    plain = lambda: checkpoint(body, x, w, use_reentrant=False, preserve_rng_state=False).sum().backward()  # noqa: E731
    sac = lambda: checkpoint(body, x, w, use_reentrant=False, preserve_rng_state=False,  # noqa: E731
                             context_fn=policy).sum().backward()
    none = lambda: body(x, w).sum().backward()  # noqa: E731
    fwd = lambda: body(x, w).sum()  # noqa: E731
    full_s, sel_s = _median_time(plain, device), _median_time(sac, device)
    none_s, fwd_s = _median_time(none, device), _median_time(fwd, device)
    out.update(seconds=sel_s, full_s=full_s, none_s=none_s, fwd_s=fwd_s,
               node_s=max(0.0, (sel_s - full_s) / n / 2 * OPS_PER_NODE),
               checkpoint_node_s=max(0.0, (full_s - none_s - fwd_s) / n * OPS_PER_NODE))
    return out


def fit_selective(items: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The profile's `selective_node_s` (and `checkpoint_node_s` where measured) the measured
    selective items give (their medians), or None."""
    got = [it for it in items if it.get("kind") == "selective" and "node_s" in it]
    if not got:
        return None
    out = {"node_s": statistics.median(it["node_s"] for it in got), "items": len(got)}
    ck = [it["checkpoint_node_s"] for it in got if "checkpoint_node_s" in it]
    if ck:
        out["checkpoint_node_s"] = statistics.median(ck)
    return out


class _Clock:
    """Seconds of the work queued on this rank's compute stream between `start` and `stop`:
    wall time on CPU, CUDA events on the current stream on a GPU (so a collective running on
    NCCL's own stream is not counted, only its effect on the compute)."""

    def __init__(self, device: str):
        self.gpu = device == "cuda"
        if self.gpu:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.gpu:
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.gpu:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        return time.perf_counter() - self.t0


def run_contention(item: dict[str, Any], group=None, device: str = "cpu") -> dict[str, Any]:
    """Time `item`'s GEMM loop alone and beside async all-reduces over `group`
    (None: the default group); every rank of the group must call this with the same item.
    Returns the item with the loop's times, k and its spread over ranks x repeats (see the
    module docstring); "seconds" is the loop's time beside the collectives (median)."""
    dt = DTYPES[item["dtype"]]
    m, kk, n = item["shape"]
    a, b = torch.randn(m, kk, device=device, dtype=dt), torch.randn(kk, n, device=device, dtype=dt)
    c = torch.empty(m, n, device=device, dtype=dt)
    x = torch.zeros(max(1, int(item["payload"]) // 4), device=device)  # zeros: sums stay finite
    ranks = dist.get_world_size(group)
    clock = _Clock(device)

    def gemms(count: int, rate: float = 0.0) -> tuple[float, float]:
        """The loop's seconds, and whether collectives (`rate` issued per GEMM, 2 ahead) were in
        flight throughout: none had drained when the next was due, the last one outlived the loop."""
        works = [dist.all_reduce(x, group=group, async_op=True) for _ in range(2 if rate else 0)]
        drained = False
        clock.start()
        for i in range(count):
            for _ in range((2 + int(i * rate) if rate else 0) - len(works)):  # same count on every rank
                drained = drained or works[-1].is_completed()
                works.append(dist.all_reduce(x, group=group, async_op=True))
            torch.mm(a, b, out=c)
        t = clock.stop()
        covered = bool(works) and not drained and not works[-1].is_completed()
        for w in works:
            w.wait()
        _sync(device)
        return t, float(covered)

    def burst(count: int) -> float:  # seconds per collective of `count` issued back to back, async
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for w in [dist.all_reduce(x, group=group, async_op=True) for _ in range(count)]:
            w.wait()
        _sync(device)
        return (time.perf_counter() - t0) / count

    gemms(2)
    burst(1)
    t_g, t_c = statistics.median(gemms(1)[0] for _ in range(3)), statistics.median(burst(4) for _ in range(3))
    # one count for every rank: the slowest rank's GEMM and collective set the loop and the cover
    t = torch.tensor([t_g, t_c], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t_g, t_c = (max(float(v), 1e-7) for v in t.tolist())
    count = max(4, math.ceil(max(float(item["window_s"]), 0.5 * t_c) / t_g))
    alone, beside, covered, issued = [], [], [], 0
    for r in range(int(item["repeats"])):
        # collectives issued through the loop 4x as fast as they complete at the GEMM pace of
        # the last loop alone (the slowest rank's): a backlog stays in flight when the host's
        # load drifts. Odd repeats run the loop beside them first: drift loads both alike
        dist.barrier(group=group)
        if r % 2 == 0:
            alone.append(gemms(count)[0])
        t = torch.tensor([alone[-1] / count if alone else t_g], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        rate = 4.0 * max(float(t.item()), t_g) / t_c
        dist.barrier(group=group)
        t, cov = gemms(count, rate)
        beside.append(t)
        covered.append(cov)
        issued += 2 + int((count - 1) * rate)
        if r % 2 == 1:
            dist.barrier(group=group)
            alone.append(gemms(count)[0])
    mine = torch.tensor([alone, beside, covered], dtype=torch.float64, device=device)
    every = torch.empty(ranks * mine.numel(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine.flatten(), group=group)
    every = every.cpu().view(ranks, *mine.shape)
    al, bs, cov = (every[:, i] for i in range(3))  # (ranks, repeats) each
    ratios = bs / al - 1.0
    kept = ratios[cov > 0] if bool((cov > 0).any()) else ratios.flatten()
    raw = float(statistics.median(kept.tolist()))
    q = torch.quantile(kept.double(), torch.tensor([0.0, 0.25, 0.75, 1.0], dtype=torch.float64)).tolist()
    out = dict(item)
    colls = round(issued / len(beside))
    out.update(gemms=count, collectives=colls, group_size=ranks, gemm_s=t_g, collective_s=t_c,
               busy_s=colls * t_c, alone_s=statistics.median(al.flatten().tolist()),
               seconds=statistics.median(bs.flatten().tolist()),
               k_raw=raw, k=min(MAX_CONTENTION, max(0.0, raw)), covered=float(cov.mean()),
               k_spread={"min": q[0], "q25": q[1], "q75": q[2], "max": q[3], "samples": int(kept.numel())},
               k_per_rank=[statistics.median(r.tolist()) for r in ratios],
               times={"alone_s": al.tolist(), "with_s": bs.tolist(), "covered": cov.tolist()})  # [rank][repeat]
    return out


def fit_contention(items: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The contention k measured `items` give (the median of their k; one item per bench), with
    the first item's spread and set-up; None when no item measured it."""
    got = [it for it in items if it.get("kind") == "contention" and it.get("k") is not None]
    if not got:
        return None
    it = got[0]
    return {"k": float(statistics.median(i["k"] for i in got)), "k_raw": it["k_raw"], "spread": it["k_spread"],
            "k_per_rank": it["k_per_rank"], "covered": it["covered"], "ranks": it["group_size"],
            "repeats": it["repeats"], "gemm": f"{'x'.join(map(str, it['shape']))} {it['dtype']} x{it['gemms']}",
            "collective": f"{it['collectives']} x {it['op']} of {it['payload']} B",
            "alone_s": it["alone_s"], "with_s": it["seconds"]}


def contention_text(r: dict[str, Any] | None) -> str:
    """The tune report's line on contention (`r`: its "contention" entry)."""
    if not r or not r.get("measured"):
        return (f"contention k: not measured (a world of one rank, or a bench from before it was); the profile's "
                f"{(r or {}).get('tuned_k', 0.0):.3g} kept")
    m, s = r["measured"], r["measured"]["spread"]
    return (f"contention k (intra-node link; compute beside all-reduce): measured {m['k']:.3f} "
            f"(unclamped {m['k_raw']:+.3f}; median of {s['samples']} rank x repeat samples of {m['ranks']} ranks x "
            f"{m['repeats']}, range {s['min']:+.3f}..{s['max']:+.3f}, quartiles {s['q25']:+.3f}..{s['q75']:+.3f}; "
            f"collectives in flight through {m['covered']:.0%} of the loops; {m['gemm']} beside {m['collective']}); "
            f"datasheet {r['datasheet_k']:.3g}, tuned profile {r['tuned_k']:.3g}")


def run_collective(item: dict[str, Any], group, device: str) -> dict[str, Any]:
    """Time `item["op"]` with `item["payload"]` bytes (per rank) on `group`; every rank of the
    group must call this with the same item. Returns the item with "seconds" (slowest rank)."""
    n = dist.get_world_size(group)
    op, payload = item["op"], int(item["payload"])
    numel = max(n, payload // 4 // n * n)
    x = torch.randn(numel, device=device)
    if op == "all_reduce":
        fn = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    elif op == "all_gather":
        out = torch.empty(numel * n, device=device)
        fn = lambda: dist.all_gather_into_tensor(out, x, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        fn = lambda: dist.reduce_scatter_tensor(out, x, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(x)
        fn = lambda: dist.all_to_all_single(out, x, group=group)  # noqa: E731
    elif op == "broadcast":
        src = dist.get_global_rank(group, 0)
        fn = lambda: dist.broadcast(x, src=src, group=group)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {op!r}; known: {COLLECTIVE_OPS}")
    dist.barrier(group=group)
    # the same repeat count on every rank (a rank-local budget would desynchronise the group)
    fn()
    _sync(device)
    dist.barrier(group=group)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    res = dict(item)
    res.update(payload=numel * 4, group_size=n, seconds=float(med.item()))
    return res


# ------------------------------------------------------------------------ predictions
def predicted_seconds(item: dict[str, Any], hw: Hardware, *, link=None) -> float:
    """The cost model's time for a measured item on `hw` (collectives: on `link`, an AxisLink)."""
    kind = item["kind"]
    if kind == "collective":
        return collective_time(item["op"], item["payload"], item["group_size"], link.link, "ring", link.efficiency) \
            if item["op"] != "all_reduce" else link.time("all_reduce", item["payload"], "auto")
    timer = NodeTimer(hw, {})
    if kind == "matmul":
        m, k, n = item["shape"]
        return timer.seconds("matmul", item["dtype"], item["flops"], 0.0, item["bytes"], shape=(m, n, k))
    if kind == "attention":
        _b, _h, s, d = item["shape"]
        return timer.seconds("attention", item["dtype"], item["flops"], 0.0, item["bytes"], shape=(s, d),
                             causal_fraction=0.5 if item.get("causal", True) else 1.0)
    if kind in ("vector", "memory", "launch"):
        return timer.seconds("vector", item["dtype"], 0.0, item["flops"], item["bytes"])
    if kind == "contention":  # the measured loop alone, slowed by hw's k while the collectives run
        return item["alone_s"] + slowdown(item["alone_s"], item["busy_s"], hw.contention_for(False))
    if kind == "selective":  # the plain run as measured, plus the dispatch mode over both passes
        return item["full_s"] + 2 * item["ops"] / OPS_PER_NODE * hw.selective_node_s
    if kind == "host_copy":
        return item["bytes"] / hw.host_bandwidth
    if kind == "host_step":
        return item["bytes"] / hw.host_memory_bandwidth
    raise ValueError(f"unknown microbenchmark kind {kind!r}")


def measured_efficiencies(items: list[dict[str, Any]], hw: Hardware) -> dict[str, Any]:
    """What measured compute items say about `hw`'s compute table: {"matmul": [(dtype, (m, n, k),
    efficiency)], "attention": [(seq, head_dim, causal, forward efficiency)], "matmul_floor_s":
    seconds or None}. Efficiency = FLOPs (causal: half) / (peak x (seconds - kernel overhead)),
    from items the model calls compute-bound (memory time under half the measured) and off the
    floor (over twice the table's floor); the floor is the fastest GEMM of at most 2 x 512^3
    FLOPs, less the overhead. The efficiency is the one with which the node formula (roofline +
    overhead) reproduces the measured time; on a GPU, where launches hide behind kernels of
    tens of microseconds, it lies above the kernel's own rate for such kernels (H100, bf16
    2048^3: 0.93 against the 0.69 that CUDA events give) and `autopar tune`'s step fit of the
    overhead settles the difference."""
    over = hw.kernel_overhead_s
    floor = hw.kernel_floor("matmul")
    mem_bw = hw.device.memory_bandwidth * hw.eff("memory")
    out: dict[str, Any] = {"matmul": [], "attention": [], "matmul_floor_s": None}
    small = [it["seconds"] for it in items if it["kind"] == "matmul" and it["flops"] <= 2 * 512**3]
    if small:
        out["matmul_floor_s"] = max(0.0, min(small) - over)
    for it in items:
        if it["kind"] not in ("matmul", "attention") or it.get("seconds") is None:
            continue
        busy = it["seconds"] - over
        if busy <= 2 * floor or busy <= 0 or it["bytes"] / mem_bw > 0.5 * busy:
            continue
        if it["kind"] == "attention" and hw.compute is not None and it["dtype"] not in hw.compute.attention_dtypes:
            continue
        try:
            peak = hw.peak(it["dtype"])
        except ValueError:
            continue
        if it["kind"] == "matmul":
            m, k, n = it["shape"]
            out["matmul"].append((hw.fp32_matmul if it["dtype"] == "fp32" else it["dtype"], (m, n, k),
                                  it["flops"] / (peak * busy)))
        else:
            _b, _h, s, d = it["shape"]
            causal = bool(it.get("causal", True))
            out["attention"].append((s, d, causal, it["flops"] * (0.5 if causal else 1.0) / (peak * busy)))
    return out
