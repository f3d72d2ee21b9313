r"""A small Vision Transformer in plain PyTorch (the model of :mod:`quotient_manifolds.experiments.vision`).

Default: 28×28×1 input, patch 7 → 16 patches + a cls token = 17 tokens, width 64, depth 4, 4 heads
(head dim 16), pre-LN blocks, MLP width 128 (ratio 2), learned positional embedding, classifier on
the cls token: 139,018 parameters.

Every attention module has **separate** ``q_proj``/``k_proj``/``v_proj``/``o_proj`` ``nn.Linear``
layers with biases and a ``num_heads`` attribute, so :func:`quotient_manifolds.adapters.layout` finds its two GL(h)
blocks per head (QK: [W_q; b_q] with [W_k; b_k]; VO: [W_v; b_v] with W_o) structurally. Attention
is written out (softmax(QKᵀ/√h)V) rather than through ``scaled_dot_product_attention``, so double
backward (Hessian-vector products) works on CPU too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 28
    channels: int = 1
    patch: int = 7
    width: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 2.0
    classes: int = 10
    dropout: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H, h = self.num_heads, self.head_dim

        def heads(t):
            return t.view(B, T, H, h).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h)
        att = self.drop(att.softmax(dim=-1))
        out = (att @ v).transpose(1, 2).reshape(B, T, D)
        return self.o_proj(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(round(dim * mlp_ratio))
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig = ViTConfig()):
        super().__init__()
        c = config
        if c.image_size % c.patch:
            raise ValueError(f"image size {c.image_size} is not a multiple of patch {c.patch}")
        self.config = c
        n_patches = (c.image_size // c.patch) ** 2
        self.patch_embed = nn.Conv2d(c.channels, c.width, kernel_size=c.patch, stride=c.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.width))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, c.width))
        self.blocks = nn.ModuleList(Block(c.width, c.heads, c.mlp_ratio, c.dropout)
                                    for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.classes)
        self.reset_parameters()

    @property
    def num_tokens(self) -> int:
        return (self.config.image_size // self.config.patch) ** 2 + 1

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # attention q/k/v/o biases start at small random values (not 0) so that every GL block has
        # full rank and no exact zeros in the adaptive parts; training moves them anyway.
        for m in self.modules():
            if isinstance(m, Attention):
                for lin in (m.q_proj, m.k_proj, m.v_proj, m.o_proj):
                    nn.init.normal_(lin.bias, std=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(1)
        t = self.patch_embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls_token.expand(t.shape[0], -1, -1), t], dim=1) + self.pos_embed
        for blk in self.blocks:
            t = blk(t)
        return self.head(self.norm(t[:, 0]))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
