"""A prepared check of poslens on one GPU: 8 minutes on an H100-class card, setup included.

Its device tests, the training step against the CPU, a pretrained ViT-B/16 quick study and a
confirm-preset block, from a fresh checkout (docs/gpu.md).

Sections, each in its own process under its own time budget (seconds on the GPU, BUDGET), so
that one that runs out of memory, fails or overruns is said in one line and the rest still run:

- tests: `pytest -m gpu` with POSLENS_TEST_DEVICE set to the device (tests/test_gpu.py);
- train: one training step of the default study's models (their shapes, batch and precision)
  on the GPU and on the CPU, as ensembles of 1, 5 and 20 seeds (the study trains a model's
  seeds as one ensemble), and the CPU's time to draw one training batch;
- pretrained: `preset("quick")` on random-initialised timm ViT-B/16s (APE and naver RoPE) at
  224 px with their weights in a local .safetensors (nothing is downloaded): each experiment's
  evaluation images per second of its stage, and the peak GPU memory;
- confirm: a short block of the confirm preset (its first seeds) on the GPU: seeds per minute,
  and what the 20-seed confirmation would take at that rate.

A study section that reaches its budget is stopped and reports the stages it finished and the
study's own ETA. `--dry-run` runs every section at tiny sizes on the CPU (about a minute on two
cores; tests/test_gpu_check.py runs it in CI), so the script cannot rot where no GPU is.
Writes OUT/gpu_check.json and OUT/gpu_check.md (one table), after each section.

    bash scripts/setup.sh --timm && .venv/bin/python benchmarks/gpu_check.py --out runs/gpu_check
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from poslens.errors import UserError
from poslens.io import atomic_write, jsonable, write_json
from poslens.limits import check_device

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "poslens.gpu_check/1"
SECTIONS = ("tests", "train", "pretrained", "confirm")
# Seconds per section on one H100-class GPU, process start included: with about 2 minutes of
# `bash scripts/setup.sh --timm`, the check stays within 8 minutes (TOTAL: all sections).
BUDGET = {"tests": 60, "train": 45, "pretrained": 105, "confirm": 105}
TOTAL = 330
# The dry run's budgets are only a guard: a slow shared CPU must not stop its tiny sections.
DRY_BUDGET = {"tests": 240, "train": 120, "pretrained": 240, "confirm": 240}
DRY_TOTAL = 900
# where the `gpu` tests live (`pytest -m gpu` over the whole suite spends most of its time collecting)
TEST_PATHS = ("tests/test_gpu.py",)
MIN_SECONDS = 10  # a section given less than this is not started
FULL_CONFIRMATION = 20  # seeds of the pre-registered confirmation (study.config.CONFIRM_SEEDS)
STAGE_LINE = re.compile(
    r"^(?P<t>[\d.]+)\tposlens: \[(?P<done>\d+)/(?P<total>\d+)\] (?P<kind>\S+) (?P<model>\S+) "
    r"seed (?P<seed>\d+): (?P<what>[^;]+); ETA (?P<eta>\S+)"
)


@dataclass
class Sizes:
    """What each section runs: the GPU run's sizes (REAL) or the dry run's (DRY)."""

    train_models: tuple[str, ...] = ("ape", "rope_axial", "rope_mixed")
    ensembles: tuple[int, ...] = (1, 5, 20)
    train_steps: int = 5  # timed steps per round
    train_rounds: int = 3
    train_model: dict[str, Any] = field(default_factory=dict)  # ModelConfig changes
    train_batch: int = 0  # 0: the default study's
    pretrained: tuple[str, ...] = ("vit_base_patch16_224", "vit_base_patch16_rope_224")
    timm_sizes: dict[str, Any] = field(default_factory=dict)  # timm.create_model changes
    pretrained_images: int = 256
    pretrained_study: dict[str, Any] = field(default_factory=dict)  # StudyConfig changes
    confirm_seeds: int = 2
    confirm_jobs: int = 4
    confirm_study: dict[str, Any] = field(default_factory=dict)  # StudyConfig changes


REAL = Sizes()
DRY = Sizes(
    train_models=("rope_axial",),
    ensembles=(1, 2),
    train_steps=1,
    train_rounds=1,
    train_model={"dim": 16, "depth": 2, "heads": 2},
    train_batch=8,
    timm_sizes={"depth": 2, "img_size": 64, "num_classes": 5, "embed_dim": 64, "num_heads": 2},
    pretrained_images=40,
    pretrained_study={
        "experiments": ("depth_profile", "axis_map", "sae_causal"),
        "analysis_set+": (
            "sae_causal.sites=probe", "sae_causal.train_images=40", "sae_causal.epochs=1", "sae_causal.k=4",
            "sae_causal.doses=2", "sae_causal.draws=1",
        ),
        "ssdc_images": 30, "batch_size": 20,
    },
    confirm_seeds=1,
    confirm_jobs=2,
    confirm_study={
        "models": ("ape", "rope_axial"), "in_situ": False, "only": (), "gate_retries": 0,
        "experiments": ("depth_profile", "position_removal"),
        "train_set+": (
            "model.dim=16", "model.depth=2", "model.heads=2", "train.steps=4",
            "train.batch_size=16", "train.eval_every=2", "train.eval_images=20",
            "data.n_val=40", "data.n_test=40", "data.image_size=16", "data.object_scale=0.32",
        ),
        "analysis_set+": ("position_removal.n_planes=1", "position_removal.draws=1"),
        "n_images": 20, "probe_images": 20, "batch_size": 20,
    },
)  # fmt: skip


def with_changes(cfg: Any, changes: dict[str, Any]) -> Any:
    """A StudyConfig with `changes`; a key ending in "+" appends to that tuple field."""
    plain = {k: v for k, v in changes.items() if not k.endswith("+")}
    added = {k[:-1]: getattr(cfg, k[:-1]) + v for k, v in changes.items() if k.endswith("+")}
    return replace(cfg, **plain, **added)


# ---- the section processes -------------------------------------------------------------------


class Part:
    """A section's figures, written atomically to its file after each step, so that what a
    stopped section finished is still read."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def update(self, **kw: Any) -> None:
        self.data.update(kw)
        write_json(self.path, jsonable(self.data))


