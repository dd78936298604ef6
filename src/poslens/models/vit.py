"""The one Vision Transformer of poslens, instrumented with hook points.

Reads top to bottom: Attention, Block, ViT (the norms and MLPs they use are in models/layers.py). Tensor layouts:
tokens [B, T, D] with T = num_prefix + gh*gw (CLS, registers, then patches row-major);
per-head tensors q, k, v, z [B, H, T, dh]; scores/pattern [B, H, T, T]; rotary table
[2, H, T, P] (cos, sin) with P = dh / 2 planes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from poslens._config import int_argument, seed_argument
from poslens.errors import ArgumentError, UserError
from poslens.models import hooks
from poslens.models.attention import softmax_attention
from poslens.models.config import ModelConfig
from poslens.models.hooks import HookedModule, HookPoint
from poslens.models.layers import NoNorm, Norm, build_mlp, make_norm, norm_or_none, plain_norm
from poslens.models.pooling import AttentionPool
from poslens.models.posenc import (
    Rotary,
    channel_tables,
    resample_pos_embed,
    rotary_table,
    rotate,
    sincos_2d,
    token_major_tables,
)
from poslens.models.relpos import RelPosBias, rel_pos_index


class Attention(nn.Module):
    """Multi-head self-attention with optional rotary q/k (same weight layout as timm's Attention);
    qk_norm: a LayerNorm over each head's q and k before rotation (hook_q / hook_k see them
    normalised); sub_norm: a LayerNorm over the heads' concatenated output before proj (norms of
    the kind `norm` names: "layer" or "rms"); proj_bias: whether proj has a bias."""

    def __init__(
        self,
        dim: int,
        heads: int,
        qkv_bias: bool,
        rope_layout: str | None,
        qk_norm: bool = False,
        sub_norm: bool = False,
        eps: float = 1e-6,
        proj_bias: bool = True,
        norm: str = "layer",
        rel_pos: RelPosBias | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.rope_layout = rope_layout
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = plain_norm(norm, self.head_dim, eps) if qk_norm else None
        self.k_norm = plain_norm(norm, self.head_dim, eps) if qk_norm else None
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        if rope_layout is not None:
            self.hook_rotary = HookPoint()  # [2, H, T, P]; rewrite it to mask planes
            self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        self.rel_pos = rel_pos  # the table of posenc "relpos" (models/relpos.py)
        if rel_pos is not None:
            self.hook_rel_bias = HookPoint()  # [H, T, T] added to the scores; zero it to remove
        self.hook_attn_scores = HookPoint()  # [B, H, T, T] scaled logits, before softmax
        self.hook_pattern = HookPoint()  # [B, H, T, T]
        self.hook_z = HookPoint()  # [B, H, T, dh] per-head mix of values
        self.norm = norm_or_none(sub_norm, dim, eps, norm)  # [B, T, D] the heads' concatenation
        # [B, T, H, D] per-head outputs, H times the residual's memory: computed only when hooked,
        # then the output is their sum (so in-place edits count) instead of one projection
        self.hook_result = HookPoint()

    def forward(
        self,
        x: torch.Tensor,
        rotary: torch.Tensor | None,
        first_query: bool = False,
        rel_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; first_query: [B, 1, D], the first token's output alone (its
        query against every key; the other queries are left out, so no hook may be active);
        rel_index [T, T]: where each query-key pair reads the relative bias table (relpos)."""
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.heads, self.head_dim)  # token-major
        rope = self.rope_layout is not None and rotary is not None
        if rope and self.q_norm is None and not any(h.active for h in self.rotation_hooks()):
            # nobody reads or rewrites q, k or the table: rotate q and k together in the linear's
            # layout, over contiguous memory (the same numbers as the per-head path below)
            # (split and unbind, not indexing: their backward writes qkv's gradient in one pass,
            # where each index would zero-fill a whole [B, T, 3, H, dh] and the parts then add up)
            cos, sin = token_major_tables(rotary, self.rope_layout, qkv.dtype, 2, self.heads)
            qk, v = qkv.split((2, 1), dim=2)
            qk = rotate(qk, cos, sin, self.rope_layout)  # [B, T, 2, H, dh]
            q, k = qk.permute(2, 0, 3, 1, 4).unbind(0)
            v = self.hook_v(v.squeeze(2).transpose(1, 2))
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
            if rope:
                cos, sin = channel_tables(self.hook_rotary(rotary), self.rope_layout, q.dtype)
                q = self.hook_rot_q(rotate(q, cos, sin, self.rope_layout))
                k = self.hook_rot_k(rotate(k, cos, sin, self.rope_layout))
        bias = None
        if self.rel_pos is not None and rel_index is not None:
            bias = self.hook_rel_bias(self.rel_pos(rel_index)).to(q.dtype)  # [H, T, T]
        if first_query:
            q, T = q[:, :, :1], 1  # [B, H, 1, dh]
            bias = None if bias is None else bias[..., :1, :]
        reads_pattern = self.hook_attn_scores.active or self.hook_pattern.active
        records_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if not reads_pattern and (x.is_cuda or not records_grad):
            # fused kernel where it pays: when nobody reads the pattern, on CUDA, and on CPU without
            # autograd (0.7-0.95x the explicit path's time); CPU backward through it is slower
            # (2.5-6x under bf16). benchmarks/attention_cpu.py measures both.
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        elif not reads_pattern:  # CPU training: the same formula, in cache-sized batch slices;
            # q [B, H, T|1, dh], k, v [B, H, T, dh] (strided views of qkv) -> z [B, H, T|1, dh]
            z = softmax_attention(q, k, v, self.scale, bias)
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            scores = self.hook_attn_scores(scores if bias is None else scores + bias)
            pattern = self.hook_pattern(scores.softmax(dim=-1))
            z = pattern @ v
        z = self.hook_z(z)
        if self.norm is not None:  # normalise the concatenation, then split into heads again
            z = self.norm(z.transpose(1, 2).reshape(B, T, D)).view(B, T, self.heads, -1)
            z = z.transpose(1, 2)
        if self.hook_result.active:
            w = self.proj.weight.view(D, self.heads, self.head_dim)  # [D_out, H, dh]
            result = self.hook_result(torch.einsum("bhtd,ohd->btho", z, w))
            out = result.sum(dim=2)
            return out if self.proj.bias is None else out + self.proj.bias
        return self.proj(z.transpose(1, 2).reshape(B, T, D))

    def rotation_hooks(self) -> list[HookPoint]:
        """The hook points on q and k and the rotation table (none without RoPE)."""
        if self.rope_layout is None:
            return []
        return [self.hook_q, self.hook_k, self.hook_rotary, self.hook_rot_q, self.hook_rot_k]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()  # modules registered in forward order, so hook_names() reads in order
        self.hook_resid_pre = HookPoint()
        self.ln1 = make_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.attn = Attention(
            cfg.dim,
            cfg.heads,
            cfg.qkv_bias,
            cfg.rope_layout if cfg.uses_rope else None,
            cfg.qk_norm,
            cfg.attn_sub_norm,
            cfg.norm_eps,
            cfg.proj_bias,
            cfg.norm,
            RelPosBias(cfg.grid, cfg.heads, cfg.num_prefix) if cfg.uses_relpos else None,
        )
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.ln2 = make_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.mlp = build_mlp(cfg)
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(
        self,
        x: torch.Tensor,
        rotary: torch.Tensor | None,
        first_only: bool = False,
        rel_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; first_only: [B, 1, D], the first token's output alone (the
        other tokens' are left uncomputed, so nothing after ln1 may be hooked; see ViT._blocks)."""
        x = self.hook_resid_pre(x)
        attn = self.hook_attn_out(self.attn(self.ln1(x), rotary, first_only, rel_index))
        x = self.hook_resid_mid((x[:, :1] if first_only else x) + attn)
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))


