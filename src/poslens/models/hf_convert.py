"""Convert a local Hugging Face transformers ViT / DeiT folder into the poslens ViT, exactly.

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

from poslens.errors import CheckpointError, ConfigError, DataError
from poslens.io import MAX_CONFIG_BYTES, check_float_weights, load_tensors, read_json
from poslens.models.config import ModelConfig
from poslens.models.vit import ViT

CONFIG, WEIGHTS, PREPROCESSOR = "config.json", "model.safetensors", "preprocessor_config.json"
MODEL_TYPES = ("vit", "deit")
ARCHITECTURES = {  # config.json "architectures" -> whether it has a classifier head
    "ViTForImageClassification": True,
    "ViTModel": False,
    "DeiTForImageClassification": True,
    "DeiTModel": False,
}
TEACHER = "DeiTForImageClassificationWithTeacher"
# ViTConfig / DeiTConfig defaults, for fields a config.json leaves out
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
    "qkv_bias": True,
}
# Tensors a folder may hold that poslens' forward never reads (see the module docstring).
DROPPED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.mask_token")


def _unsupported(folder: Path, what: str) -> CheckpointError:
    return CheckpointError(f"hf:{folder} is not supported: {what}")


def _teacher(folder: Path) -> CheckpointError:
    return _unsupported(
        folder,
        f"{TEACHER} averages a CLS and a distillation head, which poslens' one CLS head "
        "cannot reproduce (save its model.deit to study the backbone)",
    )


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of an HF folder (CheckpointError when the folder or file is missing or bad)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"hf:{folder}: no such folder (hf:DIR takes a save_pretrained folder)"
        )
    raw = read_json(folder / CONFIG, "Hugging Face config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{folder / CONFIG} is not a JSON object")
    return raw


def weights_file(folder: str | Path) -> Path:
    """The folder's model.safetensors; a one-line CheckpointError for pickles and shards."""
    folder = Path(folder)
    path = folder / WEIGHTS
    if path.is_file():
        return path
    if (folder / (WEIGHTS + ".index.json")).is_file():
        raise _unsupported(folder, "sharded weights (model.safetensors.index.json)")
    for other in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        if (folder / other).is_file():
            raise CheckpointError(
                f"hf:{folder} holds {other} but no {WEIGHTS}; poslens reads safetensors only "
                "(resave with save_pretrained(DIR, safe_serialization=True))"
            )
    raise CheckpointError(f"hf:{folder}: weights file {path} not found")


def _field(hf: dict[str, Any], name: str, kind: type | tuple[type, ...], folder: Path) -> Any:
    v = hf.get(name, DEFAULTS[name])
    if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
        raise CheckpointError(f"{folder / CONFIG}: {name} is {v!r}")
    return v


def _square(hf: dict[str, Any], name: str, folder: Path) -> int:
    v = hf.get(name, DEFAULTS[name])
    if isinstance(v, list) and len(v) == 2 and v[0] == v[1]:  # [224, 224]
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _unsupported(folder, f"{name} {v!r} (poslens takes square images and patches)")
    return v


