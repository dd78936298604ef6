"""Convert a local Hugging Face DINOv3 ViT folder (model_type dinov3_vit) into the poslens ViT,
exactly.

Layouts accepted: DINOv3ViTModel (the released facebook/dinov3-vit* folders) and
DINOv3ViTBackbone (the same tensors; its per-stage feature maps are the blocks' outputs,
blocks.b.hook_resid_post, through ln_final: poslens keeps the blocks, not the stage selection).
Both are backbones: poslens num_classes 0 (logits [B, 0]), pool "cls" (transformers'
pooler_output is the normalised CLS token), the final `norm` is poslens' ln_final.

Conventions mapped (all exact):
- RoPE: transformers' DINOv3ViTRopePositionEmbedding turns plane j of every head by
  2 pi * c * rope_theta^(-j / (dh/4)) with patch-centre coordinates c = (2 i + 1) / n - 1 in
  [-1, 1] per axis, the row planes first, in the "half" layout (channels p and p + dh/2, rotate_half).
  That is poslens' rope_axial with rope_layout "half", rope_coords "centered", rope_theta; the
  row-first planes are moved to poslens' column-first order by permuting the channels of every q
  and k head the same way (q.k unchanged; hook_q / hook_k list channels in that order), as for
  timm's DINOv3 (models/timm_eva.py). CLS and registers are never rotated, as in transformers.
  The training-time coordinate augmentations (pos_embed_shift, _jitter, _rescale) are off in eval.
- register tokens ([1, R, D]) become poslens' registers: prefix CLS, registers, then the patches.
- q / k / v biases (query_bias, key_bias, value_bias; by default k has none) become one qkv
  bias with zeros where a projection has none; proj_bias and mlp_bias likewise one proj_bias
  (zeros where one of them is off).
- layer scale (layer_scale1.lambda1, layer_scale2.lambda1) is folded into the attention output
  projection and the MLP's down projection: lambda * (W z + b) = (lambda W) z + lambda b.
- use_gated_mlp (ViT-7B) with hidden_act silu is poslens' SwiGLU: down(silu(gate x) * up x),
  fc1_g = gate_proj, fc1_x = up_proj, fc2 = down_proj; the plain MLP takes hidden_act gelu,
  gelu_pytorch_tanh or quick_gelu. A gated MLP with another activation is refused.
- `mask_token` (masked pretraining only) is never read by the forward without a mask: dropped.
Key names: what save_pretrained writes (`embeddings.*`, `layer.i.*`, `norm.*`) and the
transformers 5 module names (`model.layer.i.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError, ConfigError
from poslens.models.config import ModelConfig
from poslens.models.hf_common import (
    Reader,
    check_mlp_ratio,
    field,
    grid_fields,
    one_architecture,
    unsupported,
)
from poslens.models.timm_eva import channel_order

MODEL_TYPES = ("dinov3_vit",)
ARCHITECTURES = ("DINOv3ViTModel", "DINOv3ViTBackbone")
# DINOv3ViTConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "rope_theta": 100.0,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "query_bias": True,
    "key_bias": False,
    "value_bias": True,
    "proj_bias": True,
    "mlp_bias": True,
    "use_gated_mlp": False,
    "num_register_tokens": 0,
}
# transformers' activation names -> poslens' ModelConfig.mlp_act (the same functions)
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}


def _check_kind(hf: dict[str, Any], folder: Path) -> None:
    """Refuse other model types and architectures (one line)."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise unsupported(folder, f"model_type {hf.get('model_type')!r} (this converter takes "
                          "dinov3_vit)")  # fmt: skip
    arch = one_architecture(hf, folder)
    if arch is not None and arch not in ARCHITECTURES:
        raise unsupported(
            folder, f"architecture {arch} (poslens converts {', '.join(ARCHITECTURES)})"
        )


def _flags(hf: dict[str, Any], folder: Path) -> dict[str, bool]:
    """The bias and MLP switches of config.json (DINOv3ViTConfig's defaults where left out)."""
    names = ("query_bias", "key_bias", "value_bias", "proj_bias", "mlp_bias", "use_gated_mlp")
    return {n: field(hf, n, bool, folder, DEFAULTS) for n in names}


