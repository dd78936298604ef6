"""Convert timm ViTs (learned APE, DeiT-III, naver RoPE-ViT) into the poslens ViT, exactly.

The timm architecture is built with `timm.create_model(name, pretrained=False)` (no download), the
weights come from a local safetensors file (never a pickle), and the converted model reproduces
timm's forward: the same hooks, rotary masks and experiments then work unchanged.

Conventions mapped (all exact, checked numerically at conversion time for rotary tables):
- pos_embed that also covers the prefix tokens (timm `no_embed_class=False`) is folded into the
  CLS / register tokens: a prefix token's embedding is constant, so cls + pos[0] is the same input.
- LayerScale (DeiT-III `ls1.gamma` / `ls2.gamma`, EVA `gamma_1` / `gamma_2`) is folded into the
  attention output projection and fc2: gamma * (W z + b) = (gamma W) z + gamma b. hook_attn_out /
  hook_mlp_out then carry what is added to the residual, and hook_result still sums to it.
- EVA qkv with separate q_bias / v_bias (k has no bias) becomes one qkv bias with zeros for k.
- naver axial RoPE (RotaryEmbeddingCat, 'xy' indexing: column bands first, interleaved pairs,
  bands temperature^(-i / (dh/4))) is poslens rope_axial with rope_theta = temperature; mixed
  RoPE (RotaryEmbeddingMixed, freqs [2, depth, H, P]) is poslens rope_mixed with freqs [depth, H, P, 2].
- DINOv3 RoPE (RotaryEmbeddingDinoV3: "half" layout, row planes first, 0.5-centred coordinates in
  [-1, 1], periods temperature^(i / (dh/4))) is rope_axial with rope_layout "half" and rope_coords
  "centered"; its row-first planes are moved to poslens' column-first order by permuting the q and
  k channels of every head the same way (q.k unchanged; hook_q / hook_k list channels in that order).
  Register tokens become poslens prefix tokens (CLS, then registers), never rotated, as in timm.
- EVA-style RotaryEmbeddingCat tables (EVA-02, Perception Encoder, SBB `*_rope_reg*_gap`: offset
  indices rescaled to a reference grid, row bands first with 'ij') are rope_coords "rescaled",
  row-first planes permuted the same way (models/timm_eva.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from poslens._timm import import_timm
from poslens.errors import ConfigError, UserError
from poslens.models.config import ModelConfig
from poslens.models.timm_eva import cat_rotary, channel_order, plane_order, row_first
from poslens.models.timm_map import (
    block_bias,
    linear_state,
    map_fields,
    map_state,
    norm_kind_eps,
    norm_state,
)
from poslens.models.timm_relpos import RELPOS_ARCHS, relpos_tables
from poslens.models.timm_weights import (
    head_classes,
    load_timm_weights,
    read_kwargs,
    read_timm_weights,
)
from poslens.models.vit import ViT


def known_timm(name: str) -> Any:
    """The timm module, once `name` is known to it (UserError if not)."""
    timm = import_timm()
    if not timm.is_model(name):
        raise UserError(f"unknown timm model {name!r} (list them with timm.list_models('vit_*'))")
    return timm


def create_timm(name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Build timm model `name` (random weights unless `pretrained`, which downloads from the hub)."""
    timm = known_timm(name)
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise UserError(f"timm could not build {name!r}: {str(e).splitlines()[0]}") from None
    except (OSError, RuntimeError) as e:  # hub download failures (offline, no such file)
        if not pretrained:
            raise
        raise UserError(
            f"timm could not fetch pretrained weights for {name!r}: {str(e).splitlines()[0]}"
        ) from None
    return model.eval()


def _unsupported(name: str, what: str) -> UserError:
    return UserError(f"timm:{name} is not supported: {what}")


def _is_identity(m: Any) -> bool:
    return m is None or isinstance(m, nn.Identity)


def _square(v: Any, what: str, name: str) -> int:
    a, b = (v, v) if isinstance(v, int) else tuple(v)
    if a != b:
        raise _unsupported(name, f"non-square {what} {a}x{b}")
    return int(a)