def _kind(hf: dict[str, Any], folder: Path) -> tuple[str, bool | None]:
    """(model_type, whether the architecture has a classifier; None when config.json omits it)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _unsupported(folder, f"model_type {model_type!r} (poslens converts vit and deit)")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) > 1:
        raise _unsupported(folder, f"architectures {archs!r} (one architecture expected)")
    if not archs:
        return model_type, None
    arch = archs[0]
    if arch == TEACHER:
        raise _teacher(folder)
    if arch not in ARCHITECTURES or not arch.lower().startswith(model_type):
        raise _unsupported(
            folder, f"architecture {arch} (poslens converts {', '.join(ARCHITECTURES)})"
        )
    return model_type, ARCHITECTURES[arch]


def model_config(hf: dict[str, Any], num_classes: int, folder: Path) -> ModelConfig:
    """The poslens ModelConfig of an HF ViT / DeiT config (CheckpointError when not exact)."""
    model_type, _ = _kind(hf, folder)
    act = hf.get("hidden_act", DEFAULTS["hidden_act"])
    if act != "gelu":  # "gelu_new", "gelu_pytorch_tanh", "quick_gelu", ... are not erf GELU
        raise _unsupported(folder, f"hidden_act {act!r} (poslens' MLP uses exact GELU, 'gelu')")
    dim = _field(hf, "hidden_size", int, folder)
    hidden = _field(hf, "intermediate_size", int, folder)
    eps = _field(hf, "layer_norm_eps", (int, float), folder)
    try:
        cfg = ModelConfig(
            image_size=_square(hf, "image_size", folder),
            patch_size=_square(hf, "patch_size", folder),
            in_chans=_field(hf, "num_channels", int, folder),
            num_classes=num_classes,
            dim=dim,
            depth=_field(hf, "num_hidden_layers", int, folder),
            heads=_field(hf, "num_attention_heads", int, folder),
            mlp_ratio=hidden / dim,
            posenc="ape",
            cls_token=True,
            num_registers=1 if model_type == "deit" else 0,  # DeiT's distillation token
            pool="cls",
            qkv_bias=_field(hf, "qkv_bias", bool, folder),
            norm_eps=float(eps),
        )
    except (ConfigError, ZeroDivisionError) as e:
        raise _unsupported(folder, str(e)) from None
    if int(cfg.dim * cfg.mlp_ratio) != hidden:
        raise _unsupported(
            folder, f"intermediate_size {hidden} is not dim x a ratio poslens reproduces"
        )
    return cfg


@dataclass(frozen=True)
class Layout:
    """Where a folder's tensors are: the prefix ("vit.", "deit." or "") and the key generation."""

    prefix: str
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


def _layout(keys: set[str], model_type: str, path: Path) -> Layout:
    """The layout whose block 0 is in the file (old names first, with the prefix first)."""
    for prefix in (f"{model_type}.", ""):
        for new in (False, True):
            layout = Layout(prefix, new)
            if layout.block(0)["ln1"] + ".weight" in keys:
                return layout
    want = Layout(f"{model_type}.", False).block(0)["ln1"] + ".weight"
    raise CheckpointError(
        f"{path} is missing tensor {want} (no {model_type} blocks under any known name)"
    )


class _Reader:
    """Takes tensors out of a file's state dict by HF name, checking each shape; what is left at
    the end is an unexpected tensor."""

    def __init__(self, state: dict[str, torch.Tensor], path: Path) -> None:
        self.state, self.path = dict(state), path

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise CheckpointError(f"{self.path} is missing tensor {name}")
        t = self.state.pop(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{self.path}: tensor {name} has shape {tuple(t.shape)}, the config needs {shape}"
            )
        return t.detach().float()

    def linear(self, name: str, out: int, inp: int, bias: bool = True) -> list[torch.Tensor]:
        w = [self.take(f"{name}.weight", (out, inp))]
        return [*w, self.take(f"{name}.bias", (out,))] if bias else w

    def finish(self, dropped: tuple[str, ...]) -> None:
        for name in dropped:
            self.state.pop(name, None)
        if self.state:
            extra = sorted(self.state)
            raise CheckpointError(
                f"{self.path} has unexpected tensor {extra[0]} ({len(extra)} extra)"
            )


