"""Numerical parity with Hugging Face transformers: random-weight ViT / DeiT folders written here
by save_pretrained (safetensors, offline), converted by poslens.load("hf:DIR"), give the logits and
every block's residual of transformers' own forward to 1e-4, for every layout and both key-name
generations, at a reduced size and at ViT-B size (768 wide, 12 blocks, 224 px)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import poslens
from poslens.models import ModelConfig

if os.environ.get("POSLENS_FULL") == "1":
    import transformers  # CI installs the [transformers] extra: a missing one must fail, not skip
else:
    transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    image_size=16, patch_size=4,
)  # fmt: skip
VIT_B: dict[str, int] = {}  # ViTConfig's defaults are ViT-B/16 at 224 px
ATOL = 1e-4


def _vit_model(cfg: object) -> torch.nn.Module:
    return transformers.ViTModel(cfg)  # with its pooler (as google/vit-base-patch16-224-in21k)


def _deit_backbone(cfg: object) -> torch.nn.Module:
    # what the refusal of DeiTForImageClassificationWithTeacher suggests: study its .deit
    return transformers.DeiTForImageClassificationWithTeacher(cfg).deit


# layout -> (config class, model builder, has a classifier, key prefix to add to the saved file)
LAYOUTS: dict[str, tuple[str, Callable[[object], torch.nn.Module], bool, str]] = {
    "vit": ("ViTConfig", lambda c: transformers.ViTForImageClassification(c), True, ""),
    "vit_model": ("ViTConfig", _vit_model, False, ""),
    "vit_model_prefixed": ("ViTConfig", _vit_model, False, "vit."),
    "deit": ("DeiTConfig", lambda c: transformers.DeiTForImageClassification(c), True, ""),
    "deit_distilled_backbone": ("DeiTConfig", _deit_backbone, False, ""),
}

# old (transformers 4, and what transformers 5 still writes) -> new (transformers 5 modules)
OLD_TO_NEW = (
    ("encoder.layer.", "layers."),
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
    ("intermediate.dense.", "mlp.fc1."),
    ("output.dense.", "mlp.fc2."),
)


def rename(key: str, to_new: bool) -> str:
    """One tensor name in the other key-name generation."""
    if ".pooler." in f".{key}" or key.startswith(("classifier", "cls_", "distillation_")):
        return key
    for old, new in OLD_TO_NEW if to_new else reversed(OLD_TO_NEW):
        key = key.replace(old, new) if to_new else key.replace(new, old)
    return key


def is_new(keys: object) -> bool:
    return any(".layers.0." in f".{k}" for k in keys)  # type: ignore[attr-defined]


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Biases, LayerNorm affines, tokens and position table off their init (zeros / ones), so
    that a transposed, swapped or dropped one shows; matrices keep transformers' init (std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "embeddings" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def write(layout: str, size: dict[str, int], root: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight HF model of `layout` saved into root (old key names as save_pretrained
    writes them, with the layout's prefix); returns the model, in eval mode."""
    config_cls, build, has_head, prefix = LAYOUTS[layout]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**size, num_labels=5 if has_head else 2)
    model = build(cfg).eval()
    perturb(model, seed)
    model.save_pretrained(root, safe_serialization=True)
    if prefix:
        path = root / "model.safetensors"
        save_file({prefix + k: v for k, v in load_file(path).items()}, path)
    return model


def to_generation(root: Path, new: bool) -> None:
    """Rewrite root's model.safetensors in the old or the new key names."""
    path = root / "model.safetensors"
    state = load_file(path)
    if is_new(state) != new:
        save_file({rename(k, new): v for k, v in state.items()}, path)


def hf_forward(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor]:
    """One transformers forward: (logits [B, classes] or None for a backbone, hidden states
    [B, T, D] after the embeddings and after each block, the final LayerNorm's output)."""
    base = getattr(model, "vit", None) or getattr(model, "deit", None) or model
    seen: list[torch.Tensor] = []
    hook = base.layernorm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        with torch.no_grad():
            out = model(x, output_hidden_states=True)
    finally:
        hook.remove()
    return getattr(out, "logits", None), list(out.hidden_states), seen[0]


def check_parity(model: torch.nn.Module, root: Path, image_size: int, n: int) -> ModelConfig:
    """poslens.load("hf:ROOT") against transformers' forward on n images; its config."""
    ours = poslens.load(f"hf:{root}")
    depth = ours.cfg.depth
    x = torch.randn(n, 3, image_size, image_size, generator=torch.Generator().manual_seed(1))
    logits, hidden, last = hf_forward(model, x)
    sites = ["blocks.0.hook_resid_pre", "ln_final.hook_normalized"]
    sites += [f"blocks.{b}.hook_resid_post" for b in range(depth)]
    with torch.no_grad():
        our_logits, cache = ours.run_with_cache(x, sites)
    assert len(hidden) == depth + 1
    close = dict(atol=ATOL, rtol=0.0)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], hidden[0], **close)
    for b in range(depth):
        torch.testing.assert_close(cache[f"blocks.{b}.hook_resid_post"], hidden[b + 1], **close)
    torch.testing.assert_close(cache["ln_final.hook_normalized"], last, **close)
    if logits is None:
        assert our_logits.shape == (n, 0) and ours.cfg.num_classes == 0
    else:
        torch.testing.assert_close(our_logits, logits, **close)
        assert ours.cfg.num_classes == logits.shape[1]
    return ours.cfg


@pytest.mark.parametrize("generation", ["old", "new"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reduced_size_matches_transformers(layout: str, generation: str, tmp_path: Path) -> None:
    model = write(layout, SMALL, tmp_path)
    to_generation(tmp_path, generation == "new")
    cfg = check_parity(model, tmp_path, SMALL["image_size"], n=3)
    assert cfg.norm_eps == 1e-12 and cfg.posenc == "ape" and cfg.pool == "cls"
    assert cfg.num_registers == (1 if layout.startswith("deit") else 0)  # the distillation token


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vit_b_size_matches_transformers(layout: str, tmp_path: Path) -> None:
    model = write(layout, VIT_B, tmp_path)
    cfg = check_parity(model, tmp_path, 224, n=1)
    assert (cfg.dim, cfg.depth, cfg.heads, cfg.grid, cfg.mlp_ratio) == (768, 12, 12, 14, 4.0)


def test_new_key_names_are_the_installed_transformers_module_names(tmp_path: Path) -> None:
    """The renaming the tests use for the other generation is the real one: in transformers 5 the
    modules' own state_dict has the new names while save_pretrained writes the old ones."""
    model = write("vit", SMALL, tmp_path)
    saved, live = set(load_file(tmp_path / "model.safetensors")), set(model.state_dict())
    if is_new(live) == is_new(saved):
        pytest.skip(f"transformers {transformers.__version__} saves the names its modules use")
    assert {rename(k, is_new(live)) for k in saved} == live
