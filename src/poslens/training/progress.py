"""A progress bar for training: step, loss, images/s, ETA and the latest validation accuracy."""

from __future__ import annotations

from types import TracebackType

from poslens.progress import progress_bar


class TrainProgress:
    """Progress display on stderr; silent when disabled (tests, non-interactive use)."""

    def __init__(self, total: int, start: int, enabled: bool = True, label: str = "train") -> None:
        self.enabled = enabled
        self._progress = progress_bar(
            "{task.completed}/{task.total}",
            "loss {task.fields[loss]:.3f}",
            "{task.fields[rate]:.0f} img/s",
            "val {task.fields[val]}",
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