class ViT(HookedModule):
    """Vision Transformer whose positional encoding is one config field (see ModelConfig)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # the torch seed the weights were initialised from, where known (build_model; poslens.load
        # from the checkpoint's train.seed): what rebuilds the initialisation (axis_map's init)
        self.init_seed: int | None = None
        # cls_exit: a pass computes only the CLS token's output in the last block, as StackedViT
        # always does (training 1.2-1.5x faster at 14 x 14; docs/benchmarks.md); False keeps
        # every token (the float rounding of trajectories trained before the exit existed)
        self.train_cls_exit = True
        D, g = cfg.dim, cfg.grid
        self.patch_embed = nn.Conv2d(cfg.in_chans, D, cfg.patch_size, stride=cfg.patch_size)
        # patch_norm and norm_pre act where a hook already reads: hook_embed, blocks.0.hook_resid_pre
        self.patch_norm = plain_norm(cfg.norm, D, cfg.norm_eps) if cfg.patch_norm else None
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.cls_token else None
        self.reg_tokens = (
            nn.Parameter(torch.zeros(1, cfg.num_registers, D)) if cfg.num_registers else None
        )
        self.pos_embed = nn.Parameter(torch.zeros(1, g * g, D)) if cfg.has_pos_table else None
        self.rotary = (
            Rotary(
                cfg.rope_kind,
                cfg.depth,
                cfg.heads,
                cfg.head_dim,
                cfg.rope_theta,
                cfg.rope_coords,
                cfg.rope_variant,
                cfg.rope_blocks,
                cfg.rope_ref_grid,
                cfg.rope_offset,
            )
            if cfg.uses_rope
            else None
        )
        self.hook_embed = HookPoint()  # [B, gh*gw, D] patch embeddings, before any position
        if cfg.uses_additive_pos:
            self.hook_pos_embed = HookPoint()  # [1, gh*gw, D] what gets added to the patches
        self.norm_pre = plain_norm(cfg.norm, D, cfg.norm_eps) if cfg.norm_pre else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_final: Norm | NoNorm = NoNorm()  # without a final norm: the tokens as they are
        if cfg.final_norm:
            self.ln_final = make_norm(cfg.norm, D, cfg.norm_eps)
        # pool "map": a latent query's attention over the final tokens (models/pooling.py)
        self.attn_pool = AttentionPool(cfg) if cfg.pool == "map" else None
        self.fc_norm = norm_or_none(cfg.fc_norm, D, cfg.norm_eps, cfg.norm)  # [B, D] pooled
        # [B, D] -> [B, num_classes]; num_classes=0 (a backbone such as DINOv3): logits [B, 0]
        with warnings.catch_warnings():  # torch warns that initialising an empty head is a no-op
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.head = nn.Linear(D, cfg.num_classes)
            # DeiT's distillation head on register 0 (the distillation token)
            self.head_dist = nn.Linear(D, cfg.num_classes) if cfg.head_dist else None
        self.init_weights()
        self.setup_hooks()

    def init_weights(self) -> None:
        """timm-style init: truncated normal 0.02 for linear layers, configurable std for APE."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for p in (self.cls_token, self.reg_tokens):
            if p is not None:
                nn.init.normal_(p, std=1e-6)
        if self.attn_pool is not None:
            self.attn_pool.init_weights()
        if self.pos_embed is not None and self.cfg.ape_code == "learned":
            nn.init.trunc_normal_(
                self.pos_embed,
                std=self.cfg.ape_init_std,
                a=-2 * self.cfg.ape_init_std,
                b=2 * self.cfg.ape_init_std,
            )
        elif self.pos_embed is not None:  # a planted code, frozen: see ModelConfig.ape_code
            with torch.no_grad():
                code = planted_code(self.cfg.ape_code, self.cfg.grid, self.cfg.dim)
                self.pos_embed.copy_(code * self.cfg.ape_init_std)  # the learned table's scale
            self.pos_embed.requires_grad_(False)

    def grid_of(self, x: torch.Tensor) -> tuple[int, int]:
        """Patch grid (gh, gw) of an image batch [B, C, H, W]; UserError if it does not fit."""
        cfg = self.cfg
        check_input(x, self.patch_embed.weight)
        if x.ndim != 4 or x.shape[1] != cfg.in_chans:
            raise UserError(
                f"expected images [B, {cfg.in_chans}, H, W], got shape {tuple(x.shape)}"
            )
        h, w = x.shape[-2:]
        if h % cfg.patch_size or w % cfg.patch_size:
            raise UserError(
                f"image size {h}x{w} is not divisible by the patch size {cfg.patch_size}"
            )
        return h // cfg.patch_size, w // cfg.patch_size

    def pos_embed_for(self, gh: int, gw: int) -> torch.Tensor:
        """The additive embedding [1, gh*gw, D] for this grid (APE resampled, sincos computed)."""
        if self.cfg.posenc == "sincos":
            table = sincos_2d(gh, gw, self.cfg.dim, self.cfg.sincos_temperature)
            return table.to(self.head.weight.device)
        assert self.pos_embed is not None
        g = self.cfg.grid
        return resample_pos_embed(self.pos_embed, (g, g), (gh, gw))

    def rotary_tables(self, gh: int, gw: int) -> torch.Tensor | None:
        """cos/sin tables [depth|1, 2, H, T, P] (None without RoPE)."""
        if self.rotary is None:
            return None
        table = rotary_table(self.rotary(gh, gw), self.cfg.num_prefix)
        return table.expand(-1, -1, self.cfg.heads, -1, -1)

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images [B, C, H, W] -> tokens [B, T, D] entering block 0, and the grid."""
        gh, gw = self.grid_of(x)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, N, D]
        x = self.hook_embed(x if self.patch_norm is None else self.patch_norm(x))
        if self.cfg.uses_additive_pos:
            x = x + self.hook_pos_embed(self.pos_embed_for(gh, gw))
        prefix = [
            t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_tokens) if t is not None
        ]
        x = torch.cat([*prefix, x], dim=1)
        return (x if self.norm_pre is None else self.norm_pre(x)), (gh, gw)

    def forward(
        self, x: torch.Tensor, start_at: int = 0, grid: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Images [B, C, H, W] -> logits [B, num_classes].

        start_at b > 0: `x` is instead the residual [B, T, D] entering block b on patch grid
        `grid` (default: the config's), as `residual(images, b)` returned it; blocks 0..b-1
        and their hooks are skipped. Conditions that differ only from block b on share it."""
        if start_at:
            gh, gw = grid or (self.cfg.grid, self.cfg.grid)
            check_input(x, self.patch_embed.weight, "x")
            if not 0 < start_at <= self.cfg.depth or x.ndim != 3:
                raise ArgumentError(
                    f"start_at={start_at} needs a residual [B, T, D] and a block 1..{self.cfg.depth}"
                )
        else:
            x, (gh, gw) = self.embed(x)
        x = self._blocks(x, gh, gw, start_at, self.cfg.depth, cls_exit=self.cls_exit())
        x = self.ln_final(x)  # [B, 1, D] after a CLS exit
        pooled = self.pool(x)
        if self.fc_norm is not None:
            pooled = self.fc_norm(pooled)
        if self.head_dist is not None:  # DeiT distilled: the mean of the CLS and the dist. heads
            return (self.head(pooled) + self.head_dist(x[:, 1])) / 2
        return self.head(pooled)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """The final tokens [B, T, D] (or [B, 1, D] after a CLS exit) -> the pooled vector [B, D]:
        CLS, the mean of the patches, or the MAP pool's (over the patches, or every token with
        pool_prefix)."""
        p = self.cfg.num_prefix
        if self.attn_pool is not None:
            return self.attn_pool(x if self.cfg.pool_prefix else x[:, p:])
        return x[:, 0] if self.cfg.pool == "cls" else x[:, p:].mean(dim=1)

    def residual(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """Images [B, C, H, W] -> the residual [B, T, D] entering block `block` (blocks
        0..block-1 run, with their hooks), for `forward(..., start_at=block)`."""
        int_argument("block", block, 1, self.cfg.depth)
        x, (gh, gw) = self.embed(x)
        return self._blocks(x, gh, gw, 0, block)

    def _blocks(
        self, x: torch.Tensor, gh: int, gw: int, first: int, stop: int, cls_exit: bool = False
    ) -> torch.Tensor:
        """Blocks first..stop-1 on the residual [B, T, D] of a gh x gw grid; cls_exit: block
        stop-1 computes the first token's output alone ([B, 1, D])."""
        tables = self.rotary_tables(gh, gw)
        cfg = self.cfg
        rel = rel_pos_index(gh, gw, cfg.grid, cfg.num_prefix, x.device) if cfg.uses_relpos else None
        for i in range(first, stop):
            rotary = None if tables is None else tables[min(i, tables.shape[0] - 1)]
            x = self.blocks[i](x, rotary, cls_exit and i == stop - 1, rel)
        return x

    def cls_exit(self) -> bool:
        """Whether a pass computes only the first token's output in the last block (as
        StackedViT does; `train_cls_exit`, on by default): with CLS pooling nothing else of that
        block reaches the logits, and its attention from one query instead of T (most of one of a
        ViT-S's 12 blocks, a quarter of a depth-4 model's attention) is exact up to float
        rounding. Training and analysis passes alike, but only when no hook reads or rewrites
        anything of the last block that would see [B, 1, D] instead of [B, T, D]: its
        attention's z, output and MLP, its residual after attention, and ln_final (hook points
        or plain module hooks). Its input, ln1, q, k, v and rotations see every token as ever,
        so a rotary mask or a probe of the last block's input leaves the exit on."""
        if not self.train_cls_exit or self.cfg.pool != "cls" or self.cfg.head_dist:
            return False
        last = self.blocks[-1]
        attn = last.attn
        seen = {last.hook_resid_pre, last.ln1, last.ln1.hook_normalized}  # [B, T, D] as ever
        seen |= {attn.hook_q, attn.hook_k, attn.hook_v}  # [B, H, T, dh]
        if attn.rope_layout is not None:  # the table [2, H, T, P], rotated q and k [B, H, T, dh]
            seen |= {attn.hook_rotary, attn.hook_rot_q, attn.hook_rot_k}
        if attn.rel_pos is not None:  # the bias [H, T, T], sliced to the first query after it
            seen |= {attn.rel_pos, attn.hook_rel_bias}
        modules = [m for m in last.modules() if m not in seen] + [*self.ln_final.modules()]
        return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)

    def norm_site(self, name: str) -> tuple[str, Norm] | None:
        """For a LayerNorm's output hook, the residual hook it normalises and the norm itself:
        blocks.b.ln1 <- blocks.b.hook_resid_pre, blocks.b.ln2 <- blocks.b.hook_resid_mid,
        ln_final <- the last block's hook_resid_post. None for any other hook. An edit meant to
        reach the rest of the network rewrites that residual, not the norm's output alone."""
        norm, b = hooks.norm_of(name), hooks.block_of(name)
        if norm == "ln_final":
            if isinstance(self.ln_final, NoNorm):  # no final norm: its output is the residual
                return None
            return hooks.resid_post(self.cfg.depth - 1), self.ln_final
        if norm is None or b is None or not 0 <= b < self.cfg.depth:
            return None
        resid = hooks.resid_pre(b) if norm == "ln1" else hooks.resid_mid(b)
        return resid, getattr(self.blocks[b], norm)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_image(self, train: bool = True) -> float:
        """Matmul FLOPs of one forward (x3 for a training step) at the config resolution."""
        cfg = self.cfg
        T, D = cfg.num_prefix + cfg.grid**2, cfg.dim
        hidden = int(D * cfg.mlp_ratio)
        mlp_mats = 3 if cfg.mlp == "swiglu" else 2
        per_block = 2 * T * (3 * D * D + D * D + mlp_mats * D * hidden) + 2 * 2 * T * T * D
        embed = 2 * cfg.grid**2 * cfg.in_chans * cfg.patch_size**2 * D
        total = embed + cfg.depth * per_block + 2 * D * cfg.num_classes
        if cfg.pool == "map":  # the latent's q, the tokens' k and v, its attention, proj and MLP
            total += 2 * (D * D + 2 * T * D * D + 2 * T * D + D * D + 2 * D * cfg.map_hidden)
        return float(total * (3 if train else 1))


