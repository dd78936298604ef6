"""Convert a local Hugging Face BEiT / data2vec-vision folder into the poslens ViT, exactly.

config.json "model_type" beit or data2vec-vision (transformers' BeitModel and
Data2VecVisionModel share one architecture: the data2vec one is the older copy of BEiT's code).
Layouts accepted:
- BeitForImageClassification / Data2VecVisionForImageClassification (`beit.` /
  `data2vec_vision.` prefix, `classifier` on the pooled vector).
- BeitModel / Data2VecVisionModel, with or without the prefix: no classifier (poslens
  num_classes 0, logits [B, 0]); the pooled vector is poslens' pooled vector (fc_norm's output
  with mean pooling, the CLS token otherwise).
- BeitForMaskedImageModeling (BEiT pretraining, e.g. a pt22k checkpoint) as a backbone: its
  LayerNorm on the final tokens is poslens' final norm; `lm_head` (the visual-token logits, read
  from the patch tokens) is dropped. With use_mean_pooling false BEiT would apply two LayerNorms
  in a row there, which poslens cannot, and the folder is refused.
Semantic segmentation (UperNet / FPN heads) and BeitBackbone are refused.

Conventions mapped (all exact):
- pooling: use_mean_pooling (the default) has no LayerNorm on the final tokens and a LayerNorm on
  the mean of the patch tokens (`pooler.layernorm`): poslens final_norm false, pool "mean",
  fc_norm; otherwise `layernorm` on every token and the CLS token: final_norm, pool "cls".
- position: use_relative_position_bias (a table [(2g-1)^2 + 3, H] in every block) and
  use_shared_relative_position_bias (one table added in every block) are poslens' posenc "relpos"
  (models/relpos.py: the same offset order and CLS entries as BEiT's index); a shared table is
  copied into every block, summed with the block's own where both are on, so each block's
  hook_rel_bias holds all of the bias it adds. use_absolute_position_embeddings ([1, 1 + N, D],
  CLS share folded into the CLS token) is posenc "ape"; both at once is refused (poslens has one
  encoding); neither is posenc "none".
- attention: q and v have biases, k has none: one qkv bias with zeros for k (exact).
- layer scale (lambda_1, lambda_2; absent when layer_scale_init_value <= 0) is folded into the
  attention output projection and fc2: lambda * (W z + b) = (lambda W) z + lambda b.
- hidden_act gelu (erf), gelu_pytorch_tanh or quick_gelu; layer_norm_eps is norm_eps.
- `mask_token` (masked image modelling only) and old files' `relative_position_index` buffers
  are never read by the forward without a mask and are dropped.
Key names of both transformers generations are read: what save_pretrained writes (BEiT and
data2vec: `{p}encoder.layer.i.attention.attention.query`, ...,
`attention.attention.relative_position_bias.relative_position_bias_table`,
`{p}encoder.relative_position_bias.relative_position_bias_table` for the shared table) and
transformers 5 BEiT module names (`{p}layers.i.attention.q_proj`, `mlp.fc1`,
`layers.i.relative_position_bias.relative_position_bias_table`,
`{p}shared_position_bias.relative_position_bias_table`).
"""

from __future__ import annotations

from dataclasses import replace
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
from poslens.models.hf_vit import Layout
from poslens.models.relpos import num_offsets

MODEL_TYPES = ("beit", "data2vec-vision")
PREFIX = {"beit": "beit.", "data2vec-vision": "data2vec_vision."}
# config.json "architectures" -> "classifier", "backbone" or "mim" (a backbone, lm_head dropped)
ARCHITECTURES = {
    "BeitForImageClassification": "classifier",
    "BeitModel": "backbone",
    "BeitForMaskedImageModeling": "mim",
    "Data2VecVisionForImageClassification": "classifier",
    "Data2VecVisionModel": "backbone",
}
# BeitConfig / Data2VecVisionConfig defaults (the same), for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "use_absolute_position_embeddings": False,
    "use_relative_position_bias": False,
    "use_shared_relative_position_bias": False,
    "use_mean_pooling": True,
}
# transformers' activation names -> poslens' ModelConfig.mlp_act (the same functions)
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
TABLE = "relative_position_bias.relative_position_bias_table"