class Stamped:
    """stderr for a study: each line prefixed with the seconds since `t0` and a tab, so that the
    study's stage lines (`poslens: [k/n] ...; ETA ...`) can be read back with their times."""

    def __init__(self, path: Path, t0: float) -> None:
        self.file, self.t0, self.rest = open(path, "a"), t0, ""

    def write(self, s: str) -> int:
        *lines, self.rest = (self.rest + s).split("\n")
        for line in lines:
            self.file.write(f"{time.perf_counter() - self.t0:.2f}\t{line}\n")
        self.file.flush()
        return len(s)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False  # the study then writes one line per finished stage


def synced(device: str) -> Any:
    """A clock that waits for the device's queued work first."""
    if device.startswith("cuda"):
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]
    return time.perf_counter


def peak_memory(device: str) -> dict[str, float | None]:
    """Peak GPU memory allocated and reserved by torch in this process (MiB), and peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not device.startswith("cuda"):
        return {"peak_gpu_mib": None, "peak_gpu_reserved_mib": None, "peak_rss_mib": rss}
    return {
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20,
        "peak_gpu_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        "peak_rss_mib": rss,
    }


def section_train(sizes: Sizes, device: str, part: Part, budget: float) -> None:
    """Seconds per training step of each model as an ensemble of S seeds, on the CPU and on
    `device`, measured together in interleaved rounds (train_throughput.measure)."""
    from poslens.data import build_task
    from poslens.study import preset
    from poslens.study.plan import run_config
    from poslens.training.train import model_config_for
    from train_throughput import ensemble_step, measure

    t0, default = time.perf_counter(), preset("default")
    rows: list[dict[str, Any]] = []
    part.update(cpu_threads=torch.get_num_threads(), rows=rows)
    for posenc in sizes.train_models:
        rc = run_config(default, posenc, 0)
        task = build_task(rc.data)
        cfg = replace(model_config_for(rc, task).model, **sizes.train_model)
        batch = sizes.train_batch or rc.train.batch_size
        if "data_ms_per_batch" not in part.data:  # the CPU draws every step's batch
            t = time.perf_counter()
            for step in range(5):
                task.train_batch(step, batch)
            part.update(data_ms_per_batch=(time.perf_counter() - t) / 5 * 1e3, batch=batch)
        x, y = task.train_batch(0, batch)
        for seeds in sizes.ensembles:
            if time.perf_counter() - t0 > 0.8 * budget:
                part.update(
                    note=f"stopped before {posenc} x{seeds}: near the {budget:.0f} s budget"
                )
                return
            row: dict[str, Any] = {
                "posenc": posenc,
                "seeds": seeds,
                "precision": rc.train.precision,
            }
            try:
                steps = {k: ensemble_step(cfg, seeds, x.to(w), y.to(w), rc.train.precision,
                                          False, w) for k, w in (("cpu", "cpu"), ("gpu", device))}  # fmt: skip
                times, _ = measure(
                    steps,
                    sizes.train_rounds,
                    sizes.train_steps,
                    synced(device),
                )
                cpu, gpu = (statistics.median(times[k]) for k in ("cpu", "gpu"))
                row |= {"cpu_ms": cpu * 1e3, "gpu_ms": gpu * 1e3, "speedup": cpu / gpu,
                        "gpu_ms_per_seed": gpu * 1e3 / seeds}  # fmt: skip
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0]}"
                torch.cuda.empty_cache()
            rows.append(row)
            part.update(rows=rows)
    part.update(**peak_memory(device))


def fake_weights(names: tuple[str, ...], sizes: dict[str, Any], folder: Path) -> list[str]:
    """Random-initialised timm models saved as .safetensors (nothing downloaded): `timm:NAME=FILE`
    specs; with `sizes`, poslens builds timm:NAME at those sizes too (as tests/conftest.py's
    shrink_timm does)."""
    import timm
    from safetensors.torch import save_file

    if sizes:
        import poslens.models.timm_convert as tc

        real = tc.create_timm
        tc.create_timm = lambda name, pretrained=False, **kw: real(name, pretrained, **sizes)  # type: ignore[assignment]
    folder.mkdir(parents=True, exist_ok=True)
    specs = []
    for name in names:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, **sizes)
        path = folder / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        specs.append(f"timm:{name}={path}")
    return specs


def section_pretrained(sizes: Sizes, device: str, part: Part, work: Path, log: Path) -> None:
    """The quick preset on random-initialised ViT-B/16s: timed from its stage lines."""
    from poslens.precision import resolve_precision
    from poslens.study import preset, run_study
    from pretrained_experiment import image_folder

    os.environ["HF_HUB_OFFLINE"] = "1"  # random weights only: never the hub
    specs = fake_weights(sizes.pretrained, sizes.timm_sizes, work / "weights")
    n = sizes.pretrained_images
    folder = image_folder(work / "images", 2 * n)  # halved into val and test
    cfg = preset("quick", pretrained=tuple(specs), images=str(folder), seeds=1, n_images=n,
                 probe_images=n, in_situ=False)  # fmt: skip
    cfg = with_changes(cfg, sizes.pretrained_study)
    precision = resolve_precision(cfg.precision, torch.device(device))  # "auto": bf16 on a GPU
    part.update(models=list(sizes.pretrained), n_images=n, precision=precision,
                experiments=list(cfg.experiments))  # fmt: skip
    t = time.perf_counter()
    sys.stderr = Stamped(log, t)  # type: ignore[assignment]
    run_study(cfg, work / "study", progress=True, device=device, jobs=1)
    part.update(study_seconds=time.perf_counter() - t, **peak_memory(device))


def section_confirm(sizes: Sizes, device: str, part: Part, work: Path, log: Path) -> None:
    """The confirm preset's first seeds (from 100) on the device, timed from its stage lines."""
    from poslens.study import preset, run_study
    from poslens.study.config import CONFIRM_START

    cfg = preset("confirm", seeds=sizes.confirm_seeds, seed_start=CONFIRM_START)
    cfg = with_changes(cfg, sizes.confirm_study)
    part.update(seeds=cfg.seeds, seed_start=cfg.seed_start, models=len(cfg.models),
                runs=cfg.n_runs, jobs=sizes.confirm_jobs, in_situ=cfg.in_situ)  # fmt: skip
    t = time.perf_counter()
    sys.stderr = Stamped(log, t)  # type: ignore[assignment]
    res = run_study(cfg, work / "study", progress=True, device=device, jobs=sizes.confirm_jobs)
    gated = [r for m in res["models"].values() for r in m["runs"] if "gate" in r]
    own = peak_memory(device) if sizes.confirm_jobs == 1 else {}  # else in worker processes
    part.update(study_seconds=time.perf_counter() - t, gate_retrained=len(gated), **own)


