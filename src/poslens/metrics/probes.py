"""Linear position probes: exact cell (G^2 classes), row (gh) and column (gw) from one token.

Row and column: multinomial logistic regression, fitted for all blocks, both targets and every
L2 strength in one full-batch L-BFGS problem (the losses are separable: the problems share only
the line search), with the gradients written out (softmax minus one-hot). Exact cell: linear
discriminant analysis in closed form (class means and one shared, shrunk within-class
covariance, as scikit-learn's LinearDiscriminantAnalysis(solver="eigen")): with G^2 classes
(196 on a ViT-B grid) the logistic fit was 80-90% of a pretrained experiment's time; with LDA a
ViT-Ti's depth_profile fits took 25 s instead of 218 s
(docs/runs/2026-12-02-quick-pretrained-study-time.md). For rows and columns LDA lost up to 5 points against logistic
regression, so they stay logistic.
Images are split 60/20/20; features are standardised and then whitened on the training images
(an invertible linear map, so the probe's function class is unchanged), which makes L-BFGS
converge in about 20 iterations instead of hundreds. The L2 strength (on the whitened weights),
or for LDA the shrinkage, is chosen on validation accuracy and test accuracy is reported beside
the chance level. benchmarks/probes.py compares speed and accuracy with scikit-learn.

Two uses (METHODS.md, "Calibration"): a *refitted* probe is fitted on the activations of the
condition it reads (what position information is left); a *fixed* probe is fitted once on the
intact model's activations and applied, standardisation, whitening and weights unchanged, to the
same images' activations under a condition (what the model's own representation lost).
`fit_probes` returns the fitted probes for both.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

TARGETS = ("exact", "row", "col")
DEFAULT_L2 = (1e-4, 1e-3, 1e-2)
# the exact-cell LDA's shrinkage of the within-class covariance toward a multiple of the identity,
# chosen on validation like the L2 strength (0: the plain within-class covariance)
SHRINKAGE = (1e-3, 1e-2, 0.1, 0.3)
WHITEN_EPS = 1e-3  # added to the eigenvalues of the standardised covariance (mean eigenvalue ~1)
# at most this many logits in one L-BFGS problem (float32: 200 MB per copy); larger problems are
# fitted in groups of sites. The default study's fits are far below it (0.6 M).
MAX_LOGITS = 50_000_000
# at most this many bytes of one problem's features (its float32 tokens of every image); more
# sites are fitted in groups, so that the fit's working copies stay near this size (a ViT-S's 13
# sites x 80 images x 196 tokens are 300 MB, a ViT-B's 1,000 images 7.7 GB; the default study's
# 5 sites 4 MB, one problem)
MAX_FEATURE_BYTES = 32 * 2**20
# fitted probes kept for identical inputs, up to this many bytes of weights and whiteners: a
# condition that leaves the features unchanged (random SAE latents that never fire) costs nothing
MEMO_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ProbeResult:
    """Test accuracy [block, target] at the L2 strength chosen on validation, with chance levels."""

    test_acc: np.ndarray  # [L, 3] in TARGETS order
    val_acc: np.ndarray  # [L, 3]
    l2: np.ndarray  # [L, 3] chosen regularisation: L2 strength (row, col), LDA shrinkage (exact)
    chance: tuple[float, float, float]
    n_images: tuple[int, int, int]  # train, val, test

    def to_dict(self) -> dict[str, object]:
        return {
            "targets": list(TARGETS),
            "test_acc": self.test_acc.tolist(),
            "val_acc": self.val_acc.tolist(),
            "l2": self.l2.tolist(),
            "chance": list(self.chance),
            "n_images": list(self.n_images),
        }


def split_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded 60/20/20 split of image indices (positions of one image never straddle splits)."""
    perm = np.random.default_rng(seed).permutation(n)
    a, b = int(0.6 * n), int(0.8 * n)
    return perm[:a], perm[a:b], perm[b:]