def _kind(hf: dict[str, Any], folder: Path) -> tuple[str, str | None]:
    """(model_type, the architecture's kind: "classifier" / "backbone" / "mim"; None when
    config.json names no architecture)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise unsupported(folder, f"model_type {model_type!r} (this converter takes beit and "
                          "data2vec-vision)")  # fmt: skip
    arch = one_architecture(hf, folder)
    if arch is None:
        return model_type, None
    if arch not in ARCHITECTURES:
        what = "semantic segmentation" if "Segmentation" in arch else "architecture"
        raise unsupported(folder, f"{what} {arch} (poslens converts {', '.join(ARCHITECTURES)})")
    return model_type, ARCHITECTURES[arch]


def model_config(
    hf: dict[str, Any], num_classes: int, folder: Path, mim: bool = False
) -> ModelConfig:
    """The poslens ModelConfig of an HF BEiT / data2vec-vision config (CheckpointError when
    poslens cannot reproduce it); mim: a BeitForMaskedImageModeling folder."""
    _kind(hf, folder)
    act = hf.get("hidden_act", DEFAULTS["hidden_act"])
    if act not in ACTS:
        raise unsupported(folder, f"hidden_act {act!r} (poslens has {', '.join(ACTS)})")
    dim = field(hf, "hidden_size", int, folder, DEFAULTS)
    heads = field(hf, "num_attention_heads", int, folder, DEFAULTS)
    hidden = field(hf, "intermediate_size", int, folder, DEFAULTS)
    eps = field(hf, "layer_norm_eps", (int, float), folder, DEFAULTS)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != dim:
        raise unsupported(folder, f"head_dim {head_dim} x {heads} heads is not hidden_size {dim}")
    ape, rel, shared, mean = (
        field(hf, name, bool, folder, DEFAULTS)
        for name in (
            "use_absolute_position_embeddings",
            "use_relative_position_bias",
            "use_shared_relative_position_bias",
            "use_mean_pooling",
        )
    )
    if ape and (rel or shared):
        raise unsupported(
            folder, "absolute position embeddings together with a relative position bias "
            "(poslens has one position encoding)"
        )  # fmt: skip
    if mim and not mean:
        raise unsupported(
            folder, "BeitForMaskedImageModeling with use_mean_pooling false (two LayerNorms in a "
            "row on the final tokens)"
        )  # fmt: skip
    try:
        cfg = ModelConfig(
            **grid_fields(hf, folder, DEFAULTS),
            num_classes=num_classes,
            dim=dim,
            heads=heads,
            mlp_ratio=hidden / dim,
            posenc="relpos" if rel or shared else "ape" if ape else "none",
            cls_token=True,
            pool="mean" if mean and not mim else "cls",
            qkv_bias=True,  # q and v biases, zeros for k
            norm_eps=float(eps),
            mlp_act=ACTS[act],
            final_norm=mim or not mean,
            fc_norm=mean and not mim,  # a backbone saved without its pooler: set in convert
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise unsupported(folder, str(e)) from None
    check_mlp_ratio(cfg, hidden, folder)
    return cfg


def _layout(keys: set[str], model_type: str, path: Path) -> Layout:
    """The layout whose block 0 is in the file (old names first, with the prefix first)."""
    for prefix in (PREFIX[model_type], ""):
        for new in (False, True):
            layout = Layout(prefix, new)
            if layout.block(0)["ln1"] + ".weight" in keys:
                return layout
    want = Layout(PREFIX[model_type], False).block(0)["ln1"] + ".weight"
    raise CheckpointError(
        f"{path} is missing tensor {want} (no {model_type} blocks under any known name)"
    )


def _block_base(layout: Layout, i: int) -> str:
    """The HF name of block i's module ("{p}encoder.layer.i." or "{p}layers.i.")."""
    return (
        f"{layout.prefix}layers.{i}." if layout.new_names else f"{layout.prefix}encoder.layer.{i}."
    )


def _tables(
    r: Reader, hf: dict[str, Any], layout: Layout, cfg: ModelConfig, folder: Path
) -> list[torch.Tensor] | None:
    """Each block's relative position table [R, H] (its own plus the shared one), or None."""
    rel = field(hf, "use_relative_position_bias", bool, folder, DEFAULTS)
    shared = field(hf, "use_shared_relative_position_bias", bool, folder, DEFAULTS)
    if not (rel or shared):
        return None
    shape = (num_offsets(cfg.grid, 1), cfg.heads)  # [(2g-1)^2 + 3, H]
    p = layout.prefix
    common = None
    if shared:
        name = (
            f"{p}shared_position_bias."
            if layout.new_names
            else f"{p}encoder.relative_position_bias."
        )
        common = r.take(name + "relative_position_bias_table", shape)
    tables = []
    for i in range(cfg.depth):
        own = None
        if rel:
            base = _block_base(layout, i)
            own = r.take(base + ("" if layout.new_names else "attention.attention.") + TABLE, shape)
        parts = [t for t in (own, common) if t is not None]
        tables.append(parts[0] if len(parts) == 1 else parts[0] + parts[1])
    return tables


def _scale(r: Reader, name: str, dim: int) -> torch.Tensor | None:
    """A block's layer scale lambda [D] (None when the file has none: layer_scale_init_value
    <= 0 in transformers, a factor 1)."""
    return r.take(name, (dim,)) if name in r.state else None


