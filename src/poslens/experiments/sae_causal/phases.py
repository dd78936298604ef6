"""The SAE causal test, phase by phase: the intact reference and its fixed probes, then per SAE
site: train the SAE, find its positional latents, and read every edit against the controls."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition, floor_condition
from poslens.experiments.config import resolved
from poslens.experiments.readout import (
    PROBE_KINDS,
    Readout,
    ReferenceCache,
    baseline,
    choose_probe_site,
    eval_images,
    measure,
    site_labels,
    summarise,
)
from poslens.experiments.sae_causal.config import (
    RECON_MAX_COST,
    SELECTION_IMAGES,
    Config,
    drawn_again,
    resolve_sites,
    rowcol_only,
    site_index,
)
from poslens.experiments.sae_causal.edits import matched_random, resample, set_to, spliced, zero
from poslens.experiments.sae_causal.given import check_sites
from poslens.experiments.sae_causal.result import (
    ROWCOL_EDITS,
    ROWCOL_OTHER_IMAGE,
    ROWCOL_OTHER_POSITION,
    SAECausal,
    SiteResult,
)
from poslens.metrics.stats import row_col_share
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.precision import autocast
from poslens.progress import track
from poslens.sae.latents import PositionalLatents, find_positional_latents
from poslens.sae.metrics import evaluate, spliced_quality
from poslens.sae.model import TopKSAE
from poslens.sae.pipeline import CODES_BATCH_IMAGES, patch_codes, training_images
from poslens.sae.store import STORE_BATCH_IMAGES, ActivationStore
from poslens.sae.train import train_sae

Planned = tuple[str, Condition, dict[str, Any]]  # name, condition, meta (family, group, n, draw)


def conditions(
    sae: TopKSAE, pl: PositionalLatents, codes: np.ndarray, cfg: Config
) -> list[Planned]:
    """Every edit at one SAE: the reconstruction alone; the top n positional latents zeroed for
    each dose (plain and +error); the row and column latents, the row latents alone, the column
    latents alone and the cell latents alone;
    uniform and matched random latents of each size (draws); mean ablation; resampling; the row
    and column latents resampled from the same position of another image (their position kept)
    and from another position of the same image (their position broken).
    All but the plain splices carry the error term, so they differ only in which latents move."""
    lat = pl.latents
    out: list[Planned] = [
        ("reconstruction", spliced(sae), {"family": "reconstruction", "group": "reconstruction"})
    ]
    if not len(lat):
        return out
    n_all = len(lat)
    doses = sorted({d for d in cfg.doses if d < n_all} | {n_all})
    rng = np.random.default_rng(cfg.seed)
    pool = pl.non_positional  # controls come from latents position explains little of

    def controls(chosen: np.ndarray, n: int, group: str) -> list[Planned]:
        """Uniform and matched random latents of the same count, each draw spliced +error."""
        planned: list[Planned] = []
        for d in range(cfg.draws):
            meta = {"n": n, "draw": d}
            uni = rng.choice(pool, size=min(n, len(pool)), replace=False)
            uni_group = {"group": "uniform_all"} if group == "all" else {}
            planned.append((f"uniform_{group}_{n}/{d}", spliced(sae, zero(uni), True),
                            {"family": "uniform", "edited": len(uni)} | uni_group | meta))  # fmt: skip
            mat = matched_random(codes, chosen, pool, seed=cfg.seed * 100 + d)
            planned.append((f"matched_{group}_{n}/{d}", spliced(sae, zero(mat), True),
                            {"family": f"matched_{group}", "group": f"matched_{group}",
                             "edited": len(mat)} | meta))  # fmt: skip
        return planned

    for n in doses:
        top, is_all = lat[:n], n == n_all
        plain = {"group": "zero_all"} if is_all else {}
        err = {"group": "zero_all+error"} if is_all else {}
        out.append((f"zero_{n}", spliced(sae, zero(top)), {"family": "positional", "n": n} | plain))
        out.append((f"zero_{n}+error", spliced(sae, zero(top), True),
                    {"family": "positional+error", "n": n} | err))  # fmt: skip
        for name, cond, meta in controls(top, n, "all"):
            if not is_all:
                meta = {k: v for k, v in meta.items() if k != "group"}
            out.append((name, cond, meta))
    # the row and column latents together, each axis alone (the original's axis split: the row
    # latents zeroed should cost the row probe and leave the column probe), the cell latents
    for kinds, group in (
        (("row", "col"), "rowcol"), (("row",), "row"), (("col",), "col"), (("cell",), "cell")
    ):  # fmt: skip
        chosen = pl.of_kind(*kinds)
        if len(chosen):
            n = len(chosen)
            out.append((f"{group}+error", spliced(sae, zero(chosen), True),
                        {"family": group, "group": f"{group}+error", "n": n}))  # fmt: skip
            out += [c for c in controls(chosen, n, group) if c[2]["family"] != "uniform"]
    mean_F = torch.as_tensor(codes.reshape(-1, codes.shape[-1]).mean(0), dtype=torch.float32)
    meta = {"n": n_all}
    out.append(("mean_all", spliced(sae, set_to(lat, mean_F), True),
                {"family": "mean", "group": "mean_all"} | meta))  # fmt: skip
    for how in ("other_image", "other_position"):
        out.append((f"resample_{how}", spliced(sae, resample(lat, how, cfg.seed), True),
                    {"family": f"resample_{how}", "group": f"resample_{how}"} | meta))  # fmt: skip
    # last: the edits before it keep their order and their random draws
    rowcol = pl.of_kind("row", "col")
    if len(rowcol):
        for how, name in (("other_image", ROWCOL_OTHER_IMAGE),
                          ("other_position", ROWCOL_OTHER_POSITION)):  # fmt: skip
            out.append((name, spliced(sae, resample(rowcol, how, cfg.seed), True),
                        {"family": f"rowcol_{how}", "group": name, "n": len(rowcol)}))  # fmt: skip
    return out


def probe_table(r: Readout, sites: list[int]) -> dict[str, np.ndarray]:
    """kind -> [sites, 3] test accuracy of every kind of probe this readout has at `sites`."""
    return {
        kind: np.stack([r.probe_at(s, kind) for s in sites])
        for kind in PROBE_KINDS
        if all(r.has_probes(s, kind) for s in sites)
    }


def forward_batch(cfg: Config, default: int) -> int:
    """Images per forward pass when collecting SAE activations or codes: `default`, or the
    analysis batch where that is smaller (sized to the model: limits.auto_batch_size), so a
    pretrained model's passes stay within the memory its analysis batch was sized for."""
    return min(default, cfg.batch_size or default)


