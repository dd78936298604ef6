"""Train a TopK SAE: Adam on MSE + AuxK, unit-norm decoder rows, deterministic given the seed.

One step is dictionary_learning's TopKTrainer step (Gao et al. 2024): pick each token's top-k
latents, loss = ||x - x_hat||^2 (summed over D, mean over tokens) + aux_coef * AuxK, where AuxK
reconstructs the residual x - x_hat (detached) with the top aux_k dead latents, without b_dec,
normalised by the residual's variance; then remove each decoder row's gradient component along
the row, clip the gradient norm at 1, Adam, renormalise the rows. The gradients are written by
hand (`sae_step`, checked against autograd in tests/sae): the decoder runs on the k chosen rows
only (embedding_bag), the top-k uses `topk_indices`, and the backward is three dense products
with no autograd graph. benchmarks/sae_train.py compares it with dictionary_learning.
"""

from __future__ import annotations

import math

import torch

from poslens import distributed
from poslens.sae.config import SAEConfig
from poslens.sae.model import TopKSAE, Whitening, topk_indices
from poslens.sae.store import ActivationStore

HISTORY_KEYS = ("loss", "mse", "aux", "fvu", "l0", "dead")


def lr_scale(step: int, steps: int, warmup: int, decay_frac: float) -> float:
    """Linear warmup over `warmup` steps, constant, then linear decay to 0 over the last part."""
    decay_start = steps - int(decay_frac * steps)
    if step < warmup:
        return (step + 1) / warmup
    if step >= decay_start:
        return (steps - step) / (steps - decay_start)
    return 1.0


@torch.no_grad()
def sae_step(
    sae: TopKSAE,
    xs_BD: torch.Tensor,
    dead_tokens: int,
    aux_k: int,
    aux_coef: float,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mse, aux, codes_BK) of SAE-space inputs; sets every parameter's .grad for the loss
    mse + aux_coef * aux. Firing counters are updated first, so latents firing now are not dead.

    total: under torchrun, xs_BD is this rank's slice of a batch of `total` tokens (slices may
    be empty or unequal). The step is then collective and equals one process's on the whole
    batch up to float summation order: each slice's gradient is scaled by 1/total (its token
    share of the mean) and the gradients summed over ranks; the firing mass, the batch mean of
    the residual and AuxK's variance normaliser are all-reduced sums; the aux top-k is per token
    over the (identical) dead latents. mse, aux and the grads come back for the whole batch.
    """
    B = xs_BD.shape[0] if total is None else total
    xc_BD = xs_BD - sae.b_dec
    pre_BF = torch.addmm(sae.b_enc, xc_BD, sae.W_enc)
    idx_BK = topk_indices(pre_BF, sae.k)
    acts_BK = pre_BF.gather(1, idx_BK).relu_()
    sae.record_firing(acts_BK, idx_BK, total)
    err_BD = sae.decode_sparse(acts_BK, idx_BK) + sae.b_dec - xs_BD  # x_hat - x
    mse = err_BD.pow(2).sum(1).mean() if total is None else err_BD.pow(2).sum() / B
    sae.b_dec.grad = (2 / B) * err_BD.sum(0)
    parts = [(idx_BK, acts_BK, (2 / B) * err_BD)]  # (latents, codes, d loss / d reconstruction)
    aux = xs_BD.new_zeros(())
    dead_F = sae.dead_mask(dead_tokens).nonzero().squeeze(1)
    if len(dead_F) and aux_coef > 0:
        aux_idx_BK = dead_F[topk_indices(pre_BF[:, dead_F], min(aux_k, len(dead_F)))]
        aux_acts_BK = pre_BF.gather(1, aux_idx_BK).relu_()
        aux_err_BD = sae.decode_sparse(aux_acts_BK, aux_idx_BK) + err_BD  # aux_hat - (x - x_hat)
        centred_B = (err_BD - batch_mean0(err_BD, total)).pow(2).sum(1)
        denom = (
            centred_B.mean() if total is None else distributed.all_reduce_sum(centred_B.sum()) / B
        )
        if denom > 0:
            aux_B = aux_err_BD.pow(2).sum(1)
            aux = aux_B.mean() / denom if total is None else aux_B.sum() / B / denom
            parts.append((aux_idx_BK, aux_acts_BK, (2 * aux_coef / (B * denom)) * aux_err_BD))
    # backward: loss -> reconstructions -> decoder rows and codes -> encoder (ReLU-gated)
    sae.W_dec.grad = torch.zeros_like(sae.W_dec)
    g_BF = torch.zeros_like(pre_BF)
    for i_BK, a_BK, g_BD in parts:
        sae.W_dec.grad.addmm_(torch.zeros_like(pre_BF).scatter_(1, i_BK, a_BK).T, g_BD)
        g_BK = (g_BD @ sae.W_dec.T).gather(1, i_BK).mul_(a_BK > 0)
        g_BF.scatter_add_(1, i_BK, g_BK)
    sae.W_enc.grad = xc_BD.T @ g_BF
    sae.b_enc.grad = g_BF.sum(0)
    sae.b_dec.grad -= sae.W_enc @ sae.b_enc.grad
    if total is not None:  # every gradient (and mse, aux) is a sum over tokens: add the slices
        params = list(sae.parameters())
        flat = torch.cat([*(p.grad.flatten() for p in params), mse[None], aux[None]])  # type: ignore[union-attr]
        distributed.all_reduce_sum(flat)
        for p, g in zip(params, flat.split([*(p.numel() for p in params), 2]), strict=False):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]
        mse, aux = flat[-2], flat[-1]
    return mse, aux, acts_BK


def batch_mean0(t_BD: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Mean [D] over a batch's tokens; with `total`, over every rank's slice (collective)."""
    if total is None:
        return t_BD.mean(0)
    return distributed.all_reduce_sum(t_BD.sum(0)) / total


