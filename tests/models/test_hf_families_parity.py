"""Parity with Hugging Face transformers for the model types beyond ViT / DeiT (issue 50): a
random-weight model of each type, saved by save_pretrained into a tmp folder (safetensors,
offline), converted by poslens.load("hf:DIR"), gives transformers' final tokens and its logits
(or pooled / projected output) to 1e-5 in fp32, at a small size (image 32, patch 8, dim 32,
2 blocks, 2 heads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import poslens

if os.environ.get("POSLENS_FULL") == "1":
    import transformers  # CI installs the [transformers] extra: a missing one must fail, not skip
else:
    transformers = pytest.importorskip("transformers")

ATOL = 1e-5
SMALL: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    image_size=32, patch_size=8,
)  # fmt: skip
N = 3  # images per batch


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Vectors (biases, norm affines, layer scales), tokens and tables off their init so that a
    transposed, swapped or dropped one shows; matrices keep transformers' init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "embed" in name or "token" in name or "probe" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def save(model: torch.nn.Module, root: Path) -> torch.nn.Module:
    perturb(model)
    model.eval().save_pretrained(root, safe_serialization=True)
    return model


def images(size: int = 32, n: int = N) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def ours(root: Path, x: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """poslens' model of root and its (final tokens [B, T, D] after ln_final, the head's input
    [B, D], logits) on x."""
    model = poslens.load(f"hf:{root}")
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.ln_final.register_forward_hook(lambda _m, _i, o: seen.__setitem__("tokens", o)),
        model.head.register_forward_pre_hook(lambda _m, i: seen.__setitem__("pooled", i[0])),
    ]
    with torch.no_grad():
        logits = model(x)
    for h in hooks:
        h.remove()
    return model, seen["tokens"], seen["pooled"], logits


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, asserted <= ATOL."""
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float((a - b).abs().max())
    assert diff <= ATOL, diff
    return diff


# ---------------------------------------------------------------- ViT layout: msn, mae, ijepa
def test_vit_msn_classifier(tmp_path: Path) -> None:
    cfg = transformers.ViTMSNConfig(**SMALL, num_labels=5)
    hf = save(transformers.ViTMSNForImageClassification(cfg), tmp_path)
    x = images()
    model, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        last = hf.vit(x).last_hidden_state
    close(tokens, last)
    close(logits, out.logits)
    assert model.cfg.norm_eps == 1e-6 and model.cfg.pool == "cls"


def test_vit_msn_backbone(tmp_path: Path) -> None:
    hf = save(transformers.ViTMSNModel(transformers.ViTMSNConfig(**SMALL)), tmp_path)
    x = images()
    _, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        close(tokens, hf(x).last_hidden_state)
    assert logits.shape == (N, 0)


@pytest.mark.parametrize("arch", ["ViTMAEModel", "ViTMAEForPreTraining"])
def test_vit_mae_encoder_without_masking(arch: str, tmp_path: Path) -> None:
    """poslens is HF's encoder with mask_ratio 0 and noise arange(N): every patch, in order."""
    cfg = transformers.ViTMAEConfig(**SMALL, decoder_hidden_size=16, decoder_num_hidden_layers=1,
                                    decoder_num_attention_heads=2, decoder_intermediate_size=32)  # fmt: skip
    hf = save(getattr(transformers, arch)(cfg), tmp_path)
    encoder = getattr(hf, "vit", hf)
    encoder.config.mask_ratio = 0.0
    x = images()
    model, tokens, _, logits = ours(tmp_path, x)
    noise = torch.arange(16.0).expand(N, -1)  # argsort: the identity order
    with torch.no_grad():
        close(tokens, encoder(x, noise=noise).last_hidden_state)
    assert logits.shape == (N, 0) and model.cfg.num_classes == 0


