"""The SAE causal test's configuration and where its SAEs sit."""

from __future__ import annotations

from dataclasses import dataclass, replace

from poslens.errors import ConfigError
from poslens.experiments.config import ExperimentConfig, Passes
from poslens.experiments.sae_causal.result import NAME
from poslens.limits import check_count
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.sae.config import SAEConfig

# k = 0 ("auto by criterion"): the smallest k of Config.k_ladder whose reconstruction alone,
# spliced as the "reconstruction" condition splices it (plain, at the residual for a normalised
# site), costs at most this much accuracy (a fraction: 0.03 is 3 points, paired over the
# selection images). At width 32 the width rule's k = 4 cost 23-53 points (NOTES.md, "Sparse
# autoencoders"): an SAE that breaks the model on its own cannot say what the model uses.
RECON_MAX_COST = 0.03
# the selection images: the first max(analysis.n_images, this) of the validation split, apart
# from the evaluation images (unless analysis.split is val); 500 keeps the cost's paired SE
# near a point at a few points of cost
SELECTION_IMAGES = 500
MAX_SAE_DRAWS = 20  # a bound on analysis.sae_draws (each draw trains one SAE per site)

# SAE draw j > 0 trains (and draws its random controls) with seed + j * DRAW_SEED_STRIDE
DRAW_SEED_STRIDE = 10_000

# sites entries: "early" is the normalised residual entering block round(2 * depth / 12), the
# original study's block 2 of 12 scaled to the model's depth; "probe" the probe block's (where
# the intact model's position probes peak, or analysis.probe_block), as the original placed its
# SAE; "table" the raw residual entering block 0, where an additive position table is still one
# additive term (no norm has divided it by a patch-dependent scale). Any other entry is a hook name.
EARLY, PROBE, TABLE = "early", "probe", "table"


