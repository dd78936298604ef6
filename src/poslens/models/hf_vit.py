"""The ViT-layout family of hf:DIR (models/hf_families.py): a local Hugging Face transformers ViT,
DeiT, ViT-MSN, ViT-MAE or I-JEPA folder as the poslens ViT, exactly (the five share ViT's tensor
names and block).

A folder is what `save_pretrained(DIR, safe_serialization=True)` or `huggingface-cli download`
writes: config.json, model.safetensors (never a pickle) and, optionally, preprocessor_config.json.
Reading it needs neither transformers nor a network: config.json is plain JSON, the tensors are
renamed and reshaped here, and every tensor of the file is either used or named below as dropped.

Layouts accepted (config.json "model_type" vit or deit):
- ViTForImageClassification / DeiTForImageClassification: `vit.` / `deit.` prefix, `classifier`
  on the normalised CLS token (poslens pool "cls", head = classifier).
- ViTModel / DeiTModel, with or without the prefix: no classifier (poslens num_classes 0, logits
  [B, 0]). Their pooler (`pooler.dense`, tanh on the CLS token, an in21k checkpoint's only head)
  is not part of poslens' model and is dropped; so is a masked-image-modeling `mask_token`, which
  the forward without a mask never reads.
- DeiT's distillation token becomes poslens' one register: prefix tokens CLS, distillation, then
  the patches, as in HF. DeiTForImageClassificationWithTeacher (logits = the mean of a CLS head and
  a distillation head) is refused: poslens has one head on CLS and cannot reproduce that mean.
- vit_msn: ViTMSNModel / ViTMSNForImageClassification (classifier on the normalised CLS token) as
  ViT's; the classifier's file keeps its blocks under `encoder.` without the `vit.` prefix of its
  embeddings (the original checkpoints' names, which transformers writes back), read as such.
- vit_mae: ViTMAEModel or ViTMAEForPreTraining, the encoder only (no classifier, num_classes 0):
  the pretraining decoder (every `decoder.` tensor) is dropped. HF's encoder shuffles the patches
  by random noise and keeps (1 - config.mask_ratio) of them; poslens' forward is the encoder on
  every patch in order, which is HF's ViTMAEModel with config.mask_ratio 0 and
  noise = arange(N) (argsort of the noise: the identity order). The position table (fixed 2-D
  sin-cos in MAE, stored in the file) is read as a table like ViT's.
- ijepa: IJepaModel / IJepaForImageClassification: no CLS token (position table [1, N, D] for
  the patches alone); the classifier reads the mean of all the normalised tokens (poslens pool
  "mean", cls_token false, as HF's). An optional pooler is dropped like ViT's.

Key names of both transformers generations (transformers 5 still writes the old names to disk,
but holds the new ones in its modules, so a file saved from its state_dict has them):
  old  {p}encoder.layer.i.attention.attention.{query,key,value}, attention.output.dense,
       intermediate.dense, output.dense, layernorm_before, layernorm_after
  new  {p}layers.i.attention.{q,k,v}_proj, attention.o_proj, mlp.fc1, mlp.fc2, layernorm_before,
       layernorm_after
with {p}embeddings.{cls_token, distillation_token, position_embeddings,
patch_embeddings.projection} and {p}layernorm in both.

Conventions mapped (all exact):
- position_embeddings [1, num_prefix + N, D] also cover the prefix tokens; each prefix token's
  share is constant, so it is folded into that token (cls + pos[0], distillation + pos[1]) and
  poslens keeps pos_embed [1, N, D] for the patches.
- separate query / key / value [D, D] become poslens' fused qkv [3D, D] (rows q, k, v: timm's).
- HF's block is pre-norm like poslens': x + attn(layernorm_before(x)), then + mlp(layernorm_after(.)).
- layer_norm_eps (HF default 1e-12, timm 1e-6) becomes ModelConfig.norm_eps; hidden_act must be
  "gelu" (exact erf GELU, poslens' Mlp); qkv_bias, image / patch size and num_channels come from
  config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError, ConfigError
from poslens.models.config import ModelConfig
from poslens.models.hf_common import (
    Reader,
    check_labels,
    check_mlp_ratio,
    field,
    grid_fields,
    one_architecture,
    unsupported,
)


@dataclass(frozen=True)
class Kind:
    """What differs between the model types of this family."""

    prefix: (
        str  # the base model's attribute in a For... class (`vit.` in ViTForImageClassification)
    )
    architectures: dict[str, bool]  # config.json "architectures" -> whether it has a classifier
    cls_token: bool = True  # I-JEPA has none
    eps: float = 1e-12  # the config class's layer_norm_eps default
    dropped_prefixes: tuple[str, ...] = ()  # whole parts of a file poslens does not use


KINDS: dict[str, Kind] = {
    "vit": Kind("vit.", {"ViTForImageClassification": True, "ViTModel": False}),
    "deit": Kind("deit.", {"DeiTForImageClassification": True, "DeiTModel": False}),
    "vit_msn": Kind("vit.", {"ViTMSNForImageClassification": True, "ViTMSNModel": False}, eps=1e-6),
    "vit_mae": Kind(
        "vit.",
        {"ViTMAEModel": False, "ViTMAEForPreTraining": False},
        dropped_prefixes=("decoder.",),
    ),
    "ijepa": Kind(
        "ijepa.", {"IJepaForImageClassification": True, "IJepaModel": False}, cls_token=False
    ),
}
MODEL_TYPES = tuple(KINDS)
TEACHER = "DeiTForImageClassificationWithTeacher"
# ViTConfig / DeiTConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "qkv_bias": True,
}
# Tensors a folder may hold that poslens' forward never reads (see the module docstring).
DROPPED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.mask_token")


def _teacher(folder: Path) -> CheckpointError:
    return unsupported(
        folder,
        f"{TEACHER} averages a CLS and a distillation head, which poslens' one CLS head "
        "cannot reproduce (save its model.deit to study the backbone)",
    )


def _kind(hf: dict[str, Any], folder: Path) -> tuple[str, bool | None]:
    """(model_type, whether the architecture has a classifier; None when config.json omits it)."""
    model_type = hf.get("model_type")
    if model_type not in KINDS:
        raise unsupported(folder, f"model_type {model_type!r} (this converter takes {MODEL_TYPES})")
    arch = one_architecture(hf, folder)
    if arch is None:
        return model_type, None
    if arch == TEACHER:
        raise _teacher(folder)
    archs = KINDS[model_type].architectures
    if arch not in archs:
        raise unsupported(folder, f"architecture {arch} (poslens converts {', '.join(archs)})")
    return model_type, archs[arch]


def model_config(hf: dict[str, Any], num_classes: int, folder: Path) -> ModelConfig:
    """The poslens ModelConfig of an HF ViT / DeiT config (CheckpointError when not exact)."""
    model_type, _ = _kind(hf, folder)
    act = hf.get("hidden_act", DEFAULTS["hidden_act"])
    if act != "gelu":  # "gelu_new", "gelu_pytorch_tanh", "quick_gelu", ... are not erf GELU
        raise unsupported(folder, f"hidden_act {act!r} (poslens' MLP uses exact GELU, 'gelu')")
    dim = field(hf, "hidden_size", int, folder, DEFAULTS)
    hidden = field(hf, "intermediate_size", int, folder, DEFAULTS)
    kind = KINDS[model_type]
    defaults = {**DEFAULTS, "layer_norm_eps": kind.eps}
    eps = field(hf, "layer_norm_eps", (int, float), folder, defaults)
    try:
        cfg = ModelConfig(
            **grid_fields(hf, folder, DEFAULTS),
            num_classes=num_classes,
            dim=dim,
            heads=field(hf, "num_attention_heads", int, folder, DEFAULTS),
            mlp_ratio=hidden / dim,
            posenc="ape",
            cls_token=kind.cls_token,
            num_registers=1 if model_type == "deit" else 0,  # DeiT's distillation token
            pool="cls" if kind.cls_token else "mean",  # I-JEPA: the mean of all tokens
            qkv_bias=field(hf, "qkv_bias", bool, folder, DEFAULTS),
            norm_eps=float(eps),
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise unsupported(folder, str(e)) from None
    check_mlp_ratio(cfg, hidden, folder)
    return cfg


@dataclass(frozen=True)
class Layout:
    """Where a folder's tensors are: the prefix ("vit.", "deit." or "") and the key generation."""

    prefix: str  # of the blocks
    new_names: bool  # vit.layers.i.attention.q_proj (transformers 5 modules) vs encoder.layer.i

    def block(self, i: int) -> dict[str, str]:
        """poslens module of block i (q, k, v before fusing) -> the HF module name."""
        if self.new_names:
            b = f"{self.prefix}layers.{i}."
            attn = {c: f"{b}attention.{c}_proj" for c in "qkvo"}
            mlp = {"fc1": f"{b}mlp.fc1", "fc2": f"{b}mlp.fc2"}
        else:
            b = f"{self.prefix}encoder.layer.{i}."
            attn = {
                c: f"{b}attention.attention.{n}"
                for c, n in zip("qkv", ("query", "key", "value"), strict=True)
            }
            attn["o"] = f"{b}attention.output.dense"
            mlp = {"fc1": f"{b}intermediate.dense", "fc2": f"{b}output.dense"}
        return {**attn, **mlp, "ln1": f"{b}layernorm_before", "ln2": f"{b}layernorm_after"}