def selection_images(data: Task, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The images k is chosen on: the first max(n_images, SELECTION_IMAGES) of the val split."""
    x, y = data.split("val")
    n = max(cfg.n_images, SELECTION_IMAGES)
    return x[:n], y[:n]


def reconstruction_cost(
    model: ViT, sae: TopKSAE, x: torch.Tensor, y: torch.Tensor, cfg: Config
) -> dict[str, Any]:
    """What splicing the SAE's reconstruction alone costs, as the "reconstruction" condition
    splices it (plain, at the residual for a normalised site): accuracy lost (intact - spliced,
    a fraction, paired over the images) with its SE, and KL(intact || spliced). NaN without a
    classifier head."""
    if model.cfg.num_classes == 0:
        return {"k": sae.k, "cost": float("nan"), "cost_se": float("nan"), "kl": float("nan")}
    with autocast(model, cfg.precision):
        # the error term's sanity check is not read here: one forward pass fewer per k tried
        q = spliced_quality(model, sae, x, y, batch=cfg.batch_size, error_check=False)["spliced"]
    return {"k": sae.k, "cost": -q["d_acc"], "cost_se": q["d_acc_se"], "kl": q["kl"]}


def meets_criterion(cost: float) -> bool:
    """Whether a reconstruction cost is within RECON_MAX_COST (the tolerance absorbs the float
    error of a count fraction such as 15 / 500; NaN never meets it)."""
    return cost <= RECON_MAX_COST + 1e-9


def fit_site_sae(
    model: ViT, data: Task, cfg: Config, site: str, sae: TopKSAE | None = None
) -> tuple[TopKSAE, dict[str, Any]]:
    """The SAE at `site` and how its k was chosen (SiteResult.k_selection).

    Given an SAE, or with cfg.k > 0, that SAE (that k) is measured and kept. With k = 0 the
    ladder cfg.k_ladder(d_in) is trained rung by rung on one store of fresh training images'
    activations (float32), stopping at the first k whose reconstruction alone costs at most
    RECON_MAX_COST accuracy on the selection images; when no rung does, the cheapest rung is
    kept (smallest k among ties) and criterion_met is False. Without a classifier head there is
    no cost to read: the first rung (the width rule's k) is kept, criterion_met None."""
    xs, ys = selection_images(data, cfg)
    if sae is not None:
        tried = [(sae, reconstruction_cost(model, sae, xs, ys, cfg))]
    else:
        with autocast(model, cfg.precision):
            store = ActivationStore.from_model(
                model,
                training_images(data, cfg.train_images),
                site,
                batch_images=forward_batch(cfg, STORE_BATCH_IMAGES),
            )
        ladder = cfg.k_ladder(store.d_in)
        tried = []
        for k in ladder if model.cfg.num_classes else ladder[:1]:
            cand, _ = train_sae(
                store, cfg.sae_config(site, store.d_in, k), device=model.head.weight.device
            )
            tried.append((cand, reconstruction_cost(model, cand, xs, ys, cfg)))
            if meets_criterion(tried[-1][1]["cost"]):
                break
    met = [t for t in tried if meets_criterion(t[1]["cost"])]
    labelled = model.cfg.num_classes > 0
    if met or not labelled:
        chosen, cost = (met or tried)[0]
    else:
        chosen, cost = min(tried, key=lambda t: (t[1]["cost"], t[1]["k"]))
    selection = {
        "k": chosen.k,
        "cost": cost["cost"],
        "cost_se": cost["cost_se"],
        "criterion_met": bool(met) if labelled else None,
        "max_cost": RECON_MAX_COST,
        "by_criterion": sae is None and cfg.k == 0,
        "images": len(xs),
        "ladder": [c for _, c in tried],
    }
    return chosen, selection


def run_site(
    model: ViT,
    data: Task,
    cfg: Config,
    site: str,
    base: Readout,
    floor: Readout,
    x: torch.Tensor,
    y: torch.Tensor,
    progress: bool = False,
    sae: TopKSAE | None = None,
    roles: list[str] | None = None,
    draw: int = 0,
) -> SiteResult:
    """Train (or take) an SAE at `site` (its k chosen by fit_site_sae), find its positional
    latents and run every edit; each is read at the SAE's site and the output, with the intact
    model's fixed probes and refitted ones. SAE draw `draw` trains its SAE and draws its random
    controls from its own seed (Config.draw); the measurements keep cfg's."""
    idx = site_index(model, site)
    probe_sites = sorted({idx, model.cfg.depth})
    dcfg = cfg.draw(draw)
    sae, k_selection = fit_site_sae(model, data, dcfg, site, sae)
    xv = data.split("val")[0][: cfg.probe_images]
    with autocast(model, cfg.precision):
        val_store = ActivationStore.from_model(
            model, xv, site, batch_images=forward_batch(cfg, STORE_BATCH_IMAGES)
        )
    quality = evaluate(sae, val_store)
    codes = patch_codes(model, sae, xv, forward_batch(cfg, CODES_BATCH_IMAGES))  # fp32 codes
    pl = find_positional_latents(codes, *model.grid_of(xv[:1]))
    fixed = base.fixed_probes()
    results, probes = [], {}
    label = f"sae_causal {site}" + (f" (SAE draw {draw + 1})" if draw else "")
    planned = conditions(sae, pl, codes, dcfg)
    if rowcol_only(cfg, site, roles or []):  # the same edits, the others left out
        planned = [p for p in planned if p[0] in ROWCOL_EDITS]
    for name, cond, meta in track(planned, label, progress):
        r = measure(model, x, y, cfg, cond, probe_sites=probe_sites, fixed=fixed,
                    passes=cfg.passes)  # fmt: skip
        results.append(summarise(name, r, base, floor, idx, meta))
        probes[name] = probe_table(r, probe_sites)
    probes["intact"] = probe_table(base, probe_sites)
    assert base.probes is not None
    probes["chance"] = {"refit": np.tile(np.array(base.probes.chance), (len(probe_sites), 1))}
    return SiteResult(
        site, idx, probe_sites, quality, pl, results, probes, roles or [], k_selection
    )


@torch.no_grad()
def position_table(model: ViT, image: torch.Tensor) -> dict[str, float] | None:
    """Row + column share of the additive position table the model adds (None without one),
    read through hook_pos_embed on one image."""
    if not model.cfg.uses_additive_pos:
        return None
    _, cache = model.run_with_cache(image[:1].to(model.head.weight.device), hooks.POS_EMBED)
    gh, gw = model.grid_of(image[:1])
    return row_col_share(cache[hooks.POS_EMBED][0].float().cpu().reshape(gh, gw, -1))


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    saes: dict[str, TopKSAE] | None = None,
    references: ReferenceCache | None = None,
) -> SAECausal:
    """The causal test at every site in cfg.sites (SAEs trained here unless given by site), once
    per SAE draw (cfg.sae_draws); the intact baseline is the reference's (readout.baseline),
    reused from `references`."""
    cfg = resolved(cfg or Config(), model)
    resolve_sites(model, cfg, probe_block=0)  # ConfigError for a bad hook name before any work
    if saes and cfg.sae_draws > 1:
        raise ConfigError("analysis.sae_draws must be 1 with given SAEs (one SAE per site)")
    x, y = eval_images(data, cfg)
    all_sites = list(range(model.cfg.depth + 1))
    base = baseline(model, x, y, cfg, all_sites, cache=references)
    probe_block = cfg.probe_block if cfg.probe_block >= 0 else choose_probe_site(base)
    sites = resolve_sites(model, cfg, probe_block)
    check_sites(saes or {}, list(sites))
    floor_sites = sorted({site_index(model, s) for s in sites} | {model.cfg.depth})
    floor = measure(model, x, y, cfg, floor_condition(model), floor_sites,
                    fixed=base.fixed_probes(), passes=cfg.passes.floor)  # fmt: skip
    results = [
        run_site(model, data, cfg, s, base, floor, x, y, progress, (saes or {}).get(s), roles)
        for s, roles in sites.items()
    ]
    draws = [
        [run_site(model, data, cfg, s, base, floor, x, y, progress, None, roles, j)
         for s, roles in sites.items() if drawn_again(cfg, s, roles)]
        for j in range(1, cfg.sae_draws)
    ]  # fmt: skip
    return SAECausal(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        probe_site=probe_block,
        n_images=len(x),
        probe_images=cfg.probe_images,
        baseline=base.summary(),
        results=results,
        position_table=position_table(model, x),
        draws=draws,
    )


__all__ = [
    "conditions",
    "fit_site_sae",
    "position_table",
    "reconstruction_cost",
    "run",
    "run_site",
    "selection_images",
]
