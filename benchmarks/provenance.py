"""Where a benchmark result came from: commit, whether the tree was dirty, the command, the machine and the date.

Every result JSON of the newer benchmarks carries `provenance(...)` under "provenance", taken when the run starts
(the code that runs is the code at the start, whatever is committed while it goes).
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    return r.stdout.strip() if r.returncode == 0 else ""


def provenance(argv: list[str] | None = None) -> dict:
    """{commit, dirty, command, machine, date}: `argv` (default sys.argv) as the command, relative to the repo."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": _git("rev-parse", "--short", "HEAD") or None, "dirty": dirty,
            "command": " ".join(["python", str(script), *argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)},
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
