"""Errors a user can cause. Each carries a one-line message; only the CLI turns them into exit code 2."""

import sys
from typing import TextIO


class UserError(Exception):
    """A problem with the user's input (config, file, index), reported as one line."""


class ConfigError(UserError):
    """A configuration field has a bad value; the message names the field."""


class ArgumentError(UserError, ValueError):
    """A Python API argument has the wrong type or value; the message names the argument. Also a
    ValueError, so code that catches the built-in error for a bad argument still does."""


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, unsafe (pickle) or does not fit the model."""


class DataError(UserError):
    """Data could not be built or read: missing folder, corrupt image, unknown task."""


class OutputError(UserError):
    """Output cannot be written: --out is a file, the folder is read-only, or the disk is full."""


class LimitError(UserError):
    """A size or count beyond what this machine can hold or finish; the message gives the estimate."""


class DataWarning(UserWarning):
    """Input used with a caveat the user should know (entries of an image folder skipped); the
    CLI prints it as one `poslens: warning:` line."""


class WorkerLost(Exception):
    """A worker process or cluster job ended without its result (killed, out of memory) and again
    when rerun. Not the user's input: one line and exit code 1; the work it saved is kept."""


def show_warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """warnings.showwarning for poslens's own processes (the CLI, study workers): one
    `poslens: warning:` line on stderr, without the source line Python shows after it (a raw
    `warnings.warn(` line means nothing to a CLI user)."""
    kind = "" if issubclass(category, DataWarning) else f" ({category.__name__})"
    print(f"poslens: warning: {' '.join(str(message).split())}{kind}", file=file or sys.stderr)
