"""`poslens export`: a checkpoint as timm weights."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint as timm weights and the timm arguments beside them (timm_export),
    checked by converting them back; prints how to study and how to load them."""
    import poslens
    from poslens.limits import check_output_file
    from poslens.models.timm_export import export_timm, timm_name_for

    check_output_file(args.out, "--out")
    model = poslens.load(args.checkpoint)
    name = args.timm or timm_name_for(model.cfg)
    weights, side = export_timm(model, args.out, name)
    print(weights)
    print(side)
    print(
        f"study it with: poslens study --pretrained timm:{name}={weights} "
        f"--data task:{Path(args.checkpoint).resolve()} --out DIR  (its own task; or an image folder)"
    )
    return 0