def convert(
    hf: dict[str, Any], state: dict[str, torch.Tensor], folder: Path, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF BEiT / data2vec-vision of
    config.json `hf` and the tensors `state` (read from `path`) in `folder` (eval mode)."""
    model_type, kind = _kind(hf, folder)
    if kind is None:  # no "architectures" in config.json: the weights say
        kind = "classifier" if "classifier.weight" in state else "backbone"
        kind = "mim" if "lm_head.weight" in state else kind
    if kind == "classifier" and "classifier.weight" not in state:
        raise CheckpointError(f"{path} is missing tensor classifier.weight")
    num_classes = int(state["classifier.weight"].shape[0]) if kind == "classifier" else 0
    cfg = model_config(hf, num_classes, folder, mim=kind == "mim")
    layout = _layout(set(state), model_type, path)
    p = layout.prefix
    pooler = f"{p}pooler.layernorm"
    if kind == "backbone" and cfg.fc_norm and pooler + ".weight" not in state:
        cfg = replace(cfg, fc_norm=False)  # BeitModel(add_pooling_layer=False): no pooled norm
    check_labels(hf, num_classes, folder)

    D, C, P, N = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.grid**2
    hidden = int(D * cfg.mlp_ratio)
    r = Reader(state, path)
    e = f"{p}embeddings."
    sd: dict[str, torch.Tensor] = {}
    # patch embedding: conv [D, C, P, P] with bias [D], as poslens' patch_embed
    sd["patch_embed.weight"], sd["patch_embed.bias"] = (
        r.take(f"{e}patch_embeddings.projection.weight", (D, C, P, P)),
        r.take(f"{e}patch_embeddings.projection.bias", (D,)),
    )
    sd["cls_token"] = r.take(f"{e}cls_token", (1, 1, D))  # [1, 1, D]
    if cfg.posenc == "ape":  # [1, 1 + N, D]: the CLS share folded into the CLS token
        pos = r.take(f"{e}position_embeddings", (1, 1 + N, D))
        sd["cls_token"] = sd["cls_token"] + pos[:, :1]
        sd["pos_embed"] = pos[:, 1:].contiguous()  # [1, N, D], patches row-major as poslens'
    tables = _tables(r, hf, layout, cfg, folder)
    for i in range(cfg.depth):
        names, b, o = layout.block(i), _block_base(layout, i), f"blocks.{i}."
        q, v = r.linear(names["q"], D, D), r.linear(names["v"], D, D)  # [w [D, D], b [D]]
        k = r.take(names["k"] + ".weight", (D, D))  # no bias
        sd[o + "attn.qkv.weight"] = torch.cat([q[0], k, v[0]])  # [3D, D]: rows q, k, v
        sd[o + "attn.qkv.bias"] = torch.cat([q[1], torch.zeros(D), v[1]])  # [3D]
        if tables is not None:
            sd[o + "attn.rel_pos.table"] = tables[i]  # [R, H]
        for ours, theirs, lam, out, inp in (
            ("attn.proj", names["o"], "lambda_1", D, D),
            ("mlp.fc2", names["fc2"], "lambda_2", D, hidden),
        ):
            w, bias = r.linear(theirs, out, inp)
            gamma = _scale(r, b + lam, D)  # [D] per output channel, or None
            if gamma is not None:
                w, bias = gamma[:, None] * w, gamma * bias
            sd[o + ours + ".weight"], sd[o + ours + ".bias"] = w, bias
        sd[o + "mlp.fc1.weight"], sd[o + "mlp.fc1.bias"] = r.linear(names["fc1"], hidden, D)
        for ours in ("ln1", "ln2"):
            sd[o + ours + ".weight"] = r.take(names[ours] + ".weight", (D,))
            sd[o + ours + ".bias"] = r.take(names[ours] + ".bias", (D,))
    if cfg.final_norm:  # BEiT's `layernorm` on every token, or the MIM model's
        ln = "layernorm" if kind == "mim" else f"{p}layernorm"
        sd["ln_final.weight"], sd["ln_final.bias"] = (
            r.take(ln + ".weight", (D,)),
            r.take(ln + ".bias", (D,)),
        )
    if cfg.fc_norm:  # the LayerNorm on the mean of the patch tokens [B, D]
        sd["fc_norm.weight"] = r.take(pooler + ".weight", (D,))
        sd["fc_norm.bias"] = r.take(pooler + ".bias", (D,))
    if num_classes:  # classifier [num_classes, D] on the pooled vector
        sd["head.weight"], sd["head.bias"] = r.linear("classifier", num_classes, D)
    else:  # a backbone: poslens' empty head, logits [B, 0]
        sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)
    dropped = [f"{e}mask_token", *(n for n in r.state if n.endswith("relative_position_index"))]
    if kind == "mim":
        dropped += ["lm_head.weight", "lm_head.bias"]
    r.finish(tuple(dropped))
    return cfg, sd


def processor_defaults(hf: dict[str, Any], image_size: int) -> dict[str, Any]:
    """BeitImageProcessor's defaults (data2vec-vision folders use it too) at the model's input
    side: squash to the side, bicubic, no centre crop, mean and std 0.5."""
    return {
        "size": {"height": image_size, "width": image_size},
        "resample": 3,
        "do_center_crop": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


__all__ = ["DEFAULTS", "MODEL_TYPES", "convert", "model_config", "processor_defaults"]
