"""Interventions: context managers that rewrite activations through hook points and always clean up.

They compose with contextlib.ExitStack or nested `with`, e.g.
`with rotary_mask(model, planes=amap.row, blocks=range(3)), rpi(model, seed=0): ...`.
"""

from poslens.interventions.ablation import ablate, component_hook, mean_activations, patch
from poslens.interventions.position import (
    ape_permute,
    ape_table_part,
    ape_zero,
    rel_bias_zero,
    rpi,
    seeded_permutation,
)
from poslens.interventions.rotary import AxisMap, axis_map, num_planes, plane_mask, rotary_mask

__all__ = [
    "AxisMap",
    "ablate",
    "ape_permute",
    "ape_table_part",
    "ape_zero",
    "axis_map",
    "component_hook",
    "mean_activations",
    "num_planes",
    "patch",
    "plane_mask",
    "rel_bias_zero",
    "rotary_mask",
    "rpi",
    "seeded_permutation",
]
