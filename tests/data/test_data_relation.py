"""The procedural "relation" task: determinism, balance, geometry behind every label, statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, build_task
from poslens.data import relation as relation_module
from poslens.data.render import pink_noise
from poslens.errors import DataError


def test_train_batch_is_a_pure_function_of_seed_step_and_batch_size() -> None:
    task_a, task_b = build_task(DataConfig()), build_task(DataConfig())
    x_a, y_a = task_a.train_batch(7, 64)
    x_b, y_b = task_b.train_batch(7, 64)  # a fresh task, as after resuming
    assert torch.equal(x_a, x_b) and torch.equal(y_a, y_b)
    assert (x_a.shape, x_a.dtype, y_a.dtype) == ((64, 1, 32, 32), torch.float32, torch.int64)
    assert not torch.equal(x_a, task_a.train_batch(8, 64)[0])
    assert not torch.equal(x_a, build_task(DataConfig(seed=1)).train_batch(7, 64)[0])


def test_val_test_and_train_streams_differ_and_splits_are_cached() -> None:
    task = build_task(DataConfig(n_val=64, n_test=64))
    x_val, _ = task.split("val")
    x_test, _ = task.split("test")
    x_train, _ = task.train_batch(0, 64)
    assert not torch.equal(x_val, x_test)
    assert not torch.equal(x_val, x_train) and not torch.equal(x_test, x_train)
    assert task.split("val")[0] is x_val
    assert torch.equal(build_task(DataConfig(n_val=64, n_test=64)).split("val")[0], x_val)
    with pytest.raises(DataError, match="train"):
        task.split("train")


@pytest.mark.parametrize("relation", ["sector", "quadrant"])
def test_labels_are_balanced(relation: str) -> None:
    task = build_task(DataConfig(relation=relation))
    labels = torch.cat([task.train_batch(step, 250)[1] for step in range(12)])  # 3000 labels
    counts = torch.bincount(labels, minlength=16)
    assert len(counts) == 16
    assert counts.min() >= 0.95 * len(labels) / 16 and counts.max() <= 1.05 * len(labels) / 16
    val_counts = torch.bincount(task.split("val")[1], minlength=16)  # 1000 = 16 * 62 + 8
    assert set(val_counts.tolist()) <= {62, 63}


def test_small_batches_work_and_cover_every_class() -> None:
    task = build_task(DataConfig())
    assert task.train_batch(0, 1)[0].shape == (1, 1, 32, 32)
    labels = torch.cat([task.train_batch(step, 5)[1] for step in range(160)])  # 800 labels
    counts = torch.bincount(labels, minlength=16)
    assert counts.min() >= 30 and counts.max() <= 70  # remainders are not always classes 0..4


@pytest.mark.parametrize("relation", ["sector", "quadrant"])
@pytest.mark.parametrize("margin", [2.0, 4.0])
def test_label_matches_geometry_and_margin_holds(
    relation: str, margin: float, relation_from_centres, centroid
) -> None:
    task = build_task(DataConfig(relation=relation, margin=margin))
    scene = task.scenes("train", 3, 512)
    # The training batch is exactly this scene, standardised.
    x, y = task.train_batch(3, 512)
    assert torch.equal(y, torch.from_numpy(scene.labels))
    assert np.allclose(x[:, 0].numpy(), (scene.images - task._mean) / task._std, atol=1e-5)
    # The label is content * 4 + relation, and the relation is what the centres say.
    assert np.array_equal(scene.labels, scene.content * 4 + scene.relation)
    expected = relation_from_centres(scene.ref_centre, scene.target_centre, relation)
    assert np.array_equal(scene.relation, expected)
    # ... and what the drawn pixels say: the glyphs' centroids are within 1.2 px of the box
    # centres (the triangle's is the farthest), less than the margin, so the relation holds.
    drawn = relation_from_centres(centroid(scene.ref_alpha), centroid(scene.target_alpha), relation)
    assert np.array_equal(drawn, scene.relation)
    d = np.abs(scene.target_centre - scene.ref_centre)
    if relation == "sector":
        assert np.all(np.abs(d[:, 0] - d[:, 1]) >= margin)
    else:
        assert np.all(d.min(axis=1) >= margin)


def test_objects_inside_canvas_apart_and_visible() -> None:
    task = build_task(DataConfig(image_size=48))
    scene = task.scenes("val", 0, 512)
    size = task.image_size
    for centre, side in (
        (scene.ref_centre, scene.ref_size),
        (scene.target_centre, scene.target_size),
    ):
        assert np.all(centre - side[:, None] / 2 >= 0)
        assert np.all(centre + side[:, None] / 2 <= size)
    gap = np.abs(scene.target_centre - scene.ref_centre).max(axis=1)
    assert np.all(gap >= (scene.ref_size + scene.target_size) / 2 + 1.0)
    assert np.all(scene.ref_alpha * scene.target_alpha == 0)  # no pixel holds both objects
    # Coverage never leaks beyond half a pixel outside an object's box.
    pix = np.arange(size) + 0.5
    for alpha, centre, side in (
        (scene.ref_alpha, scene.ref_centre, scene.ref_size),
        (scene.target_alpha, scene.target_centre, scene.target_size),
    ):
        reach = side[:, None] / 2 + 0.5  # [n, 1]
        in_rows = np.abs(pix[None, :] - centre[:, :1]) < reach  # [n, H]
        in_cols = np.abs(pix[None, :] - centre[:, 1:]) < reach  # [n, W]
        assert np.all(alpha[~(in_rows[:, :, None] & in_cols[:, None, :])] == 0)
        assert np.all(alpha.sum(axis=(1, 2)) > 0.15 * side**2)  # a real shape was drawn


def test_pink_noise_has_a_falling_power_spectrum() -> None:
    field = pink_noise(np.random.default_rng(0), 512, 32)  # [n, 32, 32]
    assert np.allclose(field.mean(axis=(1, 2)), 0, atol=1e-5)
    assert np.allclose(field.std(axis=(1, 2)), 1, atol=1e-4)
    power = (np.abs(np.fft.fft2(field)) ** 2).mean(axis=0)  # [32, 32]
    f = np.fft.fftfreq(32)
    radius = np.hypot(f[:, None], f[None, :])
    bands = [(0.02, 0.06), (0.06, 0.15), (0.15, 0.5)]
    band_power = [power[(radius > lo) & (radius <= hi)].mean() for lo, hi in bands]
    assert band_power[0] > 3 * band_power[1] > 9 * band_power[2]
    # Amplitude ~ 1/f means power ~ f^-2: check the log-log slope.
    keep = (radius > 0) & (radius <= 0.5)
    slope = np.polyfit(np.log(radius[keep]), np.log(power[keep]), 1)[0]
    assert -2.3 < slope < -1.7


def test_flat_background_is_zero_off_the_objects_and_pink_is_not() -> None:
    flat = build_task(DataConfig(background="flat")).scenes("train", 0, 128)
    off = (flat.ref_alpha == 0) & (flat.target_alpha == 0)
    assert np.all(flat.images[off] == 0)
    assert np.all(flat.images[~off] > 0)
    pink = build_task(DataConfig(background="pink")).scenes("train", 0, 128)
    off = (pink.ref_alpha == 0) & (pink.target_alpha == 0)
    assert 0.8 < pink.images[off].std() < 1.2
    # Objects stand out: full-coverage pixels are at `contrast` (+- 15%), above most noise.
    full, c = pink.target_alpha == 1, DataConfig().contrast
    assert np.all((pink.images[full] >= c * 0.85 - 1e-5) & (pink.images[full] <= c * 1.15 + 1e-5))


@pytest.mark.parametrize("background", ["pink", "flat"])
def test_batches_are_roughly_standardised(background: str) -> None:
    task = build_task(DataConfig(background=background))
    x, _ = task.train_batch(5, 512)
    assert abs(x.mean().item()) < 0.05 and 0.9 < x.std().item() < 1.1
    x_val, _ = task.split("val")
    assert abs(x_val.mean().item()) < 0.05 and 0.9 < x_val.std().item() < 1.1


def test_three_channels_repeat_the_gray_image_and_sizes_scale() -> None:
    task = build_task(DataConfig(channels=3, image_size=64, n_content=8))
    x, y = task.train_batch(0, 32)
    assert x.shape == (32, 3, 64, 64) and task.in_chans == 3 and int(y.max()) < 32
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    scene = task.scenes("train", 0, 32)
    assert np.all(np.abs(scene.ref_size - 0.28 * 64) <= 0.1 * 0.28 * 64 + 1e-9)


def test_impossible_placement_raises_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    task = build_task(DataConfig())
    monkeypatch.setattr(relation_module, "GAP_PX", 40.0)  # no two boxes fit this far apart
    with pytest.raises(DataError, match="object_scale"):
        task.train_batch(0, 8)


def test_shuffled_splits_give_each_analysis_seed_its_own_subset_and_seed_0_the_task_order() -> None:
    """data.task.ShuffledSplits (a pretrained study of `task:CHECKPOINT`): seed 0 reads the
    task's splits as they are (what the native study reads); another seed reads the same images
    in its own seeded order, so the first n differ; training batches and fields are the task's."""
    from poslens.data.task import ShuffledSplits

    cfg = DataConfig(image_size=16, n_val=40, n_test=60, object_scale=0.32)
    task = build_task(cfg)
    same = ShuffledSplits(task, 0)
    for name in ("val", "test"):
        x, y = task.split(name)
        x0, y0 = same.split(name)
        assert torch.equal(x0, x) and torch.equal(y0, y)
        x1, y1 = ShuffledSplits(task, 1).split(name)
        again = ShuffledSplits(build_task(cfg), 1).split(name)
        assert torch.equal(again[0], x1) and torch.equal(again[1], y1)  # deterministic
        assert not torch.equal(x1[:10], x[:10])  # another first ten
        # the same images: each of seed 1's is one of the task's, with its label
        flat, flat1 = x.flatten(1), x1.flatten(1)
        match = (flat1[:, None, :] == flat[None, :, :]).all(-1)
        assert (match.sum(1) == 1).all() and torch.equal(y[match.int().argmax(1)], y1)
        assert not torch.equal(ShuffledSplits(task, 2).split(name)[1], y1)
    xb, yb = ShuffledSplits(task, 3).train_batch(5, 8)
    xt, yt = task.train_batch(5, 8)
    assert torch.equal(xb, xt) and torch.equal(yb, yt)
    shuffled = ShuffledSplits(task, 3)
    assert shuffled.cfg is task.cfg and shuffled.num_classes == task.num_classes
    assert (shuffled.image_size, shuffled.in_chans) == (task.image_size, task.in_chans)
