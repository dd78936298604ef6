"""Headline numbers per experiment (from its JSON) and their mean and SE across seeds.

A headline is a flat `key -> float` dict of the few numbers the claims and the report tables
rest on; it is read from the experiment's saved JSON, so a resumed study needs no Result objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Headline = dict[str, float | None]
TARGETS = ("exact", "row", "col")


def _probe(prefix: str, acc: Sequence[float] | None) -> Headline:
    if acc is None:
        return {}
    return {f"{prefix}_{t}": float(a) for t, a in zip(TARGETS, acc, strict=True)}


def _condition(prefix: str, c: dict[str, Any]) -> Headline:
    """Accuracy, paired margin change, output RPI-SSDC, probes and retentions of one condition."""
    out: Headline = {
        f"{prefix}.accuracy": c["accuracy"],
        f"{prefix}.margin": c["margin"],
        f"{prefix}.d_accuracy_se": c["d_accuracy"]["se"],
        f"{prefix}.d_margin": c["d_margin"]["mean"],
        f"{prefix}.d_margin_se": c["d_margin"]["se"],
        f"{prefix}.ssdc_rpi_out": c["ssdc_rpi"][-1],
    }
    out |= _probe(f"{prefix}.probe", c.get("probe"))
    for key in ("accuracy", "ssdc_out", "probe_row", "probe_col"):
        if key in c["retention"]:
            out[f"{prefix}.retention_{key}"] = c["retention"][key]
    return out


def depth_profile(d: dict[str, Any]) -> Headline:
    site = d["probe_site"]
    out: Headline = {"accuracy": d["accuracy"], "probe_site": float(site)}
    out |= {f"ssdc_rpi@{s}": v for s, v in zip(d["sites"], d["ssdc"]["rpi"], strict=True)}
    out["control_ssdc_rpi_out"] = d["ssdc"]["control_rpi"][-1]
    out |= _probe("probe", d["probes"]["test_acc"][site])
    out |= _probe("chance", d["probes"]["chance"])
    out |= _probe("control_probe", d["probes_control_random_init"]["test_acc"][site])
    return out


def position_removal(d: dict[str, Any]) -> Headline:
    out: Headline = {"intact.accuracy": d["baseline"]["accuracy"]}
    out["intact.margin"] = d["baseline"]["margin"]
    out |= _probe("intact.probe", d["baseline"]["probe"])
    out |= _probe("chance", d["baseline"]["probes"]["chance"])
    out |= _condition("floor", d["floor"])
    for c in d["conditions"]:
        if "/" not in c["name"]:  # random draws are summarised below
            out |= _condition(c["name"], c)
    for name, s in d.get("random_summary", {}).items():
        out[f"{name}.accuracy"] = s["accuracy"]
        out[f"{name}.accuracy_se"] = s["accuracy_se"]
        out |= {f"{name}.probe_{t}": s[f"probe_{t}"] for t in TARGETS if f"probe_{t}" in s}
    return out


def axis_map(d: dict[str, Any]) -> Headline:
    total = sum(d["counts"].values())
    out: Headline = {f"planes_{k}": float(v) for k, v in d["counts"].items()}
    out["fraction_axis_aligned"] = (d["counts"]["row"] + d["counts"]["col"]) / total if total else 0
    out["mean_alignment"] = d["mean_alignment"]
    out["head_blocks"] = float(len(d["per_head"]))  # depth x heads
    out["row_planes_per_head"] = d["counts"]["row"] / max(1, len(d["per_head"]))
    return out


def windows(d: dict[str, Any]) -> Headline:
    out: Headline = {"intact.accuracy": d["baseline"]["accuracy"]}
    out["intact.margin"] = d["baseline"]["margin"]
    out["intact.ssdc_rpi_out"] = d["baseline"]["ssdc_rpi"][-1]
    out["floor.accuracy"] = d["floor"]["accuracy"]
    out["floor.margin"] = d["floor"]["margin"]
    out["floor.ssdc_rpi_out"] = d["floor"]["ssdc_rpi"][-1]
    random: dict[str, list[float]] = {}
    for w in d["windows"]:
        name = w["result"]["name"]
        if "/" in name:
            random.setdefault(name.split("/")[0], []).append(w["result"]["accuracy"])
            continue
        out |= _condition(name, w["result"])
        last = w["blocks"][-1]
        if w["kind"].endswith("prefix") and last + 1 < len(d["sites"]):
            # retention right after the window (the floor there is exact by construction)
            ssdc, base, floor = (
                w["result"]["ssdc_rpi"][last + 1],
                d["baseline"]["ssdc_rpi"][last + 1],
                d["floor"]["ssdc_rpi"][last + 1],
            )
            out[f"{name}.retention_ssdc_after_window"] = _ratio(ssdc - floor, base - floor)
        out[f"{name}.onset"] = None if w["onset"] is None else float(w["onset"])
    for name, accs in random.items():
        out[f"{name}.accuracy"] = float(np.mean(accs))
    return out


def sae_causal(d: dict[str, Any]) -> Headline:
    out: Headline = {}
    for site, r in d["sae_sites"].items():
        v = r["verdict"]
        out[f"{site}.fvu"] = r["sae_quality"]["fvu"]
        out[f"{site}.n_positional"] = float(v["n_positional"])
        out |= {f"{site}.latents_{k}": float(n) for k, n in v["kinds"].items()}
        out[f"{site}.recon.d_accuracy"] = v["reconstruction"]["d_accuracy"]
        out[f"{site}.recon.probe_drop_out"] = v["reconstruction"]["probe_drop_out"]
        for key in ("zero_all", "zero_all+error", "matched_all"):
            for k, x in v.get(key, {}).items():
                if k != "draws" and not k.endswith("_se"):
                    out[f"{site}.{key}.{k}"] = x
        verdict = d["verdict"][site]
        out[f"{site}.probe_causal"] = float(verdict["probe_causal"])
        out[f"{site}.task_causal"] = float(verdict["task_causal"])
    return out


def heads(d: dict[str, Any]) -> Headline:
    """The heads verdict's numbers, flattened ("rebuilding/head.held_out.excess"); lists of
    units become their count (".n")."""
    return _flatten(d["verdict"])


def _flatten(d: dict[str, Any], prefix: str = "") -> Headline:
    out: Headline = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= _flatten(v, key + ".")
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, int | float):
            out[key] = float(v)
        elif isinstance(v, list):
            out[key + ".n"] = float(len(v))
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if abs(b) > 1e-12 else None


def _flat_numbers(d: dict[str, Any], prefix: str = "") -> Headline:
    """Fallback: every top-level number of an experiment without a headline function."""
    return {
        f"{prefix}{k}": float(v)
        for k, v in d.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


HEADLINES: dict[str, Callable[[dict[str, Any]], Headline]] = {
    "depth_profile": depth_profile,
    "position_removal": position_removal,
    "axis_map": axis_map,
    "windows": windows,
    "sae_causal": sae_causal,
    "heads": heads,
}


def headline(name: str, d: dict[str, Any]) -> Headline:
    """The headline numbers of experiment `name` from its JSON-ready dict (NaN becomes None)."""
    h = HEADLINES.get(name, _flat_numbers)(d)
    return {k: None if v is None or not math.isfinite(v) else float(v) for k, v in h.items()}


def mean_se(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and standard error over seeds (SE None with one value); None values are left out."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    n = len(xs)
    return {
        "mean": float(xs.mean()) if n else None,
        "se": float(xs.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
        "n": n,
        "values": list(values),
    }


def aggregate(runs: list[dict[str, Any]], experiments: Sequence[str]) -> dict[str, Any]:
    """Per experiment and headline key: mean, SE and per-seed values over the model's runs."""
    out: dict[str, Any] = {}
    for name in experiments:
        heads = [r["experiments"][name]["headline"] for r in runs if name in r["experiments"]]
        if not heads:
            continue
        keys = list(dict.fromkeys(k for h in heads for k in h))
        out[name] = {k: mean_se([h.get(k) for h in heads]) for k in keys}
    return out


__all__ = ["HEADLINES", "aggregate", "headline", "mean_se"]
