"""What the HTML and Markdown reports share: reading `results.json` generically (the claims' cells
in report/claims.py, plain formatting in report/format.py, both re-exported here).

Nothing here knows experiment names or headline keys: sections, rows and columns come from the
results themselves, so a new experiment or metric shows up in the report without code changes.
Every function returns plain text; each renderer escapes it for its own format.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poslens.report.claims import (
    CALIBRATION_HEAD,
    CLAIMS_HEAD,
    calibration_rows,
    claim_heading,
    claim_rows,
    claim_sections,
    measured_cell,
    power_cell,
    power_lines,
    reference_cell,
    verdict_counts,
    verdict_label,
    verdict_text,
)
from poslens.report.format import (
    MAX_LIST,
    NONE,
    PNG_MAGIC,
    fmt_duration,
    fmt_num,
    fmt_value,
    slug,
    verdict_class,
)
from poslens.study.result import ClaimResult, claims_of
from poslens.study.verdicts import CLAIMS_FIGURE


def models(results: Mapping[str, Any]) -> list[str]:
    """Model names: the config's order first, then any others found in the results."""
    names = [str(m) for m in results.get("config", {}).get("models", []) or []]
    names += [m for m in results.get("models", {}) or {} if m not in names]
    return names


def experiments(results: Mapping[str, Any]) -> list[str]:
    """Experiment names: the config's order first, then any others found in runs or figures."""
    names = [str(e) for e in results.get("config", {}).get("experiments", []) or []]

    def add(name: Any) -> None:
        if name is not None and str(name) not in names:
            names.append(str(name))

    for m in (results.get("models") or {}).values():
        for name in m.get("aggregate") or {}:
            add(name)
        for run in m.get("runs") or []:
            for name in run.get("experiments") or {}:
                add(name)
            for name in run.get("skipped") or {}:
                add(name)
    for fig in results.get("figures") or []:
        if fig.get("experiment") != CLAIMS_FIGURE:  # shown in the Claims section
            add(fig.get("experiment"))
    return names


def _reused_note(results: Mapping[str, Any]) -> str:
    """' (N of M stages reused from an earlier run)' when a rerun reused finished stages."""
    stages = (results.get("timings") or {}).get("stages") or []
    reused = sum(1 for st in stages if st.get("reused"))
    if not reused:
        return ""
    return f" ({reused} of {len(stages)} stages reused from an earlier run)"


def _own_seeds(cfg: Mapping[str, Any]) -> str:
    """' (rope_axial 10 seeds)': the models run with their own seed count (study.model_seeds)."""
    own = [str(item).replace("=", " ") for item in cfg.get("model_seeds") or ()]
    return f" ({', '.join(own)} seeds)" if own else ""


def summary(results: Mapping[str, Any], claims: Sequence[ClaimResult]) -> str:
    """The one-paragraph summary under the title: what ran, how long, and the verdict tally of
    its claims (claims_of(results))."""
    cfg = results.get("config") or {}
    everything = models(results)
    entries = results.get("models") or {}
    names = [m for m in everything if not (entries.get(m) or {}).get("in_situ")]
    edited = len(everything) - len(names)
    seeds = cfg.get("seeds")
    wall = (results.get("timings") or {}).get("total_seconds")
    verb = "analysed" if cfg.get("pretrained") else "trained and analysed"
    parts = [
        f"This study {verb} {len(names)} model{'s' if len(names) != 1 else ''}"
        f" ({', '.join(names) or NONE})"
        + (
            f" and {edited} in-situ control{'s' * (edited != 1)} (those models' weights edited "
            "to plant or remove a mechanism, named MODEL~EDIT)"
            if edited
            else ""
        )
        + f" with {fmt_value(seeds)} seed"
        f"{'s' if seeds != 1 else ''} each{_own_seeds(cfg)}, preset {fmt_value(cfg.get('preset'))}"
        f", task {fmt_value(cfg.get('task'))}, in {fmt_duration(wall)} of wall time"
        + _reused_note(results)
        + "."
    ]
    if claims:
        tally = ", ".join(f"{n} {v}" for v, n in verdict_counts(claims).items())
        groups = len({cl.claim for cl in claims})
        parts.append(f"Of its {groups} claims, at {len(claims)} levels: {tally}.")
    meta = [
        f"poslens {results['poslens_version']}" if results.get("poslens_version") else "",
        f"created {results['created']}" if results.get("created") else "",
        f"schema {results['schema']}" if results.get("schema") else "",
    ]
    if any(meta):
        parts.append("(" + "; ".join(m for m in meta if m) + ")")
    return " ".join(parts)


