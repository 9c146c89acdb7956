"""How much memory quantgate holds: now (RSS) and at its peak, this process and its children (llama.cpp's worker).

The long verbs print their peak when they end and show the current RSS in their progress bar, so a user sizing a
laptop for a 9B model sees what an export or an eval needs. Linux reads /proc; elsewhere `resource` alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
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


_CHILD_PEAKS: list[int] = []  # peaks the children reported themselves (llama.cpp's worker and quantizer)


def note_child_peak(n_bytes: int) -> None:
    """A child process's own peak RSS (its VmHWM, sent before it exits)."""
    _CHILD_PEAKS.append(int(n_bytes))


def own_peak_bytes() -> int | None:
    """This process's own peak RSS on Linux (VmHWM, of this address space only), else None."""
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def peak_rss_bytes() -> dict[str, int]:
    """{"quantgate": this process's peak RSS, "children": the largest peak of a child that has ended}.

    On Linux both come from each process's VmHWM, not getrusage's ru_maxrss: a child started by fork (or vfork) and
    exec keeps its parent's high-water mark in ru_maxrss, so a 0.5 GB llama.cpp worker spawned by a 6 GB process
    reads 6 GB there, and so does a process whose parent was large when it started it."""
    own = own_peak_bytes()
    children = max(_CHILD_PEAKS) if _CHILD_PEAKS else _maxrss_bytes(resource.RUSAGE_CHILDREN)
    return {"quantgate": own if own is not None else _maxrss_bytes(resource.RUSAGE_SELF), "children": children}


def peak_line() -> str:
    """One line for the end of a long verb."""
    p = peak_rss_bytes()
    child = f"; largest child process {p['children'] / 1e9:.2f} GB" if p["children"] > 0 else ""
    return f"peak memory: {p['quantgate'] / 1e9:.2f} GB (resident, this process){child}"


@functools.lru_cache(maxsize=1)
def _libc_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed() -> None:
    """Hand memory freed inside the process back to the OS (glibc's malloc_trim; nothing elsewhere).

    A layer-by-layer run frees one block's fp32 weights (768 tensors of 4 MB in a Qwen3.5-MoE layer) and allocates
    the next block's: glibc keeps the freed chunks in its heaps, and measured on a bf16 MoE checkpoint, the resident
    memory grew by 0.3 GB per layer without this call and stayed flat with it (13-21 GB at the 35B-A3B shape's 8
    layers before, benchmarks/results/logs/scale_moe_first_run.json)."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
