"""Rich progress bars for long work, written to stderr so JSON on stdout stays clean."""
from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

console = Console(stderr=True, soft_wrap=True)  # long lines stay one line in logs


def enabled() -> bool:
    return os.environ.get("QUANTGATE_PROGRESS", "1") != "0" and sys.stderr.isatty()


def make_progress(*extra_columns) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *extra_columns, TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console, disable=not enabled(), transient=False)


def track(iterable, description: str, total: int | None = None):
    with make_progress() as p:
        yield from p.track(iterable, description=description, total=total)
