from __future__ import annotations

import pytest
import torch

from poslens.sae import ActivationStore, SAEConfig, evaluate, train_sae
from poslens.sae.train import HISTORY_KEYS, init_sae, lr_scale
from tests.sae.conftest import planted

CFG = SAEConfig(site="synthetic", expansion=4, k=4, batch=256, steps=400, lr=3e-3, log_every=100)


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, list[dict[str, float]], torch.Tensor, torch.Tensor]:
    x, feats = planted(8192 + 2048)
    sae, history = train_sae(x[:8192], CFG)
    return sae, history, feats, x[8192:]


def test_recovers_a_planted_sparse_dictionary(trained: tuple) -> None:
    sae, _, feats, heldout = trained
    best_cos = (feats @ sae.W_dec.detach().T).max(dim=1).values  # per true feature
    assert (best_cos > 0.9).float().mean() >= 0.9
    m = evaluate(sae, heldout)
    assert m["fvu"] < 0.15 and m["cos"] > 0.9 and 3.5 <= m["l0"] <= 4


def test_decoder_rows_stay_unit_norm(trained: tuple) -> None:
    norms = trained[0].W_dec.detach().norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-5, rtol=0)


def test_history_logs_each_interval(trained: tuple) -> None:
    history = trained[1]
    assert [h["step"] for h in history] == [100, 200, 300, 400]
    assert all(set(HISTORY_KEYS) <= set(h) for h in history)
    assert history[-1]["tokens"] == 400 * 256
    assert history[-1]["fvu"] < history[0]["fvu"] and history[-1]["l0"] <= 4


def test_init_puts_b_dec_at_the_mean_or_whitens_around_it() -> None:
    x, _ = planted(512)
    x = x + 3.0
    sae = init_sae(ActivationStore(x), SAEConfig(site="s", k=4))
    torch.testing.assert_close(sae.b_dec.detach(), x.mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.W_enc.detach(), sae.W_dec.detach().T, atol=0, rtol=0)
    white = init_sae(ActivationStore(x), SAEConfig(site="s", k=4, whiten=True))
    assert white.whitening is not None and not white.b_dec.any()
    torch.testing.assert_close(white.whitening.mean_D, x.mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(white.to_sae_space(x).mean(0), torch.zeros(32), atol=1e-4, rtol=0)


def test_training_is_deterministic_and_accepts_a_store_or_a_tensor() -> None:
    x, _ = planted(2048)
    cfg = SAEConfig(site="synthetic", k=4, batch=128, steps=30, dead_tokens=500, log_every=10)
    a, ha = train_sae(x, cfg)
    b, hb = train_sae(ActivationStore(x), cfg)
    assert ha == hb
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    c, _ = train_sae(x, SAEConfig(**{**cfg.to_dict(), "seed": 1}))
    assert not torch.equal(a.W_dec, c.W_dec)


def test_auxk_trains_only_dead_latents_and_only_when_enabled() -> None:
    x, _ = planted(4096)
    kw = {"site": "synthetic", "expansion": 8, "k": 2, "batch": 256, "steps": 40}
    kw |= {"dead_tokens": 1024, "log_every": 40}
    _, with_aux = train_sae(x, SAEConfig(**kw))  # type: ignore[arg-type]
    _, without = train_sae(x, SAEConfig(**kw, aux_coef=0.0))  # type: ignore[arg-type]
    assert with_aux[-1]["dead"] > 0 and with_aux[-1]["aux"] > 0
    assert without[-1]["aux"] == 0.0
    assert with_aux[-1]["loss"] == pytest.approx(with_aux[-1]["mse"] + with_aux[-1]["aux"] / 32)


def test_lr_schedule_warms_up_holds_and_decays_to_zero() -> None:
    lrs = [lr_scale(s, 10, warmup=2, decay_frac=0.5) for s in range(10)]
    assert lrs == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]
    assert [lr_scale(s, 4, 0, 0.0) for s in range(4)] == [1.0] * 4
