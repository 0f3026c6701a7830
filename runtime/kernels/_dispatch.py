"""Dispatch between the Triton kernels and their torch references, and row flattening.

Every public kernel function asks `use_triton(op, *tensors)` which path to take:

- `AUTOPAR_TRITON=off` (or `0`): always the torch reference.
- `AUTOPAR_TRITON=interpret`, or `TRITON_INTERPRET=1`: always Triton, run by Triton's CPU
  interpreter when the tensors are on the CPU (how the unit tests check the kernels).
- otherwise (`auto`, the default): Triton when every tensor is on CUDA, Triton is importable
  and the dtypes are fp32 / bf16 / fp16; the torch reference otherwise.

Each decision is counted in `DISPATCH_COUNTS[(op, "triton" | "reference")]`, so tests and
reports can say which path ran. Triton itself is imported only by `load_kernels`, so importing
`autopar.runtime.kernels` works where Triton is missing. Triton reads `TRITON_INTERPRET` when
it is first imported and when a kernel is decorated, never when a kernel runs (checked with
triton 3.9): `load_kernels` sets it before importing the kernels in interpret mode, and
raises a clear error when triton was already imported the other way in this process.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import math
import os
from types import ModuleType

import torch

DISPATCH_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the torch references' accumulation dtype: fp32 for 16-bit and fp32 inputs, fp64
    stays fp64 (a reference never computes below its input's precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))

_TRUE = ("1", "true", "yes", "on", "y")  # what triton.knobs accepts as a true env_bool
_OFF = ("0", "off", "false", "no", "reference")
_AUTO = ("", "auto", "1", "on", "true")


def interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_mode() -> str:
    """'off', 'auto' or 'interpret', from AUTOPAR_TRITON and TRITON_INTERPRET (read at every
    call, so a changed environment takes effect; parsed once per pair of values: every fused
    call on the GPU asks, and its host time is the step's when kernels are small)."""
    return _mode_of(os.environ.get("AUTOPAR_TRITON", ""), os.environ.get("TRITON_INTERPRET", ""))


@functools.lru_cache(maxsize=64)
def _mode_of(autopar_triton: str, triton_interpret: str) -> str:
    value = autopar_triton.strip().lower()
    if value in _OFF:
        return "off"
    if value == "interpret":
        return "interpret"
    if value not in _AUTO:
        raise ValueError(
            f"AUTOPAR_TRITON={value!r} is not understood; use 'auto' (Triton on CUDA, "
            "torch elsewhere), 'off' (always torch) or 'interpret' (Triton's CPU interpreter)"
        )
    return "interpret" if triton_interpret.strip().lower() in _TRUE else "auto"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(op: str, *tensors: torch.Tensor | None) -> bool:
    """Decide (and count) whether `op` runs its Triton kernel on these tensors.

    Floating tensors of other dtypes than fp32 / bf16 / fp16 always take the reference.
    """
    present = [t for t in tensors if t is not None]
    mode = triton_mode()
    dtypes_ok = all(t.dtype in SUPPORTED_DTYPES or not t.is_floating_point() for t in present)
    if mode == "interpret":
        if not triton_available():
            raise RuntimeError(
                "AUTOPAR_TRITON=interpret / TRITON_INTERPRET=1 ask for Triton's interpreter, "
                "but triton is not installed; install triton or unset these variables"
            )
        fused = dtypes_ok
    elif mode == "auto":
        fused = dtypes_ok and triton_available() and all(t.is_cuda for t in present)
    else:
        fused = False
    DISPATCH_COUNTS[(op, "triton" if fused else "reference")] += 1
    return fused


def reset_dispatch_counts() -> None:
    DISPATCH_COUNTS.clear()


_LOADED: dict[tuple[str, bool], ModuleType] = {}


def load_kernels(family: str) -> ModuleType:
    """Import `_triton_<family>` (the Triton kernels and launchers of one op family)."""
    interpret = triton_mode() == "interpret"
    if (family, interpret) in _LOADED:
        return _LOADED[(family, interpret)]
    if interpret and not interpret_env():
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' decoration
    module = importlib.import_module(f"{__package__}._triton_{family}")
    common = importlib.import_module(f"{__package__}._triton_common")
    if {module.INTERPRETED, common.INTERPRETED, common.STDLIB_INTERPRETED} != {interpret}:
        raise RuntimeError(
            f"the {family} kernels need triton {'interpreted' if interpret else 'compiled'} "
            f"(mode {triton_mode()!r}), but triton or the kernels were set up the other way "
            "earlier in this process. Triton reads TRITON_INTERPRET when it is first imported "
            "and when a kernel is defined: set TRITON_INTERPRET=1 (or unset it) before "
            "anything imports triton, e.g. at process start, or use a fresh process"
        )
    _LOADED[(family, interpret)] = module
    return module


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View `x` (..., N) as (M, N) rows whose last dim is contiguous (copies only if needed)."""
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def check_last_dim(op: str, name: str, t: torch.Tensor | None, n: int) -> None:
    """A weight / bias over the last dim must be 1-D of size n."""
    if t is not None and tuple(t.shape) != (n,):
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)} but the input's last dim is {n}; "
            f"pass a 1-D {name} of size {n}"
        )


def check_same(op: str, a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    """Two inputs that are combined elementwise must agree in shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"{op}: {names} must have the same shape and dtype, got {tuple(a.shape)} {a.dtype} "
            f"and {tuple(b.shape)} {b.dtype}; broadcast or cast them first"
        )
