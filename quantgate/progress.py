"""Progress of long work on stderr (JSON on stdout stays clean): rich's bars on a terminal, and plain lines when
stderr is a file or a pipe (a log: `quantgate demo > log 2>&1`), at least one every PLAIN_EVERY seconds while any
bar is active: each active bar's stage, done/total, its fields (loss, tok/s), rate and time left.
QUANTGATE_PROGRESS=0 turns both off (the tests and CI)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

from .memory import rss_bytes

console = Console(stderr=True, soft_wrap=True)  # long lines stay one line in logs


PLAIN_EVERY = 20.0  # seconds between plain progress lines in a log (at most 30 asked); QUANTGATE_PROGRESS_EVERY


def plain_every() -> float:
    try:
        return max(0.05, float(os.environ.get("QUANTGATE_PROGRESS_EVERY", PLAIN_EVERY)))
    except ValueError:
        return PLAIN_EVERY


def wanted() -> bool:
    return os.environ.get("QUANTGATE_PROGRESS", "1") != "0"


def enabled() -> bool:
    """Live bars: progress wanted and stderr a terminal."""
    return wanted() and sys.stderr.isatty()


def plain() -> bool:
    """Plain lines: progress wanted and stderr not a terminal."""
    return wanted() and not sys.stderr.isatty()


def _duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def task_line(task) -> str:
    """One rich task as a plain line: stage, done/total, its text fields, rate, elapsed and time left."""
    if task.total is None and not task.completed:  # a stage: its name and time
        return f"{task.description}: {_duration(task.elapsed)} elapsed"
    done = f"{task.completed:,.0f}/{task.total:,.0f}" if task.total else f"{task.completed:,.0f}"
    fields = "".join(f", {v} tok/s" if k == "tps" else f", {k} {v}" for k, v in task.fields.items()
                     if isinstance(v, str) and v not in ("", "-"))
    rate = f", {task.speed:.3g}/s" if task.speed else ""
    left = f", {_duration(task.time_remaining)} left" if task.total and task.speed else ""
    return f"{task.description}: {done}{fields}{rate}, {_duration(task.elapsed)} elapsed{left}"


class _PlainReporter:
    """A daemon thread that prints the active bars as one plain line whenever PLAIN_EVERY seconds have passed since
    its last line (or the start), so short work prints nothing; the bars' own progress objects hold the numbers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active: list[Progress] = []
        self.thread: threading.Thread | None = None
        self.last = time.monotonic()

    def add(self, progress: Progress) -> None:
        with self.lock:  # `last` stays the time of the last line: a bar that starts after a silence speaks soon
            self.active.append(progress)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="quantgate-progress", daemon=True)
                self.thread.start()

    def remove(self, progress: Progress) -> None:
        with self.lock:
            if progress in self.active:
                self.active.remove(progress)

    def line(self) -> str | None:
        """The active bars' line; a verb's own heartbeat (see `verb`) speaks only while no other bar does."""
        with self.lock:
            tasks = [(p, t) for p in self.active for t in p.tasks if not t.finished or t.total is None]
        inner = [t for p, t in tasks if not isinstance(p, _VerbHeartbeat)]
        return " | ".join(task_line(t) for t in inner or [t for _p, t in tasks]) or None

    def _run(self) -> None:
        while True:  # the interval read each time: the thread outlives the verb that started it (one per process)
            every = plain_every()
            time.sleep(min(1.0, every / 4))
            if time.monotonic() - self.last < every:
                continue
            line = self.line()
            if line:
                console.print(line, markup=False, highlight=False)
                self.last = time.monotonic()


_PLAIN = _PlainReporter()


class PlainProgress(Progress):
    """rich's Progress with its live display off, whose tasks the plain reporter prints while it is started."""

    def start(self) -> None:
        super().start()
        _PLAIN.add(self)

    def stop(self) -> None:
        _PLAIN.remove(self)
        super().stop()


class _VerbHeartbeat(PlainProgress):
    """The plain reporter's fallback for a whole verb (see `verb`)."""


@contextlib.contextmanager
def verb(name: str):
    """A long verb's heartbeat in a log: while it runs, a plain line at least every PLAIN_EVERY seconds even where
    the step in progress has no bar of its own (llama.cpp's quantizer, a checkpoint being read, a plot being drawn):
    `quantize: 1m20s elapsed`. Any other active bar's line takes its place. Off on a terminal, where the steps'
    own bars show, and with QUANTGATE_PROGRESS=0."""
    if not plain():
        yield
        return
    p = _VerbHeartbeat(TextColumn("{task.description}"), console=console, disable=True)
    p.add_task(name, total=None)
    p.start()
    try:
        yield
    finally:
        p.stop()


class MemoryColumn(ProgressColumn):
    """This process's resident memory now: what a long export or eval holds while it runs."""

    def render(self, task) -> Text:
        return Text(f"RSS {rss_bytes() / 1e9:.1f} GB", style="progress.data.speed")


def make_progress(*extra_columns) -> Progress:
    cls = PlainProgress if plain() else Progress
    return cls(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               *extra_columns, TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
               console=console, disable=not enabled(), transient=False)


_ACTIVE: list[Progress] = []  # the display a bar inside another bar's loop joins (rich allows one live display)


def track(iterable, description: str, total: int | None = None, memory: bool = False):
    """A bar over `iterable` on stderr (plain lines in a log); `memory` adds the resident-memory column (streaming
    exports, layer-wise runs). A bar started inside another's loop (the blocks of a layer-by-layer pass within an
    eval's batches) is a second line of the same display, removed when done."""
    if _ACTIVE:
        p = _ACTIVE[-1]
        task = p.add_task(description, total=total)
        try:
            yield from _advancing(p, task, iterable)
        finally:
            p.remove_task(task)
        return
    with make_progress(*((MemoryColumn(),) if memory else ())) as p:
        _ACTIVE.append(p)
        try:
            yield from _advancing(p, p.add_task(description, total=total), iterable)
        finally:
            _ACTIVE.pop()


@contextlib.contextmanager
def stage(description: str):
    """A step with no count of its own (one report cell: an export, a quantization, its scoring), shown as a bar
    without a total; in a log its line names the step and the time it has taken, so a long step is never silent."""
    if _ACTIVE:
        p = _ACTIVE[-1]
        task = p.add_task(description, total=None)
        try:
            yield
        finally:
            p.remove_task(task)
        return
    with make_progress() as p:
        _ACTIVE.append(p)
        task = p.add_task(description, total=None)
        try:
            yield
        finally:
            p.remove_task(task)
            _ACTIVE.pop()


def _advancing(p: Progress, task, iterable):
    """Each item counted as done when the next is asked for (rich's own track counts from a thread that stops when
    the live display is off, as it is for plain lines)."""
    for item in iterable:
        yield item
        p.advance(task, 1)