def child(args: argparse.Namespace) -> int:
    """One section in this process (the parent's --section): its figures into --part."""
    sizes = DRY if args.dry_run else replace(REAL, confirm_jobs=args.confirm_jobs)
    part, work = Part(Path(args.part)), Path(args.work)
    log = part.path.with_suffix(".log")  # where the parent reads the stage lines

    # the GPU memory of this process: the confirm block's work is in its workers unless 1 job
    own = args.section != "confirm" or sizes.confirm_jobs == 1

    def stopped(_sig: int, _frame: object) -> None:  # the parent's budget ran out
        part.update(stopped=True, **(peak_memory(args.device) if own else {}))
        os._exit(3)

    signal.signal(signal.SIGTERM, stopped)
    try:
        if args.section == "train":
            section_train(sizes, args.device, part, args.budget)
        elif args.section == "pretrained":
            section_pretrained(sizes, args.device, part, work, log)
        else:
            section_confirm(sizes, args.device, part, work, log)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("timm", "torchvision"):  # the [timm] extra's
            part.update(error=one_line(e))
            return 1
        part.update(could_not=f"needs {e.name} (bash scripts/setup.sh --timm installs it)")
        return 1
    except Exception as e:
        part.update(error=one_line(e), **(peak_memory(args.device) if own else {}))
        return 1
    return 0


