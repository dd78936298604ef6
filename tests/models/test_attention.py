"""The CPU training pass's fast paths compute what the written-out model computes, forward and
backward: the attention kernel in batch slices whose scores stay in cache (ViT and ensemble),
and the ViT's CLS exit (the last block computes the CLS token's output alone)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import poslens.models.attention as attention
from poslens.models import build_model
from poslens.models.attention import slice_rows, sliced_attention, softmax_attention
from poslens.models.ensemble import StackedViT
from tests.conftest import tiny


def whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The formula over the whole batch at once (the ViT's hooked path)."""
    return ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1) @ v


def qkv_views(B: int, H: int, T: int, dh: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, T, dh] as strided views of a token-major qkv [B, T, 3, H, dh] (the model's
    layout), and that leaf."""
    qkv = torch.randn(B, T, 3 * H * dh, generator=torch.Generator().manual_seed(seed))
    qkv.requires_grad_(True)
    q, k, v = qkv.view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)
    return q, k, v, qkv


def test_slice_rows_keeps_the_scores_within_the_budget() -> None:
    assert slice_rows(64, 4, 197, 197, budget=2**20) == 1  # 621 kB of scores per image
    assert slice_rows(64, 4, 37, 37, budget=2**20) == 47
    assert slice_rows(64, 4, 197, 197, budget=1) == 1  # never empty
    assert slice_rows(5, 4, 1, 17, budget=2**20) == 5  # never more than the batch
    assert slice_rows(64, 4, 197, 197) == slice_rows(64, 4, 197, 197, attention.SLICE_BYTES)


@pytest.mark.parametrize("rows", [1, 3, 7, 100])  # slices of 1, of 3 (the last one shorter), one
def test_sliced_attention_is_the_whole_formula_forward_and_backward(
    monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    B, H, T, dh = 7, 2, 17, 8
    monkeypatch.setattr(attention, "SLICE_BYTES", rows * 4 * H * T * T)
    assert slice_rows(B, H, T, T) == min(rows, B)
    q, k, v, leaf = qkv_views(B, H, T, dh)
    got = sliced_attention(q, k, v, dh**-0.5)
    (grad_got,) = torch.autograd.grad((got * got.detach().sin()).sum(), leaf)
    q, k, v, leaf = qkv_views(B, H, T, dh)
    want = whole(q, k, v, dh**-0.5)
    (grad_want,) = torch.autograd.grad((want * want.detach().sin()).sum(), leaf)
    assert got.shape == (B, H, T, dh) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_got, grad_want, atol=1e-6, rtol=0)


def test_sliced_attention_takes_one_query_against_all_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ensemble's last block attends from the CLS query alone: q [N, H, 1, dh]."""
    monkeypatch.setattr(attention, "SLICE_BYTES", 2 * 4 * 2 * 1 * 17)
    q, k, v, _ = qkv_views(5, 2, 17, 8)
    got = sliced_attention(q[:, :, :1], k, v, 0.3)
    torch.testing.assert_close(got, whole(q[:, :, :1], k, v, 0.3), atol=1e-6, rtol=0)


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    logits = model(x)
    flat = logits.reshape(-1, logits.shape[-1])  # [S*B | B, classes]
    loss = F.cross_entropy(flat, torch.arange(len(flat)) % flat.shape[1])
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("posenc", ["ape", "rope_axial", "rope_mixed", "relpos"])
def test_vit_training_step_through_slices_equals_the_hooked_whole_batch_path(
    monkeypatch: pytest.MonkeyPatch, posenc: str
) -> None:
    """Autograd on, nothing hooked: the sliced kernel (slices of one image here); a pattern hook
    on every block forces the written-out whole-batch path. Logits and every gradient agree."""
    monkeypatch.setattr(attention, "SLICE_BYTES", 1)
    model, x = tiny(posenc).train(), torch.randn(5, 1, 16, 16)
    calls: list[int] = []
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    sliced, sliced_grads = loss_and_grads(model, x)
    assert calls == [1] * 5 * model.cfg.depth
    pattern = [(f"blocks.{b}.attn.hook_pattern", lambda t, _n: None) for b in range(2)]
    with model.hooks(pattern):
        hooked, hooked_grads = loss_and_grads(model, x)
    assert len(calls) == 5 * model.cfg.depth  # the hooked pass never took the kernel
    torch.testing.assert_close(sliced, hooked, atol=1e-5, rtol=0)
    for g, h in zip(sliced_grads, hooked_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=0)


