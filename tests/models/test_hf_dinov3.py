"""Numerical parity of hf:DIR with Hugging Face transformers for DINOv3 ViT: random-weight
folders written here by save_pretrained (safetensors, offline) at a small size give
transformers' every block output, final tokens and pooled CLS to 1e-5, with and without
registers, k bias, gated (SwiGLU) MLP, bias-free projections, at the config's grid and at
another one (RoPE on centred coordinates), in both key-name generations."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import poslens

if os.environ.get("POSLENS_FULL") == "1":
    import transformers  # CI installs the [transformers] extra: a missing one must fail, not skip
else:
    transformers = pytest.importorskip("transformers")

SMALL: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    image_size=32, patch_size=8,
)  # fmt: skip
ATOL = 1e-5

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "model": ("DINOv3ViTModel", {}),
    "registers_k_bias": ("DINOv3ViTModel", dict(num_register_tokens=4, key_bias=True)),
    "gated_silu": ("DINOv3ViTModel", dict(use_gated_mlp=True, hidden_act="silu", num_register_tokens=2)),
    "no_biases": ("DINOv3ViTModel", dict(query_bias=False, value_bias=False, proj_bias=False,
                                         mlp_bias=False, num_register_tokens=1)),
    "mlp_bias_only": ("DINOv3ViTModel", dict(proj_bias=False, rope_theta=10.0)),
    "backbone": ("DINOv3ViTBackbone", dict(num_register_tokens=4)),
}  # fmt: skip


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Biases, norms, layer scales and tokens off their init (zeros, ones, constants), so that a
    transposed, swapped or dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "embeddings" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def write(case: str, root: Path, seed: int = 0) -> torch.nn.Module:
    cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(transformers.DINOv3ViTConfig(**{**SMALL, **extra})).eval()
    perturb(model, seed)
    model.save_pretrained(root, safe_serialization=True)
    return model


def max_diff(ours: poslens.models.ViT, model: torch.nn.Module, side: int, n: int = 3) -> float:
    """The largest |poslens - transformers| over every block's output, the final tokens and the
    pooled CLS token on n random images of side `side`."""
    x = torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(1))
    depth = ours.cfg.depth
    base = model if isinstance(model, transformers.DINOv3ViTModel) else None
    with torch.no_grad():
        if base is None:  # the backbone: the last stage's tokens through the shared norm
            out = model(x, output_hidden_states=True)
            last, hidden = out.last_hidden_state, list(out.hidden_states)
            pooled = last[:, 0]
        else:
            out = model(x, output_hidden_states=True)
            last, hidden, pooled = out.last_hidden_state, list(out.hidden_states), out.pooler_output
        sites = [f"blocks.{b}.hook_resid_post" for b in range(depth)] + ["ln_final.hook_normalized"]
        logits, cache = ours.run_with_cache(x, sites)
    assert logits.shape == (n, 0)
    pairs = [
        (cache["ln_final.hook_normalized"], last),
        (cache["ln_final.hook_normalized"][:, 0], pooled),
    ]
    pairs += [(cache[f"blocks.{b}.hook_resid_post"], hidden[-depth:][b]) for b in range(depth)]
    for a, b in pairs:
        assert a.shape == b.shape
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    model = write(case, tmp_path)
    ours = poslens.load(f"hf:{tmp_path}")
    for side in (32, 48):  # the config's 4 x 4 grid, and a 6 x 6 one
        assert max_diff(ours, model, side) <= ATOL
    cfg, extra = ours.cfg, CASES[case][1]
    assert (cfg.posenc, cfg.rope_layout, cfg.rope_coords) == ("rope_axial", "half", "centered")
    assert cfg.num_registers == extra.get("num_register_tokens", 0) and cfg.num_classes == 0
    assert cfg.mlp == ("swiglu" if extra.get("use_gated_mlp") else "mlp")


def test_transformers_5_module_names_match(tmp_path: Path) -> None:
    """A file saved from the live modules' state_dict (model.layer.i.*) converts the same."""
    model = write("registers_k_bias", tmp_path)
    live = {k: v.contiguous() for k, v in model.state_dict().items()}
    if set(live) == set(load_file(tmp_path / "model.safetensors")):
        pytest.skip(f"transformers {transformers.__version__} saves the names its modules use")
    save_file(live, tmp_path / "model.safetensors")
    assert max_diff(poslens.load(f"hf:{tmp_path}"), model, 32) <= ATOL


def test_rotary_hooks_work_on_the_converted_model(tmp_path: Path) -> None:
    """The converted DINOv3 is a poslens ViT: zeroing its rotations (cos 1, sin 0 through
    hook_rotary) changes the output, and the CLS / registers' rows are the identity."""
    write("registers_k_bias", tmp_path)
    ours = poslens.load(f"hf:{tmp_path}")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))

    def no_rotation(t: torch.Tensor, _name: str) -> torch.Tensor:
        return torch.stack([torch.ones_like(t[0]), torch.zeros_like(t[1])])

    with torch.no_grad():
        _, cache = ours.run_with_cache(x, ["blocks.0.attn.hook_rotary", "ln_final.hook_normalized"])
        table = cache["blocks.0.attn.hook_rotary"]  # [2, H, T, P]
        assert torch.equal(table[0, :, :5], torch.ones_like(table[0, :, :5]))  # CLS + 4 registers
        with ours.hooks([(f"blocks.{b}.attn.hook_rotary", no_rotation) for b in range(2)]):
            _, flat = ours.run_with_cache(x, ["ln_final.hook_normalized"])
    assert not torch.allclose(flat["ln_final.hook_normalized"], cache["ln_final.hook_normalized"])


def test_small_width_at_224_px(tmp_path: Path) -> None:
    """DINOv3 ViT-S's width, heads and 4 registers on its 14 x 14 grid (two blocks)."""
    base = dict(hidden_size=384, num_attention_heads=6, intermediate_size=1536, image_size=224,
                patch_size=16, num_register_tokens=4)  # fmt: skip
    CASES["small"] = ("DINOv3ViTModel", base)
    try:
        model = write("small", tmp_path)
    finally:
        del CASES["small"]
    ours = poslens.load(f"hf:{tmp_path}")
    assert (ours.cfg.dim, ours.cfg.heads, ours.cfg.grid, ours.cfg.num_registers) == (384, 6, 14, 4)
    assert max_diff(ours, model, 224, n=1) <= ATOL
