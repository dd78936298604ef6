"""The SigLIP and SigLIP 2 families of hf:DIR (models/hf_families.py): the image tower of a
local Hugging Face transformers SigLIP / SigLIP 2 folder as the poslens ViT, exactly.

Layouts accepted (model types siglip_vision_model / siglip2_vision_model for a tower alone,
siglip / siglip2 for a two-tower folder):
- SiglipVisionModel / Siglip2VisionModel (no prefix, or `vision_model.`): a backbone, poslens
  num_classes 0; the final tokens are HF's last_hidden_state (post_layernorm on every token:
  poslens' ln_final) and the pooled vector, the head's input, is HF's pooler_output: the MAP head
  (poslens pool "map": `head.probe` is the latent, nn.MultiheadAttention's in_proj rows [0, D) its
  q and rows [D, 3D) its fused kv, out_proj its proj, `head.layernorm` and `head.mlp` its norm and
  MLP, of the blocks' heads, width and activation). Without a head (vision_use_head false) HF has
  no pooled output; poslens then pools by the mean of the tokens (its own convention, not HF's).
- SiglipModel / Siglip2Model: vision_model.* as above (SigLIP has no image projection: the
  image features are the pooled vector); dropped: the text tower (text_model.*), logit_scale
  and logit_bias.
- SiglipForImageClassification / Siglip2ForImageClassification: the classifier reads the mean of
  the final (post_layernorm) tokens (poslens pool "mean"); the vision tower's unused MAP head
  (vision_model.head.*) is dropped.

SigLIP: patch_embedding is a conv with bias, position_embedding [N, D] covers the patches (there
is no CLS token). SigLIP 2: patch_embedding is a Linear over flattened patches [D, P * P * C]
(the processor flattens each patch row by row, channels last), which is poslens' conv weight
[D, C, P, P] after a reshape; its position table [num_patches, D] is a square grid that HF
resizes (bilinear, antialiased) to each image's patch grid. poslens converts SigLIP 2 for a fixed
square input at config.json's grid, side sqrt(num_patches) (image_size = side * patch_size),
where that resize is the identity: HF's forward with pixel_values patchified from a square image
of that size, spatial_shapes (side, side) and a full pixel_attention_mask. HF's processor keeps a
non-square image's aspect ratio (a grid of up to max_num_patches patches); poslens' preprocessing
squashes every image to the square (the same pixels for square images).

Blocks as CLIP's (hf_clip.py). hidden_act "gelu_pytorch_tanh" (SigLIP's) is tanh GELU.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError
from poslens.models.config import ModelConfig
from poslens.models.hf_clip import (
    drop_prefixes,
    norm,
    prefix_of,
    read_blocks,
    tower_config,
    vision_config,
)
from poslens.models.hf_common import Reader, field, one_architecture, unsupported

SIGLIP_TYPES = ("siglip_vision_model", "siglip")
SIGLIP2_TYPES = ("siglip2_vision_model", "siglip2")
# SiglipVisionConfig / Siglip2VisionConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
    "num_patches": 256,
}


def _head(hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path) -> bool:
    """Whether the folder is a ...ForImageClassification (a classifier on the mean token)."""
    model_type = str(hf.get("model_type"))
    v2 = "2" if model_type.startswith("siglip2") else ""
    towers = {f"Siglip{v2}VisionModel": False, f"Siglip{v2}Model": False,
              f"Siglip{v2}ForImageClassification": True}  # fmt: skip
    two_tower = not model_type.endswith("_vision_model")
    arch = one_architecture(hf, folder)
    if arch is None:
        return "classifier.weight" in state
    if arch not in towers or (arch == f"Siglip{v2}VisionModel") == two_tower:
        names = [a for a in towers if (a == f"Siglip{v2}VisionModel") != two_tower]
        raise unsupported(folder, f"architecture {arch} (poslens converts {', '.join(names)})")
    return towers[arch]


def _config(
    hf: dict[str, Any], v: dict[str, Any], classifier: bool, folder: Path
) -> tuple[ModelConfig, int, bool]:
    """(ModelConfig, MLP width, whether the MAP head is used) of a SigLIP (2) vision config."""
    use_head = field(v, "vision_use_head", bool, folder, DEFAULTS) and not classifier
    arch: dict[str, Any] = {"num_classes": 0, "cls_token": False}
    arch["pool"] = "map" if use_head else "mean"
    if str(hf.get("model_type")).startswith("siglip2"):
        n = field(v, "num_patches", int, folder, DEFAULTS)
        side = math.isqrt(n)
        if side * side != n:
            raise unsupported(folder, f"num_patches {n} is not a square grid")
        patch = v.get("patch_size", DEFAULTS["patch_size"])
        if isinstance(patch, bool) or not isinstance(patch, int):
            raise unsupported(folder, f"patch_size {patch!r} (poslens takes square patches)")
        arch["image_size"] = side * patch
    cfg, hidden = tower_config(v, folder, DEFAULTS, **arch)
    return cfg, hidden, use_head


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the SigLIP (2) image tower of config.json
    `hf` and the tensors `state` (read from `path`) in `folder` (eval mode)."""
    classifier = _head(hf, state, folder)
    v2 = str(hf.get("model_type")).startswith("siglip2")
    v = vision_config(hf, ("siglip", "siglip2"), folder)
    cfg, hidden, use_head = _config(hf, v, classifier, folder)
    state = drop_prefixes(state, ("text_model.", "logit_scale", "logit_bias"))
    pre = prefix_of(set(state), path, ("vision_model.", ""))
    if classifier:  # the tower's MAP head is not used by the classifier
        state = drop_prefixes(state, (f"{pre}head.",))
        if "classifier.weight" not in state:
            raise CheckpointError(f"{path} is missing tensor classifier.weight")
        cfg = replace(cfg, num_classes=int(state["classifier.weight"].shape[0]))
    D, C, P, N, K = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.grid**2, cfg.num_classes
    r, e = Reader(state, path), f"{pre}embeddings."
    sd: dict[str, torch.Tensor] = {}
    if v2:  # Linear [D, P*P*C] over (row, column, channel) -> conv [D, C, P, P]
        w = r.take(f"{e}patch_embedding.weight", (D, P * P * C))
        sd["patch_embed.weight"] = w.view(D, P, P, C).permute(0, 3, 1, 2).contiguous()
    else:
        sd["patch_embed.weight"] = r.take(f"{e}patch_embedding.weight", (D, C, P, P))
    sd["patch_embed.bias"] = r.take(f"{e}patch_embedding.bias", (D,))
    sd["pos_embed"] = r.take(f"{e}position_embedding.weight", (N, D))[None]  # [1, N, D]
    sd |= read_blocks(r, cfg, hidden, f"{pre}encoder.")
    sd["ln_final.weight"], sd["ln_final.bias"] = norm(r, f"{pre}post_layernorm", D)
    if use_head:
        h = f"{pre}head."
        sd["attn_pool.latent"] = r.take(f"{h}probe", (1, 1, D))
        w_in = r.take(f"{h}attention.in_proj_weight", (3 * D, D))  # rows q, k, v
        b_in = r.take(f"{h}attention.in_proj_bias", (3 * D,))
        sd["attn_pool.q.weight"], sd["attn_pool.q.bias"] = w_in[:D], b_in[:D]
        sd["attn_pool.kv.weight"], sd["attn_pool.kv.bias"] = w_in[D:], b_in[D:]  # [2D, D]: k, v
        sd["attn_pool.proj.weight"], sd["attn_pool.proj.bias"] = r.linear(
            f"{h}attention.out_proj", D, D
        )
        sd["attn_pool.norm.weight"], sd["attn_pool.norm.bias"] = norm(r, f"{h}layernorm", D)
        sd["attn_pool.mlp.fc1.weight"], sd["attn_pool.mlp.fc1.bias"] = r.linear(
            f"{h}mlp.fc1", hidden, D
        )
        sd["attn_pool.mlp.fc2.weight"], sd["attn_pool.mlp.fc2.bias"] = r.linear(
            f"{h}mlp.fc2", D, hidden
        )
    if K:
        sd["head.weight"], sd["head.bias"] = r.linear("classifier", K, D)
    else:
        sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)
    r.finish(())
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """SiglipImageProcessor's defaults (squash to the side, bicubic, mean = std = 0.5), or
    Siglip2ImageProcessor's for siglip2 (bilinear, mean = std = 0.5; its resize to at most
    max_num_patches patches, keeping the aspect ratio, is a squash to the side for square
    images: see the module docstring)."""
    v2 = str(hf.get("model_type")).startswith("siglip2")
    out = {
        "size": {"height": image_size, "width": image_size},
        "resample": 2 if v2 else 3,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    patch = vision_config(hf, ("siglip2",), Path(".")).get("patch_size", DEFAULTS["patch_size"])
    if v2 and isinstance(patch, int) and patch > 0:  # the processor at the model's grid
        out |= {"max_num_patches": (image_size // patch) ** 2, "patch_size": patch}
    return out


def check_siglip2_processor(hf: dict[str, Any], p: dict[str, Any], image_size: int) -> str | None:
    """Why Siglip2ImageProcessor's fields `p` would not make square images the model's grid
    (max_num_patches and patch_size, default 256 and 16, must be its grid and patch), or None."""
    v = vision_config(hf, ("siglip2",), Path("."))
    patch = v.get("patch_size", DEFAULTS["patch_size"])
    grid = image_size // patch if isinstance(patch, int) and patch else 0
    got = (p.get("max_num_patches", 256), p.get("patch_size", 16))
    if got != (grid * grid, patch):
        return (f"max_num_patches {got[0]} of {got[1]} px patches is not the model's grid "
                f"({grid} x {grid} patches of {patch} px), which poslens converts for")  # fmt: skip
    return None


__all__ = [
    "SIGLIP2_TYPES",
    "SIGLIP_TYPES",
    "check_siglip2_processor",
    "convert",
    "processor_defaults",
]
