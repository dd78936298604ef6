"""Progress displays on stderr (rich): one bar factory for training, experiments, SAEs and the study.

Bars show on rank 0 only and never on stdout, so piped output stays clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from poslens import distributed

T = TypeVar("T")


def progress_bar(
    *fields: str | ProgressColumn,
    transient: bool = False,
    disable: bool = False,
    min_width: int = 0,
) -> Progress:
    """A rich Progress on stderr: description, bar, then `fields` (format strings of
    `task.fields` or columns), elapsed time and ETA."""
    console = Console(file=sys.stderr)
    if min_width:
        console = Console(file=sys.stderr, width=max(min_width, console.width))
    columns = [TextColumn(f) if isinstance(f, str) else f for f in fields]
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *columns,
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
        disable=disable,
    )


def track(items: Sequence[T], description: str, enabled: bool) -> Iterator[T]:
    """Iterate with a progress bar (a no-op when disabled, and on ranks other than 0)."""
    if not enabled or not distributed.is_main():
        yield from items
        return
    with progress_bar("{task.completed}/{task.total}") as bar:
        task = bar.add_task(description, total=len(items))
        for item in items:
            yield item
            bar.advance(task)


__all__ = ["progress_bar", "track"]
