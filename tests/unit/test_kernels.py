"""The fused Triton kernels against their torch references: compiled on the GPU where there
is one, run by Triton's CPU interpreter where there is none; and compiled for sm_90 (H100 /
H200) without a GPU.

Triton reads TRITON_INTERPRET when it is first imported, and an interpreted triton cannot
compile GPU kernels in the same process (nor the reverse). So the kernel tests run in child
processes started by three launcher tests, which re-run this file with
AUTOPAR_KERNEL_TESTS_CHILD set:
- `gpu` (only where torch sees a GPU): the parity tests on CUDA tensors, kernels compiled by
  Triton for the device, exactly as training runs them;
- `interpret` (only where there is no GPU): the same parity tests on CPU tensors through
  Triton's interpreter (TRITON_INTERPRET=1 set before anything imports triton);
- `compile`: every kernel variant compiled for sm_90 with Triton's bundled ptxas, no GPU needed.
In the parent those tests show as skipped, and the parent never imports triton. For per-test
output run a child directly: `AUTOPAR_KERNEL_TESTS_CHILD=gpu pytest tests/unit/test_kernels.py`
(or `=interpret`).

Tolerances:
- fp32: outputs and every input / weight / bias gradient within atol = rtol = 1e-5 of the
  reference (`torch.testing.assert_close`).
- bf16 and fp16: for each output and gradient, max |kernel - oracle| <= 2 * max |reference in
  the low dtype - oracle| + floor, where the oracle is the reference run in fp32 on the same
  (already rounded) inputs and upstream gradients, and floor = 1e-5 * max(1, max |oracle|)
  (it only matters where the reference is exact, e.g. an fp32 loss computed from bf16 logits).

Every parity test also checks, through DISPATCH_COUNTS, that the Triton path really ran.
Interpreted Triton is slow: shapes are tiny but cover masking (non-power-of-2 widths), row
loops and cross-program reductions (more rows than programs), and chunked paths. The same
shapes run on the GPU (inputs drawn on the CPU from the same seeds, then moved).
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Callable

import numpy as np
import pytest
import torch

CHILD_ENV = "AUTOPAR_KERNEL_TESTS_CHILD"  # "gpu", "interpret" or "compile" in a child process
CHILD = os.environ.get(CHILD_ENV, "")
if CHILD == "interpret":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
elif CHILD in ("compile", "gpu"):
    os.environ.pop("TRITON_INTERPRET", None)
DEVICE = torch.device("cuda") if CHILD == "gpu" else torch.device("cpu")  # where the parity tests run

from autopar.runtime import kernels  # noqa: E402
from autopar.runtime.kernels import DISPATCH_COUNTS, KERNELS  # noqa: E402
from autopar.runtime.kernels._dispatch import load_kernels, triton_available  # noqa: E402


def _interpreter_blocker() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None."""
    if not triton_available():
        return "triton is not installed"
    version = importlib.metadata.version("triton")
    try:
        int(np.array([1]))
    except TypeError:
        # triton 3.6's interpreter takes int() of a 1-element array for a runtime loop bound
        # (3.9 squeezes it first); numpy 2.4.6 refuses that, 2.2.6 still allows it
        if tuple(int(p) for p in version.split(".")[:2]) < (3, 9):
            return (f"triton {version}'s interpreter cannot run runtime-bound loops with numpy "
                    f"{np.__version__}; use triton >= 3.9 or numpy <= 2.2 for these tests")
    return None


BLOCKER = _interpreter_blocker()
GPU = torch.cuda.is_available()
# the parity tests: compiled on the GPU in the gpu child, interpreted in the interpret child
parity = pytest.mark.skipif(
    not ((CHILD == "gpu" and GPU and triton_available()) or (CHILD == "interpret" and BLOCKER is None)),
    reason=(BLOCKER if CHILD == "interpret" else None)
    or "runs in a child process: compiled on a GPU (test_compiled_kernel_tests_pass_on_the_gpu_in_a_fresh_process) "
       "or under Triton's interpreter (test_interpreted_kernel_tests_pass_in_a_fresh_process)",
)
compiled = pytest.mark.skipif(
    CHILD != "compile" or not triton_available(),
    reason="runs in a child process with compiled triton "
           "(test_kernels_compile_for_sm90_in_a_fresh_process)",
)
LAUNCHERS = ("test_compiled_kernel_tests_pass_on_the_gpu_in_a_fresh_process",
             "test_interpreted_kernel_tests_pass_in_a_fresh_process",
             "test_kernels_compile_for_sm90_in_a_fresh_process")


