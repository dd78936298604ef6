"""SAE quality: FVU, L0, dead fraction and cosine on held-out tokens; splicing into the model.

FVU = sum ||x - x_hat||^2 / sum ||x - mean||^2 with the per-dimension mean of the evaluated
tokens, always in the original activation space (also for whitened SAEs). A latent is dead on
some data when its code is never > 0 there: being among the top k with a zero code is not firing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from poslens._config import short_repr
from poslens.errors import ConfigError
from poslens.metrics.stats import correct_class_margin, paired_diff
from poslens.models import ViT, hooks
from poslens.sae.model import TopKSAE
from poslens.sae.store import ActivationStore

Edit = Callable[[torch.Tensor], torch.Tensor]


def fvu(x_ND: torch.Tensor, x_hat_ND: torch.Tensor) -> float:
    """Fraction of variance unexplained, against the per-dimension mean of x."""
    x, x_hat = x_ND.double(), x_hat_ND.double()
    return float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


@torch.no_grad()
def evaluate(
    sae: TopKSAE, data: ActivationStore | torch.Tensor, chunk: int = 8192
) -> dict[str, float]:
    """fvu, l0 (mean positive codes per token), dead_fraction and mean cosine(x, x_hat) on data."""
    store = data if isinstance(data, ActivationStore) else ActivationStore(data)
    dev = sae.W_dec.device
    err, cos, l0 = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(3))
    s_D, s2_D = (torch.zeros(store.d_in, dtype=torch.float64, device=dev) for _ in range(2))
    fired_F = torch.zeros(sae.d_sae, dtype=torch.bool, device=dev)
    for x in store.chunks(chunk):
        x = x.to(dev)
        x_hat, codes = sae(x)
        err += (x - x_hat).double().pow(2).sum()
        s_D += x.double().sum(0)
        s2_D += x.double().pow(2).sum(0)
        cos += F.cosine_similarity(x, x_hat, dim=-1).double().sum()
        pos = codes > 0
        l0 += pos.sum()
        fired_F |= pos.any(0)
    n = len(store)
    total_var = (s2_D - s_D**2 / n).sum()
    return {
        "fvu": float(err / total_var),
        "l0": float(l0 / n),
        "dead_fraction": float(1 - fired_F.float().mean()),
        "cos": float(cos / n),
        "tokens": n,
    }


def check_splice(model: ViT, sae: TopKSAE, site: str) -> None:
    """Refuse a splice that cannot fit, naming the site and both widths: a site that is not a
    hook of the model or not in its residual stream (models.hooks.is_token_site), or an SAE whose
    d_in is not the model's width there."""
    if not isinstance(site, str) or site not in model.hook_names():
        raise ConfigError(
            f"cannot splice the SAE at {short_repr(site)}: not a hook of this model (see "
            "poslens info --hooks)"
        )
    if not hooks.is_token_site(site):
        raise ConfigError(
            f"cannot splice the SAE at {site!r}: not in the residual stream (token activations "
            f"[B, T, {model.cfg.dim}]); splice at a residual, norm or block output hook such as "
            f"{hooks.resid_pre(0)}"
        )
    if sae.d_in != model.cfg.dim:
        raise ConfigError(
            f"cannot splice the SAE (d_in {sae.d_in}) at {site!r}: the model's width there is "
            f"{model.cfg.dim} (model.dim)"
        )