def _layout(keys: set[str], model_type: str, path: Path) -> tuple[Layout, str]:
    """The layout whose block 0 is in the file (old names first, with the prefix first), and the
    prefix of the embeddings and final norm (the blocks' but for ViTMSNForImageClassification's
    files, whose blocks lack the `vit.` of its embeddings)."""
    base = KINDS[model_type].prefix
    for prefix in (base, ""):
        for new in (False, True):
            layout = Layout(prefix, new)
            if layout.block(0)["ln1"] + ".weight" in keys:
                other = base if prefix == "" else ""
                emb = f"{prefix}embeddings.patch_embeddings.projection.weight"
                has_other = f"{other}embeddings.patch_embeddings.projection.weight" in keys
                return layout, (other if emb not in keys and has_other else prefix)
    want = Layout(base, False).block(0)["ln1"] + ".weight"
    raise CheckpointError(
        f"{path} is missing tensor {want} (no {model_type} blocks under any known name)"
    )


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF ViT / DeiT of config.json `hf`
    and the tensors `state` (read from `path`) in `folder` (eval mode)."""
    model_type, has_head = _kind(hf, folder)
    model_config(hf, 0, folder)  # what config.json asks that poslens cannot do, before the tensors
    if "cls_classifier.weight" in state and "distillation_classifier.weight" in state:
        raise _teacher(folder)
    kind = KINDS[model_type]
    if kind.dropped_prefixes:  # ViT-MAE's decoder
        state = {k: v for k, v in state.items() if not k.startswith(kind.dropped_prefixes)}
    layout, top = _layout(set(state), model_type, path)
    if has_head is None:  # no "architectures" in config.json: the weights say
        has_head = "classifier.weight" in state
    if has_head and "classifier.weight" not in state:
        raise CheckpointError(f"{path} is missing tensor classifier.weight")
    num_classes = int(state["classifier.weight"].shape[0]) if has_head else 0
    cfg = model_config(hf, num_classes, folder)
    check_labels(hf, num_classes, folder)

    D, C, P, N = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.grid**2
    hidden = int(D * cfg.mlp_ratio)
    npre = cfg.num_prefix  # 1 (CLS) for ViT, 2 (CLS, distillation) for DeiT
    r = Reader(state, path)
    e = f"{top}embeddings."
    sd: dict[str, torch.Tensor] = {}
    # patch embedding: conv [D, C, P, P] with bias [D], as poslens' patch_embed
    sd["patch_embed.weight"], sd["patch_embed.bias"] = (
        r.take(f"{e}patch_embeddings.projection.weight", (D, C, P, P)),
        r.take(f"{e}patch_embeddings.projection.bias", (D,)),
    )
    pos = r.take(f"{e}position_embeddings", (1, npre + N, D))  # [1, prefix + N, D]
    # prefix tokens [1, 1, D] each, with their constant share of the position table folded in
    if cfg.cls_token:
        sd["cls_token"] = r.take(f"{e}cls_token", (1, 1, D)) + pos[:, :1]
    if model_type == "deit":
        sd["reg_tokens"] = r.take(f"{e}distillation_token", (1, 1, D)) + pos[:, 1:2]
    sd["pos_embed"] = pos[:, npre:].contiguous()  # [1, N, D], patches row-major as poslens'
    for i in range(cfg.depth):
        names, p = layout.block(i), f"blocks.{i}."
        qkv = [r.linear(names[c], D, D, cfg.qkv_bias) for c in "qkv"]  # each [w [D, D], (b [D])]
        sd[p + "attn.qkv.weight"] = torch.cat([t[0] for t in qkv])  # [3D, D]: rows q, k, v
        if cfg.qkv_bias:
            sd[p + "attn.qkv.bias"] = torch.cat([t[1] for t in qkv])  # [3D]
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = r.linear(names["o"], D, D)
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = r.linear(names["fc1"], hidden, D)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = r.linear(names["fc2"], D, hidden)
        for ours in ("ln1", "ln2"):
            sd[p + ours + ".weight"] = r.take(names[ours] + ".weight", (D,))
            sd[p + ours + ".bias"] = r.take(names[ours] + ".bias", (D,))
    ln = f"{top}layernorm"
    sd["ln_final.weight"], sd["ln_final.bias"] = (
        r.take(ln + ".weight", (D,)),
        r.take(ln + ".bias", (D,)),
    )
    if num_classes:  # classifier [num_classes, D] on the normalised CLS token
        sd["head.weight"], sd["head.bias"] = r.linear("classifier", num_classes, D)
    else:  # a backbone: poslens' empty head, logits [B, 0]
        sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)
    r.finish(tuple(top + d for d in DROPPED))
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """ViTImageProcessor's / DeiTImageProcessor's defaults for fields a folder leaves out, at the
    model's input side (at 224: squash to 224; DeiT squash to 256, then centre crop 224). ViT-MSN,
    ViT-MAE and I-JEPA take ViTImageProcessor (transformers' AutoImageProcessor mapping)."""
    if hf.get("model_type") != "deit":
        return {"size": {"height": image_size, "width": image_size}, "resample": 2}
    side = math.floor(image_size / 0.875)
    return {
        "size": {"height": side, "width": side},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
    }


__all__ = ["DEFAULTS", "KINDS", "MODEL_TYPES", "convert", "model_config", "processor_defaults"]
