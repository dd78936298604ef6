"""A rich progress bar for training: step, loss, images/s, ETA and the latest validation accuracy."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """Progress display on stderr; silent when disabled (tests, non-interactive use)."""

    def __init__(self, total: int, start: int, enabled: bool = True, label: str = "train") -> None:
        self.enabled = enabled
        self.val_acc = float("nan")
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("{task.fields[rate]:.0f} img/s"),
            TextColumn("val {task.fields[val]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            label, total=total, completed=start, loss=float("nan"), rate=0.0, val="-"
        )

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.__exit__(t, e, tb)

    def update(self, step: int, loss: float, images_per_s: float) -> None:
        self._progress.update(self._task, completed=step, loss=loss, rate=images_per_s)

    def log_eval(self, step: int, acc: float) -> None:
        self._progress.update(self._task, val=f"{acc:.1%}")