def planted_code(kind: str, grid: int, dim: int) -> torch.Tensor:
    """A position table [1, grid*grid, dim] with a structure known by construction (unit variance
    per entry, drawn from torch's generator; the model scales it by ape_init_std): "rowcol" r[row] + c[col] (additive), "cell" one
    random orthogonal direction per cell (orthonormal rows while grid^2 <= dim)."""
    n = grid * grid
    if kind == "rowcol":
        rows, cols = torch.randn(grid, dim), torch.randn(grid, dim)
        return ((rows[:, None] + cols[None, :]) / 2**0.5).reshape(1, n, dim)
    m = max(n, dim)
    q, _ = torch.linalg.qr(torch.randn(m, m))  # orthogonal [m, m]: entries of variance 1/m
    return (q[:n, :dim] * m**0.5).reshape(1, n, dim)


def check_input(x: Any, weight: torch.Tensor, name: str = "images") -> None:
    """A model input: a floating-point tensor on the weights' device, of their dtype (or float32
    or the autocast dtype under autocast, which casts those); ArgumentError naming `name`
    otherwise, before torch's own dtype and device errors from inside the forward pass."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ArgumentError(
            f"{name} must be a floating-point tensor, got {str(x.dtype).removeprefix('torch.')}"
            f"; pass {name}.float()"
        )
    if x.device != weight.device:
        raise ArgumentError(
            f"{name} is on {x.device}, the model on {weight.device}: move one of them (.to())"
        )
    kind = x.device.type
    autocast = torch.is_autocast_enabled(kind)
    if x.dtype != weight.dtype and not (
        autocast and x.dtype in (torch.float32, torch.get_autocast_dtype(kind))
    ):
        have, want = (str(t).removeprefix("torch.") for t in (x.dtype, weight.dtype))
        raise ArgumentError(
            f"{name} has dtype {have}, the model's weights {want}: pass {name}.to({weight.dtype}) "
            "(or run under torch.autocast)"
        )


def build_model(cfg: ModelConfig, seed: int | None = None) -> ViT:
    """A freshly initialised ViT; deterministic when `seed` is given."""
    if not isinstance(cfg, ModelConfig):
        raise ArgumentError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if seed is None:
        return ViT(cfg)
    seed = seed_argument("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ViT(cfg)
    model.init_seed = seed
    return model


__all__ = ["Attention", "Block", "ViT", "build_model"]