@contextlib.contextmanager
def splice(
    model: ViT,
    sae: TopKSAE,
    site: str | None = None,
    with_error: bool = False,
    edit: Edit | None = None,
    include_prefix: bool | None = None,
) -> Iterator[None]:
    """Within the `with`, the activation x at `site` (default: the SAE's) becomes D(z').

    z = E(x) and z' = edit(z) (z without edit; edit gets codes [B, T, F] and returns new codes).
    with_error adds the SAE's error back: x + D(z') - D(z), so only edited latents move and no
    edit is an exact identity. Only patch tokens are touched unless include_prefix (default: as
    the SAE was trained).

    An SAE read at a LayerNorm's output (e.g. `blocks.b.ln1.hook_normalized`, the original
    study's site) is spliced where the model reads: the residual the norm normalises is
    rewritten, its change dy mapped back through the norm per token (dx = sigma * dy / gamma,
    sigma the token's standard deviation, or its root mean square under an RMSNorm), so the edit
    reaches every later block and not only this block's attention (NOTES.md, "Sparse autoencoders").
    """
    site = site or sae.site
    check_splice(model, sae, site)
    keep_prefix = sae.include_prefix if include_prefix is None else include_prefix
    p = 0 if keep_prefix else model.cfg.num_prefix

    def edited(x_BTD: torch.Tensor) -> torch.Tensor:
        """The SAE's output for activations x (the edited reconstruction, or x + the edit)."""
        codes = sae.encode(x_BTD)
        rec = sae.decode(codes)
        new = rec if edit is None else sae.decode(edit(codes))
        return x_BTD + (new - rec) if with_error else new

    def at_site(t_BTD: torch.Tensor, _name: str) -> torch.Tensor:
        x = t_BTD[:, p:].float()
        return torch.cat([t_BTD[:, :p], edited(x).to(t_BTD.dtype)], dim=1)

    norm_site = model.norm_site(site)
    if norm_site is None:
        with model.hooks([(site, at_site)]):
            yield
        return
    resid_name, norm = norm_site

    def at_residual(t_BTD: torch.Tensor, _name: str) -> torch.Tensor:
        x = t_BTD[:, p:].float()
        eps, shape = float(norm.eps or 0.0), norm.normalized_shape
        if isinstance(norm, nn.RMSNorm):  # x / rms(x) * gamma: sigma the root mean square
            y = F.rms_norm(x, shape, norm.weight.float(), eps)
            sigma = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        else:
            y = F.layer_norm(x, shape, norm.weight.float(), norm.bias.float(), eps)
            sigma = (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
        dy = edited(y) - y
        gamma = norm.weight.float()
        gamma = torch.where(gamma.abs() < 1e-6, torch.full_like(gamma, 1e-6), gamma)
        return torch.cat([t_BTD[:, :p], (x + sigma * dy / gamma).to(t_BTD.dtype)], dim=1)

    with model.hooks([(resid_name, at_residual)]):
        yield


@torch.no_grad()
def spliced_quality(
    model: ViT,
    sae: TopKSAE,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch: int = 256,
    error_check: bool = True,
) -> dict[str, dict[str, float]]:
    """Accuracy, correct-class margin and KL(clean || spliced) with the reconstruction spliced in,
    without ("spliced") and with ("spliced_error", a sanity check: KL ~ 0; not run without
    `error_check`) the error term; differences to clean are paired over images, with their
    standard errors."""
    model.eval()
    device, labels = model.head.weight.device, labels.cpu()
    out: dict[str, list[torch.Tensor]] = {"clean": [], "spliced": []}
    if error_check:
        out["spliced_error"] = []
    for i in range(0, images.shape[0], batch):
        x = images[i : i + batch].to(device)
        out["clean"].append(model(x))
        with splice(model, sae, with_error=False):
            out["spliced"].append(model(x))
        if error_check:
            with splice(model, sae, with_error=True):
                out["spliced_error"].append(model(x))
    logits = {k: torch.cat(v).float().cpu() for k, v in out.items()}
    clean_logp = logits["clean"].log_softmax(-1)
    correct = {k: (v.argmax(-1) == labels).double().numpy() for k, v in logits.items()}
    margin = {k: correct_class_margin(v, labels).double().numpy() for k, v in logits.items()}
    result = {
        "clean": {"acc": float(correct["clean"].mean()), "margin": float(margin["clean"].mean())}
    }
    for k in (k for k in ("spliced", "spliced_error") if k in logits):
        kl = (clean_logp.exp() * (clean_logp - logits[k].log_softmax(-1))).sum(-1).mean()
        d_acc = paired_diff(correct[k], correct["clean"])
        d_margin = paired_diff(margin[k], margin["clean"])
        result[k] = {
            "acc": float(correct[k].mean()),
            "margin": float(margin[k].mean()),
            "kl": float(kl),
            "d_acc": d_acc.mean,
            "d_acc_se": d_acc.se,
            "d_margin": d_margin.mean,
            "d_margin_se": d_margin.se,
        }
    return result