def flatten(d: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) pairs of a headline or aggregate; a {mean, ...} dict is one value."""
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and "mean" not in v:
            yield from flatten(v, key + ".")
        else:
            yield key, v


def chance_target(key: str) -> str | None:
    """What a chance row is the chance level of: 'acc' for 'acc_chance' or 'chance_acc' (with
    any dotted prefix kept), None for a key that is not a chance level."""
    head, _, last = key.rpartition(".")
    prefix = f"{head}." if head else ""
    if last.endswith("_chance") and len(last) > len("_chance"):
        return prefix + last[: -len("_chance")]
    if last.startswith("chance_") and len(last) > len("chance_"):
        return prefix + last[len("chance_") :]
    return None


def chance_base(key: str, keys: list[str]) -> str | None:
    """The row a chance row belongs under: the exact target if present (chance_acc -> acc), else
    the shortest other key ending in '_<target>' (chance_row -> probe_row), else None."""
    target = chance_target(key)
    if target is None:
        return None
    if target in keys and target != key:
        return target
    head, _, last = target.rpartition(".")
    prefix = f"{head}." if head else ""
    cands = [
        k
        for k in keys
        if k != key and k.startswith(prefix) and k.endswith(f"_{last}") and chance_target(k) is None
    ]
    return min(cands, key=len) if cands else None


def natural_key(key: str) -> tuple[Any, ...]:
    """Sort key reading digit runs as numbers: 'ssdc@block2' before 'ssdc@block10'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


def order_keys(keys: list[str]) -> list[str]:
    """First-seen order, but each chance row directly after the row it is the chance level of."""
    attached: dict[str, list[str]] = {}
    top: list[str] = []
    for k in keys:
        base = chance_base(k, keys)
        if base is not None:
            attached.setdefault(base, []).append(k)
        else:
            top.append(k)
    out: list[str] = []

    def emit(k: str) -> None:
        out.append(k)
        for c in attached.get(k, []):
            emit(c)

    for k in top:
        emit(k)
    return out


@dataclass(frozen=True)
class Cell:
    """One headline-table cell: the main text ('mean ± SE (n seeds)') and the per-seed values."""

    main: str
    seeds: str = ""


def stat_cell(v: Any) -> Cell:
    """Format an aggregate entry {mean, se, n, values}; plain values are shown as they are."""
    if not isinstance(v, Mapping):
        return Cell(fmt_value(v))
    mean, se, n = v.get("mean"), v.get("se"), v.get("n")
    values = v.get("values") or []
    main = fmt_value(mean)
    if se is not None and mean is not None:
        main += f" ± {fmt_value(se)}"
    if n is not None:
        main += f" ({fmt_value(n)} seed{'s' if n != 1 else ''})"
    return Cell(main, fmt_value(values) if len(values) > 1 else "")  # one seed: the mean says it