def test_ijepa_classifier_mean_pools_without_cls(tmp_path: Path) -> None:
    cfg = transformers.IJepaConfig(**SMALL, num_labels=4)
    hf = save(transformers.IJepaForImageClassification(cfg), tmp_path)
    x = images()
    model, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        close(tokens, hf.ijepa(x).last_hidden_state)
        close(logits, hf(x).logits)
    assert not model.cfg.cls_token and model.cfg.pool == "mean" and model.cfg.num_prefix == 0


def test_ijepa_backbone(tmp_path: Path) -> None:
    hf = save(transformers.IJepaModel(transformers.IJepaConfig(**SMALL)), tmp_path)
    x = images()
    _, tokens, _, _ = ours(tmp_path, x)
    with torch.no_grad():
        close(tokens, hf(x).last_hidden_state)


# ---------------------------------------------------------------- DINOv2 (with registers)
DINO: dict[str, Any] = {k: v for k, v in SMALL.items() if k != "intermediate_size"}


@pytest.mark.parametrize(
    "config,model_cls,extra",
    [
        ("Dinov2Config", "Dinov2Model", {}),
        ("Dinov2Config", "Dinov2Model", {"use_swiglu_ffn": True}),
        ("Dinov2Config", "Dinov2Model", {"mlp_ratio": 3, "qkv_bias": False}),
        ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {}),
        ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 2, "use_swiglu_ffn": True}),
    ],
)  # fmt: skip
def test_dinov2_backbones(
    config: str, model_cls: str, extra: dict[str, Any], tmp_path: Path
) -> None:
    """LayerScale folded, SwiGLU split, registers after CLS without position: HF's tokens."""
    cfg = getattr(transformers, config)(**DINO, **extra)
    hf = save(getattr(transformers, model_cls)(cfg), tmp_path)
    x = images()
    model, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        out = hf(x)
    close(tokens, out.last_hidden_state)
    close(tokens[:, 0], out.pooler_output)
    assert logits.shape == (N, 0) and model.cfg.mlp == (
        "swiglu" if extra.get("use_swiglu_ffn") else "mlp"
    )
    assert model.cfg.num_registers == (
        extra.get("num_register_tokens", 4) if "Registers" in config else 0
    )


def test_dinov2_module_names_load_the_same(tmp_path: Path) -> None:
    """A file of the transformers 5 module names (attention.q_proj, mlp.gate_proj, ...), as a
    state_dict saved directly holds them, converts to the same model."""
    from safetensors.torch import save_file

    cfg = transformers.Dinov2WithRegistersConfig(**DINO, use_swiglu_ffn=True)
    hf = save(transformers.Dinov2WithRegistersModel(cfg), tmp_path)
    live = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "encoder.layer.0.mlp.gate_proj.weight" in live
    save_file(live, tmp_path / "model.safetensors")
    x = images()
    _, tokens, _, _ = ours(tmp_path, x)
    with torch.no_grad():
        close(tokens, hf(x).last_hidden_state)


# ---------------------------------------------------------------- CLIP image towers
def test_clip_vision_model(tmp_path: Path) -> None:
    """norm_pre, no final norm (HF's last_hidden_state), post_layernorm on CLS (pooler_output)."""
    cfg = transformers.CLIPVisionConfig(**SMALL)
    hf = save(transformers.CLIPVisionModel(cfg), tmp_path)
    x = images()
    model, tokens, pooled, logits = ours(tmp_path, x)
    with torch.no_grad():
        out = hf(x)
    close(tokens, out.last_hidden_state)
    close(pooled, out.pooler_output)
    assert logits.shape == (N, 0) and model.cfg.mlp_act == "quick_gelu" and model.cfg.norm_pre


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_vision_model_with_projection(act: str, tmp_path: Path) -> None:
    cfg = transformers.CLIPVisionConfig(**SMALL, projection_dim=12, hidden_act=act)
    hf = save(transformers.CLIPVisionModelWithProjection(cfg), tmp_path)
    x = images()
    model, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        out = hf(x)
    close(tokens, out.last_hidden_state)
    close(logits, out.image_embeds)
    assert model.cfg.num_classes == 12


