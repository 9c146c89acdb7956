"""How much memory quantgate holds: now (RSS) and at its peak, this process and its children (llama.cpp's worker).

The long verbs print their peak when they end and show the current RSS in their progress bar, so a user sizing a
laptop for a 9B model sees what an export or an eval needs. Linux reads /proc; elsewhere `resource` alone.
"""
from __future__ import annotations

import resource
import sys
from pathlib import Path


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maxrss_bytes(who: int) -> int:
    r = resource.getrusage(who).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def rss_bytes() -> int:
    """Resident memory of this process now."""
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else _maxrss_bytes(resource.RUSAGE_SELF)


def peak_rss_bytes() -> dict[str, int]:
    """{"quantgate": this process's peak RSS, "children": the largest peak of a child that has ended}."""
    return {"quantgate": _maxrss_bytes(resource.RUSAGE_SELF), "children": _maxrss_bytes(resource.RUSAGE_CHILDREN)}


def peak_line() -> str:
    """One line for the end of a long verb."""
    p = peak_rss_bytes()
    child = f"; largest child process {p['children'] / 1e9:.2f} GB" if p["children"] > 0 else ""
    return f"peak memory: {p['quantgate'] / 1e9:.2f} GB (resident, this process){child}"
