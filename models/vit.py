"""Vision Transformer (ViT) encoder classifier: the reference non-causal model.

Images are cut into patches with reshape/permute (no convolution, so the patch embedding
is one Linear that shards like any other); a learned `cls_token` is prepended, a learned
`pos_emb` added, then pre-norm blocks (`norm1`, `attn` with one fused `qkv` Linear and a
`proj`, `norm2`, `mlp` with `fc1`, GELU, `fc2`), a final `norm`, and a `head` on the class
token. Attention is `F.scaled_dot_product_attention` without a mask.

The patch layout flattens each patch as (channel, row, column), the order a Conv2d weight
(dim, C, p, p) flattens in, so a conv patch embedding's weight loads with `.reshape(dim, -1)`.
Blocks live in `layers` (named like the other reference models), not timm's `blocks`.

It reads and writes no `node.meta` keys (it is a model, not a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ViTConfig:
    image_size: int  # square images, image_size x image_size pixels
    patch_size: int  # square patches; divides image_size
    in_chans: int  # image channels
    dim: int  # model width (D)
    n_layers: int  # transformer blocks
    n_heads: int  # attention heads; divides dim
    mlp_dim: int  # hidden width of each block's MLP
    n_classes: int  # output logits
    norm_eps: float = 1e-6  # LayerNorm epsilon (timm's ViTs use 1e-6)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; pick n_heads dividing dim")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def tiny(cls) -> ViTConfig:
        # 16 patches + cls token = 17 positions
        return cls(image_size=16, patch_size=4, in_chans=3, dim=32, n_layers=2, n_heads=4, mlp_dim=64, n_classes=10)

    @classmethod
    def vit_b16(cls) -> ViTConfig:
        # ViT-B/16 at 224 px, ImageNet-1k head: 86.6e6 parameters
        return cls(
            image_size=224, patch_size=16, in_chans=3, dim=768, n_layers=12, n_heads=12, mlp_dim=3072,
            n_classes=1000,
        )  # fmt: skip


class Attention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, D // self.n_heads)  # (B, N, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, N, hd)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, hd)
        y = y.transpose(1, 2).reshape(B, N, D)  # (B, N, D)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_dim)
        self.fc2 = nn.Linear(config.mlp_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, N, D)


class Block(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))  # (B, N, D)
        x = x + self.mlp(self.norm2(x))  # (B, N, D)
        return x


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C * p * p), patches in row-major order."""
    B, C, H, W = images.shape
    x = images.view(B, C, H // p, p, W // p, p)  # (B, C, h, p, w, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, p, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.patch_emb = nn.Linear(config.in_chans * config.patch_size**2, config.dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.dim))
        self.pos_emb = nn.Parameter(torch.empty(1, config.n_patches + 1, config.dim))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.n_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every weight from the current RNG: normal(0, 0.02) for Linear weights,
        cls_token and pos_emb; zeros for biases; ones / zeros for LayerNorm."""
        with torch.no_grad():
            nn.init.normal_(self.cls_token, std=0.02)
            nn.init.normal_(self.pos_emb, std=0.02)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B, C, H, W = images.shape
        if (C, H, W) != (self.config.in_chans, self.config.image_size, self.config.image_size):
            raise ValueError(
                f"images of shape {tuple(images.shape)} do not match the config: expected "
                f"(B, {self.config.in_chans}, {self.config.image_size}, {self.config.image_size})"
            )
        x = self.patch_emb(patchify(images, self.config.patch_size))  # (B, P, D)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)  # (B, P+1, D)
        x = x + self.pos_emb  # (B, P+1, D)
        for layer in self.layers:
            x = layer(x)  # (B, P+1, D)
        x = self.norm(x[:, 0])  # (B, D): the class token
        return self.head(x)  # (B, n_classes)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. logits (B, n_classes), targets (B,) int64."""
    return F.cross_entropy(logits, targets)