def _clip_config(**vision: Any) -> Any:
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=50, max_position_embeddings=8)  # fmt: skip
    return transformers.CLIPConfig(
        text_config=text, vision_config={**SMALL, **vision}, projection_dim=12
    )


def test_full_clip_model_is_its_image_tower(tmp_path: Path) -> None:
    """A CLIPModel folder: vision_model.* and visual_projection; the text tower is dropped, and
    so are the position_ids buffers (int64 arange) of files converted from older pickles."""
    from safetensors.torch import load_file, save_file

    hf = save(transformers.CLIPModel(_clip_config()), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    state["text_model.embeddings.position_ids"] = torch.arange(8)[None]
    save_file(state, tmp_path / "model.safetensors")
    x = images()
    _, tokens, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        vision = hf.vision_model(x)
        embeds = hf.visual_projection(vision.pooler_output)
    close(tokens, vision.last_hidden_state)
    close(logits, embeds)


def test_clip_classifier_mean_pools_without_final_norm(tmp_path: Path) -> None:
    cfg = _clip_config()
    cfg.num_labels = 4
    hf = save(transformers.CLIPForImageClassification(cfg), tmp_path)
    x = images()
    model, _, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        close(logits, hf(x).logits)
    assert model.cfg.pool == "mean" and not model.cfg.final_norm


# ---------------------------------------------------------------- SigLIP and SigLIP 2 towers
def _text() -> dict[str, Any]:
    return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=50, max_position_embeddings=8)  # fmt: skip


@pytest.mark.parametrize("use_head", [True, False])
def test_siglip_vision_model_map_head(use_head: bool, tmp_path: Path) -> None:
    """post_layernorm on every token (ln_final), the MAP head's output is HF's pooler_output."""
    cfg = transformers.SiglipVisionConfig(**SMALL, vision_use_head=use_head)
    hf = save(transformers.SiglipVisionModel(cfg), tmp_path)
    x = images()
    model, tokens, pooled, logits = ours(tmp_path, x)
    with torch.no_grad():
        out = hf(x)
    close(tokens, out.last_hidden_state)
    if use_head:
        close(pooled, out.pooler_output)
    assert logits.shape == (N, 0) and model.cfg.pool == ("map" if use_head else "mean")
    assert not model.cfg.cls_token and model.cfg.mlp_act == "gelu_tanh"


def test_full_siglip_model_is_its_image_tower(tmp_path: Path) -> None:
    cfg = transformers.SiglipConfig(text_config=_text(), vision_config=SMALL)
    hf = save(transformers.SiglipModel(cfg), tmp_path)
    x = images()
    _, tokens, pooled, _ = ours(tmp_path, x)
    with torch.no_grad():
        out = hf.vision_model(x)
    close(tokens, out.last_hidden_state)
    close(pooled, out.pooler_output)


def test_siglip_classifier_mean_pools(tmp_path: Path) -> None:
    cfg = transformers.SiglipConfig(text_config=_text(), vision_config=SMALL)
    cfg.num_labels = 3
    hf = save(transformers.SiglipForImageClassification(cfg), tmp_path)
    x = images()
    model, _, _, logits = ours(tmp_path, x)
    with torch.no_grad():
        close(logits, hf(x).logits)
    assert model.cfg.pool == "mean" and model.cfg.num_classes == 3


V2: dict[str, Any] = {**{k: v for k, v in SMALL.items() if k != "image_size"}, "num_patches": 16}