@pytest.mark.parametrize("posenc", ["ape", "rope_axial", "relpos"])
def test_ensemble_training_step_through_slices_equals_the_whole_batch(
    monkeypatch: pytest.MonkeyPatch, posenc: str
) -> None:
    """The ensemble's kernel in slices of one image equals it in one slice (logits, gradients)."""
    x, cfg = torch.randn(5, 1, 16, 16), tiny(posenc).cfg
    model = StackedViT([build_model(cfg, seed=s) for s in (0, 1)])
    monkeypatch.setattr(attention, "SLICE_BYTES", 1)
    sliced, sliced_grads = loss_and_grads(model, x)
    monkeypatch.setattr(attention, "SLICE_BYTES", 2**40)
    one, one_grads = loss_and_grads(model, x)
    torch.testing.assert_close(sliced, one, atol=1e-5, rtol=0)
    for g, h in zip(sliced_grads, one_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=0)


def attention_queries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query count Tq of every call of the sliced kernel, from now on."""
    calls: list[int] = []
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    return calls


@pytest.mark.parametrize(
    ("posenc", "kw"),
    [("ape", {}), ("rope_axial", {}), ("rope_mixed", {}), ("rope_axial", {"num_registers": 2}),
     ("relpos", {"num_registers": 1})],
)  # fmt: skip
def test_cls_exit_equals_the_whole_last_block(
    monkeypatch: pytest.MonkeyPatch, posenc: str, kw: dict[str, int]
) -> None:
    """Training, nothing hooked: the last block attends from the CLS query alone; a no-op hook
    on its output forces every token through it. Logits and every gradient agree."""
    model, x = tiny(posenc, **kw).train(), torch.randn(4, 1, 16, 16)
    T = model.cfg.num_prefix + 16
    calls = attention_queries(monkeypatch)
    assert model.cls_exit()
    fast, fast_grads = loss_and_grads(model, x)
    assert calls == [T, 1]
    with model.hooks([("blocks.1.hook_resid_post", lambda t, _n: None)]):
        assert not model.cls_exit()
        full, full_grads = loss_and_grads(model, x)
    assert calls == [T, 1, T, T]
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
    for g, h in zip(fast_grads, full_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=0)


def test_cls_exit_only_where_nothing_sees_the_last_blocks_tokens() -> None:
    model = tiny("rope_axial").train()
    assert model.cls_exit()  # on by default
    model.train_cls_exit = False
    assert not model.cls_exit()  # off when asked
    model.train_cls_exit = True
    assert not tiny("rope_axial", pool="mean").train().cls_exit()
    assert model.eval().cls_exit()  # analysis passes too
    model.train()
    with torch.no_grad():
        assert model.cls_exit()
    noop = lambda t, _n: None  # noqa: E731
    qkv = ("hook_q", "hook_k", "hook_v", "hook_rotary", "hook_rot_q", "hook_rot_k")
    every_token = ("blocks.1.hook_resid_pre", "blocks.1.ln1.hook_normalized",
                   "blocks.0.attn.hook_z", *(f"blocks.1.attn.{h}" for h in qkv))  # fmt: skip
    for name in every_token:
        with model.hooks([(name, noop)]):  # all tokens' values, as ever
            assert model.cls_exit(), name
    last = [n for n in model.hook_names() if n.startswith("blocks.1.") and n not in every_token]
    assert "blocks.1.attn.hook_z" in last and "blocks.1.hook_resid_mid" in last
    for name in [*last, "ln_final.hook_normalized"]:
        with model.hooks([(name, noop)]):
            assert not model.cls_exit(), name
    for module in (model.blocks[1].mlp.fc1, model.blocks[1], model.ln_final):
        handle = module.register_forward_hook(lambda *a: None)
        assert not model.cls_exit()
        handle.remove()
    handle = model.blocks[1].attn.register_forward_pre_hook(lambda *a: None)
    assert not model.cls_exit()
    handle.remove()
    assert model.cls_exit()


@pytest.mark.parametrize("posenc", ["ape", "rope_axial"])
def test_an_analysis_pass_takes_the_exit_with_the_same_logits(
    monkeypatch: pytest.MonkeyPatch, posenc: str
) -> None:
    """Eval mode, no_grad: the last block attends from the CLS query alone, also under a rotary
    mask and while the last block's input is cached; a cached output forces every token."""
    import poslens.models.vit as vit
    from poslens.interventions import rotary_mask

    model, x = tiny(posenc).eval(), torch.randn(4, 1, 16, 16)
    T = model.cfg.num_prefix + 16
    calls: list[int] = []
    fused = vit.F.scaled_dot_product_attention
    monkeypatch.setattr(
        vit.F,
        "scaled_dot_product_attention",
        lambda q, *a, **k: calls.append(q.shape[2]) or fused(q, *a, **k),
    )
    with torch.no_grad():
        fast, cache = model.run_with_cache(x, ["blocks.1.ln1.hook_normalized"])
        assert calls == [T, 1] and cache["blocks.1.ln1.hook_normalized"].shape[1] == T
        full, _ = model.run_with_cache(x, ["ln_final.hook_normalized"])
        assert calls == [T, 1, T, T]
        model.train_cls_exit = False
        torch.testing.assert_close(fast, model(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(full, model(x), atol=0, rtol=0)
        if posenc == "rope_axial":
            with rotary_mask(model, planes=[0, 1]):
                masked_full = model(x)
            model.train_cls_exit = True
            with rotary_mask(model, planes=[0, 1]):
                del calls[:]
                masked_fast = model(x)
                assert calls == [T, 1]
            torch.testing.assert_close(masked_fast, masked_full, atol=1e-6, rtol=0)


def test_hooks_on_the_last_block_see_every_token_while_training() -> None:
    model, x = tiny("rope_axial").train(), torch.randn(3, 1, 16, 16)
    _, cache = model.run_with_cache(x, ["blocks.1.hook_resid_post", "blocks.1.attn.hook_q"])
    assert cache["blocks.1.hook_resid_post"].shape == (3, 17, 32)
    assert cache["blocks.1.attn.hook_q"].shape == (3, 2, 17, 16)


def test_fp32_training_takes_the_fused_kernel_only_where_it_was_measured_faster() -> None:
    q = torch.zeros(2, 4, 65, 16)
    assert attention.fused_trains_faster(q, q)
    assert not attention.fused_trains_faster(q[..., :8], q[..., :8])  # head dim 8: the slices
    assert not attention.fused_trains_faster(q[:, :, :1], q[:, :, :37])  # 37 keys: the slices
    assert attention.fused_trains_faster(q[:, :, :1], q)  # one query (the CLS exit), 65 keys
    assert not attention.fused_trains_faster(q.bfloat16(), q.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not attention.fused_trains_faster(q, q)  # its bf16 backward is slow


def test_fused_training_path_is_the_formula_forward_and_backward() -> None:
    B, H, T, dh = 3, 4, 65, 16
    q, k, v, leaf = qkv_views(B, H, T, dh)
    assert attention.fused_trains_faster(q, k)
    got = softmax_attention(q, k, v, dh**-0.5)
    (grad_got,) = torch.autograd.grad((got * got.detach().sin()).sum(), leaf)
    q, k, v, leaf = qkv_views(B, H, T, dh)
    want = whole(q, k, v, dh**-0.5)
    (grad_want,) = torch.autograd.grad((want * want.detach().sin()).sum(), leaf)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_got, grad_want, atol=1e-6, rtol=0)


def test_vit_training_on_a_fused_shape_equals_the_hooked_path() -> None:
    """Head dim 16, 65 tokens: training takes the fused kernel (and the CLS exit); hooking every
    pattern takes the written-out whole-batch path. Logits and gradients agree."""
    model = tiny("rope_axial", image_size=32, dim=64, heads=4).train()
    x = torch.randn(3, 1, 32, 32)
    fast, fast_grads = loss_and_grads(model, x)
    pattern = [(f"blocks.{b}.attn.hook_pattern", lambda t, _n: None) for b in range(2)]
    with model.hooks(pattern):
        full, full_grads = loss_and_grads(model, x)
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
    for g, h in zip(fast_grads, full_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=0)
