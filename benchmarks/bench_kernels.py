"""Benchmark the fused Triton kernels against eager torch and torch.compile of the references.

GPU only (written for an H100 / H200): without a CUDA device it says so and exits with
status 1. `--cpu-smoke` instead runs tiny shapes through Triton's CPU interpreter with wall
clock timing, to check this script's own logic on a machine without a GPU; its numbers mean
nothing.

For every kernel, in bf16 at realistic sizes (16k tokens x 4096 hidden; cross-entropy 16k x
128k vocab; linear + cross-entropy 32k tokens x 4096 hidden x 128k vocab), it times the
forward (under no_grad) and forward + backward (autograd.grad with fixed upstream gradients)
of three implementations:
    triton   the fused function (checked to have taken the Triton path),
    eager    the torch reference function,
    compile  torch.compile of the reference,
with CUDA events after warmup (median of the timed runs). It prints time, achieved GB/s
(minimum bytes the op must move / time; TFLOP/s of the three / four GEMM-equivalents for
linear + cross-entropy), the fraction of copy bandwidth (a large `tensor.copy_` measured at
start), peak extra memory (torch.cuda.max_memory_allocated above what the inputs hold), the
speed-up against eager and against compile measured in the same run, and the forward's
max |difference| from eager.

    python benchmarks/bench_kernels.py [--only rms_norm,softmax] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from autopar.runtime.kernels import DISPATCH_COUNTS, KERNELS


@dataclass
class Spec:
    label: str
    op: str
    make: Callable[[torch.device, torch.dtype], tuple[tuple, dict]]
    bytes: Callable[[int], tuple[float, float]] | None  # elsize -> (fwd, fwd+bwd) bytes
    flops: tuple[float, float] | None = None  # compute-bound ops: (fwd, fwd+bwd) flops


def _t(*shape, device, dtype, grad=True, scale=1.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype) \
        .requires_grad_(grad)


def _target(rows, vocab, device):
    t = torch.randint(0, vocab, (rows,), device=device)
    t[::16] = -100
    return t


def _cos_sin(T, D, device, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    emb = torch.outer(torch.arange(T, device=device).float(), inv_freq).repeat(1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def specs(tokens: int, hidden: int, vocab: int, lce_tokens: int, batch: int,
          head_dim: int) -> list[Spec]:
    M, N = tokens, hidden
    heads, T = hidden // head_dim, tokens // batch

    def passes(fwd: float, fwd_bwd: float):
        # bytes = passes over an (M, N) tensor of the benchmark's dtype
        return lambda e: (fwd * M * N * e, fwd_bwd * M * N * e)

    def rows(*extra, **kw):
        return lambda d, dt: ((_t(M, N, device=d, dtype=dt), *[f(d, dt) for f in extra]), kw)

    def vec(d, dt):
        return _t(N, device=d, dtype=dt)

    def full(d, dt):
        return _t(M, N, device=d, dtype=dt)

    def rope_make(layout):
        def make(d, dt):
            shape = (batch, heads, T, head_dim) if layout == "bhtd" else (batch, T, heads, head_dim)
            return (_t(*shape, device=d, dtype=dt), *_cos_sin(T, head_dim, d, dt)), \
                {"layout": layout}
        return make

    lce_flops = 2.0 * lce_tokens * hidden * vocab
    return [
        # fwd reads x, writes y; bwd reads x, dy, writes dx
        Spec("rms_norm", "rms_norm", rows(vec), passes(2, 5)),
        Spec("layer_norm", "layer_norm", rows(vec, vec), passes(2, 5)),
        # fwd reads x, r, writes s, y; bwd reads ds, dy, s, writes one dx for both inputs
        Spec("add_rms_norm", "add_rms_norm", rows(full, vec), passes(4, 8)),
        Spec("add_layer_norm", "add_layer_norm", rows(full, vec, vec), passes(4, 8)),
        # fwd reads a, b, writes y; bwd reads dy, a, b, writes da, db
        Spec("swiglu", "swiglu", rows(full), passes(3, 8)),
        Spec("geglu_tanh", "geglu", rows(full, approximate="tanh"), passes(3, 8)),
        Spec("geglu_erf", "geglu", rows(full, approximate="none"), passes(3, 8)),
        Spec("bias_gelu", "bias_gelu", rows(vec, approximate="tanh"), passes(2, 5)),
        Spec("rope_bhtd", "rope", rope_make("bhtd"), passes(2, 4)),
        Spec("rope_bthd", "rope", rope_make("bthd"), passes(2, 4)),
        Spec("softmax", "softmax", rows(), passes(2, 5)),
        # fwd reads the logits; bwd reads them and writes their gradient
        Spec("cross_entropy", "cross_entropy",
             lambda d, dt: ((_t(M, vocab, device=d, dtype=dt, scale=2.0),
                             _target(M, vocab, d)), {}),
             lambda e: (M * vocab * e, 3 * M * vocab * e)),
        # GEMM-bound: 2MHV flops per GEMM; the useful work is 1 (fwd) and 3 (fwd+bwd) GEMMs
        Spec("linear_cross_entropy", "linear_cross_entropy",
             lambda d, dt: ((_t(lce_tokens, hidden, device=d, dtype=dt),
                             _t(vocab, hidden, device=d, dtype=dt, scale=0.02),
                             _target(lce_tokens, vocab, d)), {}),
             None, flops=(lce_flops, 3 * lce_flops)),
    ]


# ---------------------------------------------------------------------------- timing


class Clock:
    """CUDA events on a GPU; wall clock for --cpu-smoke."""

    def __init__(self, cuda: bool, min_iters: int = 3):
        self.cuda, self.min_iters = cuda, min_iters

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, step: Callable[[], None], warmup: int, budget_ms: float) -> float:
        for _ in range(warmup):
            step()
        self.sync()
        once = self._run(step, 1)[0]
        iters = max(self.min_iters, min(100, int(budget_ms / max(once, 1e-3))))
        return statistics.median(self._run(step, iters))

    def _run(self, step, iters):
        if not self.cuda:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            step()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def peak_bytes(self, step: Callable[[], None]) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base


def copy_bandwidth(clock: Clock, device: torch.device, nbytes: int) -> float:
    """GB/s of dst.copy_(src): bytes read + bytes written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = clock.time_ms(lambda: dst.copy_(src), warmup=3, budget_ms=200)
    return 2 * nbytes / ms / 1e6


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def steps(fn: Callable, args: tuple, kwargs: dict):
    """(forward step, forward+backward step) for fn on args."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    ups = None

    def fwd():
        with torch.no_grad():
            fn(*args, **kwargs)

    def fwd_bwd():
        nonlocal ups
        outs = _as_tuple(fn(*args, **kwargs))
        if ups is None:
            ups = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, ups)

    return fwd, fwd_bwd


# ---------------------------------------------------------------------------- report


def bench_one(spec: Spec, clock: Clock, device, dtype, copy_gbs: float, use_compile: bool,
              warmup: int, budget_ms: float) -> dict[str, list[str]]:
    fused, reference, _ = KERNELS[spec.op]
    args, kwargs = spec.make(device, dtype)
    impls: dict[str, Callable] = {"triton": fused, "eager": reference}
    if use_compile:
        torch.compiler.reset()
        impls["compile"] = torch.compile(reference, dynamic=False)

    with torch.no_grad():
        before = DISPATCH_COUNTS[(spec.op, "triton")]
        out_fused = _as_tuple(fused(*args, **kwargs))
        if DISPATCH_COUNTS[(spec.op, "triton")] != before + 1:
            raise SystemExit(f"{spec.label}: the fused function did not take the Triton path "
                             f"(AUTOPAR_TRITON={os.environ.get('AUTOPAR_TRITON')!r}?)")
        out_eager = _as_tuple(reference(*args, **kwargs))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out_fused, out_eager))
    del out_fused, out_eager

    results: dict[tuple[str, str], tuple[float, float | None]] = {}
    for impl, fn in impls.items():
        for mode, step in zip(("fwd", "fwd+bwd"), steps(fn, args, kwargs)):
            try:
                ms = clock.time_ms(step, warmup, budget_ms)
                results[(mode, impl)] = (ms, clock.peak_bytes(step))
            except Exception as e:  # a compile failure must not hide the other numbers
                print(f"  {spec.label} {mode} {impl}: failed: {type(e).__name__}: {e}"[:300])
            if clock.cuda:
                torch.cuda.empty_cache()

    shapes = ", ".join(f"{tuple(a.shape)}" for a in args if isinstance(a, torch.Tensor))
    print(f"\n{spec.label}  [{shapes}] {str(dtype)[6:]}  fwd max|triton - eager| = {diff:.3g}")
    print(f"  {'mode':8} {'impl':8} {'ms':>9} {'GB/s' if spec.bytes else 'TFLOP/s':>8} "
          f"{'%copy':>6} {'peak MiB':>9} {'x eager':>8} {'x compile':>9}")
    speedups = {}
    for mode_i, mode in enumerate(("fwd", "fwd+bwd")):
        for impl in impls:
            if (mode, impl) not in results:
                continue
            ms, peak = results[(mode, impl)]
            if spec.bytes:
                rate = spec.bytes(dtype.itemsize)[mode_i] / ms / 1e6
                frac = f"{100 * rate / copy_gbs:5.0f}%"
            else:
                rate, frac = spec.flops[mode_i] / ms / 1e9, "   -"
            ratios = []
            for ref in ("eager", "compile"):
                r = results.get((mode, ref))
                ratios.append(f"{r[0] / ms:.2f}" if r else "-")
            if impl == "triton":
                speedups[mode] = ratios
            peak_s = f"{peak / 2**20:9.0f}" if peak is not None else "      n/a"
            print(f"  {mode:8} {impl:8} {ms:9.3f} {rate:8.1f} {frac:>6} {peak_s} "
                  f"{ratios[0]:>8} {ratios[1]:>9}")
    del args, kwargs
    return speedups


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated labels, e.g. rms_norm,softmax")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes through Triton's interpreter on CPU, without torch.compile: "
                   "checks the script, measures nothing meaningful")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)

    if a.cpu_smoke:
        os.environ["AUTOPAR_TRITON"] = "interpret"
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (below)
        device, clock = torch.device("cpu"), Clock(cuda=False, min_iters=1)
        table = specs(tokens=64, hidden=128, vocab=512, lce_tokens=96, batch=2, head_dim=32)
        warmup, budget, copy_bytes = 0, 0.0, 1 << 26
        use_compile = False  # inductor on a shared CPU is too slow for a smoke check
    else:
        if not torch.cuda.is_available():
            print("bench_kernels: no CUDA device is visible, so there is nothing to measure. "
                  "Run it on a GPU machine (written for H100 / H200), or pass --cpu-smoke to "
                  "check the script itself on CPU.", file=sys.stderr)
            return 1
        device, clock = torch.device("cuda"), Clock(cuda=True)
        table = specs(tokens=16384, hidden=4096, vocab=131072, lce_tokens=32768, batch=4,
                      head_dim=128)
        warmup, budget, copy_bytes = 5, 300.0, 1 << 31
        use_compile = not a.no_compile
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {s.label for s in table}
        if unknown:
            p.error(f"unknown --only labels {sorted(unknown)}; known: "
                    f"{', '.join(s.label for s in table)}")
        table = [s for s in table if s.label in wanted]

    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if clock.cuda else "CPU (Triton interpreter, smoke)"
    import triton  # only here: the kernels package itself never needs it at import
    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}")
    copy_gbs = copy_bandwidth(clock, device, copy_bytes)
    print(f"copy bandwidth (tensor.copy_ of {copy_bytes >> 20} MiB): {copy_gbs:.0f} GB/s "
          "(bytes read + written)")

    summary = {}
    for spec in table:
        summary[spec.label] = bench_one(spec, clock, device, dtype, copy_gbs, use_compile,
                                        warmup, budget)
    print("\nsummary: triton speed-up, fwd+bwd (x eager / x compile)")
    for label, s in summary.items():
        eager, comp = s.get("fwd+bwd", ["-", "-"])
        print(f"  {label:22} {eager:>6} / {comp:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