def one_line(e: BaseException) -> str:
    """An exception as one line; out of memory named as such, also from a worker process."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError) or "out of memory" in str(seen).lower():
            return "out of memory: " + (str(seen).splitlines() or [""])[0][:200]
        seen = seen.__cause__
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


# ---- the parent: sections, budgets, the report --------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    """What the figures were measured on: versions, CPU, and the GPU's name and memory."""
    from poslens._version import __version__
    from poslens.study.run import cpu

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = None
    env: dict[str, Any] = {
        "poslens": __version__, "commit": commit, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "python": platform.python_version(), "cpu": cpu(),
        "cpu_count": os.cpu_count(), "device": device, "gpu": None,
    }  # fmt: skip
    if no_device(device) is None and device.startswith("cuda"):
        index = torch.device(device).index or 0
        p = torch.cuda.get_device_properties(index)
        env["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}", "count": torch.cuda.device_count(),
                      "bf16": torch.cuda.is_bf16_supported()}  # fmt: skip
    return env


def no_device(device: str) -> str | None:
    """Why `device` cannot run here (None: it can)."""
    if not device.startswith("cuda"):
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build: no CUDA (--dry-run checks on the CPU)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU"
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        return f"{device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
    return None


def run_process(cmd: list[str], env: dict[str, str], timeout: float, out: Path) -> int | None:
    """Run `cmd` in its own process group, its output to `out`; at `timeout` the group gets
    SIGTERM, then SIGKILL 10 s later. Returns the exit code, None when it was stopped."""
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop_group(proc, signal.SIGKILL)
                proc.wait()
            return None