def convert(
    folder: str | Path, weights: str | Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF model in `folder` (eval mode)."""
    folder = Path(folder)
    hf = read_config(folder)
    model_type, has_head = _kind(hf, folder)
    path = Path(weights) if weights is not None else weights_file(folder)
    if not path.is_file():
        raise CheckpointError(f"hf:{folder}: weights file {path} not found")
    state = load_tensors(path)
    check_float_weights(state, str(path))
    if "cls_classifier.weight" in state and "distillation_classifier.weight" in state:
        raise _teacher(folder)
    layout = _layout(set(state), model_type, path)
    if has_head is None:  # no "architectures" in config.json: the weights say
        has_head = "classifier.weight" in state
    if has_head and "classifier.weight" not in state:
        raise CheckpointError(f"{path} is missing tensor classifier.weight")
    num_classes = int(state["classifier.weight"].shape[0]) if has_head else 0
    cfg = model_config(hf, num_classes, folder)
    labels = hf.get("id2label")
    if num_classes and isinstance(labels, dict) and len(labels) != num_classes:
        raise CheckpointError(
            f"{folder / CONFIG} names {len(labels)} labels (id2label), the classifier has {num_classes}"
        )

    D, C, P, N = cfg.dim, cfg.in_chans, cfg.patch_size, cfg.grid**2
    hidden = int(D * cfg.mlp_ratio)
    npre = cfg.num_prefix  # 1 (CLS) for ViT, 2 (CLS, distillation) for DeiT
    r = _Reader(state, path)
    e = f"{layout.prefix}embeddings."
    sd: dict[str, torch.Tensor] = {}
    # patch embedding: conv [D, C, P, P] with bias [D], as poslens' patch_embed
    sd["patch_embed.weight"], sd["patch_embed.bias"] = (
        r.take(f"{e}patch_embeddings.projection.weight", (D, C, P, P)),
        r.take(f"{e}patch_embeddings.projection.bias", (D,)),
    )
    pos = r.take(f"{e}position_embeddings", (1, npre + N, D))  # [1, prefix + N, D]
    # prefix tokens [1, 1, D] each, with their constant share of the position table folded in
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
    ln = f"{layout.prefix}layernorm"
    sd["ln_final.weight"], sd["ln_final.bias"] = (
        r.take(ln + ".weight", (D,)),
        r.take(ln + ".bias", (D,)),
    )
    if num_classes:  # classifier [num_classes, D] on the normalised CLS token
        sd["head.weight"], sd["head.bias"] = r.linear("classifier", num_classes, D)
    else:  # a backbone: poslens' empty head, logits [B, 0]
        sd["head.weight"], sd["head.bias"] = torch.zeros(0, D), torch.zeros(0)
    r.finish(tuple(layout.prefix + d for d in DROPPED))
    return cfg, sd


def load_hf(folder: str | Path, weights: str | Path | None = None, device: str = "cpu") -> ViT:
    """poslens ViT (eval mode) from a local HF ViT / DeiT folder; `weights` overrides its
    model.safetensors."""
    from poslens.limits import check_model

    cfg, sd = convert(folder, weights)
    check_model(cfg, device)
    model = ViT(cfg)
    model.load_state_dict(sd)
    return model.to(torch.device(device)).eval()


def hf_labels(folder: str | Path, num_classes: int) -> list[str] | None:
    """The class names of config.json's id2label in class order (None when absent or partial)."""
    labels = read_config(folder).get("id2label")
    if not isinstance(labels, dict) or not num_classes:
        return None
    names = [labels.get(str(k)) for k in range(num_classes)]
    return names if all(isinstance(n, str) for n in names) else None  # type: ignore[return-value]


def hf_synsets(num_classes: int) -> list[str] | None:
    """ImageNet-1k synset ids in class order for a 1000-class model (as for timm models), when timm
    (which lists them) is installed; else None (folders then map by index, id2label or order)."""
    try:
        from poslens.data.preprocess import imagenet_synsets

        return imagenet_synsets(num_classes)
    except ImportError:
        return None


# PIL's resampling filter numbers (PILImageResampling) as Preprocess interpolation names
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _processor_defaults(model_type: str, image_size: int) -> dict[str, Any]:
    """ViTImageProcessor's / DeiTImageProcessor's defaults for fields a folder leaves out, at the
    model's input side (at 224: squash to 224; DeiT squash to 256, then centre crop 224)."""
    if model_type == "vit":
        return {"size": {"height": image_size, "width": image_size}, "resample": 2}
    side = math.floor(image_size / 0.875)
    return {
        "size": {"height": side, "width": side},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
    }


def _side(v: Any, what: str, where: Path) -> tuple[int, bool]:
    """(side, squash) of a processor size: {"height", "width"} (squash to a square) or
    {"shortest_edge"} (shorter side, aspect kept); an int is a square (old feature extractors)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v, True
    if isinstance(v, dict) and set(v) == {"height", "width"} and v["height"] == v["width"]:
        return int(v["height"]), True
    if isinstance(v, dict) and set(v) == {"shortest_edge"}:
        return int(v["shortest_edge"]), False
    raise DataError(f"{where}: {what} {v!r} is not supported (a square, or shortest_edge)")


def hf_preprocess(folder: str | Path, image_size: int) -> Any:
    """The eval preprocessing of an HF folder (preprocessor_config.json, else the image
    processor's defaults at the model's side `image_size`) as a poslens Preprocess: resize (squash to a square, or the shorter side),
    optional centre crop with HF's floor offsets, x / 255, normalise. This is the PIL image
    processor (ViTImageProcessorPil); the torchvision "fast" one resizes slightly differently."""
    from poslens.data.preprocess import Preprocess

    folder = Path(folder)
    model_type, _ = _kind(read_config(folder), folder)
    where = folder / PREPROCESSOR
    doc: dict[str, Any] = {}
    if where.is_file():
        raw = read_json(where, "Hugging Face preprocessor config", MAX_CONFIG_BYTES)
        if not isinstance(raw, dict):
            raise DataError(f"{where} is not a JSON object")
        doc = raw
    kind = str(doc.get("image_processor_type") or doc.get("feature_extractor_type") or "ViT")
    if not kind.startswith(("ViT", "DeiT")):
        raise DataError(f"{where}: image processor {kind} is not supported (ViT, DeiT)")
    p = {**_processor_defaults(model_type, image_size), **doc}
    if not p.get("do_resize", True) or not p.get("do_rescale", True):
        raise DataError(
            f"{where}: poslens needs do_resize and do_rescale (uint8 images in, resized)"
        )
    if not math.isclose(float(p.get("rescale_factor", 1 / 255)), 1 / 255, rel_tol=1e-6):
        raise DataError(f"{where}: rescale_factor {p['rescale_factor']} is not 1/255")
    resample = _RESAMPLE.get(p.get("resample", 2))
    if resample is None:
        raise DataError(f"{where}: resample {p.get('resample')!r} is not a PIL filter 0..5")
    size, squash = _side(p.get("size"), "size", where)
    crop = size
    if p.get("do_center_crop", False):
        crop, square = _side(p.get("crop_size"), "crop_size", where)
        if not square:
            raise DataError(f"{where}: crop_size {p['crop_size']!r} must be a square")
    elif not squash:
        raise DataError(f"{where}: shortest_edge without a centre crop makes non-square images")
    if crop != image_size:
        raise DataError(f"{where} makes {crop}px images, the model takes {image_size}px")
    # Preprocess resizes to floor(image_size / crop_pct): pick the crop_pct that gives `size`
    crop_pct = image_size / size
    if math.floor(image_size / crop_pct) != size:
        crop_pct = image_size / (size + 0.5)
    mean, std = (0.0,) * 3, (1.0,) * 3
    if p.get("do_normalize", True):
        mean = tuple(float(v) for v in p.get("image_mean", (0.5, 0.5, 0.5)))
        std = tuple(float(v) for v in p.get("image_std", (0.5, 0.5, 0.5)))
        if len(mean) != 3 or len(std) != 3:
            raise DataError(f"{where}: image_mean and image_std need 3 values (RGB)")
    return Preprocess(
        image_size,
        crop_pct,
        "squash" if squash else "center",
        resample,
        mean,
        std,  # type: ignore[arg-type]
        crop_offset="floor",
    )


__all__ = [
    "convert",
    "hf_labels",
    "hf_preprocess",
    "hf_synsets",
    "load_hf",
    "model_config",
    "read_config",
]
