"""MAP attention pooling (SigLIP, Perception Encoder core): one learned latent query attends over
the tokens, then a projection and a residual MLP give the pooled vector (timm's
AttentionPoolLatent with one latent, no position embedding and no qk-norm).

Layouts: tokens [B, T, D] in (the patches, or every token with ModelConfig.pool_prefix); q
[B, H, 1, dh], k and v [B, H, T, dh]; scores / pattern [B, H, 1, T]; the pooled vector [B, D] out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poslens.models.config import ModelConfig
from poslens.models.hooks import HookPoint
from poslens.models.layers import Mlp, make_norm


class AttentionPool(nn.Module):
    """pooled = y + mlp(norm(y)), y = proj(attention of the latent over the tokens): what
    attends is seen at hook_pattern, what the attention adds at hook_attn_out, the result at
    hook_pooled (before any fc_norm and the classifier)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()  # modules registered in forward order, so hook_names() reads in order
        D = cfg.dim
        self.heads = cfg.map_heads
        self.head_dim = D // self.heads
        self.scale = self.head_dim**-0.5
        self.latent = nn.Parameter(torch.zeros(1, 1, D))  # the query token (timm's latent)
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.hook_attn_scores = HookPoint()  # [B, H, 1, T] scaled logits, before softmax
        self.hook_pattern = HookPoint()  # [B, H, 1, T] the latent's attention over the tokens
        self.hook_z = HookPoint()  # [B, H, 1, dh] per-head mix of values
        self.proj = nn.Linear(D, D)
        self.hook_attn_out = HookPoint()  # [B, D] the projected attention output
        self.norm = make_norm(cfg.norm, D, cfg.norm_eps)
        self.mlp = Mlp(D, cfg.map_hidden, cfg.mlp_act, norm=cfg.norm)
        self.hook_mlp_out = HookPoint()  # [B, D]
        self.hook_pooled = HookPoint()  # [B, D] the pooled vector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T, D] -> the pooled vector [B, D]."""
        B, T, D = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).view(B, 1, self.heads, self.head_dim)
        q = q.transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.hook_attn_scores.active or self.hook_pattern.active:
            scores = self.hook_attn_scores((q * self.scale) @ k.transpose(-2, -1))
            z = self.hook_pattern(scores.softmax(dim=-1)) @ v
        else:
            z = F.scaled_dot_product_attention(q, k, v)
        z = self.hook_z(z)
        y = self.hook_attn_out(self.proj(z.transpose(1, 2).reshape(B, D)))
        return self.hook_pooled(y + self.hook_mlp_out(self.mlp(self.norm(y))))

    def init_weights(self) -> None:
        """timm's init of the latent: truncated normal of std dim^-0.5 (linears as the ViT's)."""
        nn.init.trunc_normal_(self.latent, std=self.latent.shape[-1] ** -0.5)


__all__ = ["AttentionPool"]