def stop_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send `sig` to the process group `proc` leads (its study workers, pytest's children)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # it has just ended
        pass


def tests_result(junit: Path) -> dict[str, Any]:
    """Counts and failures from pytest's JUnit XML."""
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    failures, skips = [], set()
    for case in suite.iter("testcase"):
        for tag in ("failure", "error"):
            if (bad := case.find(tag)) is not None:
                msg = (bad.get("message") or "").splitlines()
                failures.append(f"{case.get('name')}: {msg[0][:200] if msg else tag}")
        if (skip := case.find("skipped")) is not None:
            skips.add(skip.get("message") or "")
    return {"passed": total - skipped - failed, "failed": failed, "skipped": skipped,
            "failures": failures, "skip_reasons": sorted(skips)}  # fmt: skip


def stage_lines(log: Path) -> list[dict[str, Any]]:
    """The study's finished-stage lines from a Stamped log: time, progress, stage, seconds."""
    if not log.is_file():
        return []
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if m := STAGE_LINE.match(line):
            what = m["what"]
            rows.append({
                "t": float(m["t"]), "done": int(m["done"]), "total": int(m["total"]),
                "kind": m["kind"], "model": m["model"], "seed": int(m["seed"]),
                "seconds": float(what[:-2]) if what.endswith(" s") else None, "what": what,
                "eta": float(m["eta"].rstrip("s")) if m["eta"] != "?" else None,
            })  # fmt: skip
    return rows


def study_figures(name: str, sec: dict[str, Any], log: Path) -> None:
    """A study section's figures from its stage lines (also when it was stopped)."""
    lines = stage_lines(log)
    sec["stages_done"] = lines[-1]["done"] if lines else 0
    sec["stages_total"] = lines[-1]["total"] if lines else None
    if name == "pretrained":
        n = sec.get("n_images") or 0
        sec["experiments_timed"] = [
            {"model": r["model"], "experiment": r["kind"], "seconds": r["seconds"],
             "images_per_s": n / r["seconds"] if r["seconds"] else None}
            for r in lines if r["kind"] != "load" and r["seconds"] is not None
        ]  # fmt: skip
        sec["load_seconds"] = {r["model"]: r["seconds"] for r in lines if r["kind"] == "load"}
        return
    seconds = sec.get("study_seconds")
    if seconds is None and lines and lines[-1]["eta"] is not None:  # stopped: the study's ETA
        seconds, sec["projected"] = lines[-1]["t"] + lines[-1]["eta"], True
    sum_of = lambda train: sum(r["seconds"] or 0 for r in lines if (r["kind"] == "train") == train)  # noqa: E731
    sec["train_stage_seconds"], sec["experiment_stage_seconds"] = sum_of(True), sum_of(False)
    if seconds:
        sec["block_seconds"] = seconds
        sec["seeds_per_minute"] = sec["seeds"] * 60 / seconds
        sec["full_confirmation_minutes"] = FULL_CONFIRMATION / sec["seeds_per_minute"]


def run_section(name: str, args: argparse.Namespace, budget: float, logs: Path) -> dict[str, Any]:
    """One section in its own process within `budget` seconds; its figures and status."""
    work = logs.parent / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    part, log, junit = logs / f"{name}.json", logs / f"{name}.log", logs / f"{name}.xml"
    for f in (part, log, junit):
        f.unlink(missing_ok=True)
    # a section's pytest is not a worker of the pytest that may run this check (tests/)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("PYTEST_CURRENT_TEST", None)
    if name == "tests":
        env["POSLENS_TEST_DEVICE"] = args.device
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-p",
               "no:cacheprovider", f"--junitxml={junit}", *TEST_PATHS]  # fmt: skip
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--part",
               str(part), "--work", str(work), "--device", args.device, "--budget", str(budget),
               "--confirm-jobs", str(args.confirm_jobs), *(["--dry-run"] if args.dry_run else [])]  # fmt: skip
    t0 = time.perf_counter()
    code = run_process(cmd, env, budget, logs / f"{name}.out")
    sec: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1), "budget_seconds": budget}
    if part.is_file():
        sec |= json.loads(part.read_text())
    if name == "tests" and junit.is_file():
        sec |= tests_result(junit)
    if name in ("pretrained", "confirm"):
        study_figures(name, sec, log)
    out_tail = (logs / f"{name}.out").read_text(errors="replace").strip().splitlines()[-1:]
    if code is None or sec.pop("stopped", False):
        sec |= {"status": "stopped", "reason": f"stopped at its {budget:.0f} s budget"}
    elif "could_not" in sec:
        sec |= {"status": "skipped", "reason": sec.pop("could_not")}
    elif "error" in sec:
        oom = sec["error"].startswith("out of memory")
        sec |= {"status": "out of memory" if oom else "failed", "reason": sec.pop("error")}
    elif name == "tests" and "passed" in sec:
        if sec["failed"]:
            sec |= {"status": "failed", "reason": f"{sec['failed']} failed: {sec['failures'][0]}"}
        elif not sec["passed"]:
            reason = "; ".join(sec["skip_reasons"]) or "no test ran"
            sec |= {"status": "skipped", "reason": reason}
        else:
            sec["status"] = "ok"
    elif code != 0:
        sec |= {"status": "failed", "reason": f"exit code {code}: {' '.join(out_tail)[:300]}"}
    else:
        sec["status"] = "ok"
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return sec