def _run_child(mode: str, tmp_path, *pytest_args: str) -> list[str]:
    """Run this file's tests in a fresh process; return the names of the skipped tests."""
    report = tmp_path / f"{mode}.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOPAR_TRITON", "TRITON_INTERPRET")}
    env[CHILD_ENV] = mode
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", *pytest_args],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    assert cases, proc.stdout[-2000:]
    return [c.get("name") for c in cases if c.find("skipped") is not None]


def test_compiled_kernel_tests_pass_on_the_gpu_in_a_fresh_process(tmp_path):
    if CHILD:
        pytest.skip("this is a child")
    if not GPU:
        pytest.skip("no GPU: the kernels run under the interpreter "
                    "(test_interpreted_kernel_tests_pass_in_a_fresh_process)")
    if not triton_available():
        pytest.skip("triton is not installed")
    skipped = _run_child("gpu", tmp_path)
    # every test ran in the child except the launchers and the compile-only test
    assert sorted(skipped) == sorted([*LAUNCHERS, "test_every_kernel_compiles_for_sm90"]), \
        skipped


def test_interpreted_kernel_tests_pass_in_a_fresh_process(tmp_path):
    if CHILD:
        pytest.skip("this is a child")
    if GPU:
        pytest.skip("a GPU is here: the kernels run compiled on it "
                    "(test_compiled_kernel_tests_pass_on_the_gpu_in_a_fresh_process)")
    if BLOCKER is not None:
        pytest.skip(BLOCKER)
    skipped = _run_child("interpret", tmp_path)
    # every test ran in the child except the launchers and the compile-only test
    assert sorted(skipped) == sorted([*LAUNCHERS, "test_every_kernel_compiles_for_sm90"]), \
        skipped


def test_kernels_compile_for_sm90_in_a_fresh_process(tmp_path):
    if CHILD:
        pytest.skip("this is a child")
    if not triton_available():
        pytest.skip("triton is not installed")
    skipped = _run_child("compile", tmp_path, "-k", "compiles_for_sm90")
    assert skipped == [], skipped


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
                 torch.int64: "i64"}