def patchify(x: torch.Tensor, p: int) -> tuple[torch.Tensor, ...]:
    """Siglip2ImageProcessor's patches of square images [B, C, H, W]: ([B, N, P*P*C] patches,
    each row by row with channels last; the full attention mask [B, N]; spatial_shapes [B, 2])."""
    B, C, H, W = x.shape
    patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(B, (H // p) * (W // p), p * p * C)
    mask = torch.ones(B, patches.shape[1], dtype=torch.long)
    return patches, mask, torch.tensor([[H // p, W // p]] * B)


def test_siglip2_vision_model_at_its_square_grid(tmp_path: Path) -> None:
    hf = save(transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**V2)), tmp_path)
    x = images()
    model, tokens, pooled, _ = ours(tmp_path, x)
    patches, mask, shapes = patchify(x, 8)
    with torch.no_grad():
        out = hf(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes)
    close(tokens, out.last_hidden_state)
    close(pooled, out.pooler_output)
    assert model.cfg.image_size == 32 and model.cfg.grid == 4


def test_full_siglip2_model_and_classifier(tmp_path: Path) -> None:
    cfg = transformers.Siglip2Config(text_config=_text(), vision_config=V2)
    hf = save(transformers.Siglip2Model(cfg), tmp_path / "model")
    x = images()
    patches, mask, shapes = patchify(x, 8)
    _, tokens, pooled, _ = ours(tmp_path / "model", x)
    with torch.no_grad():
        out = hf.vision_model(
            pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes
        )
    close(tokens, out.last_hidden_state)
    close(pooled, out.pooler_output)
    cfg.num_labels = 3
    hf = save(transformers.Siglip2ForImageClassification(cfg), tmp_path / "classifier")
    _, _, _, logits = ours(tmp_path / "classifier", x)
    with torch.no_grad():
        theirs = hf(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes)
    close(logits, theirs.logits)


@pytest.mark.parametrize("config,model_cls", [("Dinov2Config", "Dinov2Model"),
                                              ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel")])  # fmt: skip
def test_dinov2_converted_at_its_processors_crop(
    config: str, model_cls: str, tmp_path: Path
) -> None:
    """facebook/dinov2-*: image_size 518, a 224 crop. A folder whose preprocessor_config.json
    crops to another side is converted for that side, its table resized as HF's forward does."""
    import json

    cfg = getattr(transformers, config)(**{**DINO, "image_size": 64})  # grid 8
    hf = save(getattr(transformers, model_cls)(cfg), tmp_path)
    proc = {"image_processor_type": "BitImageProcessor", "do_center_crop": True,
            "crop_size": {"height": 32, "width": 32}, "size": {"shortest_edge": 36}}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(proc))
    x = images(32)
    model, tokens, _, _ = ours(tmp_path, x)
    with torch.no_grad():
        close(tokens, hf(x).last_hidden_state)
    assert (model.cfg.image_size, model.cfg.grid) == (32, 4)


# ---------------------------------------------------------------- hooks on converted models
@pytest.mark.parametrize(
    "build,prefix",
    [
        (lambda: transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(**DINO)), 5),
        (lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL)), 1),
        (lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL)), 0),
        (lambda: transformers.IJepaModel(transformers.IJepaConfig(**SMALL)), 0),
    ],
)  # fmt: skip
def test_hook_vocabulary_on_converted_models(build: Any, prefix: int, tmp_path: Path) -> None:
    """The usual hook points read the converted models: [B, N, D] patch embeddings, [B, T, D]
    residuals and final tokens, [B, H, T, T] attention patterns (T = prefix tokens + patches)."""
    save(build(), tmp_path)
    model = poslens.load(f"hf:{tmp_path}")
    x, T = images(), prefix + 16
    sites = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.attn.hook_pattern",
             "blocks.1.hook_resid_post", "ln_final.hook_normalized"]  # fmt: skip
    with torch.no_grad():
        _, cache = model.run_with_cache(x, sites)
    assert cache["hook_embed"].shape == (N, 16, 32)
    assert cache["blocks.0.hook_resid_pre"].shape == (N, T, 32)
    assert cache["blocks.1.attn.hook_pattern"].shape == (N, 2, T, T)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"].sum(-1), torch.ones(N, 2, T))
    assert cache["ln_final.hook_normalized"].shape == (N, T, 32)
    assert model.cfg.num_prefix == prefix