def rows_tests(sec: dict[str, Any], device: str) -> list[list[str]]:
    if "passed" not in sec:
        return []
    counts = f"{sec['passed']} passed, {sec['failed']} failed, {sec['skipped']} skipped"
    return [[f"pytest -m gpu on {device}", counts, "; ".join(sec["failures"][:3])]]


def rows_train(sec: dict[str, Any], gpu: str) -> list[list[str]]:
    rows = []
    if "data_ms_per_batch" in sec:
        rows.append([f"a training batch of {sec['batch']} drawn on the CPU",
                     f"{sec['data_ms_per_batch']:.1f} ms", "every step, before the step"])  # fmt: skip
    for r in sec.get("rows", []):
        what = f"{r['posenc']} step, {r['seeds']} seed{'s' * (r['seeds'] > 1)}, {r['precision']}"
        if "error" in r:
            rows.append([what, "-", r["error"]])
            continue
        rows.append([what, f"{gpu} {r['gpu_ms']:.1f} ms, CPU {r['cpu_ms']:.1f} ms: "
                     f"{r['speedup']:.1f}x", f"{r['gpu_ms_per_seed']:.2f} ms per seed on the "
                     f"{gpu}; CPU at {sec.get('cpu_threads')} threads"])  # fmt: skip
    return rows


def rows_pretrained(sec: dict[str, Any]) -> list[list[str]]:
    rows = [[f"{r['model']} {r['experiment']}", f"{r['images_per_s']:.1f} images/s",
             f"{r['seconds']:.1f} s for {sec['n_images']} images, {sec.get('precision')}"]
            for r in sec.get("experiments_timed", [])]  # fmt: skip
    rows += [[f"{model} load", f"{s:.1f} s", "its converted weights, images, intact baseline"]
             for model, s in sec.get("load_seconds", {}).items()]  # fmt: skip
    return rows


def rows_confirm(sec: dict[str, Any]) -> list[list[str]]:
    if "seeds" not in sec:
        return []
    last = sec["seed_start"] + sec["seeds"] - 1
    block = f"seeds {sec['seed_start']}-{last}, {sec['runs']} runs, {sec['jobs']} job(s)"
    rows = [["stages finished", f"{sec['stages_done']} of {sec['stages_total']}", block]]
    if "seeds_per_minute" in sec:
        how = "projected from the study's ETA" if sec.get("projected") else "measured"
        rows += [
            ["seeds per minute", f"{sec['seeds_per_minute']:.2f}",
             f"{how}; the block: {sec['block_seconds']:.0f} s"],
            [f"the {FULL_CONFIRMATION}-seed confirmation at that rate",
             f"{sec['full_confirmation_minutes']:.0f} min",
             "an upper bound: more seeds share each model's training ensemble"],
        ]  # fmt: skip
    rows.append(["summed stage seconds", f"training {sec['train_stage_seconds']:.0f} s, "
                 f"experiments {sec['experiment_stage_seconds']:.0f} s", ""])  # fmt: skip
    return rows


