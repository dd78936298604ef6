"""`poslens sae train`: a TopK SAE at one hook of a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from poslens.cli.common import rank_zero, unfinished


def cmd_sae_train(args: argparse.Namespace) -> int:
    import poslens
    from poslens.limits import check_count, check_output_dir, check_sae
    from poslens.sae import SAEConfig
    from poslens.sae.pipeline import train_on_checkpoint

    cfg = SAEConfig(
        site=args.site, expansion=args.expansion, k=args.k, epochs=args.epochs, whiten=args.whiten
    )
    check_count("--images", args.images, "images")
    model = poslens.load(
        args.checkpoint, device=args.device, allow_unfinished=args.allow_unfinished
    )
    task = poslens.load_task(args.checkpoint)
    cfg.d_sae(model.cfg.dim)  # ConfigError here if k does not fit, before any work
    check_output_dir(args.out)
    check_sae(model.cfg, cfg, args.images, args.device, getattr(task, "cfg", None))
    status = unfinished(args.checkpoint)
    main = rank_zero()  # under torchrun only rank 0 reports
    r = train_on_checkpoint(
        model,
        task,
        cfg,
        Path(args.out),
        n_images=args.images,
        progress=main and not args.no_progress,
        record=None if status is None else {"unfinished_checkpoint": status.to_dict()},
    )
    if not main:
        return 0
    q, sp, pl = r["quality"], r["spliced"], r["positional_latents"]
    print(
        f"{cfg.site}: FVU {q['fvu']:.3f}  L0 {q['l0']:.1f}  dead {q['dead_fraction']:.1%}  "
        f"accuracy clean {sp['clean']['acc']:.1%} -> spliced {sp['spliced']['acc']:.1%}"
    )
    print(f"{pl['verdict']}\nsaved to {args.out}")
    return 0