def _compile_for_sm90(kernel, num_warps: int = 4, **args) -> None:
    """Compile `kernel` for sm_90 (H100 / H200) with triton's bundled ptxas; no GPU needed.

    `args` are example values: a tensor stands for a pointer to its dtype, an int for i32, a
    float for fp32; the constexpr parameters take their values.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    signature, constexprs = {}, {}
    for param in kernel.params:
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    source = triton.compiler.ASTSource(kernel, signature, constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@compiled
def test_every_kernel_compiles_for_sm90():
    """Compiled Triton is stricter than the interpreter (types of loop-carried values,
    constexpr branches, scalar loads): compile every kernel variant the launchers use."""
    norms, act, rope, sm, ce = (load_kernels(f) for f in
                                ("norms", "activations", "rope", "softmax", "cross_entropy"))
    x, f32, i64 = (torch.empty(1, dtype=d) for d in (torch.bfloat16, torch.float32, torch.int64))
    n, s = 4096, 4096  # a width and a row stride
    for has_w, has_r in ((True, True), (False, False)):
        _compile_for_sm90(norms._rms_norm_fwd, 8, X=x, stride_x=s, R=x, stride_r=s, S=x,
                          stride_s=s, W=x, Y=x, stride_y=s, RSTD=f32, N=n, eps=1e-6,
                          HAS_W=has_w, HAS_RESIDUAL=has_r, BLOCK=4096)
    for has_w, has_ds in ((True, True), (False, False)):
        _compile_for_sm90(norms._rms_norm_bwd, 8, DY=x, stride_dy=s, DS=x, stride_ds=s, X=x,
                          stride_x=s, W=x, RSTD=f32, DX=x, stride_dx=s, DW_PARTIAL=f32, M=n,
                          N=n, rows_per_program=n, HAS_W=has_w, HAS_DS=has_ds, BLOCK=4096)
    for has_w, has_b, has_r in ((True, True, True), (False, False, False)):
        _compile_for_sm90(norms._layer_norm_fwd, 8, X=x, stride_x=s, R=x, stride_r=s, S=x,
                          stride_s=s, W=x, B=x, Y=x, stride_y=s, MEAN=f32, RSTD=f32, N=n,
                          eps=1e-5, HAS_W=has_w, HAS_B=has_b, HAS_RESIDUAL=has_r, BLOCK=4096)
        _compile_for_sm90(norms._layer_norm_bwd, 8, DY=x, stride_dy=s, DS=x, stride_ds=s, X=x,
                          stride_x=s, W=x, MEAN=f32, RSTD=f32, DX=x, stride_dx=s,
                          DW_PARTIAL=f32, DB_PARTIAL=f32, M=n, N=n, rows_per_program=n,
                          HAS_W=has_w, HAS_B=has_b, HAS_DS=has_r, BLOCK=4096)
    _compile_for_sm90(norms._rms_norm_fwd, 4, X=f32, stride_x=s, R=f32, stride_r=s, S=f32,
                      stride_s=s, W=f32, Y=f32, stride_y=s, RSTD=f32, N=n, eps=1e-6,
                      HAS_W=True, HAS_RESIDUAL=False, BLOCK=1024)
    for a in ("silu", "gelu", "gelu_tanh"):  # the bias kernels share the activation code
        _compile_for_sm90(act._glu_bwd, DY=x, A=x, B=x, DA=x, DB=x, n=n, ACT=a, BLOCK=1024)
    _compile_for_sm90(act._glu_fwd, A=x, B=x, Y=x, n=n, ACT="silu", BLOCK=1024)
    _compile_for_sm90(act._bias_act_fwd, X=x, BIAS=x, Y=x, n=n, N=n, ACT="gelu", BLOCK=1024)
    _compile_for_sm90(act._bias_act_bwd, DY=x, X=x, BIAS=x, DX=x, DB_PARTIAL=f32, M=n, N=n,
                      rows_per_program=n, ACT="gelu_tanh", BLOCK_M=8, BLOCK_N=256)
    for t_on_s2, backward in ((True, False), (False, True)):
        _compile_for_sm90(rope._rope, 8, X=x, sxb=s, sx1=s, sx2=s, Y=x, syb=s, sy1=s, sy2=s,
                          COS=x, SIN=x, stride_cs=s, rows=n, S1=n, S2=n, HALF=64,
                          T_ON_S2=t_on_s2, BACKWARD=backward, BLOCK_R=32, BLOCK_H=64)
    for one_block in (True, False):
        _compile_for_sm90(sm._softmax_fwd, 8, X=x, stride_x=s, Y=x, stride_y=s, N=n,
                          BLOCK=4096, ONE_BLOCK=one_block)
        _compile_for_sm90(sm._softmax_bwd, 8, DY=x, stride_dy=s, Y=x, stride_y=s, DX=x,
                          stride_dx=s, N=n, BLOCK=4096, ONE_BLOCK=one_block)
    _compile_for_sm90(ce._ce_fwd, 8, X=x, stride_x=s, TARGET=i64, LOSS=f32, ROW_MAX=f32,
                      ROW_LOGSUM=f32, V=n, ignore_index=-100, BLOCK=4096)
    _compile_for_sm90(ce._ce_bwd, 8, X=x, stride_x=s, TARGET=i64, ROW_MAX=f32, ROW_LOGSUM=f32,
                      SCALE=f32, DX=x, stride_dx=s, V=n, ignore_index=-100, BLOCK=4096)


@pytest.fixture
def triton_path(monkeypatch):
    """The Triton path for this test: compiled on CUDA tensors in the gpu child (AUTOPAR_TRITON
    auto), forced through the interpreter for CPU tensors in the interpret child."""
    if CHILD == "gpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setenv("AUTOPAR_TRITON", "auto")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("AUTOPAR_TRITON", "interpret")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0,
           grad: bool = True) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (the same on every device), on DEVICE."""
    t = (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)
    return t.requires_grad_(grad)


