"""TopK SAE training: poslens.sae.train_sae vs dictionary_learning's TopKTrainer, same activations.

Both train on the same planted-dictionary activations (d=128; 1,024 unit-norm features with
power-law frequencies, ~12 active per token with exponential magnitudes, Gaussian noise and a
mean offset), in the same batch order, with the same hyperparameters: d_sae = 4 x 128, k = 16,
batch 1024, Adam at Gao et al.'s width-scaled lr, no warmup, linear decay over the last 20% of
steps, AuxK with aux_k = 64 and coefficient 1/32, the same dead-latent threshold (tokens),
gradient-norm clip 1. Remaining differences are each implementation's own: dictionary_learning
initialises b_dec at the geometric median of the first batch (poslens: the mean of all training
tokens) and counts a latent as fired whenever it is selected, even with a zero code. Its
inference-threshold tracking (threshold_start_step) is switched off: it is not used for FVU.
Throughput counts everything from handing over the activations to the trained SAE (poslens'
statistics pass included); FVU is measured by the same function on held-out tokens. A last,
untimed check trains both for 100 steps from poslens' initial weights and b_dec: the weights
then agree to float rounding, which shows the two training steps compute the same update.

The reference is the published dictionary_learning 0.1.0 wheel. Its package __init__ imports
nnsight (and through it a CUDA torch), so it is installed without dependencies into a throwaway
venv that reuses the core venv's torch, and its trainers/top_k.py is loaded without the package
__init__:

    python -m venv /tmp/venv_dlref
    echo /tmp/venv_core/lib/python3.11/site-packages \\
        > /tmp/venv_dlref/lib/python3.11/site-packages/core.pth
    /tmp/venv_dlref/bin/pip install --no-deps dictionary-learning==0.1.0 einops
    PYTHONPATH=src /tmp/venv_dlref/bin/python benchmarks/sae_train.py \\
        [--tokens 200000] [--epochs 3] [--threads 1] [--repeats 3] [--json out.json]

Measured on 2 shared CPU cores (load ~5), 1 thread, median of 5 interleaved repeats: poslens
65.6k tokens/s, dictionary_learning 38.1k (1.72x; single repeats 1.59-1.98x); held-out FVU
0.3225 vs 0.3226; same-init check: weights within 2.3e-6 after 100 steps, FVU equal to 6 digits.
The gain: the top-k is ~4x faster (grouped numpy argpartition), the decoder forward is an
embedding_bag over the k chosen rows and the backward is written by hand: 4 dense [B, D] x
[D, F] products per step (encoder forward + 3 in the backward) against dictionary_learning's 6.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from poslens.sae import ActivationStore, SAEConfig, TopKSAE, evaluate, fvu, train_sae
from poslens.sae.train import init_sae

D, N_TRUE, ACTIVE = 128, 1024, 12
CHECK_STEPS = 100


def planted_activations(n: int, seed: int = 1234) -> torch.Tensor:
    """[n, D] tokens: sparse sums of unit-norm planted features + noise + a mean offset.

    The seed must differ from the SAE's: with both at 0 the SAE's random initial decoder rows
    are the planted features themselves.
    """
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(N_TRUE, D, generator=g)
    feats /= feats.norm(dim=1, keepdim=True)
    freq = torch.arange(1, N_TRUE + 1, dtype=torch.float64) ** -0.6  # power-law frequencies
    idx = torch.multinomial(freq.expand(n, -1), ACTIVE, replacement=False, generator=g)
    mag = torch.empty(n, ACTIVE).exponential_(1.0, generator=g)
    x = torch.nn.functional.embedding_bag(idx, feats, per_sample_weights=mag, mode="sum")
    return x + 0.05 * torch.randn(n, D, generator=g) + torch.randn(D, generator=g)


def load_reference() -> Any:
    """dictionary_learning.trainers.top_k, imported without the package __init__ (nnsight)."""
    spec = importlib.util.find_spec("dictionary_learning")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("dictionary_learning is not importable; see this file's docstring for the venv")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, path in (
        ("dictionary_learning", root),
        ("dictionary_learning.trainers", root / "trainers"),
    ):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    from dictionary_learning.trainers import top_k

    return top_k


def run_poslens(store: ActivationStore, cfg: SAEConfig) -> tuple[torch.nn.Module, float]:
    t0 = time.perf_counter()
    sae, _ = train_sae(store, cfg)
    return sae, time.perf_counter() - t0


def run_reference(
    top_k: Any, store: ActivationStore, cfg: SAEConfig, steps: int, start: TopKSAE | None = None
) -> tuple[Any, float]:
    """dictionary_learning's trainer over the same batches; `start`: begin from these weights
    (and b_dec, instead of the geometric median), to check that the two steps agree."""
    t0 = time.perf_counter()
    d_sae, decay = cfg.d_sae(store.d_in), int(cfg.decay_frac * steps)
    trainer = top_k.TopKTrainer(
        steps=steps,
        activation_dim=store.d_in,
        dict_size=d_sae,
        k=cfg.k,
        layer=0,
        lm_name="planted",
        lr=cfg.lr_for(d_sae),
        auxk_alpha=cfg.aux_coef,
        warmup_steps=cfg.warmup_steps,
        decay_start=steps - decay if decay else None,
        threshold_start_step=steps + 1,
        seed=cfg.seed,
        device="cpu",
    )
    trainer.dead_feature_threshold = cfg.dead_tokens
    trainer.top_k_aux = cfg.aux_k_for(store.d_in)
    median = top_k.geometric_median
    if start is not None:
        trainer.ae.decoder.weight.data = start.W_dec.detach().T.contiguous()
        trainer.ae.encoder.weight.data = start.W_enc.detach().T.contiguous()
        top_k.geometric_median = lambda points, **_: start.b_dec.detach().clone()
    try:
        batches: Iterator[torch.Tensor] = store.batches(cfg.batch, cfg.seed)
        for step in range(steps):
            trainer.update(step, next(batches))
    finally:
        top_k.geometric_median = median
    return trainer, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000, help="training + held-out tokens")
    ap.add_argument("--heldout", type=int, default=20_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    top_k = load_reference()
    x = planted_activations(args.tokens)
    train_x, test_x = x[: -args.heldout], x[-args.heldout :]
    store = ActivationStore(train_x)
    cfg = SAEConfig(site="planted", k=16, expansion=4, batch=1024, epochs=args.epochs, aux_k=64)
    steps = args.epochs * -(-len(store) // cfg.batch)
    tokens = sum(min(cfg.batch, len(store) - i) for i in range(0, len(store), cfg.batch))
    tokens *= args.epochs
    run_poslens(store, SAEConfig(site="planted", steps=3))  # warm up both code paths
    run_reference(top_k, store, cfg, 3)
    times: dict[str, list[float]] = {"poslens": [], "dictionary_learning": []}
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        sae, t = run_poslens(store, cfg)
        times["poslens"].append(t)
        trainer, t = run_reference(top_k, store, cfg, steps)
        times["dictionary_learning"].append(t)
    # untimed: both trainers from the same initial weights and b_dec, for CHECK_STEPS steps
    check = SAEConfig(**{**cfg.to_dict(), "steps": min(CHECK_STEPS, steps)})
    ours_short, _ = run_poslens(store, check)
    theirs_short, _ = run_reference(top_k, store, check, check.steps, start=init_sae(store, cfg))
    w_diff = (ours_short.W_dec - theirs_short.ae.decoder.weight.T).abs().max().item()
    with torch.no_grad():
        ours = evaluate(sae, test_x)
        ref_fvu = fvu(test_x, trainer.ae(test_x))
        short_fvu = (fvu(test_x, ours_short(test_x)[0]), fvu(test_x, theirs_short.ae(test_x)))
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    result = {
        "tokens_train": len(store),
        "tokens_heldout": args.heldout,
        "steps": steps,
        "threads": args.threads,
        "repeats": args.repeats,
        "seconds": times,
        "tokens_per_s": tps,
        "speedup": tps["poslens"] / tps["dictionary_learning"],
        "fvu_heldout": {"poslens": ours["fvu"], "dictionary_learning": ref_fvu},
        "same_init_check": {
            "steps": check.steps,
            "max_abs_W_dec_difference": w_diff,
            "fvu_heldout": dict(zip(times, short_fvu, strict=True)),
        },
        "poslens_l0": ours["l0"],
        "poslens_dead_fraction": ours["dead_fraction"],
    }
    print(
        f"{steps} steps of {cfg.batch} tokens, d={D}, d_sae={cfg.d_sae(D)}, k={cfg.k}, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    for name in times:
        print(
            f"  {name:20s} {tps[name]:9.0f} tokens/s   held-out FVU "
            f"{result['fvu_heldout'][name]:.4f}"
        )
    print(f"  speedup {result['speedup']:.2f}x")
    print(
        f"  same initial weights, {check.steps} steps: max |W_dec difference| {w_diff:.1e}, "
        f"held-out FVU {short_fvu[0]:.6f} (poslens) vs {short_fvu[1]:.6f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
