"""`poslens info`: describe a checkpoint or a converted pretrained model."""

from __future__ import annotations

import argparse

from poslens.cli.common import unfinished
from poslens.errors import UserError


def cmd_info(args: argparse.Namespace) -> int:
    import poslens

    spec = args.model or args.checkpoint
    if spec is None or (args.model and args.checkpoint):
        raise UserError(
            "poslens info takes a checkpoint folder, --model timm:NAME --weights PATH or "
            "--model hf:DIR"
        )
    model = poslens.load(spec, weights=args.weights, allow_unfinished=args.allow_unfinished)
    cfg = model.cfg
    print(
        f"{spec}: ViT posenc={cfg.posenc} depth={cfg.depth} dim={cfg.dim} heads={cfg.heads} "
        f"grid={cfg.grid}x{cfg.grid} prefix={cfg.num_prefix} params={model.num_params():,}"
    )
    status = unfinished(args.checkpoint, args.weights) if args.checkpoint else None
    if status is not None:
        print(f"warning: {status.describe()}, loaded with --allow-unfinished")
    if args.hooks:
        print("\n".join(model.hook_names()))
    return 0