def _cos_sin(T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D), as HF builds it
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _target(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    t = torch.randint(0, vocab, shape, generator=_gen(seed))
    t.view(-1)[1::4] = -100  # every fourth row ignored
    return t.to(DEVICE)


# Each case: (op, make(dtype) -> (args, kwargs)). Floating tensors made with grad=True are
# the ones whose gradients are compared.
Case = Callable[[torch.dtype], tuple[tuple, dict]]
CASES: dict[str, tuple[str, Case]] = {
    "rms_norm": ("rms_norm", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=1), _randn(40, dtype=dt, seed=2)), {})),
    "rms_norm_no_weight": ("rms_norm", lambda dt: ((_randn(6, 40, dtype=dt, seed=3),), {})),
    "rms_norm_strided_rows": ("rms_norm", lambda dt: (
        (_randn(2, 3, 48, dtype=dt, seed=4, grad=False)[..., :40].requires_grad_(),
         _randn(40, dtype=dt, seed=5)), {"eps": 1e-5})),
    "layer_norm": ("layer_norm", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=6, scale=2.0), _randn(40, dtype=dt, seed=7),
         _randn(40, dtype=dt, seed=8)), {})),
    "layer_norm_no_bias": ("layer_norm", lambda dt: (
        (_randn(7, 24, dtype=dt, seed=9), _randn(24, dtype=dt, seed=10)), {})),
    "add_rms_norm": ("add_rms_norm", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=11), _randn(2, 3, 40, dtype=dt, seed=12),
         _randn(40, dtype=dt, seed=13)), {})),
    "add_layer_norm": ("add_layer_norm", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=34, scale=2.0), _randn(2, 3, 40, dtype=dt, seed=35),
         _randn(40, dtype=dt, seed=36), _randn(40, dtype=dt, seed=37)), {})),
    "swiglu": ("swiglu", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=14, scale=3.0), _randn(2, 3, 40, dtype=dt, seed=15)),
        {})),
    "geglu_erf": ("geglu", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=16, scale=3.0), _randn(2, 3, 40, dtype=dt, seed=17)),
        {"approximate": "none"})),
    "geglu_tanh": ("geglu", lambda dt: (
        (_randn(2, 3, 40, dtype=dt, seed=18, scale=3.0), _randn(2, 3, 40, dtype=dt, seed=19)),
        {"approximate": "tanh"})),
    "bias_gelu_erf": ("bias_gelu", lambda dt: (
        (_randn(2, 5, 40, dtype=dt, seed=20, scale=3.0), _randn(40, dtype=dt, seed=21)),
        {"approximate": "none"})),
    "bias_gelu_tanh": ("bias_gelu", lambda dt: (
        (_randn(9, 24, dtype=dt, seed=22, scale=3.0), _randn(24, dtype=dt, seed=23)),
        {"approximate": "tanh"})),
    "rope_bhtd": ("rope", lambda dt: (
        (_randn(2, 3, 5, 16, dtype=dt, seed=24), *_cos_sin(5, 16, dt)), {"layout": "bhtd"})),
    "rope_bthd": ("rope", lambda dt: (
        (_randn(2, 5, 3, 16, dtype=dt, seed=25), *_cos_sin(5, 16, dt)), {"layout": "bthd"})),
    "rope_bhtd_transposed_view": ("rope", lambda dt: (
        (_randn(2, 5, 3, 12, dtype=dt, seed=26, grad=False).transpose(1, 2).requires_grad_(),
         *_cos_sin(5, 12, torch.float32)), {"layout": "bhtd"})),
    "softmax": ("softmax", lambda dt: ((_randn(2, 3, 40, dtype=dt, seed=27, scale=3.0),), {})),
    "cross_entropy": ("cross_entropy", lambda dt: (
        (_randn(2, 5, 40, dtype=dt, seed=28, scale=3.0), _target((2, 5), 40, seed=29)), {})),
    "linear_cross_entropy": ("linear_cross_entropy", lambda dt: (
        (_randn(2, 5, 16, dtype=dt, seed=30), _randn(40, 16, dtype=dt, seed=31, scale=0.5),
         _target((2, 5), 40, seed=32), _randn(40, dtype=dt, seed=33)), {"chunk_size": 4})),
}


