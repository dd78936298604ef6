"""A synthetic study folder: a results dict shaped like the study's and real PNG/SVG figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

EVIL = "<script>alert('x')</script> & | pipe"
MISSING_PNG = "figures/gone.png"


def save_figure(out_dir: Path, rel: str, colour: str) -> None:
    """A tiny real line plot saved as PNG and SVG at rel (and rel with .svg)."""
    path = out_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(2.4, 1.6), dpi=60)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2, 3], [0.2, 0.6, 0.5, 0.9], color=colour)
    ax.set_title(Path(rel).stem, fontsize=7)
    fig.savefig(path)
    fig.savefig(path.with_suffix(".svg"))


def _stat(values: list[float | None]) -> dict[str, Any]:
    """An aggregate entry as the study writes it (the mean and SE are given, not checked here)."""
    real = [v for v in values if v is not None]
    mean = sum(real) / len(real) if real else None
    return {"mean": mean, "se": 0.001 if len(real) > 1 else None, "n": len(real), "values": values}


def make_study(out_dir: Path) -> dict[str, Any]:
    """Write the figures into out_dir and return results: 2 models x 2 seeds, 4 experiments,
    3 claims (one per verdict, one with hostile text, each with the keys a claim requires), one
    missing figure, one skipped experiment."""
    figures = [
        {
            "title": "RPI-SSDC by depth, mean and SE over seeds",
            "png": "figures/depth_profile.png",
            "svg": "figures/depth_profile.svg",
            "experiment": "depth_profile",
            "model": None,
        },
        {
            "title": "Window accuracy",
            "png": "runs/ape/seed0/windows.png",
            "svg": "runs/ape/seed0/windows.svg",
            "experiment": "windows",
            "model": "ape",
        },
        {
            "title": "Window accuracy",
            "png": "runs/rope_axial/seed0/windows.png",
            "svg": "runs/rope_axial/seed0/windows.svg",
            "experiment": "windows",
            "model": "rope_axial",
        },
        {
            "title": "Rotary axis map",
            "png": "runs/rope_axial/seed0/axis_map.png",
            "svg": "runs/rope_axial/seed0/axis_map.svg",
            "experiment": "axis_map",
            "model": "rope_axial",
        },
        {
            "title": "Claims at a glance",
            "png": "figures/claims.png",
            "svg": "figures/claims.svg",
            "experiment": "claims",
            "model": None,
        },
        {
            "title": "Removal curve",
            "png": MISSING_PNG,
            "svg": "figures/gone.svg",
            "experiment": "position_removal",
            "model": None,
        },
    ]
    for i, f in enumerate(figures):
        if f["png"] != MISSING_PNG:
            save_figure(out_dir, f["png"], colour=f"C{i}")

    def run(model: str, seed: int, acc: float) -> dict[str, Any]:
        """One seed's record: training numbers, per-experiment headline and files, skips."""
        exps: dict[str, Any] = {
            "depth_profile": {
                "headline": {
                    "accuracy": acc,
                    "ssdc_rpi_out": 0.5 + seed / 10,
                    "probe_acc_row": 0.9,
                    "probe_acc_row_chance": 0.125,
                    "by_site": {"block0": 0.3, "out": None},
                },
                "files": [
                    f"runs/{model}/seed{seed}/depth_profile.json",
                    f"runs/{model}/seed{seed}/depth_profile_probes.csv",
                    f"runs/{model}/seed{seed}/depth_profile.png",
                ],
            },
            "windows": {"headline": {"window_acc": 0.8}, "files": []},
            "position_removal": {"headline": {"acc_drop": 0.42}, "files": []},
        }
        skipped = {}
        if model == "rope_axial":
            exps["axis_map"] = {"headline": {"row_planes": 8, "col_planes": 8}, "files": []}
        else:
            skipped["axis_map"] = "model has no rotary encoding"
        return {
            "seed": seed,
            "checkpoint": f"checkpoints/{model}_s{seed}_ab12cd34ef56",
            "config_hash": "ab12cd34ef56",
            "train": {
                "test_acc": acc,
                "val_acc": acc - 0.01,
                "train_acc": 1.0,
                "chance": 0.5,
                "steps": 1200,
                "steps_to_90": 800 if seed == 0 else None,
                "train_seconds": 150.04,
            }
            | ({"lr_final": 3e-5} if seed == 0 else {}),
            "experiments": exps,
            "skipped": skipped,
        }

    def model(name: str, accs: list[float]) -> dict[str, Any]:
        """A model's runs and the aggregate over them (nested headline keys flattened here)."""
        runs = [run(name, s, a) for s, a in enumerate(accs)]
        aggregate: dict[str, Any] = {
            "depth_profile": {
                "accuracy": _stat(accs),
                "ssdc_rpi_out": _stat([0.5, 0.6]),
                "probe_acc_row": _stat([0.9, 0.9]),
                "probe_acc_row_chance": _stat([0.125, 0.125]),
                "by_site": {"block0": _stat([0.3, 0.3]), "out": _stat([None, None])},
            },
            "windows": {"window_acc": _stat([0.8, 0.8])},
        }
        if name == "rope_axial":
            aggregate["axis_map"] = {"row_planes": _stat([8, 8]), "col_planes": _stat([8, 8])}
        # position_removal has no aggregate: the report falls back to per-seed values
        return {"posenc": name, "runs": runs, "aggregate": aggregate}

    claims = [
        {
            "id": "ape_explicit_features",
            "title": "APE: position lives in explicit row/column features that are causal",
            "verdict": "supported",
            "summary": "Zeroing the APE drops accuracy from 0.99 to 0.41 (SE 0.01, 2 seeds).",
            "evidence": ["row probe 0.90 vs 0.125 chance"],
            "controls": ["random directions of the same rank drop 0.02"],
            "caveats": ["two seeds only"],
            "models": ["ape"],
            "seeds": 2,
        },
        {
            "id": "rope_rebuilds",
            "title": "RoPE rebuilds withheld position",
            "verdict": "not supported",
            "summary": EVIL,
            "evidence": ["probe stays at chance after block 1 <b>bold?</b>"],
            "controls": [],
            "caveats": [],
            "models": ["rope_axial"],
            "seeds": 2,
        },
        {
            "id": "heads_rebuild",
            "title": "Axis-specialized heads rebuild position",
            "verdict": "inconclusive",
            "qualifier": "no power",
            "summary": "Effect within 1 SE of the control.",
            "evidence": ["head 3 margin drop 0.2"],
            "controls": ["matched random heads drop 0.18"],
            "caveats": ["quick preset"],
            "models": ["rope_axial"],
            "seeds": 2,
            "measured": {
                "rope_axial": {
                    "measured": 2,
                    "seeds": 3,
                    "missing": "seed 2: no variance",
                    "gate": None,
                }
            },
        },
    ]
    test = {"n": 5, "mean": 0.4, "ci": [0.3, 0.5], "p": 0.01, "values": [0.3, 0.35, 0.4, 0.45, 0.5]}
    for c in claims:
        c["claim"], c["level"] = c["id"], "original"
        c["primary"] = {
            "effect": "an effect",
            "threshold": 0.25,
            "models": {m: test | {"p_holm": 0.02, "detected": True} for m in c["models"]},
        }
        c["calibration"] = {
            "controls": [
                {
                    "model": "ape_rowcol",
                    "role": "positive",
                    "test": test,
                    "detected": True,
                    "enough_seeds": True,
                    "seeds_above_threshold": 5,
                    "as_designed": True,
                }
            ],
            "sensitivity": 1.0,
            "specificity": None,
            "complete": False,
            "passed": False,
        }
        c["would_change"] = "A smaller effect."
        c["reference"] = {
            "original_verdict": "supported",
            "effect": 0.33,
            "rule_verdict": "supported",
            "agrees": True,
            "note": "published numbers",
        }
    stages = [
        {"stage": "train", "model": m, "seed": s, "seconds": 150.2, "reused": s == 1}
        for m in ("ape", "rope_axial")
        for s in (0, 1)
    ]
    stages.append({"stage": "aggregate", "model": None, "seed": None, "seconds": 0.4})
    return {
        "schema": "poslens.study/2",
        "poslens_version": "0.1.0",
        "created": "2026-11-30T02:10:00Z",
        "config": {
            "preset": "default",
            "models": ["ape", "rope_axial"],
            "seeds": 2,
            "task": "relation",
            "experiments": ["depth_profile", "windows", "axis_map", "position_removal"],
            "train_set": ["train.steps=1200"],
            "analysis_set": ["windows.prefix_ks=0,1,2"],
            "n_images": 300,
        },
        "environment": {"python": "3.11.7", "torch": "2.13.0", "threads": 2},
        "timings": {"total_seconds": 1100.0, "stages": stages},
        "models": {
            "ape": model("ape", [0.99, 0.992]),
            "rope_axial": model("rope_axial", [0.97, 0.98]),
        },
        "claims": claims,
        "figures": figures,
    }


def make_valid_study(out_dir: Path) -> dict[str, Any]:
    """make_study made to follow the results schema (what `python -m poslens.report` accepts):
    the required config and environment keys, flat headlines, study stages only."""
    res = make_study(out_dir)
    res["config"] |= {"probe_images": 100, "batch_size": 50, "only": [], "device": "cpu"}
    res["environment"] |= {"numpy": "2.0", "platform": "Linux", "machine": "x86_64", "jobs": 1}
    res["environment"]["cpu"] = {"model": "Test CPU", "extensions": ["avx2"]}
    for m in res["models"].values():
        m["aggregate"]["depth_profile"].pop("by_site")
        for run in m["runs"]:
            run["experiments"]["depth_profile"]["headline"].pop("by_site")
    res["timings"]["stages"] = [s for s in res["timings"]["stages"] if s["model"] is not None]
    return res