def headline_table(results: Mapping[str, Any], exp: str) -> tuple[list[str], list[str], dict]:
    """Rows (headline keys), columns (models with any value) and cells[(key, model)] for one
    experiment: the aggregate where there is one, else the runs' per-seed values (no mean)."""
    cells: dict[tuple[str, str], Cell] = {}
    keys: list[str] = []
    cols: list[str] = []
    for name in models(results):
        m = (results.get("models") or {}).get(name) or {}
        agg = (m.get("aggregate") or {}).get(exp) or {}
        found: dict[str, Cell] = {k: stat_cell(v) for k, v in flatten(agg)}
        per_seed: dict[str, list[str]] = {}
        for run in m.get("runs") or []:
            head = ((run.get("experiments") or {}).get(exp) or {}).get("headline") or {}
            for k, v in flatten(head):
                per_seed.setdefault(k, []).append(f"seed {run.get('seed')}: {fmt_value(v)}")
        for k, vals in per_seed.items():
            if k not in found:
                found[k] = Cell(
                    f"no aggregate ({len(vals)} run{'s' if len(vals) != 1 else ''})",
                    "; ".join(vals),
                )
        if found:
            cols.append(name)
        for k, c in found.items():
            if k not in keys:
                keys.append(k)
            cells[(k, name)] = c
    # Rows in natural key order, not the order the dicts happen to hold: a fresh study builds its
    # headlines in code order, a resumed one reads them back from key-sorted JSON, and both (and a
    # rebuild from results.json) must render the same table.
    return order_keys(sorted(keys, key=natural_key)), cols, cells


def figures(results: Mapping[str, Any], exp: str | None) -> list[dict[str, Any]]:
    """An experiment's figures (exp None: those with no experiment): across-seed ones first."""
    figs = [f for f in results.get("figures") or [] if f.get("experiment") == exp]
    order = {m: i for i, m in enumerate(models(results))}
    return sorted(figs, key=lambda f: (f.get("model") is not None, order.get(f.get("model"), 0)))


def skipped(results: Mapping[str, Any], exp: str) -> list[tuple[str, str]]:
    """(model, 'reason') for an experiment skipped on a model; seeds named when reasons differ."""
    out: list[tuple[str, str]] = []
    for name in models(results):
        runs = ((results.get("models") or {}).get(name) or {}).get("runs") or []
        reasons = [
            (run.get("seed"), str((run.get("skipped") or {})[exp]))
            for run in runs
            if exp in (run.get("skipped") or {})
        ]
        if not reasons:
            continue
        distinct = {r for _, r in reasons}
        if len(distinct) == 1 and len(reasons) == len(runs):
            out.append((name, f"{reasons[0][1]} (all seeds)"))
        else:
            out.extend((name, f"seed {s}: {r}") for s, r in reasons)
    return out


def data_files(results: Mapping[str, Any], exp: str) -> list[tuple[str, str]]:
    """(label, relative path) of an experiment's table files (CSV, JSON) per model and seed."""
    out: list[tuple[str, str]] = []
    for name in models(results):
        for run in ((results.get("models") or {}).get(name) or {}).get("runs") or []:
            files = ((run.get("experiments") or {}).get(exp) or {}).get("files") or []
            for f in files:
                if str(f).lower().endswith((".csv", ".json")):
                    label = f"{name} seed {run.get('seed')}: {Path(str(f)).name}"
                    out.append((label, str(f)))
    return out


TRAIN_LABELS = {
    "test_acc": "Test acc",
    "val_acc": "Val acc",
    "train_acc": "Train acc",
    "chance": "Chance",
    "steps": "Steps",
    "steps_to_90": "Steps to 90%",
    "train_seconds": "Train time",
    "n_images": "Images",
    "params": "Parameters",
}
PRETRAINED_KEYS = ("test_acc", "chance", "n_images", "params")


def runs_heading(results: Mapping[str, Any]) -> str:
    """The run table's heading: pretrained models are loaded and evaluated, not trained."""
    return "Pretrained models" if (results.get("config") or {}).get("pretrained") else "Training"


