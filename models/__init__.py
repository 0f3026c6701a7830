"""Reference models and their registry.

`get(name)` returns a `ModelSpec`: how to build the model (on the current default device,
so `with torch.device("meta"): spec.build()` costs no memory), how to make an example
batch, and the loss. Everything in a spec is picklable (functools.partial, no lambdas), so
a spec can be handed to spawned processes.

Token models draw a (B, T + 1) random sequence and return inputs = tokens[:, :-1],
targets = tokens[:, 1:]. Batches are drawn on CPU (from `generator` when given) and then
moved, so the same generator seed gives the same batch on every device; on the meta
device nothing is drawn.

It reads and writes no `node.meta` keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import gpt, mlp, moe, vit
from .gpt import GPT, GPTConfig
from .mlp import MLP, MLPConfig
from .moe import MoE, MoEConfig
from .vit import ViT, ViTConfig

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]  # (inputs, targets)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]  # builds on the current default device; seed first for determinism
    example_batch: Callable[..., Batch]  # (batch_size, *, seq_len=None, generator=None, device="cpu")
    loss_fn: Callable  # loss_fn(model(*inputs), targets) -> scalar
    config: Any = None  # the model's config dataclass, for reading sizes


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")


def _draw(make: Callable[[torch.Generator | None], torch.Tensor], shape, dtype, generator, device) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return make(generator).to(device)


def token_batch(
    batch_size: int,
    *,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    vocab_size: int,
    max_seq_len: int,
) -> Batch:
    """((idx (B, T),), targets (B, T)), T = seq_len or max_seq_len; next-token targets."""
    _check_batch_size(batch_size)
    T = max_seq_len if seq_len is None else seq_len
    if not 1 <= T <= max_seq_len:
        raise ValueError(f"seq_len={seq_len} must be between 1 and the model's max_seq_len={max_seq_len}")
    tokens = _draw(
        lambda g: torch.randint(0, vocab_size, (batch_size, T + 1), generator=g),
        (batch_size, T + 1), torch.long, generator, device,
    )  # fmt: skip
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def feature_batch(
    batch_size: int,
    *,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dim: int,
    n_classes: int,
) -> Batch:
    """((x (B, dim),), targets (B,)); seq_len is ignored (no sequence)."""
    _check_batch_size(batch_size)
    x = _draw(lambda g: torch.randn(batch_size, dim, generator=g), (batch_size, dim), torch.float32, generator, device)
    y = _draw(lambda g: torch.randint(0, n_classes, (batch_size,), generator=g), (batch_size,), torch.long, generator, device)
    return (x,), y


def image_batch(
    batch_size: int,
    *,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    in_chans: int,
    image_size: int,
    n_classes: int,
) -> Batch:
    """((images (B, C, H, W),), targets (B,)); seq_len is ignored (fixed patch count)."""
    _check_batch_size(batch_size)
    shape = (batch_size, in_chans, image_size, image_size)
    x = _draw(lambda g: torch.randn(shape, generator=g), shape, torch.float32, generator, device)
    y = _draw(lambda g: torch.randint(0, n_classes, (batch_size,), generator=g), (batch_size,), torch.long, generator, device)
    return (x,), y


def _gpt_spec(name: str, config: GPTConfig) -> ModelSpec:
    batch = functools.partial(token_batch, vocab_size=config.vocab_size, max_seq_len=config.max_seq_len)
    return ModelSpec(name, functools.partial(GPT, config), batch, gpt.loss_fn, config)


def _moe_spec(name: str, config: MoEConfig) -> ModelSpec:
    batch = functools.partial(token_batch, vocab_size=config.vocab_size, max_seq_len=config.max_seq_len)
    return ModelSpec(name, functools.partial(MoE, config), batch, moe.loss_fn, config)


def _mlp_spec(name: str, config: MLPConfig) -> ModelSpec:
    batch = functools.partial(feature_batch, dim=config.dim, n_classes=config.n_classes)
    return ModelSpec(name, functools.partial(MLP, config), batch, mlp.loss_fn, config)


def _vit_spec(name: str, config: ViTConfig) -> ModelSpec:
    batch = functools.partial(
        image_batch, in_chans=config.in_chans, image_size=config.image_size, n_classes=config.n_classes
    )
    return ModelSpec(name, functools.partial(ViT, config), batch, vit.loss_fn, config)


_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        _gpt_spec("gpt-tiny", GPTConfig.tiny()),
        _gpt_spec("gpt-tiny-tied", dataclasses.replace(GPTConfig.tiny(), tie_embeddings=True)),
        _gpt_spec("llama2-7b", GPTConfig.llama2_7b()),
        _gpt_spec("llama3-8b", GPTConfig.llama3_8b()),
        _gpt_spec("llama3-70b", GPTConfig.llama3_70b()),
        _gpt_spec("llama3-405b", GPTConfig.llama3_405b()),
        _moe_spec("moe-tiny", MoEConfig.tiny()),
        _moe_spec("moe-tiny-capacity", MoEConfig.tiny(capacity_factor=1.0)),
        _moe_spec("mixtral-8x7b", MoEConfig.mixtral_8x7b()),
        _mlp_spec("mlp-tiny", MLPConfig()),
        _vit_spec("vit-tiny", ViTConfig.tiny()),
        _vit_spec("vit-b16", ViTConfig.vit_b16()),
    ]
}


def names() -> list[str]:
    """Registered model names, in registration order (tiny models next to their real sizes)."""
    return list(_SPECS)


def get(name: str) -> ModelSpec:
    """The spec registered under name; ValueError naming the known models otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(_SPECS)}") from None


__all__ = [
    "GPT", "GPTConfig", "MLP", "MLPConfig", "MoE", "MoEConfig", "ModelSpec", "ViT", "ViTConfig",
    "feature_batch", "get", "image_batch", "names", "token_batch",
]  # fmt: skip