def _run(fn: Callable, args: tuple, kwargs: dict, grad_dtype: torch.dtype | None = None):
    """Outputs and gradients of every grad-requiring input, for seeded upstream gradients.

    Upstream gradients are drawn in fp32 and rounded through `grad_dtype` (the low precision
    of the run) so that all three runs of a low-precision comparison get equal values.
    """
    outs = fn(*args, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    ups = []
    for i, o in enumerate(outs):
        up = torch.randn(o.shape, generator=_gen(100 + i))
        ups.append(up.to(grad_dtype or o.dtype).to(o.dtype).to(o.device))
    grads = torch.autograd.grad(outs, leaves, ups)
    return [o.detach() for o in outs] + list(grads)


def _as_fp32(args: tuple) -> tuple:
    return tuple(
        a.detach().float().requires_grad_(a.requires_grad)
        if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )


@parity
@pytest.mark.parametrize("case", list(CASES))
def test_fused_op_matches_reference_in_fp32_outputs_and_gradients(case, triton_path):
    op, make = CASES[case]
    fused, reference, _ = KERNELS[op]
    args, kwargs = make(torch.float32)
    before = DISPATCH_COUNTS[(op, "triton")]
    got = _run(fused, args, kwargs)
    assert DISPATCH_COUNTS[(op, "triton")] == before + 1, "the Triton path did not run"
    want = _run(reference, args, kwargs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"[{i}] {m}")


@parity
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_op_in_low_precision_is_within_twice_the_reference_error(case, dtype, triton_path):
    op, make = CASES[case]
    fused, reference, _ = KERNELS[op]
    args, kwargs = make(dtype)
    before = DISPATCH_COUNTS[(op, "triton")]
    got = _run(fused, args, kwargs)
    assert DISPATCH_COUNTS[(op, "triton")] == before + 1, "the Triton path did not run"
    low = _run(reference, args, kwargs)
    oracle = _run(reference, _as_fp32(args), kwargs, grad_dtype=dtype)
    for i, (g, r, o) in enumerate(zip(got, low, oracle)):
        assert g.dtype == r.dtype, f"[{i}] dtype {g.dtype} != reference {r.dtype}"
        err_fused = (g.float() - o).abs().max().item()
        err_ref = (r.float() - o).abs().max().item()
        floor = 1e-5 * max(1.0, o.abs().max().item())
        assert err_fused <= 2 * err_ref + floor, (
            f"[{i}] fused error {err_fused:.3g} > 2 x reference error {err_ref:.3g} + {floor:.1g}")


@parity
def test_cross_entropy_with_logits_offset_by_1e4_is_finite_and_equals_reference(triton_path):
    logits = _randn(12, 40, dtype=torch.float32, seed=40, scale=3.0, grad=False) + 1e4
    logits.requires_grad_()
    target = _target((12,), 40, seed=41)
    got = _run(kernels.cross_entropy, (logits, target), {})
    want = _run(kernels.cross_entropy_reference, (logits, target), {})
    assert all(torch.isfinite(t).all() for t in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    ignored = target == -100
    assert ignored.any() and (got[1][ignored] == 0).all(), "ignored rows must get no gradient"
    # shifting all logits of a row leaves the loss unchanged: compare with the unshifted
    # logits (x - 1e4 is exact in fp32 here) at the fp32 tolerance
    unshifted = kernels.cross_entropy(logits.detach() - 1e4, target)
    torch.testing.assert_close(got[0], unshifted, atol=1e-5, rtol=1e-5)


@parity
def test_cross_entropy_mean_skips_ignored_rows_and_all_ignored_gives_nan(triton_path):
    logits = _randn(8, 24, dtype=torch.float32, seed=42, grad=False)
    target = torch.randint(0, 24, (8,), generator=_gen(43)).to(DEVICE)
    target[:5] = -100
    loss = kernels.cross_entropy(logits, target)
    kept = torch.nn.functional.cross_entropy(logits[5:], target[5:])
    torch.testing.assert_close(loss, kept, atol=1e-5, rtol=1e-5)
    assert torch.isnan(kernels.cross_entropy(logits, torch.full((8,), -100, device=DEVICE)))


@parity
@pytest.mark.parametrize("op", ["cross_entropy", "softmax"])
def test_row_kernels_over_several_vocab_blocks_match_reference(op, triton_path, monkeypatch):
    # lower the block so that a 40-wide row runs the chunked (online max) path
    family = load_kernels(op)
    monkeypatch.setattr(family, "MAX_BLOCK_V" if op == "cross_entropy" else "MAX_BLOCK", 16)
    x = _randn(5, 40, dtype=torch.float32, seed=44, scale=3.0)
    args = (x, _target((5,), 40, seed=45)) if op == "cross_entropy" else (x,)
    got = _run(KERNELS[op].fused, args, {})
    want = _run(KERNELS[op].reference, args, {})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@parity
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 4, 64])
def test_linear_cross_entropy_equals_linear_then_cross_entropy(with_bias, chunk_size,
                                                               triton_path):
    # 10 rows: chunk 3 and 4 leave a partial last chunk; 64 is one chunk bigger than the rows
    x = _randn(10, 16, dtype=torch.float32, seed=50)
    w = _randn(40, 16, dtype=torch.float32, seed=51, scale=0.5)
    b = _randn(40, dtype=torch.float32, seed=52) if with_bias else None
    target = _target((10,), 40, seed=53)
    args = (x, w, target, b)

    def unfused(x, w, target, b):
        return kernels.cross_entropy_reference(torch.nn.functional.linear(x, w, b), target)

    got = _run(lambda *a: kernels.linear_cross_entropy(*a, chunk_size=chunk_size), args, {})
    want = _run(unfused, args, {})
    assert len(got) == (4 if with_bias else 3)
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, atol=1e-5, rtol=1e-5)


