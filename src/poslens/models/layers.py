"""The small layers of a ViT block: LayerNorm and RMSNorm with a hook (and NoNorm, the place of a
norm a model does not have), and the MLPs (GELU / QuickGELU, SwiGLU) with their optional sub-norm.
Tokens [B, T, D] in and out.
"""

from __future__ import annotations

import torch
from torch import nn

from poslens.models.config import ModelConfig
from poslens.models.hooks import HookPoint


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose output is exposed as `hook_normalized`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)
        self.hook_normalized = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(super().forward(x))


class RMSNorm(nn.RMSNorm):
    """RMSNorm (x / sqrt(mean(x^2) + eps) * weight, no bias: timm's RmsNorm) whose output is
    exposed as `hook_normalized`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)
        self.hook_normalized = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(super().forward(x))


Norm = LayerNorm | RMSNorm  # a hooked norm, of the kind ModelConfig.norm names


def make_norm(kind: str, dim: int, eps: float) -> Norm:
    """A hooked norm of ModelConfig.norm's kind: "layer" LayerNorm, "rms" RMSNorm."""
    return RMSNorm(dim, eps) if kind == "rms" else LayerNorm(dim, eps)


def plain_norm(kind: str, dim: int, eps: float) -> nn.LayerNorm | nn.RMSNorm:
    """An unhooked norm of that kind, for norms that act where a hook already reads (patch_norm,
    norm_pre, qk-norm)."""
    return nn.RMSNorm(dim, eps=eps) if kind == "rms" else nn.LayerNorm(dim, eps=eps)


class NoNorm(nn.Module):
    """The place of a norm a model does not have (no final norm): its input, as `hook_normalized`."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_normalized = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(x)


def norm_or_none(on: bool, dim: int, eps: float, kind: str = "layer") -> Norm | None:
    """A hooked norm of `kind` where a config field switches one on, else None."""
    return make_norm(kind, dim, eps) if on else None


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
               "quick_gelu": QuickGELU}  # fmt: skip


class Mlp(nn.Module):
    """Two-layer MLP (GELU by default); sub_norm: a norm of `norm`'s kind on the hidden layer
    before fc2; bias: whether fc1 and fc2 have biases."""

    def __init__(
        self, dim: int, hidden: int, act: str = "gelu", sub_norm: bool = False, eps: float = 1e-6,
        bias: bool = True, norm: str = "layer",
    ) -> None:  # fmt: skip
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = ACTIVATIONS[act]()
        self.norm = norm_or_none(sub_norm, hidden, eps, norm)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        return self.fc2(x if self.norm is None else self.norm(x))


class SwiGLU(nn.Module):
    """Gated MLP of EVA-02 (timm's SwiGLU): fc2(silu(fc1_g x) * fc1_x x), sub_norm as in Mlp."""

    def __init__(
        self, dim: int, hidden: int, sub_norm: bool = False, eps: float = 1e-6, bias: bool = True,
        norm: str = "layer",
    ) -> None:  # fmt: skip
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden, bias=bias)
        self.fc1_x = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.SiLU()
        self.norm = norm_or_none(sub_norm, hidden, eps, norm)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1_g(x)) * self.fc1_x(x)
        return self.fc2(x if self.norm is None else self.norm(x))


def build_mlp(cfg: ModelConfig) -> Mlp | SwiGLU:
    """The MLP of a block as the config describes it (model.mlp, mlp_act, mlp_sub_norm, norm,
    proj_bias)."""
    hidden = int(cfg.dim * cfg.mlp_ratio)
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.dim, hidden, cfg.mlp_sub_norm, cfg.norm_eps, cfg.proj_bias, cfg.norm)
    bias, norm = cfg.proj_bias, cfg.norm
    return Mlp(cfg.dim, hidden, cfg.mlp_act, cfg.mlp_sub_norm, cfg.norm_eps, bias, norm)


__all__ = [
    "ACTIVATIONS",
    "LayerNorm",
    "Mlp",
    "NoNorm",
    "Norm",
    "QuickGELU",
    "RMSNorm",
    "SwiGLU",
    "build_mlp",
    "make_norm",
    "norm_or_none",
    "plain_norm",
]
