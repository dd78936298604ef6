"""hf:DIR is strict: a missing, unexpected or mis-shaped tensor, a pickle, and an architecture
poslens cannot reproduce exactly (DeiT with teacher, tanh GELU, other model types) are one-line
CheckpointErrors naming it; config fields (eps, qkv_bias, sizes) come from config.json. The
folders are written by hand (config.json + safetensors), so these tests need no transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import poslens
from poslens.errors import CheckpointError, UserError

D, HIDDEN, DEPTH, GRID = 8, 16, 2, 2  # a 2-block model on a 2x2 grid of 4px patches
CONFIG = {
    "architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": D,
    "num_hidden_layers": DEPTH, "num_attention_heads": 2, "intermediate_size": HIDDEN,
    "hidden_act": "gelu", "layer_norm_eps": 1e-12, "image_size": 8, "patch_size": 4,
    "num_channels": 3, "qkv_bias": True, "id2label": {"0": "cat", "1": "dog", "2": "owl"},
}  # fmt: skip


def vit_state(
    prefix: str = "vit.", classes: int = 3, deit: bool = False
) -> dict[str, torch.Tensor]:
    """Random tensors under the old (saved) transformers names."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    e = f"{prefix}embeddings."
    npre = 2 if deit else 1
    sd = {
        e + "cls_token": r(1, 1, D),
        e + "position_embeddings": r(1, npre + GRID**2, D),
        e + "patch_embeddings.projection.weight": r(D, 3, 4, 4),
        e + "patch_embeddings.projection.bias": r(D),
        f"{prefix}layernorm.weight": r(D),
        f"{prefix}layernorm.bias": r(D),
    }
    if deit:
        sd[e + "distillation_token"] = r(1, 1, D)
    for i in range(DEPTH):
        b = f"{prefix}encoder.layer.{i}."
        for name, (o, n) in {
            "attention.attention.query": (D, D), "attention.attention.key": (D, D),
            "attention.attention.value": (D, D), "attention.output.dense": (D, D),
            "intermediate.dense": (HIDDEN, D), "output.dense": (D, HIDDEN),
        }.items():  # fmt: skip
            sd[b + name + ".weight"], sd[b + name + ".bias"] = r(o, n), r(o)
        for ln in ("layernorm_before", "layernorm_after"):
            sd[b + ln + ".weight"], sd[b + ln + ".bias"] = r(D), r(D)
    if classes:
        sd["classifier.weight"], sd["classifier.bias"] = r(classes, D), r(classes)
    return sd


def write(root: Path, state: dict[str, torch.Tensor], **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in {**CONFIG, **config}.items() if v is not None}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(state, root / "model.safetensors")
    return root


def one_line(e: pytest.ExceptionInfo[BaseException], *parts: str) -> None:
    text = str(e.value)
    assert "\n" not in text, text
    for p in parts:
        assert p in text, text


def test_config_fields_come_from_config_json(tmp_path: Path) -> None:
    cfg = poslens.load(f"hf:{write(tmp_path, vit_state())}").cfg
    assert (cfg.dim, cfg.depth, cfg.heads, cfg.mlp_ratio) == (D, DEPTH, 2, 2.0)
    assert (cfg.image_size, cfg.patch_size, cfg.in_chans, cfg.num_classes) == (8, 4, 3, 3)
    assert cfg.norm_eps == 1e-12 and cfg.qkv_bias and cfg.posenc == "ape" and cfg.pool == "cls"
    other = write(tmp_path / "eps", vit_state(), layer_norm_eps=1e-5, image_size=[8, 8])
    assert poslens.load(f"hf:{other}").cfg.norm_eps == 1e-5


def test_missing_fields_take_the_vit_config_defaults(tmp_path: Path) -> None:
    """A config.json written by transformers leaves out fields at their default (1e-12, gelu)."""
    folder = write(tmp_path, vit_state(), layer_norm_eps=None, hidden_act=None, qkv_bias=None)
    assert poslens.load(f"hf:{folder}").cfg.norm_eps == 1e-12


def test_without_qkv_bias(tmp_path: Path) -> None:
    state = {
        k: v
        for k, v in vit_state().items()
        if not k.endswith(("query.bias", "key.bias", "value.bias"))
    }
    model = poslens.load(f"hf:{write(tmp_path, state, qkv_bias=False)}")
    assert not model.cfg.qkv_bias and model.blocks[0].attn.qkv.bias is None


def test_bare_backbone_without_architectures_and_fp16_weights(tmp_path: Path) -> None:
    state = {k: v.half() for k, v in vit_state(prefix="", classes=0).items()}
    state["pooler.dense.weight"], state["pooler.dense.bias"] = torch.zeros(D, D), torch.zeros(D)
    model = poslens.load(f"hf:{write(tmp_path, state, architectures=None, id2label=None)}")
    assert model.cfg.num_classes == 0 and model.head.weight.dtype == torch.float32
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 0)