def table(doc: dict[str, Any]) -> list[list[str]]:
    """The report's rows: section, what was measured, the figure, a note."""
    gpu = "device (CPU)" if doc["dry_run"] else "GPU"
    rows: list[list[str]] = []
    for name, sec in doc["sections"].items():
        status = sec["status"] + (f": {sec['reason']}" if sec.get("reason") else "")
        took = f"{sec['seconds']:.0f} s of {sec['budget_seconds']:.0f}" if "seconds" in sec else ""
        mine = [["status", status, took]] + ([["note", sec["note"], ""]] if "note" in sec else [])
        if name == "tests":
            mine += rows_tests(sec, doc["device"])
        elif name == "train":
            mine += rows_train(sec, gpu)
        elif name == "pretrained":
            mine += rows_pretrained(sec)
        else:
            mine += rows_confirm(sec)
        if sec.get("peak_gpu_mib") is not None:
            mine.append(["peak GPU memory (torch)", f"{sec['peak_gpu_mib'] / 1024:.2f} GiB",
                         f"reserved {sec['peak_gpu_reserved_mib'] / 1024:.2f} GiB"])  # fmt: skip
        rows += [[name, *row] for row in mine]
    return rows


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    gpu = env["gpu"]
    card = f"{gpu['name']} ({gpu['memory_gib']} GiB)" if gpu else "no GPU"
    head = (f"# poslens GPU check{' (dry run, CPU, tiny sizes)' if doc['dry_run'] else ''}\n\n"
            f"{doc['created']}, poslens {env['poslens']} ({env['commit']}), torch {env['torch']} "
            f"(CUDA {env['torch_cuda']}), {card}, CPU {env['cpu']['model']} x{env['cpu_count']}; "
            f"{doc['wall_seconds']:.0f} s in all.\n\n")  # fmt: skip
    lines = ["| section | measure | value | note |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in doc["table"]]
    return head + "\n".join(lines) + "\n"


def write_report(out: Path, doc: dict[str, Any]) -> None:
    doc["table"] = table(doc)
    write_json(out / "gpu_check.json", jsonable(doc))
    text = markdown(doc)
    atomic_write(out / "gpu_check.md", lambda p: p.write_text(text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu_check", help="output folder (default runs/gpu_check)")
    p.add_argument("--dry-run", action="store_true", help="every section at tiny sizes on the CPU")
    p.add_argument("--device", default="", help="default: cuda (cpu with --dry-run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in order")
    p.add_argument("--budget", type=float, default=0, help="seconds for all sections (default "
                   f"{TOTAL}; {DRY_TOTAL} dry)")  # fmt: skip
    p.add_argument("--section-budget", action="append", default=[], metavar="NAME=SECONDS",
                   help="one section's seconds (defaults: "
                   + ", ".join(f"{k}={v}" for k, v in BUDGET.items()) + ")")  # fmt: skip
    p.add_argument("--confirm-jobs", type=int, default=REAL.confirm_jobs,
                   help=f"processes sharing the GPU in the confirm block (default {REAL.confirm_jobs})")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep each section's study folder")
    p.add_argument("--section", choices=SECTIONS[1:], help=argparse.SUPPRESS)
    for internal in ("--part", "--work"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    try:
        check_device(args.device, here=False)  # a name poslens knows; whether it is here: below
    except UserError as e:
        p.error(str(e))
    if args.section:
        args.budget = args.budget or BUDGET[args.section]
        return child(args)
    budgets = dict(DRY_BUDGET if args.dry_run else BUDGET)
    for item in args.section_budget:
        key, _, value = item.partition("=")
        if key not in budgets:
            p.error(f"--section-budget {item}: no section {key!r}")
        budgets[key] = float(value)
    names = [s for s in args.sections.split(",") if s]
    if unknown := [s for s in names if s not in SECTIONS]:
        p.error(f"--sections: no section {', '.join(unknown)} (sections: {', '.join(SECTIONS)})")
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + (args.budget or (DRY_TOTAL if args.dry_run else TOTAL))
    doc: dict[str, Any] = {
        "schema": SCHEMA, "dry_run": args.dry_run, "device": args.device,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "environment": environment(args.device), "sections": {}, "wall_seconds": 0.0,
    }  # fmt: skip
    missing = None if args.dry_run else no_device(args.device)
    for name in names:
        left = deadline - time.perf_counter()
        if missing is not None:
            sec = {"status": "skipped", "reason": missing}
        elif left < MIN_SECONDS:
            sec = {
                "status": "skipped",
                "reason": f"no time left in the check's budget ({left:.0f} s)",
            }
        else:
            sec = run_section(name, args, min(budgets[name], left), logs)
        doc["sections"][name] = sec
        doc["wall_seconds"] = time.perf_counter() - start
        write_report(out, doc)
        took = (
            f" ({sec['seconds']:.0f} s of {sec['budget_seconds']:.0f})" if "seconds" in sec else ""
        )
        said = f": {sec['reason']}" if sec.get("reason") else ""
        print(f"gpu_check: {name}: {sec['status']}{took}{said}", flush=True)
    print(markdown(doc), end="")
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
