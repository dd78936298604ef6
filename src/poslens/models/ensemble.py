"""S ViTs of one config as one module: every parameter stacked on a leading member dimension.

Member s of `StackedViT(models)` computes exactly what `models[s]` computes (the same ops on the
same numbers, grouped), but every op covers all S members at once, so S small models train in
fewer, larger kernels. It is a training module: no hook points, images at the config resolution.

Layouts: stacked parameters [S, *shape of the ViT's parameter]; tokens [S, B, T, D]; per-head
tensors [S*B, H, T, dh]; logits [S, B, num_classes].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from poslens.models.attention import softmax_attention
from poslens.models.posenc import (
    Rotary,
    channel_tables,
    rotary_table,
    rotate,
    sincos_2d,
    token_major_tables,
)
from poslens.models.relpos import rel_pos_index
from poslens.models.vit import ViT


class StackedViT(nn.Module):
    """The members' parameters as one [S, ...] tensor each, under the ViT's parameter names."""

    def __init__(self, models: Sequence[ViT]) -> None:
        super().__init__()
        cfg = models[0].cfg
        if any(m.cfg != cfg for m in models):
            raise ValueError("the members of an ensemble must share one model config")
        if cfg.arch_pieces():  # its forward is the plain ViT's (see ModelConfig's ARCH_FIELDS)
            raise ValueError(f"an ensemble stacks plain ViTs; this one has {cfg.arch_pieces()[0]}")
        self.cfg, self.size = cfg, len(models)
        self.names = [n for n, _ in models[0].named_parameters()]
        if set(self.names) != set(models[0].state_dict()):  # checkpoints are the parameters only
            raise ValueError("StackedViT stacks parameters; this ViT has other persistent state")
        members = [dict(m.named_parameters()) for m in models]
        for name in self.names:
            stacked = torch.stack([p[name].detach() for p in members])
            frozen = not members[0][name].requires_grad
            self.register_parameter(_key(name), nn.Parameter(stacked, requires_grad=not frozen))
        # member 0's Rotary computes the angles: its own for fixed frequencies, each member's for
        # learned ones (the stacked `freqs`); kept out of the module tree and its parameters
        self.rotary: list[Rotary] = [models[0].rotary] if models[0].rotary is not None else []

    def stacked(self, name: str) -> nn.Parameter:
        """The parameter `name` of the ViT, stacked over members: [S, ...]."""
        return getattr(self, _key(name))

    def named_stacked(self) -> list[tuple[str, nn.Parameter]]:
        """(ViT parameter name, stacked parameter) in the ViT's order."""
        return [(n, self.stacked(n)) for n in self.names]

    def member_state(self, s: int) -> dict[str, torch.Tensor]:
        """Member s's parameters under the ViT's names (views, not copies)."""
        return {n: self.stacked(n)[s].detach() for n in self.names}

    def num_params(self) -> int:
        """Parameters of one member."""
        return sum(p[0].numel() for _, p in self.named_stacked())

    def linear(self, x: torch.Tensor, name: str, rows: slice = slice(None)) -> torch.Tensor:
        """x [S, B, ..., in] -> [S, B, ..., out] through each member's nn.Linear `name` (only its
        output channels `rows`, when given)."""
        w = self.stacked(f"{name}.weight")[:, rows]  # [S, out, in]
        b = self.stacked(f"{name}.bias")[:, rows]  # [S, out]
        flat = x.reshape(self.size, -1, x.shape[-1])  # [S, B*..., in]
        return torch.baddbmm(b[:, None], flat, w.mT).view(*x.shape[:-1], w.shape[1])

    def layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Each member's LayerNorm `name` over the last dim of x [S, ...].

        Eager: one fused LayerNorm per member, the ViT's own rounding, and faster than a shared
        normalisation with a stacked affine, whose backward reduces over every token (bf16,
        qkv input of 5 members: 10.6 vs 13.9 ms). Under torch.compile the latter, which
        inductor fuses into one kernel (RoPE bf16 ensemble: 986 vs 909 img/s).
        """
        w, b = self.stacked(f"{name}.weight"), self.stacked(f"{name}.bias")  # [S, D]
        eps, D = self.cfg.norm_eps, x.shape[-1]
        if torch.compiler.is_compiling():
            shape = (self.size,) + (1,) * (x.ndim - 2) + (D,)
            return torch.addcmul(b.view(shape), F.layer_norm(x, (D,), eps=eps), w.view(shape))
        # unbind, not x[s]: indexing's backward would fill a zero [S, ...] tensor per member
        parts = zip(x.unbind(0), w.unbind(0), b.unbind(0), strict=True)
        return torch.stack([F.layer_norm(xs, (D,), ws, bs, eps) for xs, ws, bs in parts])

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W], shared by the members -> tokens [S, B, T, D] entering block 0."""
        cfg, S, B = self.cfg, self.size, x.shape[0]
        p, g, D = cfg.patch_size, cfg.grid, cfg.dim
        if x.shape[1:] != (cfg.in_chans, cfg.image_size, cfg.image_size):
            raise ValueError(f"expected images [B, {cfg.in_chans}, {cfg.image_size}, "
                             f"{cfg.image_size}], got {tuple(x.shape)}")  # fmt: skip
        # the stride-p convolution as a matmul over patches [B*N, C*p*p] (channel, row, col order)
        patches = x.reshape(B, cfg.in_chans, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(1, B * g * g, -1).expand(S, -1, -1)
        w = self.stacked("patch_embed.weight").flatten(2)  # [S, D, C*p*p]
        b = self.stacked("patch_embed.bias")[:, None]  # [S, 1, D]
        tok = torch.baddbmm(b, patches, w.mT).view(S, B, g * g, D)
        if cfg.posenc == "sincos":
            tok = tok + sincos_2d(g, g, D).to(tok.device)
        elif cfg.uses_additive_pos:
            tok = tok + self.stacked("pos_embed")  # [S, 1, N, D]
        prefix = [
            self.stacked(n).expand(-1, B, -1, -1)  # [S, B, 1 | R, D]
            for n in ("cls_token", "reg_tokens")
            if n in self.names
        ]
        return torch.cat([*prefix, tok], dim=2)

    def rotary_tables(self) -> torch.Tensor | None:
        """cos/sin tables [S|1, depth|1, 2, 1|H, T, P] (None without RoPE)."""
        if not self.rotary:
            return None
        rotary, g, device = self.rotary[0], self.cfg.grid, self.stacked("head.weight").device
        if "rotary.freqs" in self.names:  # learned: [S, depth, H, P, 2], angles per member
            angles = functional_call(rotary, {"freqs": self.stacked("rotary.freqs")}, (g, g))
        else:  # fixed: one set of angles for every member
            angles = rotary(g, g).to(device)[None]
        return rotary_table(angles, self.cfg.num_prefix)  # angles [S|1, depth|1, H|1, N, P]

    def attention(
        self, x: torch.Tensor, i: int, table: torch.Tensor | None, cls_only: bool = False
    ) -> torch.Tensor:
        """Block i's attention on x [S, B, T, D] -> [S, B, T, D] ([S, B, 1, D]: the CLS token's
        output alone, which never rotates its query); `table` [S|1, 2, 1|H, T, P]."""
        cfg, S, B, T, D = self.cfg, *x.shape
        H, dh = cfg.heads, cfg.head_dim
        name = f"blocks.{i}.attn.qkv"
        # the linear's token-major layout [S, B, T, n, H, dh]: the parts that rotate (q and k,
        # or k alone when the CLS query is the only one), then the rest
        if cls_only:
            q = self.linear(x[:, :, :1], name, slice(0, D)).view(S * B, 1, H, dh).transpose(1, 2)
            kv = self.linear(x, name, slice(D, 3 * D)).view(S, B, T, 2, H, dh)
            turn, v = kv.split((1, 1), dim=3)  # split: a one-pass backward (a cat), as the ViT's
        else:
            qkv = self.linear(x, name).view(S, B, T, 3, H, dh)
            turn, v = qkv.split((2, 1), dim=3)
        v = v.squeeze(3)
        layout, compiling = cfg.rope_layout, torch.compiler.is_compiling()
        if table is not None and not compiling:  # eager: q and k in one pass over contiguous memory
            cos, sin = token_major_tables(table, layout, turn.dtype, turn.shape[3], H)
            turn = rotate(turn, cos[:, None], sin[:, None], layout)  # cos [S|1, 1, T, n, H, dh]
        heads = [t.flatten(0, 1).transpose(1, 2) for t in (*turn.unbind(3), v)]  # [S*B, H, T, dh]
        if table is not None and compiling:  # inductor fuses this better (bf16: 968 vs 849 img/s)
            cos, sin = channel_tables(table.movedim(-4, 0), layout, turn.dtype)  # [S|1, H|1, T, dh]
            for j in range(turn.shape[3]):
                t = heads[j].unflatten(0, (S, B))
                heads[j] = rotate(t, cos[:, None], sin[:, None], layout).flatten(0, 1)
        if cls_only:
            k, v = heads
        else:
            q, k, v = heads
        bias = self.rel_bias(i, B, 1 if cls_only else T, q.dtype)  # [S*B, H, T|1, T] or None
        if x.is_cuda or not torch.is_grad_enabled():  # as the ViT: fused where it pays
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:  # the ViT's CPU training kernel: scores [S*B, H, T|1, T] in cache-sized slices
            z = softmax_attention(q, k, v, dh**-0.5, bias)
        z = z.transpose(1, 2).reshape(S, B, q.shape[2], D)
        return self.linear(z, f"blocks.{i}.attn.proj")

    def rel_bias(self, i: int, B: int, tq: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Block i's relative position bias per member, repeated over the batch [S*B, H, tq, T]
        (the first tq queries); None without posenc "relpos"."""
        name = f"blocks.{i}.attn.rel_pos.table"
        if name not in self.names:
            return None
        cfg, table = self.cfg, self.stacked(name)  # [S, R, H]
        index = rel_pos_index(cfg.grid, cfg.grid, cfg.grid, cfg.num_prefix, table.device)
        bias = table[:, index[:tq].reshape(-1)].view(self.size, tq, -1, cfg.heads)
        bias = bias.permute(0, 3, 1, 2).to(dtype)  # [S, H, tq, T]
        return bias[:, None].expand(-1, B, -1, -1, -1).flatten(0, 1)

    def block(
        self, h: torch.Tensor, i: int, table: torch.Tensor | None, cls_only: bool = False
    ) -> torch.Tensor:
        """Block i on tokens h [S, B, T, D] -> [S, B, T, D] (cls_only: [S, B, 1, D], the CLS
        token's output alone; the other tokens' outputs are then left uncomputed)."""
        x = self.attention(self.layer_norm(h, f"blocks.{i}.ln1"), i, table, cls_only)
        h = (h[:, :, :1] if cls_only else h) + x
        mlp = self.linear(self.layer_norm(h, f"blocks.{i}.ln2"), f"blocks.{i}.mlp.fc1")
        return h + self.linear(F.gelu(mlp), f"blocks.{i}.mlp.fc2")

    def forward(
        self, x: torch.Tensor, withheld: range = range(0), planes: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Images [B, C, H, W] -> every member's logits [S, B, num_classes]; rotations are
        withheld (identity, as rotary_mask makes them) in the `withheld` blocks: every plane, or
        those of the bool mask `planes` [depth, H, P]."""
        cfg = self.cfg
        h = self.embed(x)
        tables = self.rotary_tables()
        for i in range(cfg.depth):
            table = None if tables is None else tables[:, min(i, tables.shape[1] - 1)]
            if table is not None and i in withheld:  # cos 1, sin 0: the identity rotation
                ident = torch.stack(
                    [torch.ones_like(table[:, 0]), torch.zeros_like(table[:, 1])], 1
                )  # [S|1, 2, H|1, T, P]
                off = None if planes is None else planes[i][:, None].to(table.device)  # [H, 1, P]
                table = ident if off is None else torch.where(off, ident, table)
            # with CLS pooling only the CLS token leaves the last block: compute just that
            h = self.block(h, i, table, cls_only=cfg.pool == "cls" and i == cfg.depth - 1)
        if cfg.pool == "cls":  # LayerNorm is per token: normalising CLS alone is exact
            pooled = self.layer_norm(h[:, :, 0], "ln_final")
        else:
            pooled = self.layer_norm(h, "ln_final")[:, :, cfg.num_prefix :].mean(dim=2)
        return self.linear(pooled, "head")  # [S, B, num_classes]


def _key(name: str) -> str:
    """A module attribute name for a dotted ViT parameter name."""
    return name.replace(".", "__")


__all__ = ["StackedViT"]
