"""SAELens both ways: a poslens SAE loads in SAELens with the same codes and reconstructions, and
SAELens TopK / standard / JumpReLU folders drive poslens (load_sae and `poslens analyze --sae`),
matching the same SAE in poslens' own format. Folders are written by SAELens itself when it is
installed (the `saelens` extra), else by hand exactly as SAELens 6.54 writes them."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import poslens
from poslens.cli import main
from poslens.data import DataConfig
from poslens.errors import CheckpointError
from poslens.experiments.analyze import analyze
from poslens.experiments.registry import configs
from poslens.sae import SAEConfig, TopKSAE, train_sae
from poslens.sae.io import load_sae, save_sae
from poslens.sae.saelens import SAELensSAE
from tests.conftest import tiny
from tests.sae.conftest import planted


@cache
def saelens() -> Any:
    """The sae_lens module, or None without the optional extra (imported once, when first used:
    it takes seconds). CI (POSLENS_FULL=1) installs the extra: there a missing one fails."""
    if os.environ.get("POSLENS_FULL") == "1":
        import sae_lens

        return sae_lens
    try:
        import sae_lens
    except ImportError:  # the folders are then written by hand
        return None
    return sae_lens


def needs_saelens() -> Any:
    lens = saelens()
    if lens is None:
        pytest.skip("sae_lens is not installed (pip install -e '.[saelens]')")
    return lens


SITE = "blocks.1.ln1.hook_normalized"
KEYS = ("W_enc", "b_enc", "W_dec", "b_dec")


def weights(d_in: int = 32, d_sae: int = 96, seed: int = 3) -> dict[str, torch.Tensor]:
    """Seeded SAE weights with non-zero biases and a positive JumpReLU threshold."""
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(d_sae, d_in, generator=g)
    return {
        "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        "b_enc": 0.1 * torch.randn(d_sae, generator=g),
        "W_dec": W_dec / W_dec.norm(dim=1, keepdim=True),
        "b_dec": 0.1 * torch.randn(d_in, generator=g),
        "threshold": 0.3 * torch.rand(d_sae, generator=g),
    }


def write_saelens(
    folder: Path, arch: str, w: dict[str, torch.Tensor], k: int = 6, **cfg: Any
) -> Path:
    """An SAE folder as SAELens writes it: its own save_model when installed, else the same
    cfg.json and safetensors by hand (the fields SAELens 6.54 writes for these kinds)."""
    names = (*KEYS, "threshold") if arch == "jumprelu" else KEYS
    tensors = {n: w[n].contiguous() for n in names}
    d_sae, d_in = w["W_dec"].shape
    sae_lens = saelens()
    if sae_lens is not None and not cfg:
        from sae_lens.saes.sae import SAEMetadata

        cls, cfg_cls = {
            "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
            "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
            "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        }[arch]
        extra = {"k": k} if arch == "topk" else {}
        sae = cls(cfg_cls(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=SITE), **extra))
        sae.load_state_dict(tensors)
        sae.save_model(folder)
        return folder
    folder.mkdir(parents=True)
    save_file(tensors, folder / "sae_weights.safetensors")
    doc = {
        "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.54.12", "sae_lens_training_version": "6.54.12",
                     "hook_name": SITE},
        **({"k": k, "rescale_acts_by_decoder_norm": False} if arch == "topk" else {}),
        "architecture": arch,
    } | cfg  # fmt: skip
    (folder / "cfg.json").write_text(json.dumps(doc))
    return folder


def reference_codes(
    arch: str, w: dict[str, torch.Tensor], x: torch.Tensor, k: int = 6
) -> torch.Tensor:
    """SAELens' encode written out: pre = (x - b_dec) @ W_enc + b_enc, then its activation."""
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if arch == "topk":
        top = pre.topk(k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    codes = pre.relu()
    return codes * (pre > w["threshold"]) if arch == "jumprelu" else codes


# --- poslens -> SAELens ---


def test_a_poslens_sae_loads_in_saelens_with_the_same_codes(tmp_path: Path) -> None:
    lens = needs_saelens()
    x, _ = planted(1024)
    cfg = SAEConfig(site=SITE, k=4, batch=128, steps=20)
    sae = train_sae(x, cfg)[0]
    save_sae(sae, tmp_path / "sae", cfg)
    theirs = lens.SAE.load_from_disk(tmp_path / "sae")
    assert type(theirs).__name__ == "TopKSAE" and theirs.cfg.metadata.hook_name == SITE
    x_test = planted(200, seed=7)[0]
    with torch.no_grad():
        ours_rec, ours = sae(x_test)
        codes = theirs.encode(x_test)
        assert torch.equal(codes > 0, ours > 0)  # the same latents fire
        assert torch.allclose(codes, ours, atol=1e-5)
        assert torch.allclose(theirs.decode(codes), ours_rec, atol=1e-5)
        assert torch.allclose(theirs(x_test), ours_rec, atol=1e-5)


def test_a_whitened_poslens_sae_folds_into_saelens(tmp_path: Path) -> None:
    """SAELens refuses the stored whitening keys; the documented route folds them in."""
    lens = needs_saelens()
    from sae_lens.saes.sae import SAEMetadata

    x, _ = planted(1024)
    sae = train_sae(x, SAEConfig(site=SITE, k=4, batch=128, steps=20, whiten=True))[0]
    assert sae.whitening is not None
    theirs = lens.TopKSAE(
        lens.TopKSAEConfig(d_in=32, d_sae=sae.d_sae, k=4, metadata=SAEMetadata(hook_name=SITE))
    )
    theirs.load_state_dict({n: getattr(sae, n).detach() for n in KEYS})
    w = sae.whitening
    theirs.fold_activation_whitening(w.mean_D, w.M_DD, w.M_inv_DD)
    x_test = planted(200, seed=7)[0]
    with torch.no_grad():
        ours_rec, ours = sae(x_test)
        assert torch.equal(theirs.encode(x_test) > 0, ours > 0)
        assert torch.allclose(theirs.encode(x_test), ours, atol=1e-4)
        assert torch.allclose(theirs(x_test), ours_rec, atol=1e-4)


# --- SAELens -> poslens ---


@pytest.mark.parametrize("arch", ["topk", "standard", "jumprelu"])
def test_saelens_folders_load_with_saelens_codes(arch: str, tmp_path: Path) -> None:
    w = weights()
    folder = write_saelens(tmp_path / arch, arch, w)
    sae = load_sae(folder)
    assert (sae.site, sae.d_in, sae.d_sae) == (SITE, 32, 96)
    # a SAELens TopK SAE is poslens' own kind; the others run with SAELens' encoder
    assert type(sae) is (TopKSAE if arch == "topk" else SAELensSAE)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        codes = sae.encode(x)
        expected = reference_codes(arch, w, x)
        assert torch.equal(codes > 0, expected > 0)
        assert torch.allclose(codes, expected, atol=1e-5)
        assert torch.allclose(sae.decode(codes), expected @ w["W_dec"] + w["b_dec"], atol=1e-5)
        assert 0 < (codes > 0).sum(-1).float().mean() < 96  # sparse, and not empty
        if saelens() is not None:  # and SAELens' own encode of the same folder
            theirs = saelens().SAE.load_from_disk(folder)
            assert torch.equal(theirs.encode(x) > 0, codes > 0)
            assert torch.allclose(theirs.encode(x), codes, atol=1e-5)


def test_b_dec_not_applied_to_the_input_is_followed(tmp_path: Path) -> None:
    w = weights()
    sae = load_sae(write_saelens(tmp_path / "s", "standard", w, apply_b_dec_to_input=False))
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert torch.allclose(sae.encode(x), (x @ w["W_enc"] + w["b_enc"]).relu(), atol=1e-5)
    # and saving it keeps its kind: the folder reads back as the same SAE
    save_sae(sae, tmp_path / "again")
    back = load_sae(tmp_path / "again")
    assert isinstance(back, SAELensSAE) and back.architecture == "standard"
    with torch.no_grad():
        assert torch.equal(back.encode(x), sae.encode(x))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"architecture": "gated"}, "SAE architecture 'gated' is not supported"),
        ({"architecture": "transcoder"}, "SAE architecture 'transcoder' is not supported"),
        ({"activation_fn": "tanh-relu"}, "standard SAE with activation_fn 'tanh-relu'"),
        ({"normalize_activations": "layer_norm"}, "normalize_activations must be one of none"),
        ({"reshape_activations": "hook_z"}, "reshape_activations must be one of none"),
        ({"rescale_acts_by_decoder_norm": True}, "rescale_acts_by_decoder_norm"),
        ({"metadata": {"hook_name": SITE, "hook_head_index": 3}}, r"on one attention head \(3\)"),
    ],
)
def test_unsupported_kinds_are_one_line_errors_naming_the_kind(
    cfg: dict[str, Any], message: str, tmp_path: Path
) -> None:
    folder = write_saelens(tmp_path / "s", "standard", weights(), **cfg)
    with pytest.raises(CheckpointError, match=message) as info:
        load_sae(folder)
    assert "\n" not in str(info.value)