def _qkv(attn: nn.Module, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused qkv weight [3D, D] and bias [3D] (None without bias) of a timm / EVA attention."""
    if getattr(attn, "qkv", None) is not None:
        w = attn.qkv.weight
        b = attn.qkv.bias
        if b is None and getattr(attn, "q_bias", None) is not None:  # EVA: k has no bias
            b = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
        return w, b
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = torch.cat([p.weight for p in projs])
    if all(p.bias is None for p in projs):
        return w, None
    b = torch.cat([p.bias if p.bias is not None else torch.zeros(dim) for p in projs])
    return w, b


def _permute_qk(
    w: torch.Tensor, b: torch.Tensor | None, heads: int, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder the channels of every q and k head of a fused qkv [3D, D] (v untouched): q.k is unchanged."""
    dh = order.numel()
    idx = torch.arange(w.shape[0]).view(3, heads, dh)
    idx[:2] = idx[:2, :, order]
    idx = idx.flatten()
    return w[idx], None if b is None else b[idx]


def _gamma(block: nn.Module, which: int) -> torch.Tensor | None:
    """LayerScale gamma of the attention (1) or MLP (2) branch, or None."""
    ls = getattr(block, f"ls{which}", None)  # timm VisionTransformer Block
    if ls is not None and not isinstance(ls, nn.Identity):
        return ls.gamma
    return getattr(block, f"gamma_{which}", None)  # EVA block


def _mlp_act(act: nn.Module, name: str) -> str:
    """poslens' name (ModelConfig.mlp_act) of a timm MLP activation."""
    kind = type(act).__name__
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if kind in ("GELUTanh", "QuickGELU"):
        return {"GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}[kind]
    raise _unsupported(name, f"MLP activation {kind}")


def _mlp_kind(mlp: nn.Module, name: str) -> str:
    """The MLP's kind: "mlp" (fc1 -> act -> fc2) or "swiglu" (SwiGLU, or GluMlp gating first)."""
    kind = type(mlp).__name__
    if kind == "Mlp":
        return "mlp"
    silu = isinstance(getattr(mlp, "act", None), nn.SiLU)
    if (kind == "SwiGLU" and silu) or (kind == "GluMlp" and silu and not mlp.gate_last):
        return "swiglu"
    raise _unsupported(name, f"MLP type {kind} (poslens has a GELU-family Mlp and SwiGLU)")


def _mlp_linears(mlp: nn.Module) -> list[nn.Linear]:
    """The MLP's linear layers (fc1 or fc1_g / fc1_x, then fc2)."""
    return [getattr(mlp, n) for n in ("fc1", "fc1_g", "fc1_x", "fc2") if hasattr(mlp, n)]


def _mlp_state(mlp: nn.Module) -> dict[str, torch.Tensor | None]:
    """fc1 (or fc1_g / fc1_x) tensors under poslens' names; a packed GluMlp's fc1 is split into
    its gate (first half) and value (second half)."""
    if type(mlp).__name__ == "GluMlp":
        (wg, wx), b = mlp.fc1.weight.chunk(2), mlp.fc1.bias
        (bg, bx) = (None, None) if b is None else b.chunk(2)
        return {"fc1_g.weight": wg, "fc1_g.bias": bg, "fc1_x.weight": wx, "fc1_x.bias": bx}
    out = {}
    for n in ("fc1", "fc1_g", "fc1_x"):
        if hasattr(mlp, n):
            out[n + ".weight"], out[n + ".bias"] = getattr(mlp, n).weight, getattr(mlp, n).bias
    return out  # a bias is None where the MLP has none


def _hidden(mlp: nn.Module) -> int:
    """Width of the MLP's hidden layer (after gating)."""
    fc2 = mlp.fc2
    return int(fc2.in_features)


def _block_kind(block: nn.Module, name: str) -> dict[str, Any]:
    """The ModelConfig fields a timm block sets: its MLP, activation, qk-norm and sub-LNs."""
    mlp = _mlp_kind(block.mlp, name)
    return {
        "mlp": mlp,
        "mlp_act": _mlp_act(block.mlp.act, name) if mlp == "mlp" else "gelu",
        "qk_norm": not _is_identity(getattr(block.attn, "q_norm", None)),
        "attn_sub_norm": not _is_identity(getattr(block.attn, "norm", None)),
        "mlp_sub_norm": not _is_identity(getattr(block.mlp, "norm", None)),
        "proj_bias": block_bias(block, _mlp_linears(block.mlp), name),
    }


def _block_norms(block: nn.Module) -> dict[str, nn.Module]:
    """A timm block's norms under poslens' names (relative to the block), where present."""
    attn, mlp = block.attn, block.mlp
    found = {"ln1": block.norm1, "ln2": block.norm2, "attn.q_norm": getattr(attn, "q_norm", None),
             "attn.k_norm": getattr(attn, "k_norm", None), "attn.norm": getattr(attn, "norm", None),
             "mlp.norm": getattr(mlp, "norm", None)}  # fmt: skip
    return {k: m for k, m in found.items() if not _is_identity(m)}


def _check_block(block: nn.Module, name: str) -> None:
    """Refuse block features poslens' Block cannot reproduce (gating, grouped queries, ...)."""
    kind = type(block).__name__
    if kind not in ("Block", "EvaBlock", "RelPosBlock"):
        raise _unsupported(name, f"block type {kind} (poslens has pre-norm Block / EvaBlock)")
    attn, mlp = block.attn, block.mlp
    if type(attn).__name__ not in ("Attention", "AttentionRope", "EvaAttention", "RelPosAttention"):
        raise _unsupported(name, f"attention type {type(attn).__name__}")
    if _is_identity(getattr(attn, "q_norm", None)) != _is_identity(getattr(attn, "k_norm", None)):
        raise _unsupported(name, "attention with a norm on q or k alone")
    if getattr(attn, "gate", None) is not None:
        raise _unsupported(name, "gated attention")
    if getattr(attn, "num_kv_groups", 1) != 1:
        raise _unsupported(name, "grouped-query attention")
    if _mlp_kind(mlp, name) == "mlp":
        _mlp_act(mlp.act, name)
    block_bias(block, _mlp_linears(mlp), name)


def _rotary(
    tm: nn.Module, name: str, head_dim: int
) -> tuple[str, float, torch.Tensor | None, dict[str, Any]]:
    """(kind, theta, mixed freqs [depth, H, P, 2] or None, the rope_coords fields) of a timm
    rotary embedding."""
    rope = tm.rope
    kind = type(rope).__name__
    if kind == "RotaryEmbeddingDinoV3":
        if rope.min_period is not None or rope.max_period is not None or rope.temperature is None:
            raise _unsupported(name, "DINOv3 rotary embedding with min/max periods")
        if rope.normalize_coords != "separate" or rope.grid_offset != 0 or rope.dim != head_dim:
            raise _unsupported(name, "DINOv3 rotary embedding with non-default coordinates")
        if not rope.rotate_half or rope.grid_indexing not in ("ij", "xy"):
            raise _unsupported(name, "DINOv3 rotary embedding in interleaved layout")
        return "axial", float(rope.temperature), None, {"rope_coords": "centered"}
    if kind == "RotaryEmbeddingCat":  # naver, EVA-02, PE, SBB (timm_eva)
        theta, fields = cat_rotary(rope, name, head_dim)
        return "axial", theta, None, fields
    if kind == "RotaryEmbeddingMixed":
        freqs = rope.freqs.detach()  # [2, depth, H, P]: freqs[0] multiplies t_x, freqs[1] t_y
        if rope.grid_indexing == "ij":  # t_x is then the row coordinate
            freqs = freqs.flip(0)
        return "mixed", float(rope.temperature), freqs.permute(1, 2, 3, 0).contiguous(), {}
    raise _unsupported(name, f"rotary embedding {kind}")


def convert(tm: nn.Module, name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing a timm VisionTransformer / Eva in eval mode."""
    arch = type(tm).__name__
    distilled = arch == "VisionTransformerDistilled"
    if arch not in ("VisionTransformer", "Eva", *RELPOS_ARCHS) and not distilled:
        raise _unsupported(name, f"architecture {arch} (poslens converts VisionTransformer, Eva, "
                           "Beit, VisionTransformerRelPos)")  # fmt: skip
    pe = tm.patch_embed
    if getattr(pe, "dynamic_img_pad", False):
        raise _unsupported(name, "patch embedding with padding")
    # timm's norms outside the blocks under poslens' names, in forward order
    norms = {"patch_norm": getattr(pe, "norm", None), "norm_pre": getattr(tm, "norm_pre", None),
             "ln_final": getattr(tm, "norm", None), "fc_norm": getattr(tm, "fc_norm", None)}  # fmt: skip
    present = {n: not _is_identity(m) for n, m in norms.items()}
    if distilled and (present["fc_norm"] or not isinstance(tm.head_dist, nn.Linear)):
        raise _unsupported(name, "distillation head with fc_norm or without a classifier")
    if not isinstance(tm.head, nn.Linear) and not _is_identity(tm.head):
        raise _unsupported(name, f"classifier head {type(tm.head).__name__} (not linear)")
    attn_pool = getattr(tm, "attn_pool", None)
    if getattr(tm, "pool_include_prefix", False) and attn_pool is None:
        raise _unsupported(name, "pooling that includes prefix tokens")
    pool = {"token": "cls", "avg": "mean"}.get(tm.global_pool, "map" if attn_pool else None)
    if pool is None:
        raise _unsupported(name, f"global_pool={tm.global_pool!r} (poslens pools 'token', 'avg', "
                           "'map')")  # fmt: skip
    blocks = list(tm.blocks)
    for b in blocks:
        _check_block(b, name)
    b0 = blocks[0]
    dim = int(tm.embed_dim)
    heads = int(b0.attn.num_heads)
    if _qkv(b0.attn, dim)[0].shape[0] != 3 * dim:  # BEiT's attention may set its own head dim
        raise _unsupported(name, "attention head dimension other than dim / heads")
    hidden = _hidden(b0.mlp)
    timm_names = {"patch_norm": "patch_embed.norm", "ln_final": "norm"}
    kinds = {norm_kind_eps(m, name, timm_names.get(n, n)) for n, m in norms.items() if present[n]}
    block_kind = _block_kind(b0, name)
    pooling = {"pool": pool}
    if pool == "map":
        act = block_kind["mlp_act"]
        pooling = map_fields(tm, name, heads, hidden, act, _mlp_act)
        kinds |= {norm_kind_eps(attn_pool.norm, name, "attn_pool.norm")}
    for i, b in enumerate(blocks):
        if _hidden(b.mlp) != hidden or b.attn.num_heads != heads:
            raise _unsupported(name, "blocks of different widths")
        if _block_kind(b, name) != block_kind:
            raise _unsupported(name, "blocks of different kinds")
        for where, norm in _block_norms(b).items():
            kinds |= {norm_kind_eps(norm, name, f"blocks.{i}.{where}")}
    if len({k for k, _ in kinds}) != 1:
        raise _unsupported(name, "a mix of LayerNorm and RMSNorm")
    eps = {e for _, e in kinds}
    if len(eps) != 1:
        raise _unsupported(name, f"LayerNorms with different eps {sorted(eps)}")
    # DeiT's distillation token is register 0; BEiT and relpos ViTs have no registers
    reg = tm.dist_token if distilled else getattr(tm, "reg_token", None)
    num_registers = 0 if reg is None else int(reg.shape[1])
    has_cls = tm.cls_token is not None
    num_prefix = int(has_cls) + num_registers

    rope = getattr(tm, "rope", None)
    mixed_freqs = None
    theta = ModelConfig.rope_theta
    coord_fields: dict[str, Any] = {}
    rel_tables = relpos_tables(tm, name, num_prefix)  # BEiT / relpos ViT: one table per block
    pos_embed = getattr(tm, "pos_embed", None)
    if rel_tables is not None and (rope is not None or pos_embed is not None):
        raise _unsupported(name, "relative position bias with an absolute or rotary encoding")
    if rel_tables is not None:
        posenc = "relpos"
    elif rope is None:
        posenc = "ape" if pos_embed is not None else "none"
    else:
        kind, theta, mixed_freqs, coord_fields = _rotary(tm, name, dim // heads)
        posenc = f"rope_{kind}" + ("_ape" if pos_embed is not None else "")
    try:
        cfg = ModelConfig(
            image_size=_square(pe.img_size, "image size", name),
            patch_size=_square(pe.patch_size, "patch size", name),
            in_chans=int(pe.proj.in_channels),
            num_classes=int(tm.head.out_features) if isinstance(tm.head, nn.Linear) else 0,
            dim=dim,
            depth=len(blocks),
            heads=heads,
            mlp_ratio=hidden / dim,
            posenc=posenc,
            rope_theta=theta,
            rope_layout="half" if getattr(rope, "rotate_half", False) else "interleaved",
            **coord_fields,
            cls_token=has_cls,
            num_registers=num_registers,
            qkv_bias=_qkv(b0.attn, dim)[1] is not None,
            norm_eps=eps.pop(),
            patch_norm=present["patch_norm"],
            norm_pre=present["norm_pre"],
            qk_norm=block_kind["qk_norm"],
            attn_sub_norm=block_kind["attn_sub_norm"],
            mlp=block_kind["mlp"],
            mlp_act=block_kind["mlp_act"],
            mlp_sub_norm=block_kind["mlp_sub_norm"],
            final_norm=present["ln_final"],
            fc_norm=present["fc_norm"],
            head_dist=distilled,
            norm=kinds.pop()[0],
            proj_bias=block_kind["proj_bias"],
            **pooling,
        )
    except ConfigError as e:
        raise _unsupported(name, str(e)) from None
    if int(cfg.dim * cfg.mlp_ratio) != hidden:
        raise _unsupported(name, f"MLP width {hidden} is not dim x a ratio poslens reproduces")

    sd: dict[str, torch.Tensor] = {}
    w = pe.proj.weight
    sd["patch_embed.weight"] = w
    sd["patch_embed.bias"] = pe.proj.bias if pe.proj.bias is not None else w.new_zeros(dim)
    prefix = [t for t in (tm.cls_token, reg) if t is not None]
    prefix_t = torch.cat(prefix, dim=1) if prefix else None  # [1, num_prefix, D]
    if pos_embed is not None:
        pos = pos_embed  # [1, (num_prefix if embedded) + N, D]
        n_patch = cfg.grid**2
        if (
            pos.shape[1] == n_patch + num_prefix
            and num_prefix
            and not getattr(tm, "no_embed_class", False)
        ):
            assert prefix_t is not None
            prefix_t = prefix_t + pos[:, :num_prefix]  # constant per prefix token: fold it in
            pos = pos[:, num_prefix:]
        if pos.shape[1] != n_patch:
            raise _unsupported(name, f"pos_embed of {pos.shape[1]} tokens for {n_patch} patches")
        sd["pos_embed"] = pos
    if has_cls:
        assert prefix_t is not None
        sd["cls_token"] = prefix_t[:, :1]
    if num_registers:
        assert prefix_t is not None
        sd["reg_tokens"] = prefix_t[:, int(has_cls) :]
    if mixed_freqs is not None:
        sd["rotary.freqs"] = mixed_freqs
    for i, b in enumerate(blocks):
        p = f"blocks.{i}."
        qkv_w, qkv_b = _qkv(b.attn, dim)
        if row_first(tm):
            order = channel_order(cfg.head_dim, cfg.rope_layout)
            qkv_w, qkv_b = _permute_qk(qkv_w, qkv_b, heads, order)
        sd[p + "attn.qkv.weight"] = qkv_w
        if rel_tables is not None:
            sd[p + "attn.rel_pos.table"] = rel_tables[i]
        if qkv_b is not None:
            sd[p + "attn.qkv.bias"] = qkv_b
        for ours, theirs, branch in (("attn.proj", b.attn.proj, 1), ("mlp.fc2", b.mlp.fc2, 2)):
            sd |= linear_state(p + ours, theirs, _gamma(b, branch))
        sd.update({p + "mlp." + k: v for k, v in _mlp_state(b.mlp).items() if v is not None})
        for ours, norm in _block_norms(b).items():  # ln1, ln2 (timm's norm1, norm2), sub-norms
            state = norm_state(p + ours, norm)
            if row_first(tm) and ours in ("attn.q_norm", "attn.k_norm"):  # channels reordered
                order = channel_order(cfg.head_dim, cfg.rope_layout)
                state = {k: v[order] for k, v in state.items()}
            sd |= state
    for ours, m in norms.items():
        if present[ours]:
            sd |= norm_state(ours, m)
    if pool == "map":
        sd |= map_state(tm)
    if distilled:
        sd["head_dist.weight"], sd["head_dist.bias"] = tm.head_dist.weight, tm.head_dist.bias
    if isinstance(tm.head, nn.Linear):
        sd["head.weight"], sd["head.bias"] = tm.head.weight, tm.head.bias
    else:  # a backbone without classifier (DINOv3): poslens' empty head, logits [B, 0]
        sd["head.weight"], sd["head.bias"] = torch.zeros(0, dim), torch.zeros(0)
    return cfg, {k: v.detach().clone().float() for k, v in sd.items()}


@torch.no_grad()
def check_rotary(model: ViT, tm: nn.Module, name: str) -> None:
    """Compare poslens' cos/sin tables with timm's rotary embedding on the native grid (UserError if not equal)."""
    if getattr(tm, "rope", None) is None:
        return
    g = model.cfg.grid
    ours = model.rotary_tables(g, g)  # [depth|1, 2, H, num_prefix + N, P]
    ours = ours[:, :, :, model.cfg.num_prefix :]
    theirs = tm.rope.get_embed(shape=[g, g])
    sin, cos = theirs.float().chunk(2, -1)  # [..., N, dh]
    P = model.cfg.head_dim // 2
    if model.cfg.rope_layout == "half":  # plane p at channels p and p + dh/2
        sin, cos = sin[..., :P], cos[..., :P]
    else:  # interleaved: plane p at channels 2p, 2p + 1
        sin, cos = sin[..., ::2], cos[..., ::2]  # [N, P] or [depth, H, N, P]
    if row_first(tm):
        order = plane_order(model.cfg.head_dim)
        sin, cos = sin[..., order], cos[..., order]
    if sin.ndim == 2:
        sin, cos = sin[None, None], cos[None, None]
    ok = torch.allclose(ours[:, 0], cos, atol=1e-5) and torch.allclose(ours[:, 1], sin, atol=1e-5)
    if not ok:
        raise _unsupported(name, "its rotary tables differ from poslens' (unknown convention)")


def load_timm(name: str, weights: str | Path, device: str = "cpu", **timm_kwargs: Any) -> ViT:
    """poslens ViT (eval mode) from timm model `name` and a local safetensors file, or weights='hub'.

    `timm_kwargs` go to timm.create_model (for example depth=2 for a truncated model), after
    the shape arguments that `poslens export --timm` wrote beside the weights (timm_export).
    """
    hub = str(weights) == "hub"
    state = None
    known_timm(name)
    if not hub:
        state = read_timm_weights(weights)
        # the classifier the file carries (a tagged checkpoint's: .dino, .mae, .clip, ...)
        # unless the caller or the export's arguments say otherwise
        timm_kwargs = {"num_classes": head_classes(state)} | read_kwargs(weights) | timm_kwargs
    tm = create_timm(name, pretrained=hub, **timm_kwargs)
    if state is not None:
        load_timm_weights(tm, name, weights, state, **timm_kwargs)
    cfg, sd = convert(tm, name)
    model = ViT(cfg)
    model.load_state_dict(sd)
    model.eval()
    check_rotary(model, tm, name)
    return model.to(torch.device(device))


__all__ = [
    "check_rotary",
    "convert",
    "create_timm",
    "import_timm",
    "load_timm",
]