@parity
def test_linear_cross_entropy_saves_no_logits_for_backward(triton_path):
    M, H, V = 10, 16, 40
    x = _randn(M, H, dtype=torch.float32, seed=54)
    w = _randn(V, H, dtype=torch.float32, seed=55)
    loss = kernels.linear_cross_entropy(x, w, _target((M,), V, seed=56), chunk_size=4)
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]  # the bias is None
    assert any(t.data_ptr() == w.data_ptr() for t in saved)
    small = [t for t in saved if t.data_ptr() not in (w.data_ptr(), x.data_ptr())]
    # target, per-row max and log-sum, the valid count: O(M), never (M, V) logits
    assert sum(t.numel() for t in small) <= 3 * M + 1


@parity
def test_linear_cross_entropy_with_logits_offset_by_1e4_is_finite_and_equals_reference(triton_path):
    # a bias of 1e4 shifts every logit by 1e4 inside the chunked kernel
    x = _randn(10, 16, dtype=torch.float32, seed=57)
    w = _randn(40, 16, dtype=torch.float32, seed=58, scale=0.5)
    b = (torch.full((40,), 1e4) + torch.randn(40, generator=_gen(59))).to(DEVICE).requires_grad_()
    target = _target((10,), 40, seed=59)
    got = _run(lambda *a: kernels.linear_cross_entropy(*a, chunk_size=4), (x, w, target, b), {})
    want = _run(kernels.linear_cross_entropy_reference, (x, w, target, b), {})
    assert all(torch.isfinite(t).all() for t in got)
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, atol=1e-5, rtol=1e-5)


@parity
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_add_norm_gives_separate_equal_gradients_to_x_and_residual(op, triton_path):
    x = _randn(6, 24, dtype=torch.float32, seed=60)
    r = _randn(6, 24, dtype=torch.float32, seed=61)
    s, y = KERNELS[op].fused(x, r)
    (s.sum() + (y * 2).sum()).backward()
    torch.testing.assert_close(x.grad, r.grad, atol=0, rtol=0)
    assert x.grad.data_ptr() != r.grad.data_ptr()


@parity
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_add_norm_with_only_one_output_used_matches_reference(op, triton_path):
    # post-norm blocks (BERT) use only the normalised output; the sum alone is also legal
    for pick in (0, 1):
        args = (_randn(5, 24, dtype=torch.float32, seed=62), _randn(5, 24, dtype=torch.float32, seed=63),
                _randn(24, dtype=torch.float32, seed=64, grad=pick == 1))  # the sum ignores w
        got = _run(lambda *a: KERNELS[op].fused(*a)[pick], args, {})
        want = _run(lambda *a: KERNELS[op].reference(*a)[pick], args, {})
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@parity
def test_rope_layouts_give_the_same_rotation(triton_path):
    x = _randn(2, 3, 5, 16, dtype=torch.float32, seed=62, grad=False)  # (B, H, T, D)
    cos, sin = _cos_sin(5, 16, torch.float32)
    bhtd = kernels.rope(x, cos, sin, layout="bhtd")
    bthd = kernels.rope(x.transpose(1, 2).contiguous(), cos, sin, layout="bthd")
    torch.testing.assert_close(bthd.transpose(1, 2), bhtd, atol=0, rtol=0)
    assert not torch.equal(bhtd, x), "rope must rotate the input"