# --- a SAELens SAE drives the SAE causal experiment ---

ANALYSIS = ["--images", "30", "--probe-images", "20", "--no-progress"]
SETS = {"doses": "2", "draws": "1", "rpi_probes": "false"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny APE model with a planted row + column code (it has positional latents to find)."""
    m = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0)
    data = DataConfig(image_size=16, object_scale=0.32, n_val=40, n_test=30)
    return poslens.save(m, tmp_path_factory.mktemp("ckpt") / "ape", data)


def test_saelens_topk_folder_gives_the_same_experiment_as_poslens_format(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, task = poslens.load(checkpoint), poslens.load_task(checkpoint)
    x = model.cache_until(task.split("val")[0], [SITE])[SITE][:, 1:].reshape(-1, 32)
    own = train_sae(x, SAEConfig(site=SITE, k=4, batch=128, steps=30))[0]
    save_sae(own, tmp_path / "poslens_sae")
    w = {n: getattr(own, n).detach() for n in KEYS}
    lens_dir = write_saelens(tmp_path / "saelens_sae", "topk", w, k=4)

    # the SAELens folder through the CLI; the sites default to its hook
    sets = [f"--set=sae_causal.{k}={v}" for k, v in SETS.items()]
    argv = ["analyze", str(checkpoint), "--experiments", "sae_causal", *ANALYSIS, *sets]
    assert main([*argv, "--sae", str(lens_dir), "--out", str(tmp_path / "lens")]) == 0
    lens = json.loads((tmp_path / "lens" / "sae_causal.json").read_text())
    record = json.loads((tmp_path / "lens" / "analysis.json").read_text())
    assert record["sae"] == [str(lens_dir)]
    # the poslens folder through the same path (configs + analyze), in this process
    common = {"n_images": 30, "probe_images": 20, "batch_size": 0, "seed": 0}
    cfg = configs(["sae_causal"], common, {"sae_causal": SETS | {"sites": SITE}})["sae_causal"]
    saes = {SITE: load_sae(tmp_path / "poslens_sae")}
    analyze(model, task, ["sae_causal"], [cfg], tmp_path / "own",
            run_kwargs={"sae_causal": {"saes": saes}})  # fmt: skip
    ours = json.loads((tmp_path / "own" / "sae_causal.json").read_text())
    site = lens["sae_sites"][SITE]
    assert list(lens["sae_sites"]) == [SITE] and site["k_selection"]["k"] == 4
    assert site["k_selection"]["by_criterion"] is False  # given, not trained
    assert len(site["positional_latents"]["latents"]) > 0  # it found positional latents to edit
    assert len(site["conditions"]) > 5
    assert lens["sae_sites"] == ours["sae_sites"] and lens["baseline"] == ours["baseline"]


def test_a_jumprelu_folder_drives_the_experiment(checkpoint: Path, tmp_path: Path) -> None:
    from poslens.experiments import sae_causal

    model, task = poslens.load(checkpoint), poslens.load_task(checkpoint)
    folder = write_saelens(tmp_path / "jr", "jumprelu", weights(d_sae=64))
    cfg = configs(["sae_causal"], {"n_images": 30, "probe_images": 20},
                  {"sae_causal": SETS | {"sites": SITE}})["sae_causal"]  # fmt: skip
    res = sae_causal.run(model, task, cfg, saes={SITE: load_sae(folder)})
    (r,) = res.results
    assert r.k_selection["k"] == 0  # no fixed k
    assert 0 < r.sae_quality["l0"] < 64
    assert r.conditions[0].name == "reconstruction"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--experiments", "depth_profile"], "--sae is read by the sae_causal experiment"),
        (["--set", "sae_causal.sites=blocks.0.hook_resid_pre"], "would go unused"),
        (["--sae", "GATED"], "SAE architecture 'gated' is not supported"),
        (["--sae", "OTHER_SITE"], "'blocks.9.hook_resid_pre' is not a hook of this model"),
        (["--sae", "WIDE"], "reads d_in=48, the model's activations there are 32 wide"),
    ],
)
def test_bad_sae_arguments_are_one_line_errors(
    checkpoint: Path, extra: list[str], message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    good = write_saelens(tmp_path / "good", "topk", weights())
    folders = {
        "GATED": write_saelens(tmp_path / "gated", "standard", weights(), architecture="gated"),
        "OTHER_SITE": write_saelens(
            tmp_path / "other", "topk", weights(), metadata={"hook_name": "blocks.9.hook_resid_pre"}
        ),
        "WIDE": write_saelens(tmp_path / "wide", "topk", weights(d_in=48)),
    }
    extra = [str(folders.get(e, e)) for e in extra]
    argv = [
        "analyze",
        str(checkpoint),
        "--out",
        str(tmp_path / "out"),
        *ANALYSIS,
        "--sae",
        str(good),
    ]
    if "--experiments" not in extra:
        argv += ["--experiments", "sae_causal"]
    if "--sae" in extra:
        argv = argv[: argv.index("--sae")]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "sae_causal.json").exists()
