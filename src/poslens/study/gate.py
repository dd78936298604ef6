"""The accuracy gate of a study's trained models: a seed whose training never reached its target
(train.stop_acc) is retrained from a reserve seed, so that each model's seeds are models that
learned the task and a failed run does not pass for seed-to-seed spread.

A trained seed fails the gate when its run has train.stop_acc > 0 and its metrics record no
early stop (`stopped_at` is None: fewer than STOP_EVALS consecutive evaluations reached the
target in all train.steps). Its slot (the study seed s) is retrained with the reserve seeds
s + RESERVE * a (a = 1 .. study.gate_retries), the slots of one model together as one ensemble,
each into its own checkpoint folder; the first that passes takes the slot, and everything
downstream (the slot's experiments and in-situ controls) reads its checkpoint. After the last
attempt the slot keeps that attempt and is reported as not passed. Reserve seeds are at least
RESERVE, and study seeds stay below it (limits.COUNTS["seeds"]), so the two never meet. The gate
is decided from the finished checkpoints' metrics, so a rerun reuses every attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from poslens.study.plan import RunPlan, checkpoint_dir
from poslens.study.stages import Events, train_group

RESERVE = 1000  # reserve seed of slot s at attempt a: s + RESERVE * a


def reserve_seed(slot: int, attempt: int) -> int:
    """The training seed of slot `slot`'s attempt `attempt` (0: the slot's own seed)."""
    return slot + RESERVE * attempt


def failure(run: RunPlan) -> str | None:
    """Why `run`'s finished checkpoint fails the gate, or None: it reached train.stop_acc (its
    metrics' `stopped_at` is set), or it has no target (stop_acc 0)."""
    from poslens.checkpoint import read_metrics

    rc, ckpt = run.run_config, run.checkpoint
    assert rc is not None and ckpt is not None
    if not rc.train.stop_acc:
        return None
    m = read_metrics(ckpt)
    if m.get("stopped_at") is not None:
        return None
    return (f"seed {rc.train.seed} did not reach stop_acc {rc.train.stop_acc:g} "
            f"(val {m['val']['acc']:.3f} after {m['steps']} steps)")  # fmt: skip


@dataclass
class Slot:
    """One study seed of a trained model through the gate: the run that holds it now (its last
    attempt), the training seeds tried, why each failed, and its training time and reuse."""

    run: RunPlan
    tried: list[int]
    why: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reused: bool = True
    passed: bool = True

    def record(self) -> dict[str, Any] | None:
        """results.json's `gate` of a slot that was retrained; None for one that kept its seed."""
        if len(self.tried) == 1:
            return None
        return {"slot": self.run.seed, "tried": list(self.tried), "passed": self.passed,
                "why": "; ".join(self.why)}  # fmt: skip

    def holding(self, run: RunPlan) -> RunPlan:
        """`run` (the slot's own run or one of its in-situ controls) reading this slot's
        checkpoint."""
        return replace(run, run_config=self.run.run_config, checkpoint=self.run.checkpoint)

    @property
    def trained_seed(self) -> int:
        assert self.run.run_config is not None
        return self.run.run_config.train.seed


def attempt(run: RunPlan, n: int, out: Path) -> RunPlan:
    """Slot `run`'s attempt `n`: the reserve seed's training config and checkpoint folder (the
    run keeps its slot's seed, stages and run folder)."""
    rc = run.run_config
    assert rc is not None
    seed = reserve_seed(run.seed, n)
    rc = replace(rc, train=replace(rc.train, seed=seed))
    return replace(run, run_config=rc, checkpoint=checkpoint_dir(out, run.model, seed, rc))


def gated(
    runs: list[RunPlan],
    trained: dict[int, tuple[float, bool]],
    retries: int,
    out: Path,
    device: str,
    events: Events | None = None,
) -> dict[int, Slot]:
    """The slots of one model's trained `runs` (trained: train_group's seconds and reuse per
    seed) after the gate: each failing slot retrained from its reserve seeds, up to `retries`
    times, the failing slots of each attempt as one ensemble. By slot seed."""
    slots = {r.seed: Slot(r, [r.seed], seconds=trained[r.seed][0], reused=trained[r.seed][1])
             for r in runs}  # fmt: skip
    for n in range(1, retries + 1):
        failing = []
        for s in slots.values():
            why = failure(s.run)
            if why is not None:
                s.why.append(why)
                failing.append(s)
        if not failing:
            break
        tries = {s.run.seed: attempt(s.run, n, out) for s in failing}
        for seed, (seconds, reused) in train_group(list(tries.values()), device, events).items():
            s = slots[seed]
            s.run = tries[seed]
            s.tried.append(s.trained_seed)
            s.seconds += seconds
            s.reused = s.reused and reused
    else:  # every attempt used: the last one's own verdict
        for s in slots.values():
            why = failure(s.run) if len(s.tried) > 1 else None
            if why is not None:
                s.why.append(why)
                s.passed = False
    return slots


__all__ = ["RESERVE", "Slot", "attempt", "failure", "gated", "reserve_seed"]
