"""Model configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from poslens._config import finite_number, from_dict, one_of, positive_float, positive_int
from poslens.errors import CheckpointError, ConfigError

POSENCS = ("ape", "sincos", "rope_axial", "rope_mixed", "rope_axial_ape", "rope_mixed_ape", "relpos",
           "none")  # fmt: skip
# What each encoding is made of; every check of an encoding reads these (never the name's text).
POS_TABLE = ("ape", "rope_axial_ape", "rope_mixed_ape")  # a learned table added to the patches
ADDITIVE = (*POS_TABLE, "sincos")  # a position vector added to the patches (learned or fixed)
ROPE_KIND = {"rope_axial": "axial", "rope_axial_ape": "axial",
             "rope_mixed": "mixed", "rope_mixed_ape": "mixed"}  # fmt: skip
RELATIVE = ("relpos",)  # a learned per-head bias over 2-D offsets on the scores (models/relpos.py)
FAMILIES = ("rotary", "additive", "relative", "none")


def posenc_family(posenc: str) -> str:
    """How an encoding gives position: "rotary" (rotations, with or without a table),
    "additive" (an added vector alone: APE, sincos), "relative" (a bias on the attention
    scores over 2-D offsets) or "none". The claims' families."""
    if posenc in ROPE_KIND:
        return "rotary"
    if posenc in RELATIVE:
        return "relative"
    return "additive" if posenc in ADDITIVE else "none"