def run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of one run's table row: its training summary, or a pretrained model's."""
    if run.get("train"):
        return dict(run["train"])
    pre = run.get("pretrained") or {}
    return {k: pre[k] for k in PRETRAINED_KEYS if k in pre}


def training_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per model and seed: the known training numbers present (in
    TRAIN_LABELS order), any other recorded ones after them, then the checkpoint."""
    runs = [
        (name, run)
        for name in models(results)
        for run in ((results.get("models") or {}).get(name) or {}).get("runs") or []
    ]
    seen: list[str] = []
    for _, run in runs:
        seen += [k for k in run_summary(run) if k not in seen]
    extra = sorted((k for k in seen if k not in TRAIN_LABELS), key=natural_key)
    keys = [k for k in TRAIN_LABELS if k in seen] + extra
    head = ["Model", "Seed", *(TRAIN_LABELS.get(k, k) for k in keys), "Checkpoint"]
    rows = []
    for name, run in runs:
        t = run_summary(run)
        row = [name, fmt_value(run.get("seed"))]
        for k in keys:
            v = t.get(k)
            row.append(
                f"{fmt_num(v)} s" if k == "train_seconds" and v is not None else fmt_value(v)
            )
        pre = run.get("pretrained") or {}
        where = f"{pre['model']} ({pre['weights']})" if pre else run.get("checkpoint")
        rows.append([*row, fmt_value(where)])
    return head, rows


GATE_HEADING = "Accuracy gate"


def gate_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per study seed retrained at the accuracy gate (study/gate.py): the seeds tried,
    the one kept and why the others failed (a model's in-situ controls share its slots and are
    not repeated)."""
    lines = []
    for name in models(results):
        m = (results.get("models") or {}).get(name) or {}
        if m.get("in_situ"):
            continue
        for run in m.get("runs") or []:
            g = run.get("gate")
            if not g:
                continue
            tried = ", ".join(str(s) for s in g.get("tried") or [])
            kept = (f"retrained as seed {run.get('seed')}" if g.get("passed") else
                    f"failed the gate in every attempt, seed {run.get('seed')} kept")  # fmt: skip
            lines.append(f"{name} seed {g.get('slot')} {kept} (tried {tried}): {g.get('why')}")
    return lines


TIMING_COLUMNS = ("Stage", "Model", "Seed", "Seconds", "Reused")


def timing_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """One row per recorded stage (see TIMING_COLUMNS)."""
    return [
        [
            fmt_value(s.get("stage")),
            fmt_value(s.get("model")),
            fmt_value(s.get("seed")),
            fmt_value(s.get("seconds")),
            fmt_value(s.get("reused")) if "reused" in s else NONE,
        ]
        for s in (results.get("timings") or {}).get("stages") or []
    ]


def kv_rows(d: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(key, value text) for a flat settings table such as the config or the environment, in
    key order (the same whichever order the dict was built in)."""
    return [(str(k), fmt_value(v)) for k, v in sorted((d or {}).items(), key=lambda kv: str(kv[0]))]


def read_png(out_dir: Path, rel: str | None) -> tuple[bytes | None, str]:
    """A figure's PNG bytes, or None and why not (no path, outside out_dir, missing, not a PNG)."""
    if not rel:
        return None, "no PNG path given"
    root = out_dir.resolve()
    path = (root / rel).resolve()
    if not path.is_relative_to(root):
        return None, "path is outside the output folder"
    if not path.is_file():
        return None, "file not found"
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        return None, "not a PNG file"
    return data, ""


__all__ = [
    "CALIBRATION_HEAD",
    "CLAIMS_HEAD",
    "MAX_LIST",
    "NONE",
    "PNG_MAGIC",
    "PRETRAINED_KEYS",
    "TIMING_COLUMNS",
    "TRAIN_LABELS",
    "Cell",
    "calibration_rows",
    "chance_base",
    "chance_target",
    "claim_heading",
    "claim_rows",
    "claim_sections",
    "claims_of",
    "data_files",
    "experiments",
    "figures",
    "flatten",
    "fmt_duration",
    "fmt_num",
    "fmt_value",
    "headline_table",
    "kv_rows",
    "measured_cell",
    "models",
    "natural_key",
    "order_keys",
    "power_cell",
    "power_lines",
    "read_png",
    "reference_cell",
    "run_summary",
    "runs_heading",
    "skipped",
    "slug",
    "stat_cell",
    "summary",
    "timing_rows",
    "training_table",
    "verdict_class",
    "verdict_counts",
    "verdict_label",
    "verdict_text",
]
