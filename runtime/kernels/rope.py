"""Fused rotary position embedding, rotate-half convention (Llama / GPT-NeoX / HF style).

    rope(x, cos, sin) = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]

Layouts of `x` (name the one you pass with `layout`):
    "bhtd": (B, H, T, D), heads before time, as fed to scaled_dot_product_attention;
    "bthd": (B, T, H, D), time before heads, as a projection's output viewed per head.
`cos` and `sin` have shape (T, D) (leading size-1 dims are accepted, e.g. (1, 1, T, D)) and
are broadcast over batch and heads; position t of `x` uses row t. The Triton path reads any
strides with a contiguous last dim (a transposed view costs no copy). `cos` and `sin` are
constants: no gradient flows to them.

Torch reference (`rope_reference`: the oracle and the CPU fallback), an autograd Function over
`_triton_rope.py`, and the dispatching `rope`. Arithmetic is fp32; the result is in x's dtype.

Reads and writes no node.meta keys (runtime code).
"""
from __future__ import annotations

import torch

from ._dispatch import acc, load_kernels, use_triton

LAYOUTS = ("bhtd", "bthd")


def _cos_sin_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout not in LAYOUTS:
        raise ValueError(f"rope: layout={layout!r}; use 'bhtd' for (B, H, T, D) or 'bthd' for "
                         "(B, T, H, D)")
    if x.dim() != 4:
        raise ValueError(f"rope: x has shape {tuple(x.shape)}; expected 4-D {layout.upper()}")
    T, D = (x.shape[2], x.shape[3]) if layout == "bhtd" else (x.shape[1], x.shape[3])
    if D % 2:
        raise ValueError(f"rope: head_dim {D} is odd; rotate-half needs an even head_dim")
    out = []
    for name, t in (("cos", cos), ("sin", sin)):
        lead = t.shape[:-2]
        if t.dim() < 2 or tuple(t.shape[-2:]) != (T, D) or any(s != 1 for s in lead):
            raise ValueError(
                f"rope: {name} has shape {tuple(t.shape)} but x ({layout}) has T={T}, "
                f"head_dim={D}; pass {name} of shape ({T}, {D}) (slice a longer cache as "
                f"{name}[:{T}]; per-batch positions are not supported)"
            )
        out.append(t.reshape(T, D))
    return out[0], out[1]


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   layout: str = "bhtd") -> torch.Tensor:
    cos2, sin2 = _cos_sin_2d(x, cos, sin, layout)
    xf = acc(x)
    c, s = cos2.detach().to(xf.dtype), sin2.detach().to(xf.dtype)  # constants, as in the fused path
    if layout == "bthd":  # (T, D) -> (T, 1, D): broadcast over heads
        c, s = c[:, None, :], s[:, None, :]
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, t_on_s2):
        if x.stride(-1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.t_on_s2 = t_on_s2
        return load_kernels("rope").rope(x, cos, sin, t_on_s2)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = load_kernels("rope").rope(dy, cos, sin, ctx.t_on_s2, backward=True)
        return dx, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         layout: str = "bhtd") -> torch.Tensor:
    """Rotary embedding of `x` in `layout` ("bhtd" or "bthd") with cos, sin of shape (T, D)."""
    cos2, sin2 = _cos_sin_2d(x, cos, sin, layout)
    if use_triton("rope", x, cos2, sin2):
        return _Rope.apply(x, cos2.contiguous(), sin2.contiguous(), layout == "bhtd")
    return rope_reference(x, cos, sin, layout)
