"""Arguments for `poslens train` on a tiny fp32 single-thread model, for subprocess tests."""

from __future__ import annotations


def tiny_train_args(steps: int, eval_every: int, ckpt_every: int = 4) -> list[str]:
    sets = [
        "model.dim=16", "model.depth=2", "model.heads=2", f"train.steps={steps}",
        "train.batch_size=16", f"train.ckpt_every={ckpt_every}", f"train.eval_every={eval_every}",
        "train.eval_images=16", "data.n_val=32", "data.n_test=32", "data.image_size=16",
        "data.object_scale=0.32", "train.threads=1", 'train.precision="fp32"',
    ]  # fmt: skip
    return ["--preset", "rope_axial", *(a for s in sets for a in ("--set", s)), "--no-progress"]
