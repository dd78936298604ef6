"""Command line: parses arguments (parser.py), calls the Python API (a module per command: train.py,
info.py, analyze.py, sae.py, study.py, export.py, report.py), maps user errors to one line and exit
code 2."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from poslens.cli.parser import _Parser, build_parser
from poslens.errors import UserError, WorkerLost, show_warning_line


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from poslens.allocator import keep_freed_memory

    keep_freed_memory()  # this process is ours: reuse big freed CPU blocks (poslens/allocator.py)
    try:
        if getattr(args, "device", None) is not None:
            from poslens.limits import check_device, resolve_device

            here = getattr(args, "executor", "local") == "local"  # slurm: checked on the nodes
            if here:
                args.device = resolve_device(args.device)
            check_device(args.device, here=here)
        with warnings.catch_warnings():  # restored after the command (main runs in tests too)
            warnings.showwarning = show_warning_line
            return int(args.fn(args))
    except UserError as e:
        print(f"poslens: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except WorkerLost as e:  # not the input's fault: exit 1, with what is kept
        print(f"poslens: error: {' '.join(str(e).split())}; {INTERRUPTED.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print(f"poslens: interrupted ({INTERRUPTED.get(args.command, '')})", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed by the reader (`poslens study ... | head`): results
        # are written before anything is printed, so only the printout is cut short
        _silence_stdout()
        return 141  # 128 + SIGPIPE, as a shell reports it


def _silence_stdout() -> None:
    """Point stdout at devnull so the interpreter's final flush cannot raise again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a captured stdout)
        pass


# What an interrupted command leaves, and how to continue: only train takes --resume.
INTERRUPTED = {
    "train": "checkpoints written so far are kept; rerun with --resume to continue",
    "study": "finished stages are kept; rerun the same command to continue",
    "analyze": "experiments saved so far are kept, without analysis.json; rerun to redo them",
    "sae": "nothing was saved; rerun the command",
    "info": "nothing was written",
    "report": "reports are written atomically: each is the old one or the new one; rerun it",
    "compare": "files are written atomically: each is the old one or the new one; rerun it",
    "merge": "linked files and finished stages are kept; rerun the same command to continue",
}


__all__ = ["INTERRUPTED", "_Parser", "build_parser", "main"]
