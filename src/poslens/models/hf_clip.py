"""The CLIP family of hf:DIR (models/hf_families.py): the image tower of a local Hugging Face
transformers CLIP folder as the poslens ViT, exactly; and the encoder pieces CLIP, SigLIP and
SigLIP 2 share (hf_siglip.py).

Layouts accepted:
- model_type clip_vision_model: CLIPVisionModel (no prefix; a backbone, num_classes 0, whose
  pooled vector, the head's input, is HF's pooler_output: post_layernorm of the CLS token) and
  CLIPVisionModelWithProjection (`vision_model.` prefix; poslens' head is visual_projection, a
  bias-free [projection_dim, D] linear with a zero bias, and the logits are HF's image_embeds).
- model_type clip, a full CLIPModel: its vision_model.* and visual_projection as
  CLIPVisionModelWithProjection's (the logits are get_image_features: unnormalised image
  embeddings); dropped: the text tower (text_model.*), text_projection and logit_scale, which
  an image model never reads. CLIPForImageClassification (model_type clip): its classifier reads
  the mean of the patch tokens of the last block (no post_layernorm, which is dropped): poslens
  pool "mean", no final norm.

Conventions mapped (all exact):
- class_embedding [D] is the CLS token [1, 1, D], with position_embedding row 0 folded in; rows
  1.. are the patches' table [1, N, D]. patch_embedding is a bias-free conv (poslens' bias 0).
- pre_layrnorm (sic) on all tokens before block 0 is poslens' norm_pre; the blocks' outputs leave
  without a final norm (HF's last_hidden_state; poslens final_norm false); post_layernorm is
  poslens' fc_norm on the pooled CLS token.
- blocks: layer_norm1, self_attn.{q,k,v}_proj (fused into qkv [3D, D], rows q, k, v),
  self_attn.out_proj, layer_norm2, mlp.fc1, mlp.fc2: pre-norm as poslens'.
- hidden_act "quick_gelu" (x sigmoid(1.702 x)), "gelu" (erf) and "gelu_pytorch_tanh" /
  "gelu_new" (tanh GELU) map to ModelConfig.mlp_act; any other is refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError, ConfigError
from poslens.models.config import ModelConfig
from poslens.models.hf_common import (
    CONFIG,
    Reader,
    check_mlp_ratio,
    field,
    one_architecture,
    shorter_side_crop,
    square,
    unsupported,
)

MODEL_TYPES = ("clip_vision_model", "clip")
ARCHITECTURES = {  # architecture -> (its model_type, its head: None, "projection", "classifier")
    "CLIPVisionModel": ("clip_vision_model", None),
    "CLIPVisionModelWithProjection": ("clip_vision_model", "projection"),
    "CLIPModel": ("clip", "projection"),
    "CLIPForImageClassification": ("clip", "classifier"),
}
ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_new": "gelu_tanh"}  # fmt: skip  # HF hidden_act -> ModelConfig.mlp_act
# CLIPVisionConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


def vision_config(hf: dict[str, Any], towers: tuple[str, ...], folder: Path) -> dict[str, Any]:
    """The vision tower's config: config.json itself, or its "vision_config" for a two-tower
    model_type (clip, siglip, siglip2)."""
    if hf.get("model_type") not in towers:
        return hf
    v = hf.get("vision_config") or {}
    if not isinstance(v, dict):
        raise CheckpointError(f"{folder / CONFIG}: vision_config is {v!r}")
    return v


def tower_config(
    v: dict[str, Any], folder: Path, defaults: dict[str, Any], **arch: Any
) -> tuple[ModelConfig, int]:
    """The poslens ModelConfig of a CLIP-style vision config `v` (the MLP's hidden width too);
    `arch` the architecture's ModelConfig fields (pool, norm_pre, ...). image_size may be given
    in `arch` (SigLIP 2)."""
    act = v.get("hidden_act", defaults["hidden_act"])
    if act not in ACTS:
        raise unsupported(folder, f"hidden_act {act!r} (poslens reproduces {', '.join(ACTS)})")
    dim = field(v, "hidden_size", int, folder, defaults)
    hidden = field(v, "intermediate_size", int, folder, defaults)
    eps = field(v, "layer_norm_eps", (int, float), folder, defaults)
    if "image_size" not in arch:
        arch["image_size"] = square(v, "image_size", folder, defaults)
    try:
        cfg = ModelConfig(
            patch_size=square(v, "patch_size", folder, defaults),
            in_chans=field(v, "num_channels", int, folder, defaults),
            dim=dim,
            depth=field(v, "num_hidden_layers", int, folder, defaults),
            heads=field(v, "num_attention_heads", int, folder, defaults),
            mlp_ratio=hidden / dim,
            posenc="ape",
            qkv_bias=True,
            norm_eps=float(eps),
            mlp_act=ACTS[act],
            **arch,
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise unsupported(folder, str(e)) from None
    check_mlp_ratio(cfg, hidden, folder)
    return cfg, hidden


def prefix_of(keys: set[str], path: Path, prefixes: tuple[str, ...]) -> str:
    """The prefix under which the file holds the vision encoder's block 0."""
    for p in prefixes:
        if f"{p}encoder.layers.0.layer_norm1.weight" in keys:
            return p
    want = f"{prefixes[0]}encoder.layers.0.layer_norm1.weight"
    raise CheckpointError(f"{path} is missing tensor {want}")


def read_blocks(r: Reader, cfg: ModelConfig, hidden: int, enc: str) -> dict[str, torch.Tensor]:
    """poslens' blocks from CLIP-style encoder layers under `enc` (e.g. "vision_model.encoder.")."""
    D, sd = cfg.dim, {}
    for i in range(cfg.depth):
        b, p = f"{enc}layers.{i}.", f"blocks.{i}."
        qkv = [r.linear(f"{b}self_attn.{c}_proj", D, D) for c in "qkv"]  # each [w [D, D], b [D]]
        sd[p + "attn.qkv.weight"] = torch.cat([t[0] for t in qkv])  # [3D, D]: rows q, k, v
        sd[p + "attn.qkv.bias"] = torch.cat([t[1] for t in qkv])  # [3D]
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = r.linear(
            f"{b}self_attn.out_proj", D, D
        )
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = r.linear(f"{b}mlp.fc1", hidden, D)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = r.linear(f"{b}mlp.fc2", D, hidden)
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2")):
            sd[p + ours + ".weight"] = r.take(f"{b}{theirs}.weight", (D,))
            sd[p + ours + ".bias"] = r.take(f"{b}{theirs}.bias", (D,))
    return sd


def norm(r: Reader, name: str, D: int) -> list[torch.Tensor]:
    """[weight, bias] of a LayerNorm over D."""
    return [r.take(f"{name}.weight", (D,)), r.take(f"{name}.bias", (D,))]


def drop_prefixes(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The state without the tensors under `prefixes` (another tower)."""
    return {k: v for k, v in state.items() if not k.startswith(prefixes)}


def _head(hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path) -> str | None:
    arch = one_architecture(hf, folder)
    if arch is None:  # no "architectures": the weights say
        if hf.get("model_type") == "clip":
            return "classifier" if "classifier.weight" in state else "projection"
        return "projection" if "visual_projection.weight" in state else None
    if arch not in ARCHITECTURES or ARCHITECTURES[arch][0] != hf.get("model_type"):
        names = [a for a, (t, _) in ARCHITECTURES.items() if t == hf.get("model_type")]
        raise unsupported(folder, f"architecture {arch} (poslens converts {', '.join(names)})")
    return ARCHITECTURES[arch][1]


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the CLIP image tower of config.json `hf`
    and the tensors `state` (read from `path`) in `folder` (eval mode)."""
    head = _head(hf, state, folder)
    state = drop_prefixes(state, ("text_model.", "text_projection.", "logit_scale"))
    v = vision_config(hf, ("clip",), folder)
    classifier = head == "classifier"
    pool = {"pool": "mean"} if classifier else {"pool": "cls", "fc_norm": True}
    cfg, hidden = tower_config(
        v, folder, DEFAULTS, num_classes=0, norm_pre=True, final_norm=False, **pool
    )
    if head is not None:
        name = "classifier" if classifier else "visual_projection"
        if f"{name}.weight" not in state:
            raise CheckpointError(f"{path} is missing tensor {name}.weight")
        cfg = replace(cfg, num_classes=int(state[f"{name}.weight"].shape[0]))
    pre = prefix_of(set(state), path, ("vision_model.", ""))
    D, C, P, N, K = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.grid**2, cfg.num_classes
    r, e = Reader(state, path), f"{pre}embeddings."
    sd: dict[str, torch.Tensor] = {}
    sd["patch_embed.weight"] = r.take(f"{e}patch_embedding.weight", (D, C, P, P))
    sd["patch_embed.bias"] = torch.zeros(D)  # CLIP's conv has no bias
    pos = r.take(f"{e}position_embedding.weight", (1 + N, D))  # [1 + N, D]: CLS, patches
    sd["cls_token"] = (r.take(f"{e}class_embedding", (D,)) + pos[0]).view(1, 1, D)
    sd["pos_embed"] = pos[None, 1:].contiguous()  # [1, N, D]
    sd["norm_pre.weight"], sd["norm_pre.bias"] = norm(r, f"{pre}pre_layrnorm", D)
    sd |= read_blocks(r, cfg, hidden, f"{pre}encoder.")
    dropped: tuple[str, ...] = ()
    if classifier:  # the mean of the patch tokens as they leave the last block
        sd["head.weight"], sd["head.bias"] = r.linear("classifier", K, D)
        dropped = (f"{pre}post_layernorm.weight", f"{pre}post_layernorm.bias")
    else:
        sd["fc_norm.weight"], sd["fc_norm.bias"] = norm(r, f"{pre}post_layernorm", D)
        if K:  # visual_projection [K, D], bias-free
            sd["head.weight"], sd["head.bias"] = (
                r.take("visual_projection.weight", (K, D)),
                torch.zeros(K),
            )
        else:
            sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)
    r.finish(dropped)
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """CLIPImageProcessor's defaults at the model's side: the shorter side to image_size
    (224 in the class), bicubic, centre crop, OpenAI CLIP's mean and std."""
    return shorter_side_crop(image_size)


__all__ = ["MODEL_TYPES", "convert", "processor_defaults", "read_blocks", "tower_config"]
