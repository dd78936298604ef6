"""The DINOv2 family of hf:DIR (models/hf_families.py): a local Hugging Face transformers
dinov2 or dinov2_with_registers folder as the poslens ViT, exactly.

Layouts accepted: Dinov2Model / Dinov2WithRegistersModel and Dinov2Backbone /
Dinov2WithRegistersBackbone (the same tensors, no prefix or `dinov2.`): a backbone, poslens
num_classes 0 (logits [B, 0]); its output is the final normalised tokens (HF's
last_hidden_state; HF's pooler_output is the CLS token of it). The masked-image-modeling
`mask_token` is dropped (the forward without a mask never reads it). Refused in one line:
Dinov2ForImageClassification / Dinov2WithRegistersForImageClassification, whose classifier reads
the CLS token concatenated with the mean of the patch tokens ([B, 2D]), which poslens' one pool
cannot reproduce (save its .dinov2 to study the backbone).

Key names (transformers 5 writes the first to disk; the second are its modules' names):
  {p}encoder.layer.i.norm1, attention.attention.{query,key,value}, attention.output.dense,
  layer_scale1.lambda1, norm2, mlp.fc1, mlp.fc2 (SwiGLU: mlp.weights_in, mlp.weights_out),
  layer_scale2.lambda1
  {p}encoder.layer.i.attention.{q,k,v,o}_proj, mlp.{gate,up,down}_proj (SwiGLU)
with {p}embeddings.{cls_token, mask_token, register_tokens, position_embeddings,
patch_embeddings.projection} and {p}layernorm.

Conventions mapped (exact up to float rounding):
- position_embeddings [1, 1 + N, D] cover CLS and the patches: CLS's share is folded into it.
  The registers get no position (HF inserts them between CLS and the patches after adding the
  table), which is poslens' order too: CLS, registers, patches.
- LayerScale (lambda1 of each branch) is folded into the attention output projection and fc2:
  lambda * (W z + b) = (lambda W) z + lambda b (as timm_convert does).
- use_swiglu_ffn: HF's gate_proj / up_proj (weights_in [2h, D]: gate rows first, as transformers'
  Chunk(dim=0) splits it) are poslens' SwiGLU fc1_g / fc1_x, down_proj its fc2; hidden
  h = (int(D * mlp_ratio * 2 / 3) + 7) // 8 * 8, given to poslens as mlp_ratio h / D.
- The input side: config.json's image_size, unless the folder's preprocessor_config.json makes
  images of another square side (facebook/dinov2-*: image_size 518, a 224 centre crop). The model
  is then converted for that side: the table is resized to its grid as HF's forward resizes it
  for such an input (bicubic, align_corners false, in float32; antialiased for
  dinov2_with_registers, not for dinov2), so poslens at that side is HF at that side. poslens'
  own resampling for yet other sides (antialiased bicubic) is not HF's for dinov2.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poslens.errors import CheckpointError, ConfigError
from poslens.io import MAX_CONFIG_BYTES, read_json
from poslens.models.config import ModelConfig
from poslens.models.hf_common import (
    PREPROCESSOR,
    Reader,
    field,
    grid_fields,
    one_architecture,
    shorter_side_crop,
    unsupported,
)

MODEL_TYPES = ("dinov2", "dinov2_with_registers")
BACKBONES = ("Dinov2Model", "Dinov2Backbone", "Dinov2WithRegistersModel",
             "Dinov2WithRegistersBackbone")  # fmt: skip
CLASSIFIERS = ("Dinov2ForImageClassification", "Dinov2WithRegistersForImageClassification")
# Dinov2Config / Dinov2WithRegistersConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "mlp_ratio": 4,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
    "image_size": 224,
    "num_channels": 3,
    "qkv_bias": True,
    "use_swiglu_ffn": False,
    "num_register_tokens": 4,
}
PATCH = {"dinov2": 14, "dinov2_with_registers": 16}  # patch_size defaults


def _check_architecture(hf: dict[str, Any], folder: Path) -> None:
    arch = one_architecture(hf, folder)
    if arch in CLASSIFIERS:
        raise unsupported(
            folder,
            f"{arch} classifies the CLS token concatenated with the mean patch token, which "
            "poslens' one pool cannot reproduce (save its model.dinov2 to study the backbone)",
        )
    if arch is not None and arch not in BACKBONES:
        raise unsupported(folder, f"architecture {arch} (poslens converts {', '.join(BACKBONES)})")


def model_config(hf: dict[str, Any], folder: Path) -> tuple[ModelConfig, int]:
    """The poslens ModelConfig of an HF DINOv2 config, and the MLP's hidden width."""
    model_type = hf["model_type"]
    act = hf.get("hidden_act", DEFAULTS["hidden_act"])
    swiglu = field(hf, "use_swiglu_ffn", bool, folder, DEFAULTS)
    if act != "gelu" and not swiglu:  # SwiGLU ignores hidden_act (SiLU gate)
        raise unsupported(folder, f"hidden_act {act!r} (poslens' MLP uses exact GELU, 'gelu')")
    dim = field(hf, "hidden_size", int, folder, DEFAULTS)
    ratio = field(hf, "mlp_ratio", (int, float), folder, DEFAULTS)
    hidden = int(dim * ratio)
    if swiglu:
        hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
    regs = 0
    if model_type == "dinov2_with_registers":
        regs = field(hf, "num_register_tokens", int, folder, DEFAULTS)
    defaults = {**DEFAULTS, "patch_size": PATCH[model_type]}
    try:
        cfg = ModelConfig(
            **grid_fields(hf, folder, defaults),
            num_classes=0,
            dim=dim,
            heads=field(hf, "num_attention_heads", int, folder, defaults),
            mlp_ratio=hidden / dim,
            posenc="ape",
            cls_token=True,
            num_registers=regs,
            pool="cls",
            qkv_bias=field(hf, "qkv_bias", bool, folder, defaults),
            norm_eps=float(field(hf, "layer_norm_eps", (int, float), folder, defaults)),
            mlp="swiglu" if swiglu else "mlp",
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise unsupported(folder, str(e)) from None
    if int(cfg.dim * cfg.mlp_ratio) != hidden:
        raise unsupported(folder, f"MLP width {hidden} is not dim x a ratio poslens reproduces")
    return cfg, hidden


def eval_side(folder: Path, image_size: int) -> int:
    """The square side of the folder's preprocessed images (its preprocessor_config.json's
    centre crop, or its square resize without one), else image_size."""
    where = folder / PREPROCESSOR
    if not where.is_file():
        return image_size
    doc = read_json(where, "Hugging Face preprocessor config", MAX_CONFIG_BYTES)
    if not isinstance(doc, dict):
        return image_size
    side = doc.get("crop_size") if doc.get("do_center_crop", True) else doc.get("size")
    if isinstance(side, dict) and set(side) == {"height", "width"}:
        side = side["height"] if side["height"] == side["width"] else None
    return side if isinstance(side, int) and not isinstance(side, bool) else image_size


def resize_table(pos: torch.Tensor, old: int, new: int, antialias: bool) -> torch.Tensor:
    """The patches' table [1, old^2, D] at grid new x new, as HF's interpolate_pos_encoding."""
    D = pos.shape[-1]
    grid = pos.reshape(1, old, old, D).permute(0, 3, 1, 2)  # [1, D, old, old]
    grid = F.interpolate(grid.float(), size=(new, new), mode="bicubic", align_corners=False,
                         antialias=antialias)  # fmt: skip
    return grid.permute(0, 2, 3, 1).reshape(1, new * new, D)


def _prefix(keys: set[str], path: Path) -> str:
    for prefix in ("", "dinov2."):
        if f"{prefix}encoder.layer.0.norm1.weight" in keys:
            return prefix
    raise CheckpointError(f"{path} is missing tensor encoder.layer.0.norm1.weight")


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF DINOv2 backbone of config.json `hf`
    and the tensors `state` (read from `path`) in `folder` (eval mode)."""
    _check_architecture(hf, folder)
    cfg, hidden = model_config(hf, folder)
    side, grid = eval_side(folder, cfg.image_size), cfg.grid
    if side != cfg.image_size:
        try:
            cfg = replace(cfg, image_size=side)
        except ConfigError as e:
            raise unsupported(folder, f"{PREPROCESSOR} makes {side}px images: {e}") from None
    pre = _prefix(set(state), path)
    D, C, P, R = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.num_registers
    r = Reader(state, path)
    e = f"{pre}embeddings."
    sd: dict[str, torch.Tensor] = {}
    # patch embedding: conv [D, C, P, P] with bias [D], as poslens' patch_embed
    sd["patch_embed.weight"] = r.take(f"{e}patch_embeddings.projection.weight", (D, C, P, P))
    sd["patch_embed.bias"] = r.take(f"{e}patch_embeddings.projection.bias", (D,))
    pos = r.take(f"{e}position_embeddings", (1, 1 + grid**2, D))  # [1, 1 + g^2, D]: CLS, patches
    sd["cls_token"] = r.take(f"{e}cls_token", (1, 1, D)) + pos[:, :1]
    if R:
        sd["reg_tokens"] = r.take(f"{e}register_tokens", (1, R, D))  # no position
    sd["pos_embed"] = pos[:, 1:].contiguous()  # [1, N, D]
    if grid != cfg.grid:  # the eval side's grid, as HF resizes the table for it
        sd["pos_embed"] = resize_table(
            sd["pos_embed"], grid, cfg.grid, hf["model_type"] == "dinov2_with_registers"
        )
    new = f"{pre}encoder.layer.0.attention.q_proj.weight" in state
    for i in range(cfg.depth):
        b, p = f"{pre}encoder.layer.{i}.", f"blocks.{i}."
        if new:
            names = [f"{b}attention.{c}_proj" for c in "qkv"]
            out = f"{b}attention.o_proj"
        else:
            names = [f"{b}attention.attention.{n}" for n in ("query", "key", "value")]
            out = f"{b}attention.output.dense"
        qkv = [r.linear(n, D, D, cfg.qkv_bias) for n in names]  # each [w [D, D], (b [D])]
        sd[p + "attn.qkv.weight"] = torch.cat([t[0] for t in qkv])  # [3D, D]: rows q, k, v
        if cfg.qkv_bias:
            sd[p + "attn.qkv.bias"] = torch.cat([t[1] for t in qkv])  # [3D]
        ls1 = r.take(f"{b}layer_scale1.lambda1", (D,))  # [D], folded into the projection
        ls2 = r.take(f"{b}layer_scale2.lambda1", (D,))
        w, bias = r.linear(out, D, D)
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = ls1[:, None] * w, ls1 * bias
        m = f"{b}mlp."
        if cfg.mlp == "swiglu":
            if f"{m}weights_in.weight" in state:  # [2h, D]: gate rows, then up rows
                gw, uw = r.take(f"{m}weights_in.weight", (2 * hidden, D)).chunk(2)
                gb, ub = r.take(f"{m}weights_in.bias", (2 * hidden,)).chunk(2)
                dw, db = r.linear(f"{m}weights_out", D, hidden)
            else:
                gw, gb = r.linear(f"{m}gate_proj", hidden, D)
                uw, ub = r.linear(f"{m}up_proj", hidden, D)
                dw, db = r.linear(f"{m}down_proj", D, hidden)
            sd[p + "mlp.fc1_g.weight"], sd[p + "mlp.fc1_g.bias"] = gw, gb
            sd[p + "mlp.fc1_x.weight"], sd[p + "mlp.fc1_x.bias"] = uw, ub
        else:
            sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = r.linear(f"{m}fc1", hidden, D)
            dw, db = r.linear(f"{m}fc2", D, hidden)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = ls2[:, None] * dw, ls2 * db
        for ours, theirs in (("ln1", "norm1"), ("ln2", "norm2")):
            sd[p + ours + ".weight"] = r.take(f"{b}{theirs}.weight", (D,))
            sd[p + ours + ".bias"] = r.take(f"{b}{theirs}.bias", (D,))
    sd["ln_final.weight"] = r.take(f"{pre}layernorm.weight", (D,))
    sd["ln_final.bias"] = r.take(f"{pre}layernorm.bias", (D,))
    sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)  # logits [B, 0]
    r.finish((f"{e}mask_token",))
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """BitImageProcessor's defaults (transformers' AutoImageProcessor for dinov2), at the model's
    side: the shorter side to image_size (224 in the class), bicubic, centre crop, OpenAI CLIP's
    mean and std (facebook/dinov2-* folders override these: shorter side 256, ImageNet's)."""
    return shorter_side_crop(image_size)


__all__ = ["MODEL_TYPES", "convert", "model_config", "processor_defaults"]