@dataclass(frozen=True)
class Config(ExperimentConfig):
    # Where SAEs read, one test each. An SAE on a normalised residual is spliced at the residual
    # the norm reads, so an edit reaches every later block (sae.metrics.splice).
    sites: tuple[str, ...] = (EARLY, PROBE)
    # active latents per token; 0: chosen by a stated criterion (RECON_MAX_COST, k_ladder): the
    # width rule's k (one per 12 input dimensions, at least 4: the original's 64 at d = 768) if
    # its reconstruction alone keeps the model, else the next of its doublings that does. A k
    # near d lets the SAE spread position over many latents at once.
    k: int = 0
    expansion: int = 5  # d_sae / d_in, as the original
    epochs: int = 5
    train_images: int = 1000
    doses: tuple[int, ...] = (4, 8, 16, 32)  # plus "all" positional latents

    whiten: bool = False
    # SAEs trained per site with different seeds (draw j: seed + j * DRAW_SEED_STRIDE), every
    # headline number their mean: the SAE's own seed is noise in each effect (at width 32 and
    # k = 8 one model's planted row + column effect read 0.14, 0.17 and 0.43 over three SAE seeds)
    sae_draws: int = 1
    # the entries of `sites` the further SAE draws repeat (empty: every site); a site left out is
    # read from draw 0's SAE alone
    draw_sites: tuple[str, ...] = ()
    # the entries of `sites` that run only the edits of the row and column latents the APE
    # sharper level and its notes read (result.ROWCOL_EDITS: zeroed, resampled from another image
    # and from another position, beside the reconstruction alone): no dose ladder, no random
    # controls (empty: every edit at every site)
    rowcol_sites: tuple[str, ...] = ()
    # probes refitted on every edit, clean and under RPI (what a new probe can still decode);
    # False: each edit reads the intact model's fixed probes alone, the probes the APE rules
    # read, a third of the test's time at width 32 (docs/runs/2026-12-05-faster-sae-edits.md)
    refit: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.doses or any(not isinstance(d, int) or d < 1 for d in self.doses):
            raise ConfigError(f"analysis.doses must be positive integers, got {self.doses!r}")
        check_count("analysis.doses", self.doses, "doses")
        if not self.sites or any(not isinstance(s, str) or not s for s in self.sites):
            raise ConfigError(
                f"analysis.sites must be hook names, early, probe or table, got {self.sites!r}"
            )
        for name in ("draw_sites", "rowcol_sites"):
            if any(s not in self.sites for s in getattr(self, name)):
                raise ConfigError(
                    f"analysis.{name} must be entries of analysis.sites {self.sites!r}, "
                    f"got {getattr(self, name)!r} (a preset may set it; "
                    f"`--set {NAME}.{name}=` clears it)"
                )
        if not isinstance(self.refit, bool):
            raise ConfigError(f"analysis.refit must be true or false, got {self.refit!r}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ConfigError(
                f"analysis.k must be 0 (automatic) or a positive count, got {self.k!r}"
            )
        check_count("analysis.train_images", self.train_images, "images")
        if (
            not isinstance(self.sae_draws, int)
            or isinstance(self.sae_draws, bool)
            or not (1 <= self.sae_draws <= MAX_SAE_DRAWS)
        ):
            raise ConfigError(
                f"analysis.sae_draws must be a count from 1 to {MAX_SAE_DRAWS}, "
                f"got {self.sae_draws!r}"
            )

    @property
    def passes(self) -> Passes:
        """Every edit's passes: the shared ones, refitting its probes only where `refit`."""
        return replace(super().passes, refit=self.refit)

    def draw(self, j: int) -> Config:
        """The config of SAE draw j (draw 0 is this config itself)."""
        return self if j == 0 else replace(self, seed=self.seed + j * DRAW_SEED_STRIDE)

    def k_ladder(self, d_in: int) -> tuple[int, ...]:
        """The k tried in order for activations of width d_in: cfg.k alone when set; for k = 0,
        auto_k(d_in), then doublings, up to and including min(d_in, d_sae / 2)."""
        if self.k:
            return (self.k,)
        ks = [auto_k(d_in)]
        top = min(d_in, self.expansion * d_in // 2)
        while ks[-1] * 2 < top:
            ks.append(ks[-1] * 2)
        return (*ks, top) if ks[-1] < top else tuple(ks)

    def sae_config(self, site: str, d_in: int, k: int | None = None) -> SAEConfig:
        """The SAE at `site` for activations of width d_in with k active latents (default: cfg.k,
        or the width rule's auto_k when cfg.k = 0)."""
        return SAEConfig(
            site=site,
            k=k or self.k or auto_k(d_in),
            expansion=self.expansion,
            epochs=self.epochs,
            whiten=self.whiten,
            seed=self.seed,
        )


def auto_k(d_in: int) -> int:
    """One active latent per 12 input dimensions, at least 4."""
    return max(4, round(d_in / 12))


def _names(entries: tuple[str, ...], hook: str, roles: list[str]) -> bool:
    """Whether `entries` (of Config.sites) name the site `hook` or one of its `roles`."""
    return hook in entries or any(r in entries for r in roles)


def drawn_again(cfg: Config, hook: str, roles: list[str]) -> bool:
    """Whether the further SAE draws repeat the site `hook` (playing `roles`): cfg.draw_sites
    names it or one of its roles, or is empty."""
    return not cfg.draw_sites or _names(cfg.draw_sites, hook, roles)


def rowcol_only(cfg: Config, hook: str, roles: list[str]) -> bool:
    """Whether the site `hook` (playing `roles`) runs only the row and column edits
    (cfg.rowcol_sites names it or one of its roles)."""
    return _names(cfg.rowcol_sites, hook, roles)


def applies(model: ViT) -> str | None:
    return None


def normalised_hook(model: ViT, block: int) -> str:
    """The normalised residual entering `block` (the final norm's output for the last site)."""
    return hooks.FINAL_NORM if block == model.cfg.depth else hooks.normalized(block)


def early_block(model: ViT) -> int:
    """Block 2 of 12 scaled to this model's depth (at least 1, so that it follows a block)."""
    return max(1, int(2 * model.cfg.depth / 12 + 0.5))


def site_index(model: ViT, site: str) -> int:
    """The residual site a hook belongs to: blocks.b.* -> b (b's input), ln_final -> out."""
    b = hooks.block_of(site)
    return model.cfg.depth if b is None else b


def resolve_sites(model: ViT, cfg: Config, probe_block: int) -> dict[str, list[str]]:
    """cfg.sites as hook names, in order without repeats, each with the roles it plays ("early",
    "probe", "table"; none for a site named by its hook)."""
    sites: dict[str, list[str]] = {}
    for s in cfg.sites:
        if s == TABLE:
            sites.setdefault(hooks.resid_pre(0), []).append(TABLE)
        elif s == EARLY:
            sites.setdefault(
                normalised_hook(model, min(early_block(model), model.cfg.depth)), []
            ).append(EARLY)
        elif s == PROBE:
            sites.setdefault(normalised_hook(model, probe_block), []).append(PROBE)
        elif s not in model.hook_names():
            raise ConfigError(f"analysis.sites: {s!r} is not a hook of this model")
        else:
            sites.setdefault(s, [])
    return sites


__all__ = [
    "DRAW_SEED_STRIDE",
    "EARLY",
    "PROBE",
    "RECON_MAX_COST",
    "SELECTION_IMAGES",
    "TABLE",
    "Config",
    "applies",
    "auto_k",
    "drawn_again",
    "early_block",
    "resolve_sites",
    "rowcol_only",
    "site_index",
]
