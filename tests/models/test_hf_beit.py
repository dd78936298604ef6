"""Numerical parity of hf:DIR with Hugging Face transformers for BEiT and data2vec-vision:
random-weight folders written here by save_pretrained (safetensors, offline) at a small size give
transformers' logits, every block's output, the final tokens and the pooled vector to 1e-5, for
relative position bias (per block, shared, both), absolute embeddings, none, mean pooling or CLS,
with and without layer scale, the masked-image-modelling model as a backbone, and both key-name
generations."""

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
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    image_size=32, patch_size=8,
)  # fmt: skip
ATOL = 1e-5
REL = dict(use_relative_position_bias=True)
SHARED = dict(use_shared_relative_position_bias=True)
APE = dict(use_absolute_position_embeddings=True)
# BEiT-B / 16 at 224 px, two blocks (the defaults of write's SMALL overridden)
BASE = dict(
    hidden_size=768, num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16
)

# case -> (model class, config fields beyond SMALL)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "beit_cls_relpos_mean": ("BeitForImageClassification", REL),
    "beit_cls_relpos_cls_token": ("BeitForImageClassification", {**REL, "use_mean_pooling": False}),
    "beit_cls_ape_no_layer_scale": ("BeitForImageClassification", {**APE, "layer_scale_init_value": 0.0}),
    "beit_model_shared_cls_token": ("BeitModel", {**SHARED, "use_mean_pooling": False}),
    "beit_model_both_tables_mean": ("BeitModel", {**REL, **SHARED}),
    "beit_model_no_position": ("BeitModel", {"hidden_act": "gelu_pytorch_tanh"}),
    "beit_mim_shared": ("BeitForMaskedImageModeling", {**SHARED, "vocab_size": 11}),
    "data2vec_cls_relpos_mean": ("Data2VecVisionForImageClassification", REL),
    "data2vec_model_ape_cls_token": ("Data2VecVisionModel", {**APE, "use_mean_pooling": False}),
    "data2vec_model_shared_mean": ("Data2VecVisionModel", SHARED),
}  # fmt: skip


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Biases, norms, layer scales, tokens, position and relative tables off their init (zeros,
    ones, constants), so that a transposed, swapped or dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "embeddings" in name or "relative_position" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def write(case: str, root: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight transformers model of `case` saved into root; returns it in eval mode."""
    cls, extra = CASES[case]
    config_cls = "Data2VecVisionConfig" if cls.startswith("Data2Vec") else "BeitConfig"
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**SMALL, **extra}, num_labels=5)
    model = getattr(transformers, cls)(cfg).eval()
    perturb(model, seed)
    model.save_pretrained(root, safe_serialization=True)
    return model


def hf_outputs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' logits (classifier), block outputs, final tokens and pooled vector."""
    base = getattr(model, "beit", None) or getattr(model, "data2vec_vision", None) or model
    with torch.no_grad():
        out = base(x, output_hidden_states=True)
        logits = model(x).logits if hasattr(model, "classifier") else None
    got = {"hidden": list(out.hidden_states), "last": out.last_hidden_state}
    if isinstance(model, transformers.BeitForMaskedImageModeling):
        with torch.no_grad():
            got["last"] = model.layernorm(out.last_hidden_state)  # what lm_head reads
    if getattr(out, "pooler_output", None) is not None:
        got["pooled"] = out.pooler_output
    if logits is not None:
        got["logits"] = logits
    return got


def max_diff(ours: poslens.models.ViT, model: torch.nn.Module, n: int = 3) -> float:
    """The largest |poslens - transformers| over the logits, every block's output, the final
    tokens and the pooled vector, on n random images."""
    cfg = ours.cfg
    x = torch.randn(
        n, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(1)
    )
    theirs = hf_outputs(model, x)
    last = (
        "ln_final.hook_normalized" if cfg.final_norm else f"blocks.{cfg.depth - 1}.hook_resid_post"
    )
    sites = [f"blocks.{b}.hook_resid_post" for b in range(cfg.depth)] + [last]
    if cfg.fc_norm:
        sites.append("fc_norm.hook_normalized")
    with torch.no_grad():
        logits, cache = ours.run_with_cache(x, sites)
    pairs = [(cache[last], theirs["last"])]
    hidden = theirs["hidden"][-cfg.depth :]  # after each block
    pairs += [(cache[f"blocks.{b}.hook_resid_post"], hidden[b]) for b in range(cfg.depth)]
    if "pooled" in theirs:
        pooled = cache["fc_norm.hook_normalized"] if cfg.fc_norm else cache[last][:, 0]
        pairs.append((pooled, theirs["pooled"]))
    if "logits" in theirs:  # with hooks on the last block, and without (CLS exit where pooled)
        with torch.no_grad():
            plain = ours(x)
        pairs += [(logits, theirs["logits"]), (plain, theirs["logits"])]
    else:
        assert logits.shape == (n, 0)
    for a, b in pairs:
        assert a.shape == b.shape
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    model = write(case, tmp_path)
    ours = poslens.load(f"hf:{tmp_path}")
    assert max_diff(ours, model) <= ATOL
    cls, extra = CASES[case]
    cfg = ours.cfg
    rel = extra.get("use_relative_position_bias") or extra.get("use_shared_relative_position_bias")
    assert cfg.posenc == ("relpos" if rel else "ape" if "use_absolute_position_embeddings" in extra
                          else "none")  # fmt: skip
    mean = extra.get("use_mean_pooling", True) and "MaskedImage" not in cls
    pooler = any(
        k.endswith("pooler.layernorm.weight") for k in load_file(tmp_path / "model.safetensors")
    )
    assert (cfg.pool, cfg.fc_norm, cfg.final_norm) == (("mean", pooler, False) if mean
                                                       else ("cls", False, True))  # fmt: skip
    assert cfg.num_classes == (5 if "Classification" in cls else 0)


@pytest.mark.parametrize("case", ["beit_cls_relpos_mean", "beit_model_both_tables_mean"])
def test_transformers_5_module_names_match(case: str, tmp_path: Path) -> None:
    """A file saved from the live modules' state_dict (transformers 5 names: layers.i.*_proj,
    mlp.fc1, layers.i.relative_position_bias, shared_position_bias) converts the same."""
    model = write(case, tmp_path)
    live = {k: v.contiguous() for k, v in model.state_dict().items()}
    if set(live) == set(load_file(tmp_path / "model.safetensors")):
        pytest.skip(f"transformers {transformers.__version__} saves the names its modules use")
    save_file(live, tmp_path / "model.safetensors")
    assert max_diff(poslens.load(f"hf:{tmp_path}"), model) <= ATOL


def test_backbone_saved_without_pooler(tmp_path: Path) -> None:
    """BeitModel(add_pooling_layer=False) with mean pooling: no norm on the final tokens nor on
    their mean; poslens pools the mean without fc_norm."""
    cfg = transformers.BeitConfig(**SMALL, **REL)
    torch.manual_seed(0)
    model = transformers.BeitModel(cfg, add_pooling_layer=False).eval()
    perturb(model, 0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = poslens.load(f"hf:{tmp_path}")
    assert (ours.cfg.pool, ours.cfg.fc_norm, ours.cfg.final_norm) == ("mean", False, False)
    assert max_diff(ours, model) <= ATOL


def test_hooks_read_and_zero_the_relative_bias(tmp_path: Path) -> None:
    """The converted BEiT is a poslens ViT: hook_rel_bias holds each block's whole bias (its own
    table plus the shared one) and zeroing it changes the output."""
    model = write("beit_model_both_tables_mean", tmp_path)
    ours = poslens.load(f"hf:{tmp_path}")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    site = "blocks.0.attn.hook_rel_bias"
    with torch.no_grad():
        _, cache = ours.run_with_cache(x, [site, "blocks.1.hook_resid_post"])
        shared = model.shared_position_bias(model.shared_position_bias.window_size)[0]
        own = model.layers[0].relative_position_bias(model.shared_position_bias.window_size)[0]
        torch.testing.assert_close(cache[site], shared + own, atol=1e-6, rtol=0)
        with ours.hooks([(site, lambda t, _hook: torch.zeros_like(t))]):
            _, zeroed = ours.run_with_cache(x, ["blocks.1.hook_resid_post"])
    assert not torch.allclose(zeroed["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_post"])


def test_older_files_with_index_buffers_load(tmp_path: Path) -> None:
    """Files saved by older transformers carry each table's integer relative_position_index
    (int64, rebuilt by the forward): dropped, with the same parity."""
    model = write("data2vec_cls_relpos_mean", tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    tables = [k for k in state if k.endswith("relative_position_bias_table")]
    assert tables
    for k in tables:
        index = k.replace("relative_position_bias_table", "relative_position_index")
        state[index] = torch.zeros(17, 17, dtype=torch.int64)  # [1 + N, 1 + N]
    save_file(state, path)
    assert max_diff(poslens.load(f"hf:{tmp_path}"), model) <= ATOL


def test_base_width_at_224_px(tmp_path: Path) -> None:
    """BEiT-B's width and heads on its 14 x 14 grid (two blocks): relative tables of 732 offsets."""
    CASES["base"] = ("BeitForImageClassification", {**REL, **BASE})
    try:
        model = write("base", tmp_path)
    finally:
        del CASES["base"]
    ours = poslens.load(f"hf:{tmp_path}")
    assert (ours.cfg.dim, ours.cfg.heads, ours.cfg.grid) == (768, 12, 14)
    assert max_diff(ours, model, n=1) <= ATOL