@parity
def test_empty_rows_are_returned_without_launching(triton_path):
    x = torch.zeros(0, 3, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    y = kernels.rms_norm(x, w)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(16, device=DEVICE))


def test_dispatch_falls_back_to_reference_on_cpu_when_not_forced(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("AUTOPAR_TRITON", raising=False)
    x = _randn(4, 16, dtype=torch.float32, seed=70).detach().cpu()  # on the CPU, also in the GPU child
    ref, fused = DISPATCH_COUNTS[("rms_norm", "reference")], DISPATCH_COUNTS[("rms_norm", "triton")]
    y = kernels.rms_norm(x)
    assert DISPATCH_COUNTS[("rms_norm", "reference")] == ref + 1
    assert DISPATCH_COUNTS[("rms_norm", "triton")] == fused
    torch.testing.assert_close(y, kernels.rms_norm_reference(x), atol=0, rtol=0)


def test_autopar_triton_off_wins_over_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("AUTOPAR_TRITON", "off")
    before = DISPATCH_COUNTS[("softmax", "reference")]
    kernels.softmax(torch.randn(3, 8))
    assert DISPATCH_COUNTS[("softmax", "reference")] == before + 1


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_float64_takes_the_reference_even_when_forced(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TRITON", "interpret")
    before = DISPATCH_COUNTS[("swiglu", "reference")]
    a = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(kernels.swiglu(a, a), kernels.swiglu_reference(a, a))
    assert DISPATCH_COUNTS[("swiglu", "reference")] == before + 1


def test_unknown_autopar_triton_value_is_a_value_error(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TRITON", "fast")
    with pytest.raises(ValueError, match="AUTOPAR_TRITON='fast'"):
        kernels.softmax(torch.randn(2, 4))


@pytest.mark.parametrize("call, match", [
    (lambda: kernels.rms_norm(torch.randn(2, 8), torch.ones(7)), "weight has shape"),
    (lambda: kernels.swiglu(torch.randn(2, 8), torch.randn(2, 4)), "same shape"),
    (lambda: kernels.geglu(torch.randn(2, 8), torch.randn(2, 8), "fast"), "approximate"),
    (lambda: kernels.rope(torch.randn(1, 2, 3, 5), torch.randn(3, 5), torch.randn(3, 5)),
     "odd"),
    (lambda: kernels.rope(torch.randn(1, 2, 3, 4), torch.randn(4, 4), torch.randn(4, 4)),
     r"cos\[:3\]"),
    (lambda: kernels.cross_entropy(torch.randn(4, 8), torch.zeros(3, dtype=torch.long)),
     "target has shape"),
    (lambda: kernels.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 6),
                                          torch.zeros(4, dtype=torch.long)), "weight has shape"),
])
def test_bad_arguments_raise_value_errors_that_name_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_lists_every_op_with_matching_fused_and_reference_functions():
    expected = {"rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "swiglu", "geglu",
                "bias_gelu", "rope", "softmax", "cross_entropy", "linear_cross_entropy"}
    assert set(KERNELS) == expected
    for name, (fused, reference, description) in KERNELS.items():
        assert fused.__name__ == name and reference.__name__ == f"{name}_reference"
        assert description
    assert {op for op, _ in CASES.values()} == expected, "every registered op has a parity case"


def test_default_chunk_holds_about_as_many_logits_as_x_has_elements():
    from autopar.runtime.kernels.cross_entropy import default_chunk_rows

    assert default_chunk_rows(32768, 4096, 131072) == 1024  # 1024 x 128k logits = 32k x 4k
    assert default_chunk_rows(10, 16, 40) == 4
    assert default_chunk_rows(3, 4096, 131072) == 1
    assert default_chunk_rows(100, 8, 8) == 100  # V <= H: all rows at once
