"""A poslens ViT as a timm state dict: the inverse of timm_convert, for studying a trained poslens
model through the pretrained route (`poslens study --pretrained timm:NAME=FILE`) exactly as a
downloaded checkpoint is studied.

- APE (and `none`) become timm's VisionTransformer; naver-style RoPE-Axial (interleaved planes,
  column bands first) becomes timm's Eva with `attn_type="rope"` (AttentionRope: a fused qkv
  with every bias, as poslens has). The exported table holds patch rows only
  (`no_embed_class=True`); there is no LayerScale (`init_values=None`).
- The shape arguments timm needs to build that model (image size, width, depth, ...) are written
  beside the weights, `<file>.timm.json`, and `load_timm` reads them from there; with them
  `timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=FILE,
  num_classes=..., input_size=...), **kwargs)` loads the file in timm itself (the overlay is in
  the same JSON: timm drops a classifier whose size differs from its pretrained config's).
- Every export is checked by converting the timm model back (timm_convert.convert): the config
  and every tensor must come back as they went in, and timm's forward must equal poslens'.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poslens.errors import UserError
from poslens.io import save_tensors, write_json
from poslens.models.config import ModelConfig
from poslens.models.timm_convert import check_rotary, convert, create_timm, import_timm
from poslens.models.timm_weights import KWARGS_SUFFIX, kwargs_file, read_kwargs
from poslens.models.vit import ViT

EXPORTABLE = ("ape", "none", "rope_axial")
LAYER_SCALE = ("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")


def timm_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """The timm constructor arguments that rebuild `cfg`'s architecture (UserError when timm's
    VisionTransformer / naver Eva cannot express it)."""
    if cfg.arch_pieces():  # exported as a plain timm VisionTransformer
        raise UserError(f"export to timm supports the plain ViT; this model has "
                        f"model.{cfg.arch_pieces()[0]}")  # fmt: skip
    if cfg.posenc not in EXPORTABLE:
        raise UserError(f"export to timm supports {', '.join(EXPORTABLE)}, not {cfg.posenc}")
    if cfg.posenc == "rope_axial":
        if cfg.rope_variant != "standard" or cfg.rope_blocks != "all":
            raise UserError(f"a {cfg.rope_variant} / {cfg.rope_blocks} RoPE has no timm form")
        if cfg.rope_layout != "interleaved" or cfg.rope_coords != "index":
            raise UserError("naver RoPE in timm is interleaved on patch-index coordinates")
    if cfg.ape_code != "learned" and cfg.has_pos_table:
        raise UserError("a planted (frozen) position code exports as a learned table; use "
                        "the trained weights of a learned one")  # fmt: skip
    kw: dict[str, Any] = {
        "img_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "in_chans": cfg.in_chans,
        "num_classes": cfg.num_classes,
        "embed_dim": cfg.dim,
        "depth": cfg.depth,
        "num_heads": cfg.heads,
        "mlp_ratio": cfg.mlp_ratio,
        "qkv_bias": cfg.qkv_bias,
        "class_token": cfg.cls_token,
        "global_pool": "token" if cfg.pool == "cls" else "avg",
        "no_embed_class": True,
    }
    if cfg.num_registers:
        kw["reg_tokens" if cfg.posenc != "rope_axial" else "num_reg_tokens"] = cfg.num_registers
    # poslens normalises every token, then pools: timm's `norm` before pooling, never fc_norm
    kw["use_fc_norm" if cfg.posenc == "rope_axial" else "fc_norm"] = False
    if cfg.posenc == "rope_axial":
        kw |= {"attn_type": "rope", "init_values": None, "use_abs_pos_emb": False,
               "use_rot_pos_emb": True, "rope_grid_indexing": "xy",
               "rope_temperature": cfg.rope_theta}  # fmt: skip
    else:
        kw |= {"init_values": None, "pos_embed": "learn" if cfg.has_pos_table else "none"}
    return kw


def timm_state_dict(model: ViT) -> dict[str, torch.Tensor]:
    """poslens parameters under timm's names (VisionTransformer and Eva share them here)."""
    cfg = model.cfg
    sd = model.state_dict()
    out = {
        "patch_embed.proj.weight": sd["patch_embed.weight"],
        "patch_embed.proj.bias": sd["patch_embed.bias"],
        "norm.weight": sd["ln_final.weight"],
        "norm.bias": sd["ln_final.bias"],
        "head.weight": sd["head.weight"],
        "head.bias": sd["head.bias"],
    }
    if cfg.cls_token:
        out["cls_token"] = sd["cls_token"]
    if cfg.num_registers:
        out["reg_token"] = sd["reg_tokens"]
    if cfg.has_pos_table:
        out["pos_embed"] = sd["pos_embed"]
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        for ours, theirs in (("ln1", "norm1"), ("ln2", "norm2"), ("attn.qkv", "attn.qkv"),
                             ("attn.proj", "attn.proj"), ("mlp.fc1", "mlp.fc1"),
                             ("mlp.fc2", "mlp.fc2")):  # fmt: skip
            for t in ("weight", "bias"):
                if p + f"{ours}.{t}" in sd:
                    out[p + f"{theirs}.{t}"] = sd[p + f"{ours}.{t}"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def timm_name_for(cfg: ModelConfig) -> str:
    """The timm architecture a poslens config exports to by default."""
    return "vit_small_patch16_rope_224" if cfg.posenc == "rope_axial" else "vit_tiny_patch16_224"


@torch.no_grad()
def to_timm(model: ViT, name: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The timm model `name` (default timm_name_for) holding `model`'s weights, and the
    arguments that built it; checked by converting it back and by timm's own forward."""
    cfg = model.cfg
    name = name or timm_name_for(cfg)
    kwargs = timm_kwargs(cfg)
    want = "eva" if cfg.posenc == "rope_axial" else "vision_transformer"
    timm = import_timm()
    if not timm.is_model(name):
        raise UserError(f"unknown timm model {name!r}")
    module = timm.models.model_entrypoint(name).__module__.rsplit(".", 1)[-1]
    if module != want:  # before building: the arguments are the architecture's own
        raise UserError(f"timm:{name} is a {module} model; a {cfg.posenc} model exports to "
                        f"timm's {want} (e.g. timm:{timm_name_for(cfg)})")  # fmt: skip
    tm = create_timm(name, **kwargs)
    sd = timm_state_dict(model)
    theirs = tm.state_dict()
    for k in theirs:  # LayerScale, where the architecture always has it: gamma 1 is no scaling
        if k.endswith(LAYER_SCALE) and k not in sd:
            sd[k] = torch.ones_like(theirs[k])
    missing = sorted(set(theirs) - set(sd) - _buffers(tm))
    extra = sorted(set(sd) - set(theirs))
    if missing or extra:
        raise UserError(f"timm:{name} does not fit this model: missing {missing[:3]}, "
                        f"unexpected {extra[:3]}")  # fmt: skip
    for k, v in sd.items():
        if theirs[k].shape != v.shape:
            raise UserError(f"timm:{name} does not fit this model: {k} is {tuple(theirs[k].shape)}"
                            f" in timm, {tuple(v.shape)} here")  # fmt: skip
    tm.load_state_dict(sd, strict=False)
    tm.eval()
    # the round trip: timm -> poslens gives back this architecture and these tensors
    back_cfg, back = convert(tm, name)
    if _arch(back_cfg) != _arch(cfg) or (cfg.uses_rope and back_cfg.rope_theta != cfg.rope_theta):
        raise UserError(f"timm:{name} converts back to another architecture")
    mine = model.state_dict()
    for k, v in back.items():
        if k not in mine or not torch.equal(v, mine[k].detach().cpu().float()):
            raise UserError(f"timm:{name}: {k} does not come back unchanged from timm")
    ours = copy.deepcopy(model).cpu().eval()
    check_rotary(ours, tm, name)
    x = torch.randn(2, cfg.in_chans, cfg.image_size, cfg.image_size,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    if not torch.allclose(tm(x), ours(x), atol=1e-4, rtol=1e-4):
        raise UserError(f"timm:{name}'s forward differs from poslens' on the exported weights")
    return tm, kwargs


def _buffers(tm: nn.Module) -> set[str]:
    """State-dict entries of `tm` that are buffers (rotary tables), not weights."""
    return {n for n, _ in tm.named_buffers()}


def _arch(cfg: ModelConfig) -> dict[str, Any]:
    keep = ("image_size", "patch_size", "in_chans", "num_classes", "dim", "depth", "heads",
            "mlp_ratio", "posenc", "cls_token", "num_registers", "pool", "qkv_bias", "norm_eps",
            "rope_layout", "rope_coords")  # fmt: skip
    d = cfg.to_dict()
    return {k: d[k] for k in keep if k in d}


def export_timm(model: ViT, out: str | Path, name: str | None = None) -> tuple[Path, Path]:
    """Write `model` as timm weights: `out` (.safetensors, timm's key names) and the timm
    arguments beside it (kwargs_file); both atomically. Returns the two paths."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise UserError(f"--out must be a .safetensors file, got {out}")
    tm, kwargs = to_timm(model, name)
    name = name or timm_name_for(model.cfg)
    state = {
        k: v.detach().contiguous() for k, v in tm.state_dict().items() if k not in _buffers(tm)
    }
    save_tensors(out, state)
    # timm drops a classifier whose size differs from its pretrained config's: say the size
    overlay = {"file": str(out), "num_classes": model.cfg.num_classes,
               "input_size": [model.cfg.in_chans, model.cfg.image_size, model.cfg.image_size]}  # fmt: skip
    doc = {"timm": name, "kwargs": kwargs, "pretrained_cfg_overlay": overlay,
           "poslens": model.cfg.to_dict(),
           "load": f"timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay="
                   "doc['pretrained_cfg_overlay'], **doc['kwargs'])"}  # fmt: skip
    side = kwargs_file(out)
    write_json(side, doc)
    return out, side


__all__ = ["KWARGS_SUFFIX", "export_timm", "kwargs_file", "read_kwargs", "timm_kwargs", "to_timm"]