def position_labels(gh: int, gw: int) -> torch.Tensor:
    """[T, 3] labels of each row-major patch token: exact cell, row, column."""
    k = torch.arange(gh * gw)
    return torch.stack([k, k // gw, k % gw], dim=1)


def _whitener(x_LMD: torch.Tensor) -> torch.Tensor:
    """[L, D, D] maps making the (standardised) training features of each block white (one site
    at a time in float64: a ViT-B's 13 sites at once would hold gigabytes of float64 copies)."""
    out = []
    for x_MD in x_LMD:
        x = x_MD.double()
        eig, vec = torch.linalg.eigh(x.T @ x / x.shape[0])
        out.append((vec / (eig.clamp_min(0) + WHITEN_EPS).sqrt()[None, :]).float())
    return torch.stack(out)


@dataclass(frozen=True)
class PositionProbes:
    """Probes fitted at L sites, kept whole so they can read other activations of the same images
    (the fixed probe): per-site standardisation and whitening, and per site and target the
    weights at the L2 strength chosen on validation."""

    result: ProbeResult  # what the fit scored on its own features
    mu_L11D: torch.Tensor
    sd_L11D: torch.Tensor
    white_LDD: torch.Tensor
    weights: tuple[torch.Tensor, ...]  # per target: [L, D + 1, C] (last row = bias)
    test_idx: np.ndarray  # the test images (the seeded 60/20/20 split of N images)
    n_images: int
    grid: tuple[int, int]

    def score(self, feats: torch.Tensor, sites: Sequence[int] | None = None) -> np.ndarray:
        """Test accuracy [len(sites), 3] (exact, row, col) of the probes of `sites` (indices into
        the L fitted sites; default all) on feats [len(sites), N_images, T, D] of the same images."""
        idx = list(range(len(self.weights[0]))) if sites is None else list(sites)
        L, n, T, D = feats.shape
        if L != len(idx) or n != self.n_images or T != self.grid[0] * self.grid[1]:
            raise ValueError(
                f"features {tuple(feats.shape)} do not fit probes of {len(idx)} sites, "
                f"{self.n_images} images and a {self.grid[0]}x{self.grid[1]} grid"
            )
        x = (feats[:, self.test_idx].float() - self.mu_L11D[idx]) / self.sd_L11D[idx]
        xs = x.reshape(L, len(self.test_idx) * T, D) @ self.white_LDD[idx]
        xs = torch.cat([xs, torch.ones(L, xs.shape[1], 1)], dim=-1)
        labels = position_labels(*self.grid).repeat(len(self.test_idx), 1)
        with torch.no_grad():
            acc = [
                (torch.einsum("lmd,ldc->lmc", xs, w[idx]).argmax(-1) == labels[:, t])
                .double()
                .mean(-1)
                for t, w in enumerate(self.weights)
            ]
        return torch.stack(acc, dim=-1).numpy()


def _concat(parts: list[PositionProbes]) -> PositionProbes:
    """Probes fitted on consecutive groups of sites (the same images and split) as one."""
    first = parts[0]
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    result = ProbeResult(
        test_acc=cat([p.result.test_acc for p in parts]),
        val_acc=cat([p.result.val_acc for p in parts]),
        l2=cat([p.result.l2 for p in parts]),
        chance=first.result.chance,
        n_images=first.result.n_images,
    )
    return PositionProbes(
        result,
        torch.cat([p.mu_L11D for p in parts]),
        torch.cat([p.sd_L11D for p in parts]),
        torch.cat([p.white_LDD for p in parts]),
        tuple(torch.cat([p.weights[t] for p in parts]) for t in range(len(TARGETS))),
        first.test_idx,
        first.n_images,
        first.grid,
    )


def fit_position_probes(
    feats: torch.Tensor,
    gh: int,
    gw: int,
    seed: int = 0,
    l2: tuple[float, ...] = DEFAULT_L2,
    shuffle_labels: bool = False,
    max_iter: int = 25,
) -> ProbeResult:
    """Probe feats [L, N_images, T, D] (patch tokens of L blocks) for exact/row/col position.

    shuffle_labels: the control; labels are shuffled across training tokens, so a probe can only
    memorise and test accuracy should sit at chance.
    """
    return fit_probes(feats, gh, gw, seed, l2, shuffle_labels, max_iter).result


@torch.no_grad()
def objective(
    ws: Sequence[torch.Tensor], x_LMD: torch.Tensor, y_M3: torch.Tensor, lam_R: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The probes' loss, summed over every problem, and its gradients, written out (softmax minus
    one-hot: 2x faster than autograd through cross_entropy). ws: per target [L, R*C, D+1]
    (strength-major rows, last column = bias); x_LMD: whitened features with a bias column;
    y_M3: labels; lam_R: L2 strengths. Per site, target and strength: mean cross-entropy over
    the M tokens + lam * |w|^2 without the bias.

    The logits [L, R, C, M] put the classes in the middle and the tokens last, so the softmax
    runs along contiguous tokens (18x faster than over the last axis for C = 6 on one core)."""
    L, M, _ = x_LMD.shape
    R = len(lam_R)
    xT = x_LMD.transpose(1, 2)  # [L, D+1, M] (a view: bmm reads it transposed)
    # every target's logits from one bmm (twice the rows of one target's: faster on a CPU)
    rows = [w.shape[1] for w in ws]
    logits_all = torch.bmm(torch.cat(ws, dim=1), xT)  # [L, sum R*C, M]
    p_all = torch.empty_like(logits_all)
    total = torch.zeros((), dtype=torch.float64)
    at = 0
    for t, n in enumerate(rows):
        C = n // R
        target = y_M3[:, t].view(1, 1, 1, M).expand(L, R, 1, M)
        logits = logits_all[:, at : at + n].view(L, R, C, M)
        p = p_all[:, at : at + n].view(L, R, C, M)
        top = logits.amax(2, keepdim=True)  # [L, R, 1, M]
        picked = logits.gather(2, target).sum()
        torch.sub(logits, top, out=p).exp_()
        norm = p.sum(2, keepdim=True)
        ce = (top + norm.log()).sum() - picked  # summed over tokens: / M below
        p.div_(norm).scatter_add_(2, target, torch.full_like(norm, -1.0))  # dCE/dlogits
        total += ce.double() / M
        at += n
    grad_all = torch.bmm(p_all, x_LMD).div_(M)  # [L, sum R*C, D+1]
    grads = []
    at = 0
    for w, n in zip(ws, rows, strict=True):
        C = n // R
        lam = lam_R.repeat_interleave(C).view(1, n, 1)
        grad = grad_all[:, at : at + n].contiguous()  # L-BFGS flattens it with view()
        weights = w[:, :, :-1]  # no penalty on the bias
        grad[:, :, :-1] += 2 * lam * weights
        grads.append(grad)
        total += (lam * weights * weights).sum().double()
        at += n
    return total.float(), grads


_memo: OrderedDict[bytes, PositionProbes] = OrderedDict()


def _nbytes(p: PositionProbes) -> int:
    return sum(t.nbytes for t in (p.mu_L11D, p.sd_L11D, p.white_LDD, *p.weights))


def fit_probes(
    feats: torch.Tensor,
    gh: int,
    gw: int,
    seed: int = 0,
    l2: tuple[float, ...] = DEFAULT_L2,
    shuffle_labels: bool = False,
    max_iter: int = 25,
) -> PositionProbes:
    """fit_position_probes, keeping the fitted probes (PositionProbes) to read other activations.

    The fit is deterministic, so a call with the same features (byte for byte) and arguments as
    a recent one returns that fit (MEMO_BYTES bound what is kept); callers never mutate it."""
    x = feats.detach().cpu().contiguous()
    key = hashlib.blake2b(x.flatten().view(torch.uint8).numpy().data, digest_size=20)
    key.update(repr((x.dtype, tuple(x.shape), gh, gw, seed, tuple(l2), shuffle_labels,
                     max_iter, MAX_LOGITS, MAX_FEATURE_BYTES, SHRINKAGE)).encode())  # fmt: skip
    digest = key.digest()
    if digest in _memo:
        _memo.move_to_end(digest)
        return _memo[digest]
    fitted = _fit(x, gh, gw, seed, l2, shuffle_labels, max_iter)
    _memo[digest] = fitted
    while sum(_nbytes(p) for p in _memo.values()) > MEMO_BYTES and len(_memo) > 1:
        _memo.popitem(last=False)
    return fitted


def _fit(
    feats: torch.Tensor,
    gh: int,
    gw: int,
    seed: int,
    l2: tuple[float, ...],
    shuffle_labels: bool,
    max_iter: int,
) -> PositionProbes:
    """fit_probes without the memo.

    A problem whose logits would exceed MAX_LOGITS numbers, or whose features MAX_FEATURE_BYTES
    (a pretrained ViT's 13 sites of hundreds of thousands of tokens), is fitted in groups of
    sites, each its own problem: the losses are separable, so only the line searches differ, and
    memory stays bounded."""
    L, n, T, D = feats.shape
    if T != gh * gw:
        raise ValueError(f"{T} tokens do not fit a {gh}x{gw} grid")
    if n < 5:
        raise ValueError(f"need at least 5 images to split 60/20/20, got {n}")
    per_site = len(l2) * int(0.6 * n) * T * (gh + gw)  # logistic logits of one site
    group = max(1, min(MAX_LOGITS // per_site, MAX_FEATURE_BYTES // (4 * n * T * D)))
    if L > group:
        parts = [_fit(feats[i : i + group], gh, gw, seed, l2, shuffle_labels, max_iter)
                 for i in range(0, L, group)]  # fmt: skip
        return _concat(parts)
    tr, va, te = split_images(n, seed)
    labels = position_labels(gh, gw)  # [T, 3]
    sizes = (gh * gw, gh, gw)
    x = feats.float()
    x_tr = x[:, tr]  # a copy (fancy indexing): the training images' tokens
    mu = x_tr.mean(dim=(1, 2), keepdim=True)
    sd = x_tr.std(dim=(1, 2), keepdim=True).clamp_min(1e-6)
    del x_tr
    x = (x - mu).div_(sd)  # one new tensor: the caller's features stay as they were
    white_LDD = _whitener(x[:, tr].reshape(L, -1, D))

    def flat(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Whitened features with a bias column [L, M, D+1] and labels [M, 3] of these images."""
        xs = x[:, idx].reshape(L, len(idx) * T, D) @ white_LDD
        ones = torch.ones(L, xs.shape[1], 1)
        return torch.cat([xs, ones], dim=-1), labels.repeat(len(idx), 1)

    x_tr, y_tr = flat(tr)
    if shuffle_labels:
        g = torch.Generator().manual_seed(seed + 1)
        y_tr = y_tr[torch.randperm(len(y_tr), generator=g)]
    R = len(l2)
    lam = torch.tensor(l2, dtype=torch.float32)  # [R]
    # Row and column: one weight tensor per target [L, R*C, D+1] (strength-major rows, last
    # column = bias), fitted together by L-BFGS
    ws = [torch.zeros(L, R * c, D + 1, requires_grad=True) for c in sizes[1:]]
    opt = torch.optim.LBFGS(
        ws, lr=1, max_iter=max_iter, history_size=10, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        total, grads = objective(ws, x_tr, y_tr[:, 1:], lam)
        for w, g in zip(ws, grads, strict=True):
            w.grad = g
        return total

    opt.step(closure)
    # Exact cell: LDA, one [L, S*C, D+1] weight tensor over the shrinkages (same layout)
    shrink = torch.tensor(SHRINKAGE, dtype=torch.float64)
    w_exact = lda(x_tr[..., :-1], y_tr[:, 0], sizes[0], shrink)
    all_ws = [w_exact, *(w.detach() for w in ws)]
    regs = [shrink, lam.double(), lam.double()]

    @torch.no_grad()
    def accuracy(idx: np.ndarray) -> list[torch.Tensor]:  # per target [R_t, L]
        xs, ys = flat(idx)
        xs = xs.transpose(1, 2)  # [L, D+1, M']
        return [
            (torch.bmm(w, xs).view(L, len(r), c, -1).argmax(2) == ys[:, t]).double().mean(-1).T
            for t, (w, c, r) in enumerate(zip(all_ws, sizes, regs, strict=True))
        ]

    val, test = accuracy(va), accuracy(te)
    best = [v.argmax(dim=0) for v in val]  # per target [L]: the chosen regularisation per site

    def pick(acc: list[torch.Tensor]) -> np.ndarray:  # [L, 3] at the chosen regularisation
        return torch.stack(
            [a[b, torch.arange(L)] for a, b in zip(acc, best, strict=True)], -1
        ).numpy()

    result = ProbeResult(
        test_acc=pick(test),
        val_acc=pick(val),
        l2=torch.stack([r[b] for r, b in zip(regs, best, strict=True)], -1).numpy(),
        chance=(1 / sizes[0], 1 / sizes[1], 1 / sizes[2]),
        n_images=(len(tr), len(va), len(te)),
    )
    chosen = tuple(  # [L, D+1, C] at each site's chosen regularisation
        w.view(L, len(r), c, D + 1)[torch.arange(L), b].transpose(1, 2).contiguous()
        for w, c, r, b in zip(all_ws, sizes, regs, best, strict=True)
    )
    return PositionProbes(result, mu, sd, white_LDD, chosen, te, n, (gh, gw))


@torch.no_grad()
def lda(x_LMD: torch.Tensor, y_M: torch.Tensor, C: int, shrinkage: torch.Tensor) -> torch.Tensor:
    """Linear discriminant analysis of C classes at each site and shrinkage: [L, S*C, D+1]
    (shrinkage-major rows, last column = bias), logits = w @ [x, 1].

    Class means m_c and the pooled within-class covariance W (biased, as scikit-learn's); per
    shrinkage s the covariance S = (1 - s) W + s tr(W) / D I (scikit-learn shrinks each class's
    covariance so, which pools to this); logits x S^-1 m_c - m_c S^-1 m_c / 2 + log prior_c.
    A class absent from training gets logit -inf."""
    L, M, D = x_LMD.shape
    counts = torch.bincount(y_M, minlength=C).double()  # [C]
    log_prior = (counts / M).log()  # -inf for an absent class
    out = []
    for x_MD in x_LMD:  # one site at a time: float64 copies of one site's tokens only
        x = x_MD.double()
        means_CD = torch.zeros(C, D, dtype=torch.float64).index_add_(0, y_M, x)
        means_CD /= counts.clamp_min(1)[:, None]
        # W = total second moment - between-class part: no centred copy of the tokens
        within_DD = (x.T @ x - (means_CD.T * counts) @ means_CD) / M
        # floored so that tokens identical within each class (W = 0) still give a solvable system
        scaled_eye_DD = within_DD.diagonal().mean().clamp_min(WHITEN_EPS) * torch.eye(
            D, dtype=torch.float64
        )
        site = []
        for s in shrinkage.tolist():
            w_DC = torch.linalg.solve((1 - s) * within_DD + s * scaled_eye_DD, means_CD.T)
            bias_C = -0.5 * (means_CD * w_DC.T).sum(-1) + log_prior
            site.append(torch.cat([w_DC.T, bias_C[:, None]], dim=-1))  # [C, D+1]
        out.append(torch.stack(site))  # [S, C, D+1]
    return torch.stack(out).view(L, len(shrinkage) * C, D + 1).float()