def init_sae(store: ActivationStore, cfg: SAEConfig) -> TopKSAE:
    """A fresh SAE for this store: b_dec at the activation mean, or an exact whitening fitted."""
    d_in = store.d_in
    sae = TopKSAE(d_in, cfg.d_sae(d_in), cfg.k, cfg.seed, cfg.site, cfg.include_prefix)
    s_D, s_DD = store.moments(outer=cfg.whiten)
    with torch.no_grad():
        if s_DD is not None:  # whitened tokens have mean 0, the initial b_dec
            sae.whitening = Whitening.fit(s_D, s_DD, len(store))
        else:
            sae.b_dec.copy_(s_D / len(store))
    return sae


def train_sae(
    data: ActivationStore | torch.Tensor,
    cfg: SAEConfig,
    progress: bool = False,
    device: str | torch.device = "cpu",
    shard: bool = True,
) -> tuple[TopKSAE, list[dict[str, float]]]:
    """Train on a store or tokens [N, D] (batches move to `device`); history: per log interval,
    means of HISTORY_KEYS.

    The history's fvu is over the interval's training batches and in the training space
    (whitened when cfg.whiten); report poslens.sae.metrics.evaluate on held-out tokens instead.

    Under torchrun (and `shard`) this is data-parallel training, DistributedDataParallel in
    spirit but written by hand because sae_step has no autograd graph to hook: every rank holds
    the same store and the full SAE, takes an equal slice of each step's batch, and sae_step
    sums the slices' gradients and statistics, so every rank takes the identical step and the
    result equals one process's up to float summation order (~1e-6 on the weights).
    """
    store = data if isinstance(data, ActivationStore) else ActivationStore(data)
    rank, world = distributed.world() if shard else (0, 1)
    sae = init_sae(store, cfg).to(device)
    steps = cfg.steps or cfg.epochs * math.ceil(len(store) / cfg.batch)
    lr, aux_k = cfg.lr_for(sae.d_sae), cfg.aux_k_for(sae.d_in)
    params = list(sae.parameters())
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), fused=True)
    history: list[dict[str, float]] = []
    sums = torch.zeros(len(HISTORY_KEYS) + 1, dtype=torch.float64, device=device)  # + variance
    seen = n_steps = 0
    bar = _Bar(steps) if progress and rank == 0 else None
    for step, x_BD in zip(range(steps), store.batches(cfg.batch, cfg.seed), strict=False):
        for group in opt.param_groups:
            group["lr"] = lr * lr_scale(step, steps, cfg.warmup_steps, cfg.decay_frac)
        b = x_BD.shape[0]
        total = None if world == 1 else b
        if total is not None:  # this rank's slice of the batch
            x_BD = x_BD[rank * b // world : (rank + 1) * b // world]
        x_BD = x_BD.to(device, non_blocking=True)
        xs_BD = sae.to_sae_space(x_BD)
        mse, aux, acts_BK = sae_step(sae, xs_BD, cfg.dead_tokens, aux_k, cfg.aux_coef, total)
        sae.remove_parallel_grad()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sae.normalize_decoder()
        with torch.no_grad():
            var = (xs_BD - batch_mean0(xs_BD, total)).pow(2).sum()
            dead = sae.dead_mask(cfg.dead_tokens).float().mean()
            l0 = (acts_BK > 0).sum()
            if total is not None:
                var, l0 = distributed.all_reduce_sum(torch.stack([var, l0.to(var.dtype)]))
            l0 = l0 / b
            sums += torch.stack([mse + cfg.aux_coef * aux, mse, aux, mse * b, l0, dead, var])
        seen, n_steps = seen + b, n_steps + 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            row = dict(zip(HISTORY_KEYS, (sums[:-1] / n_steps).tolist(), strict=True))
            row["fvu"] = float(sums[3] / sums[-1])
            history.append({"step": step + 1, "tokens": seen, **row})
            sums.zero_()
            n_steps = 0
        if bar is not None:
            bar.advance()
    if bar is not None:
        bar.close()
    return sae.eval(), history


class _Bar:
    """A transient rich progress bar over the steps."""

    def __init__(self, steps: int) -> None:
        from rich.progress import Progress

        self.progress = Progress(transient=True)
        self.progress.start()
        self.task = self.progress.add_task("SAE", total=steps)

    def advance(self) -> None:
        self.progress.advance(self.task)

    def close(self) -> None:
        self.progress.stop()