ROPE_LAYOUTS = ("interleaved", "half")
ROPE_COORDS = ("index", "centered", "rescaled")
POOLS = ("cls", "mean", "map")
MAP_POOLS = ("map",)  # pools of pretrained architectures: a model with one is studied, not stacked
NORMS = ("layer", "rms")
APE_CODES = ("learned", "rowcol", "cell")
ROPE_VARIANTS = ("standard", "oblique", "head_split")
ROPE_BLOCKS = ("all", "first_half")
MLPS = ("mlp", "swiglu")
MLP_ACTS = ("gelu", "gelu_tanh", "quick_gelu")
# pieces of pretrained architectures (CLIP, EVA-02, DeiT distilled, ...), each off by default
# (timm's names in brackets); a model with any of them on trains and stacks nowhere, it is studied
ARCH_FIELDS = {
    "patch_norm": False,  # a LayerNorm on the patch embeddings, before position (patch_embed.norm)
    "norm_pre": False,  # a LayerNorm on the tokens entering block 0 (CLIP's ln_pre; norm_pre)
    "qk_norm": False,  # a LayerNorm over each head's q and k, before any rotation (q/k_norm)
    "attn_sub_norm": False,  # a LayerNorm on the heads' concatenated output, before proj (attn.norm)
    "mlp": "mlp",  # "mlp" fc1 -> act -> fc2; "swiglu" silu(fc1_g x) * fc1_x x -> fc2 (SwiGLU)
    "mlp_act": "gelu",  # the "mlp" activation: exact GELU, tanh GELU, or QuickGELU x sigmoid(1.702 x)
    "mlp_sub_norm": False,  # a LayerNorm on the MLP's hidden layer, before fc2 (mlp.norm)
    "final_norm": True,  # the LayerNorm on the tokens leaving the last block (norm)
    "fc_norm": False,  # a LayerNorm on the pooled vector, before the head (fc_norm)
    "head_dist": False,  # DeiT's distillation head: register 0 is the distillation token, read by
    # a second head; the logits are the mean of the two heads' (head_dist)
    # MAP attention pooling (pool "map", SigLIP / PE core; AttentionPoolLatent) and AIMv2's norms
    "pool_heads": 0,  # heads of the MAP latent's attention; 0: the blocks' (attn_pool.num_heads)
    "pool_mlp_ratio": 0.0,  # the MAP head's MLP width / dim; 0: the blocks' mlp_ratio
    "pool_prefix": False,  # the MAP latent attends over the prefix tokens too (Eva; include_prefix)
    "norm": "layer",  # every norm a LayerNorm, or "rms" an RMSNorm without bias (timm's RmsNorm)
    "proj_bias": True,  # biases on the attention output projection and the MLP linears (proj_bias)
}
# fields added after the first release, with the default that to_dict leaves out
LATER_FIELDS = {
    "rope_coords": "index", "ape_code": "learned", "rope_variant": "standard", "rope_blocks": "all",
    "sincos_temperature": 10000.0, **ARCH_FIELDS, "rope_ref_grid": 0, "rope_offset": 0.0,
}  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """Shape and positional encoding of one ViT.

    posenc: "ape" learned absolute; "sincos" fixed 2-D sinusoidal; "rope_axial" half the rotation
    planes of each head follow the column, half the row; "rope_mixed" learned 2-D frequencies per
    block/head/plane; "rope_axial_ape" / "rope_mixed_ape" the rotary encoding plus a learned absolute
    embedding (naver's RoPE+APE ViTs); "none".
    """

    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 1
    num_classes: int = 16  # 0: no classifier head (a backbone such as DINOv3)
    dim: int = 128
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    posenc: str = "rope_axial"
    # RoPE temperature: plane i of an axis turns theta^(-i / (planes per axis)) rad per patch.
    # Heo et al. use 100 (axial, 14x14 grid); on the default 8x8 grid the slowest planes then turn
    # by only 0.13 rad across the image, and theta 10 learned the relation task about 2x faster.
    rope_theta: float = 10.0
    # Plane p rotates channels (2p, 2p+1) ("interleaved") or (p, p + dh/2) ("half").
    rope_layout: str = "interleaved"
    # Rotary coordinates: "index" 0-based patch index; "centered" DINOv3's (2 i + 1) / n - 1 per axis
    # (in [-1, 1] whatever the grid), with angles 2 pi * coordinate * theta^(-i / (planes per
    # axis)); "rescaled" EVA's (index + rope_offset) * rope_ref_grid / n per axis (a grid of any
    # size spans the reference grid of pretraining: EVA-02, Perception Encoder, SBB RoPE ViTs).
    rope_coords: str = "index"
    # rotary coordinates "rescaled" (timm ref_feat_shape, rope_grid_offset): the reference grid
    # side (0 for other coordinates) and the offset added to each 0-based index before rescaling
    rope_ref_grid: int = 0
    rope_offset: float = 0.0
    # The additive table of posenc "ape": "learned" (initialised with ape_init_std), or a code
    # planted by construction and frozen, for calibration (METHODS.md, "Calibration"): "rowcol"
    # an additive row + column code (a random vector per row plus one per column), "cell" one
    # random orthogonal direction per grid cell (no row or column structure).
    ape_code: str = "learned"
    # Rotary calibration variants (see posenc.Rotary), for axial posencs (rope_axial[_ape]):
    # "standard", "oblique" (planes along the diagonals: no row/column split by construction),
    # "head_split" (each head's planes follow one axis: axis-specialised heads by construction).
    rope_variant: str = "standard"
    # Which blocks rotate: "all", or "first_half" (blocks [0, depth // 2); later blocks cannot
    # rebuild position through rotations, by construction).
    rope_blocks: str = "all"
    # Temperature of posenc "sincos": channel pair i of an axis turns temperature^(-i / (dim/4)) rad
    # per patch. 10000 is MAE's (a 14x14 grid, dim 768); at dim 32 on a 6x6 grid only the first two
    # or three of 8 pairs per axis then change across the image, and sincos learned the relation
    # task slowly and erratically (85-95% val at lr 6e-3 over three seeds); 100 reached 90% in
    # 650-750 steps on all three.
    sincos_temperature: float = 10000.0
    # Learned APE init std. timm uses 0.02; on the default task (600 steps, batch 64) APE reached
    # 27% / 31% val accuracy with std 0.02 at lr 1e-3 / 3e-3, 49% / 16% with std 0.3.
    ape_init_std: float = 0.3
    cls_token: bool = True
    num_registers: int = 0
    pool: str = "cls"
    qkv_bias: bool = True
    norm_eps: float = 1e-6
    # pieces of pretrained architectures: see ARCH_FIELDS
    patch_norm: bool = False
    norm_pre: bool = False
    qk_norm: bool = False
    attn_sub_norm: bool = False
    mlp: str = "mlp"
    mlp_act: str = "gelu"
    mlp_sub_norm: bool = False
    final_norm: bool = True
    fc_norm: bool = False
    head_dist: bool = False
    pool_heads: int = 0
    pool_mlp_ratio: float = 0.0
    pool_prefix: bool = False
    norm: str = "layer"
    proj_bias: bool = True

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "patch_size",
            "in_chans",
            "dim",
            "depth",
            "heads",
        ):
            positive_int(f"model.{name}", getattr(self, name))
        positive_int("model.num_registers", self.num_registers, allow_zero=True)
        positive_int("model.num_classes", self.num_classes, allow_zero=True)
        for name in ("mlp_ratio", "rope_theta", "norm_eps", "sincos_temperature"):
            positive_float(f"model.{name}", getattr(self, name))
        positive_float("model.ape_init_std", self.ape_init_std, allow_zero=True)
        bools = [n for n, v in ARCH_FIELDS.items() if isinstance(v, bool)]
        for name in ("cls_token", "qkv_bias", *bools):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"model.{name} must be true or false, got {getattr(self, name)!r}"
                )
        one_of("model.posenc", self.posenc, POSENCS)
        one_of("model.rope_layout", self.rope_layout, ROPE_LAYOUTS)
        one_of("model.rope_coords", self.rope_coords, ROPE_COORDS)
        positive_int("model.rope_ref_grid", self.rope_ref_grid, allow_zero=True)
        if isinstance(self.rope_offset, bool) or not isinstance(self.rope_offset, int | float):
            raise ConfigError(f"model.rope_offset must be a number, got {self.rope_offset!r}")
        finite_number("model.rope_offset", self.rope_offset)
        if (self.rope_coords == "rescaled") != (self.rope_ref_grid > 0):
            raise ConfigError(f"model.rope_ref_grid ({self.rope_ref_grid}) must be positive "
                              f"exactly when model.rope_coords is 'rescaled', got "
                              f"{self.rope_coords!r}")  # fmt: skip
        if self.rope_offset != 0.0 and self.rope_coords != "rescaled":
            raise ConfigError(f"model.rope_offset needs model.rope_coords 'rescaled', got "
                              f"{self.rope_coords!r}")  # fmt: skip
        one_of("model.ape_code", self.ape_code, APE_CODES)
        one_of("model.rope_variant", self.rope_variant, ROPE_VARIANTS)
        one_of("model.rope_blocks", self.rope_blocks, ROPE_BLOCKS)
        if self.rope_variant != "standard" and self.rope_kind != "axial":
            raise ConfigError(
                f"model.rope_variant {self.rope_variant!r} needs posenc 'rope_axial' or "
                f"'rope_axial_ape', got {self.posenc!r}"
            )
        if self.rope_blocks != "all" and not self.uses_rope:
            raise ConfigError(f"model.rope_blocks needs a rotary posenc, got {self.posenc!r}")
        if self.ape_code != "learned" and self.posenc != "ape":
            raise ConfigError(
                f"model.ape_code {self.ape_code!r} needs posenc 'ape', got {self.posenc!r}"
            )
        if self.sincos_temperature != 10000.0 and self.posenc != "sincos":
            raise ConfigError(
                f"model.sincos_temperature needs posenc 'sincos', got {self.posenc!r}"
            )
        one_of("model.pool", self.pool, POOLS)
        self._check_map_and_norm()
        one_of("model.mlp", self.mlp, MLPS)
        one_of("model.mlp_act", self.mlp_act, MLP_ACTS)
        if self.mlp == "swiglu" and self.mlp_act != "gelu":
            raise ConfigError(f"model.mlp_act {self.mlp_act!r} needs model.mlp 'mlp' (SwiGLU gates "
                              "with SiLU)")  # fmt: skip
        if self.head_dist and (self.pool != "cls" or not self.num_registers):
            raise ConfigError("model.head_dist needs model.pool 'cls' and a register (the "
                              "distillation token)")  # fmt: skip
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"model.image_size ({self.image_size}) is not divisible by "
                f"model.patch_size ({self.patch_size})"
            )
        if self.dim % self.heads:
            raise ConfigError(
                f"model.dim ({self.dim}) is not divisible by model.heads ({self.heads})"
            )
        if self.uses_rope and self.head_dim % 4:
            raise ConfigError(
                f"rotary encodings need a head dimension divisible by 4 (two axes x channel "
                f"pairs); model.dim / model.heads = {self.head_dim}"
            )
        if self.pool == "cls" and not self.cls_token:
            raise ConfigError("model.pool is 'cls' but model.cls_token is false")

    def _check_map_and_norm(self) -> None:
        """The MAP pool's fields (only with pool "map") and the norm kind."""
        positive_int("model.pool_heads", self.pool_heads, allow_zero=True)
        positive_float("model.pool_mlp_ratio", self.pool_mlp_ratio, allow_zero=True)
        one_of("model.norm", self.norm, NORMS)
        for name in ("pool_heads", "pool_mlp_ratio", "pool_prefix"):
            if getattr(self, name) != ARCH_FIELDS[name] and self.pool != "map":
                raise ConfigError(f"model.{name} needs model.pool 'map', got {self.pool!r}")
        if self.pool == "map" and self.dim % self.map_heads:
            raise ConfigError(f"model.dim ({self.dim}) is not divisible by model.pool_heads "
                              f"({self.map_heads})")  # fmt: skip

    @property
    def map_heads(self) -> int:
        """Heads of the MAP pool's attention (pool_heads, or the blocks' when 0)."""
        return self.pool_heads or self.heads

    @property
    def map_hidden(self) -> int:
        """Hidden width of the MAP pool's MLP (pool_mlp_ratio, or the blocks' when 0)."""
        return int(self.dim * (self.pool_mlp_ratio or self.mlp_ratio))

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid(self) -> int:
        """Patches per side at the training resolution."""
        return self.image_size // self.patch_size

    @property
    def num_prefix(self) -> int:
        """Tokens before the patches (CLS, registers); never rotated, excluded from spatial metrics."""
        return int(self.cls_token) + self.num_registers

    @property
    def rope_kind(self) -> str | None:
        """ "axial" (fixed per-axis frequencies), "mixed" (learned 2-D frequencies) or None."""
        return ROPE_KIND.get(self.posenc)

    @property
    def uses_rope(self) -> bool:
        return self.rope_kind is not None

    @property
    def uses_relpos(self) -> bool:
        """True when every block adds a relative position bias to its attention scores."""
        return self.posenc in RELATIVE

    @property
    def has_pos_table(self) -> bool:
        """True when a learned position table (APE) is added to the patch tokens."""
        return self.posenc in POS_TABLE

    @property
    def uses_additive_pos(self) -> bool:
        """True when a position embedding is added to the patch tokens (APE or sincos)."""
        return self.posenc in ADDITIVE

    @property
    def family(self) -> str:
        return posenc_family(self.posenc)

    def arch_pieces(self) -> list[str]:
        """The pretrained-architecture fields (ARCH_FIELDS) not at their default, in order, after
        "pool" where it is a pretrained architecture's (MAP_POOLS)."""
        pool = ["pool"] if self.pool in MAP_POOLS else []
        return pool + [n for n, v in ARCH_FIELDS.items() if getattr(self, n) != v]

    @property
    def scale(self) -> dict[str, int]:
        """What a verdict on this model describes: width, depth, heads and grid side."""
        return {"dim": self.dim, "depth": self.depth, "heads": self.heads,
                "grid": self.image_size // self.patch_size}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; fields added after the first release only when not at their
        default, so that configs (and the study's checkpoint hashes) written before they existed
        stay the same."""
        d = asdict(self)
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return from_dict(cls, d, "model")

    def canonical_json(self) -> str:
        """to_dict() as compact key-sorted JSON: the same config, the same text, in any process
        (fields added later are left out at their default, so older fingerprints stay valid)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """16 hex digits of sha256 over canonical_json(): which model the weights belong to."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def weights_metadata(self) -> dict[str, str]:
        """safetensors metadata that ties saved weights to this config (see config_mismatch)."""
        return {MODEL_CONFIG_KEY: self.canonical_json(), FINGERPRINT_KEY: self.fingerprint()}


MODEL_CONFIG_KEY, FINGERPRINT_KEY = "model_config", "model_fingerprint"


def config_mismatch(cfg: ModelConfig, metadata: dict[str, str]) -> str | None:
    """What `cfg` (a checkpoint's config.json) gets wrong about weights saved with `metadata`, as
    a phrase naming the first differing field; None when they agree or the weights carry no
    fingerprint (saved before fingerprints existed, or by another tool: unknown, not an error).

    Shapes are checked by load_state_dict; this catches what shapes cannot show: the encoding,
    rotary layout, theta, coordinates, norm eps, pooling, registers vs no registers of one size.
    """
    if MODEL_CONFIG_KEY not in metadata:
        saved_fp = metadata.get(FINGERPRINT_KEY)
        if saved_fp is None or saved_fp == cfg.fingerprint():
            return None
        return f"model fingerprint {cfg.fingerprint()} differs from the weights' {saved_fp}"
    from poslens.io import parse_json

    try:
        saved = ModelConfig.from_dict(parse_json(metadata[MODEL_CONFIG_KEY], "model_config"))
    except (CheckpointError, ConfigError) as e:
        return f"the model config stored with the weights is unreadable ({e})"
    for f in fields(cfg):
        ours, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if ours != theirs:
            return f"model.{f.name} is {ours!r} but the weights were saved with {theirs!r}"
    saved_fp = metadata.get(FINGERPRINT_KEY)
    if saved_fp is not None and saved_fp != saved.fingerprint():
        return "the weights' model fingerprint does not match their stored model config"
    return None
