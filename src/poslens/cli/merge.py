"""`poslens merge --out OUT BLOCK [BLOCK ...]`: blocks of one study (each a `poslens study` on
its own seeds) merged into one study folder, judged and reported as one (study/merge.py)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction, count: type[int]) -> None:  # type: ignore[type-arg]
    """The `merge` subcommand's arguments (`count`: the parser's --jobs / --threads type)."""
    p = sub.add_parser(
        "merge",
        help="blocks of one study (disjoint seed ranges) merged, judged and reported as one",
        description="Link the checkpoints and finished stages of several `poslens study` folders "
        "that ran the same study on disjoint, contiguous seed ranges (e.g. --preset confirm in "
        "blocks of --seeds 100-104, 105-109, ...) into OUT, and run the study over all their "
        "seeds there: every stage is reused, the claims are judged on the union, and "
        "results.json and the reports are written. Rerun it as blocks finish.",
    )
    p.add_argument("blocks", nargs="+", metavar="BLOCK",
                   help="`poslens study` output folders, or their results.json files (joined "
                   "without their stages)")  # fmt: skip
    p.add_argument("--out", required=True, help="the merged study's folder")
    p.add_argument("--jobs", type=count, default=0, help="parallel processes for any stage left")
    p.add_argument("--threads", type=count, default=0, help="torch threads per job")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.set_defaults(fn=cmd_merge)


def cmd_merge(args: argparse.Namespace) -> int:
    from poslens.limits import check_output_dir
    from poslens.study import run_study
    from poslens.study.merge import merge_blocks

    check_output_dir(args.out)
    if all(str(b).endswith(".json") for b in args.blocks):
        return _merge_results(args)
    cfg = merge_blocks(args.blocks, args.out)
    results = run_study(cfg, args.out, progress=not args.no_progress, threads=args.threads,
                        jobs=args.jobs)  # fmt: skip
    last = cfg.seed_start + cfg.seeds - 1
    print(f"merged {len(args.blocks)} blocks: seeds {cfg.seed_start}-{last} in {args.out} "
          f"(report.html, report.md, results.json) after "
          f"{results['timings']['total_seconds']:.0f}s")  # fmt: skip
    return 0


def _merge_results(args: argparse.Namespace) -> int:
    """Blocks given as results.json files (kept apart from their stages): their per-seed numbers
    joined and judged anew, results.json and the reports written into --out."""
    import json
    from pathlib import Path

    from poslens.errors import UserError
    from poslens.io import write_json
    from poslens.report import write_report
    from poslens.study.merge import merge_results

    blocks = []
    for b in args.blocks:
        try:
            blocks.append((b, json.loads(Path(b).read_text())))
        except (OSError, ValueError) as e:
            raise UserError(f"{b}: not a readable results.json ({e})") from None
    results = merge_results(blocks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    write_report(out, results)
    first, last = results["config"]["seed_start"], results["config"]["seed_start"] + results[
        "config"]["seeds"] - 1  # fmt: skip
    print(f"merged {len(blocks)} results: seeds {first}-{last} in {out} (report.html, report.md, "
          "results.json)")  # fmt: skip
    return 0


__all__ = ["add_parser", "cmd_merge"]