def model_config(hf: dict[str, Any], folder: Path) -> ModelConfig:
    """The poslens ModelConfig of an HF DINOv3 ViT config (CheckpointError when poslens cannot
    reproduce it)."""
    _check_kind(hf, folder)
    flags = _flags(hf, folder)
    act = hf.get("hidden_act", DEFAULTS["hidden_act"])
    if flags["use_gated_mlp"] and act != "silu":
        raise unsupported(folder, f"gated MLP with hidden_act {act!r} (poslens' SwiGLU gates "
                          "with SiLU, 'silu')")  # fmt: skip
    if not flags["use_gated_mlp"] and act not in ACTS:
        raise unsupported(folder, f"hidden_act {act!r} (poslens has {', '.join(ACTS)})")
    dim = field(hf, "hidden_size", int, folder, DEFAULTS)
    hidden = field(hf, "intermediate_size", int, folder, DEFAULTS)
    eps = field(hf, "layer_norm_eps", (int, float), folder, DEFAULTS)
    theta = field(hf, "rope_theta", (int, float), folder, DEFAULTS)
    try:
        cfg = ModelConfig(
            **grid_fields(hf, folder, DEFAULTS),
            num_classes=0,
            dim=dim,
            heads=field(hf, "num_attention_heads", int, folder, DEFAULTS),
            mlp_ratio=hidden / dim,
            posenc="rope_axial",
            rope_theta=float(theta),
            rope_layout="half",
            rope_coords="centered",
            cls_token=True,
            num_registers=field(hf, "num_register_tokens", int, folder, DEFAULTS),
            pool="cls",
            qkv_bias=flags["query_bias"] or flags["key_bias"] or flags["value_bias"],
            norm_eps=float(eps),
            mlp="swiglu" if flags["use_gated_mlp"] else "mlp",
            mlp_act="gelu" if flags["use_gated_mlp"] else ACTS[act],
            proj_bias=flags["proj_bias"] or flags["mlp_bias"],
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise unsupported(folder, str(e)) from None
    check_mlp_ratio(cfg, hidden, folder)
    return cfg


def _blocks_prefix(keys: set[str], path: Path) -> str:
    """Where the blocks are: "layer." (as saved) or "model.layer." (transformers 5 modules)."""
    for prefix in ("layer.", "model.layer."):
        if f"{prefix}0.norm1.weight" in keys:
            return prefix
    raise CheckpointError(f"{path} is missing tensor layer.0.norm1.weight (no DINOv3 blocks)")


def _linear(
    r: Reader, name: str, out: int, inp: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [out, inp], bias [out]) of a linear, the bias zeros where it has none."""
    w = r.take(f"{name}.weight", (out, inp))
    return w, r.take(f"{name}.bias", (out,)) if bias else torch.zeros(out)


def _permute_qk(t: torch.Tensor, heads: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the channels of every q and k head of a fused qkv weight [3D, D] or bias [3D]
    (v untouched): q.k is unchanged."""
    dh = order.numel()
    idx = torch.arange(t.shape[0]).view(3, heads, dh)
    idx[:2] = idx[:2, :, order]
    return t[idx.flatten()]


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF DINOv3 ViT of config.json `hf` and
    the tensors `state` (read from `path`) in `folder` (eval mode)."""
    cfg = model_config(hf, folder)
    flags = _flags(hf, folder)
    blocks = _blocks_prefix(set(state), path)
    D, C, P, H = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.heads
    hidden = int(D * cfg.mlp_ratio)
    R = cfg.num_registers
    r = Reader(state, path)
    sd: dict[str, torch.Tensor] = {}
    # patch embedding: conv [D, C, P, P] with bias [D], as poslens' patch_embed
    sd["patch_embed.weight"], sd["patch_embed.bias"] = (
        r.take("embeddings.patch_embeddings.weight", (D, C, P, P)),
        r.take("embeddings.patch_embeddings.bias", (D,)),
    )
    sd["cls_token"] = r.take("embeddings.cls_token", (1, 1, D))  # [1, 1, D]
    name = "embeddings.register_tokens"
    if R or name in r.state:  # [1, R, D]; without registers transformers saves [1, 0, D]
        regs = r.take(name, (1, R, D))
        if R:
            sd["reg_tokens"] = regs
    order = channel_order(cfg.head_dim, "half")  # row-first planes -> poslens' column-first
    for i in range(cfg.depth):
        b, o = f"{blocks}{i}.", f"blocks.{i}."
        a = f"{b}attention."
        qkv = [
            _linear(r, a + f"{c}_proj", D, D, flags[f"{n}_bias"])
            for c, n in (("q", "query"), ("k", "key"), ("v", "value"))
        ]  # each (w [D, D], b [D])
        sd[o + "attn.qkv.weight"] = _permute_qk(torch.cat([t[0] for t in qkv]), H, order)
        if cfg.qkv_bias:
            sd[o + "attn.qkv.bias"] = _permute_qk(torch.cat([t[1] for t in qkv]), H, order)
        mlp = f"{b}mlp."
        for ours, theirs, scale, out, inp, bias in (
            ("attn.proj", a + "o_proj", "layer_scale1", D, D, flags["proj_bias"]),
            ("mlp.fc2", mlp + "down_proj", "layer_scale2", D, hidden, flags["mlp_bias"]),
        ):
            w, bb = _linear(r, theirs, out, inp, bias)
            gamma = r.take(f"{b}{scale}.lambda1", (D,))  # [D] per output channel
            sd[o + ours + ".weight"] = gamma[:, None] * w
            if cfg.proj_bias:  # zeros where this one has none but the other has
                sd[o + ours + ".bias"] = gamma * bb
        fc1 = (
            {"fc1_g": "gate_proj", "fc1_x": "up_proj"}
            if cfg.mlp == "swiglu"
            else {"fc1": "up_proj"}
        )
        for ours, theirs in fc1.items():
            w, bb = _linear(r, mlp + theirs, hidden, D, flags["mlp_bias"])
            sd[o + f"mlp.{ours}.weight"] = w
            if cfg.proj_bias:
                sd[o + f"mlp.{ours}.bias"] = bb
        for ours, theirs in (("ln1", "norm1"), ("ln2", "norm2")):
            sd[o + ours + ".weight"] = r.take(f"{b}{theirs}.weight", (D,))
            sd[o + ours + ".bias"] = r.take(f"{b}{theirs}.bias", (D,))
    sd["ln_final.weight"], sd["ln_final.bias"] = (
        r.take("norm.weight", (D,)),
        r.take("norm.bias", (D,)),
    )
    sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)  # logits [B, 0]
    r.finish(("embeddings.mask_token",))
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """DINOv3ViTImageProcessor's defaults at the model's input side: squash to the side,
    bilinear, ImageNet mean and std. (transformers' processor rescales to [0, 1] before resizing
    the float image with torchvision's antialiased resize; poslens' Preprocess resizes the uint8
    image with PIL, a difference of rounding.)"""
    return {
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "do_center_crop": False,
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
    }


__all__ = ["DEFAULTS", "MODEL_TYPES", "convert", "model_config", "processor_defaults"]