def test_weights_override(tmp_path: Path) -> None:
    folder = write(tmp_path / "a", vit_state())
    other = tmp_path / "other.safetensors"
    state = vit_state()
    state["classifier.bias"] = torch.full((3,), 7.0)
    save_file(state, other)
    model = poslens.load(f"hf:{folder}", weights=other)
    assert torch.equal(model.head.bias, torch.full((3,), 7.0))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.pop("vit.encoder.layer.1.output.dense.bias"), "missing tensor vit.encoder.layer.1.output.dense.bias"),
        (lambda s: s.update({"vit.encoder.layer.0.extra.weight": torch.zeros(1)}), "unexpected tensor vit.encoder.layer.0.extra.weight (1 extra)"),
        (lambda s: s.update({"vit.encoder.layer.1.intermediate.dense.weight": torch.zeros(HIDDEN + 1, D)}), "intermediate.dense.weight has shape (17, 8), the config needs (16, 8)"),
        (lambda s: s.update({"vit.embeddings.position_embeddings": torch.zeros(1, 4, D)}), "position_embeddings has shape (1, 4, 8), the config needs (1, 5, 8)"),
        (lambda s: s.pop("classifier.weight"), "missing tensor classifier.weight"),
        (lambda s: [s.pop(k) for k in list(s) if ".layer." in k], "missing tensor vit.encoder.layer.0.layernorm_before.weight"),
    ],
)  # fmt: skip
def test_weights_that_do_not_fit_are_one_line(edit: Any, message: str, tmp_path: Path) -> None:
    state = vit_state()
    edit(state)
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{write(tmp_path, state)}")
    one_line(e, message)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "exact GELU"),
        ({"model_type": "swin"}, "model_type 'swin' (poslens converts vit, deit"),
        ({"architectures": ["ViTForMaskedImageModeling"]}, "architecture ViTForMaskedImageModeling"),
        ({"model_type": "deit", "architectures": ["DeiTForImageClassificationWithTeacher"]}, "averages a CLS and a distillation head"),
        ({"image_size": [8, 16]}, "image_size [8, 16]"),
        ({"patch_size": 3}, "model.image_size (8) is not divisible by model.patch_size (3)"),
        ({"hidden_size": "8"}, "hidden_size is '8'"),
        ({"id2label": {"0": "cat"}}, "names 1 labels (id2label), the classifier has 3"),
    ],
)  # fmt: skip
def test_architectures_poslens_cannot_reproduce_are_one_line(
    config: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{write(tmp_path, vit_state(), **config)}")
    one_line(e, message)


def test_teacher_weights_without_architectures_are_refused(tmp_path: Path) -> None:
    state = {k: v for k, v in vit_state("deit.", classes=0, deit=True).items()}
    for head in ("cls_classifier", "distillation_classifier"):
        state[f"{head}.weight"], state[f"{head}.bias"] = torch.zeros(3, D), torch.zeros(3)
    folder = write(tmp_path, state, model_type="deit", architectures=None)
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{folder}")
    one_line(e, "DeiTForImageClassificationWithTeacher averages", "model.deit")


def test_deit_distillation_token_is_the_register(tmp_path: Path) -> None:
    state = vit_state("deit.", deit=True)
    folder = write(tmp_path, state, model_type="deit", architectures=["DeiTForImageClassification"])
    model = poslens.load(f"hf:{folder}")
    assert model.cfg.num_prefix == 2 and model.cfg.num_registers == 1
    pos = state["deit.embeddings.position_embeddings"]
    torch.testing.assert_close(
        model.reg_tokens, state["deit.embeddings.distillation_token"] + pos[:, 1:2]
    )
    torch.testing.assert_close(model.pos_embed, pos[:, 2:])


def test_pickles_are_never_read(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{tmp_path}")
    one_line(e, "holds pytorch_model.bin but no model.safetensors", "safe_serialization=True")


@pytest.mark.parametrize(
    "spec,message",
    [
        ("hf:", "hf: spec needs a folder"),
        ("hf:/nonexistent/vit", "no such folder"),
    ],
)
def test_bad_specs_are_one_line(spec: str, message: str) -> None:
    with pytest.raises(UserError) as e:
        poslens.load(spec)
    one_line(e, message)


def test_new_key_names_load_the_same_model(tmp_path: Path) -> None:
    old = vit_state()
    new = {}
    for k, v in old.items():
        k = k.replace("encoder.layer.", "layers.").replace(
            "attention.attention.query", "attention.q_proj"
        )
        k = k.replace("attention.attention.key", "attention.k_proj").replace(
            "attention.attention.value", "attention.v_proj"
        )
        k = k.replace("attention.output.dense", "attention.o_proj").replace(
            "intermediate.dense", "mlp.fc1"
        )
        new[k.replace(".output.dense", ".mlp.fc2")] = v
    a = poslens.load(f"hf:{write(tmp_path / 'old', old)}")
    b = poslens.load(f"hf:{write(tmp_path / 'new', new)}")
    assert set(load_file(tmp_path / "new" / "model.safetensors")) != set(old)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
