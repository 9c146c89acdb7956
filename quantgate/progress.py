"""Rich progress bars for long work, written to stderr so JSON on stdout stays clean."""
from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

from .memory import rss_bytes

console = Console(stderr=True, soft_wrap=True)  # long lines stay one line in logs


def enabled() -> bool:
    return os.environ.get("QUANTGATE_PROGRESS", "1") != "0" and sys.stderr.isatty()


class MemoryColumn(ProgressColumn):
    """This process's resident memory now: what a long export or eval holds while it runs."""

    def render(self, task) -> Text:
        return Text(f"RSS {rss_bytes() / 1e9:.1f} GB", style="progress.data.speed")


def make_progress(*extra_columns) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *extra_columns, TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console, disable=not enabled(), transient=False)


_ACTIVE: list[Progress] = []  # the display a bar inside another bar's loop joins (rich allows one live display)


def track(iterable, description: str, total: int | None = None, memory: bool = False):
    """rich's track on stderr; `memory` adds the resident-memory column (streaming exports, layer-wise runs). A bar
    started inside another's loop (the blocks of a layer-by-layer pass within an eval's batches) is a second line of
    the same display, removed when done."""
    if _ACTIVE:
        p = _ACTIVE[-1]
        task = p.add_task(description, total=total)
        try:
            yield from p.track(iterable, task_id=task, total=total)
        finally:
            p.remove_task(task)
        return
    with make_progress(*((MemoryColumn(),) if memory else ())) as p:
        _ACTIVE.append(p)
        try:
            yield from p.track(iterable, description=description, total=total)
        finally:
            _ACTIVE.pop()
