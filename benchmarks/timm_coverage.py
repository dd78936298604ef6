"""Coverage of timm's pretrained ViT-like architectures: which poslens converts with parity.

Every architecture of timm's vision_transformer, eva, deit, beit, vision_transformer_relpos and
naflexvit modules that has pretrained weights (253 in timm 1.0.31) and at most --max-params
parameters at full size (counted on the meta device) is built with random weights
(pretrained=False, no download) at a 4 x 4 patch grid with 2 blocks, converted, and its logits
compared with timm's (poslens.models.timm_coverage.check). Prints one line per architecture, then
the counts per family and per refusal reason, and a JSON summary as the last line.

    python benchmarks/timm_coverage.py [--max-params 700e6] [--names a,b,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from poslens.io import write_json
from poslens.models.timm_coverage import MAX_PARAMS, Outcome, check, vit_like_names

STATUSES = ("parity", "refused", "mismatch", "crash", "unbuilt", "large")


def table(outcomes: list[Outcome]) -> str:
    """Markdown table: per family, the architectures in each status."""
    fams = collections.defaultdict(collections.Counter)
    for o in outcomes:
        fams[o.family][o.status] += 1
    head = "| family | architectures | " + " | ".join(STATUSES) + " |"
    rows = [head, "|---" * (len(STATUSES) + 2) + "|"]
    for fam, c in sorted(fams.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        cells = " | ".join(str(c[s]) for s in STATUSES)
        rows.append(f"| {fam} | {sum(c.values())} | {cells} |")
    total = collections.Counter(o.status for o in outcomes)
    cells = " | ".join(f"**{total[s]}**" for s in STATUSES)
    rows.append(f"| **all** | **{len(outcomes)}** | {cells} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-params", type=float, default=MAX_PARAMS, help="size cap (full size)")
    ap.add_argument("--names", default="", help="comma-separated architectures (default: all)")
    ap.add_argument("--json", type=Path, help="also write every outcome to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.names.split(",") if args.names else vit_like_names()
    t0 = time.perf_counter()
    outcomes = []
    for name in names:
        o = check(name, int(args.max_params))
        outcomes.append(o)
        print(f"{o.status:8s} {name:45s} {o.family:20s} {o.detail}", flush=True)
    seconds = time.perf_counter() - t0
    print()
    print(table(outcomes))
    reasons = collections.Counter(o.detail for o in outcomes if o.status == "refused")
    print("\nrefusals by reason:")
    for reason, n in reasons.most_common():
        print(f"{n:4d}  {reason}")
    built = [o for o in outcomes if o.status != "large"]
    summary = {
        "architectures": len(outcomes),
        "max_params": int(args.max_params),
        "status": dict(collections.Counter(o.status for o in outcomes)),
        "parity_of_capped": f"{sum(o.status == 'parity' for o in built)}/{len(built)}",
        "seconds": round(seconds, 1),
    }
    if args.json:
        write_json(args.json, {"summary": summary, "outcomes": [o.__dict__ for o in outcomes]})
    print(json.dumps(summary))
    bugs = [o for o in outcomes if o.status in ("mismatch", "crash")]
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
