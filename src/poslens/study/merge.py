"""Blocks of one study merged into one: `poslens merge --out OUT BLOCK [BLOCK ...]`.

A long study (the confirmation: tens of seeds, hours on two cores) runs as blocks of seeds, each a
`poslens study` of its own (`--seeds A-B`, in separate processes, machines or SLURM jobs, each
resumable). Seed s trains and analyses the same in any study, so the blocks' checkpoints and
experiment stages are the merged study's: they are linked (or copied) into OUT, and the study
over the union of the seeds is run there, every stage reused, then judged and reported as one.
The blocks must be one design: the same study config but for their seeds, and seed ranges that
are disjoint and together contiguous.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from poslens.errors import UserError
from poslens.study.aggregate import mean_se
from poslens.study.config import StudyConfig
from poslens.study.judge import evaluate_claims

SEED_FIELDS = ("seeds", "seed_start")  # what blocks of one study differ in
SHARED = ("checkpoints", "runs")  # what a block holds that the merged study reuses


def block_config(folder: Path) -> StudyConfig:
    """The StudyConfig a finished block ran (its results.json's config); UserError naming the
    block where it has none or it is malformed."""
    path = folder / "results.json"
    if not path.is_file():
        raise UserError(f"{folder} holds no results.json: run (or finish) its study first")
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} has no readable study config ({e})") from None
    return _config_of(results if isinstance(results, Mapping) else {}, str(path))


def merged_config(configs: Sequence[tuple[Path, StudyConfig]]) -> StudyConfig:
    """The config of the study over every block's seeds; UserError naming the block that differs
    in anything but its seeds, or seed ranges that overlap or leave a gap."""
    first_path, first = configs[0]
    for path, cfg in configs[1:]:
        a = replace(first, seeds=1, seed_start=0)
        b = replace(cfg, seeds=1, seed_start=0)
        if a != b:
            diff = [f.name for f in fields(StudyConfig)
                    if getattr(a, f.name) != getattr(b, f.name)]  # fmt: skip
            raise UserError(f"{path} is another study than {first_path}: its {', '.join(diff)} "
                            "differ (blocks of one study differ only in their seeds)")  # fmt: skip
    ranges = sorted((c.seed_start, c.seed_start + c.seeds, p) for p, c in configs)
    for (_, end, p), (start, _, q) in itertools.pairwise(ranges):
        if start < end:
            raise UserError(f"{p} and {q} share seeds {start}-{end - 1}")
        if start > end:
            raise UserError(f"seeds {end}-{start - 1} lie between {p} and {q}: no block ran them")
    return replace(first, seed_start=ranges[0][0], seeds=ranges[-1][1] - ranges[0][0])


def _link_tree(src: Path, dst: Path) -> int:
    """Every file under src linked (hard link, or a copy across file systems) to the same place
    under dst, where dst has no file of that name yet; the number of files placed."""
    placed = 0
    for root, _, files in os.walk(src):
        here = dst / Path(root).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.startswith(".") and name.endswith(".tmp"):  # a killed write's leftover
                continue
            target = here / name
            if target.exists():
                continue
            try:
                os.link(Path(root) / name, target)
            except OSError:
                shutil.copy2(Path(root) / name, target)
            placed += 1
    return placed


def merge_blocks(blocks: Sequence[str | Path], out: str | Path) -> StudyConfig:
    """Link every block's checkpoints and stages into `out` and return the merged study's config
    (run it with study.run_study on `out`: each stage is found finished). UserError before
    anything is written where the blocks are not one study."""
    if len(blocks) < 1:
        raise UserError("merge needs at least one block folder")
    paths = [Path(b) for b in blocks]
    out = Path(out)
    if any(p.resolve() == out.resolve() for p in paths):
        raise UserError(f"--out {out} is one of the blocks: merge into a folder of its own")
    cfg = merged_config([(p, block_config(p)) for p in paths])
    out.mkdir(parents=True, exist_ok=True)
    for p in paths:
        for part in SHARED:
            if (p / part).is_dir():
                _link_tree(p / part, out / part)
    return cfg


def _config_of(results: Mapping[str, Any], where: str) -> StudyConfig:
    known = {f.name for f in fields(StudyConfig)}
    recorded = results.get("config")
    if not isinstance(recorded, Mapping):
        raise UserError(f"{where} has no study config")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in known}
    try:
        return StudyConfig(**kw)
    except (TypeError, UserError) as e:
        raise UserError(f"{where}: its study config does not load ({e})") from None


def _merged_model(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One model's results.json entry over several blocks (in seed order): its runs one after
    the other and each number's per-seed values joined (None where a block lacks the key)."""
    first = entries[0]
    out = {k: first[k] for k in ("posenc", "scale", "in_situ") if k in first}
    out["runs"] = [r for e in entries for r in e["runs"]]
    aggregate: dict[str, Any] = {}
    for exp in dict.fromkeys(x for e in entries for x in e["aggregate"]):
        keys = dict.fromkeys(k for e in entries for k in e["aggregate"].get(exp, {}))
        ran = [sum(exp in r["experiments"] for r in e["runs"]) for e in entries]
        aggregate[exp] = {
            k: mean_se([v for e, n in zip(entries, ran, strict=True)
                        for v in e["aggregate"].get(exp, {}).get(k, {}).get("values", [None] * n)])
            for k in keys
        }  # fmt: skip
    out["aggregate"] = aggregate
    return out


def merge_results(blocks: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Several blocks' results.json (name, content) as one study's results, judged anew over all
    their seeds: blocks kept apart (on other machines, or committed from earlier sessions as
    `python -m poslens.study.preregistration slim` writes them) joined without their stages.
    UserError where they are not blocks of one study."""
    configs = [(Path(name), _config_of(r, name)) for name, r in blocks]
    cfg = merged_config(configs)
    order = sorted(range(len(blocks)), key=lambda i: configs[i][1].seed_start)
    ordered = [blocks[i][1] for i in order]
    names = dict.fromkeys(m for r in ordered for m in r["models"])
    models = {m: _merged_model([r["models"][m] for r in ordered if m in r["models"]])
              for m in names}  # fmt: skip
    first = ordered[0]
    return {
        "schema": first.get("schema"), "poslens_version": first.get("poslens_version"),
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.to_dict() | {"device": first["config"].get("device", "cpu")},
        "environment": first.get("environment", {}),
        "blocks": [{"seeds": [c.seed_start, c.seed_start + c.seeds - 1], "from": str(p),
                    "environment": blocks[i][1].get("environment", {})}
                   for i, (p, c) in sorted(enumerate(configs), key=lambda x: x[1][1].seed_start)],
        "models": models,
        "claims": [c.to_dict() for c in evaluate_claims(models, cfg)],
        "figures": {},
        "timings": {"total_seconds": sum(float((r.get("timings") or {}).get("total_seconds", 0))
                                         for r in ordered), "stages": []},
    }  # fmt: skip


__all__ = ["block_config", "merge_blocks", "merge_results", "merged_config"]
