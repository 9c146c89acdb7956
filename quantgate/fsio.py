"""Atomic writes: nothing half-written is left behind, and inputs are never overwritten.

Files and directories are written under a temporary name beside their destination and renamed
into place only once complete (rename is atomic on one filesystem).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import QuantgateError


def check_not_input(out: Path, *inputs: Path | str | None) -> None:
    """Refuse an output path that is (or lies inside) one of the inputs."""
    o = Path(out).resolve()
    for i in inputs:
        if i is None:
            continue
        ip = Path(i).resolve()
        if o == ip or ip in o.parents:
            raise QuantgateError(f"output {out} would overwrite the input {i}; choose another path")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode(is_dir: bool) -> int:
    """mkstemp/mkdtemp create private (0600/0700) entries; finished outputs get the usual umask mode."""
    return (0o777 if is_dir else 0o666) & ~_umask()


def _writable_parent(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantgateError(f"cannot create {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise QuantgateError(f"output folder {parent} is not writable")
    return parent


def check_output_dir(path: Path | str, flag: str = "--out") -> None:
    """Fail before any work when `path` cannot become a directory (a file is in the way, or its nearest
    existing folder is read-only); creates nothing, so a refused run leaves no empty folders behind."""
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"lies under {probe}, which is a file"
        raise QuantgateError(f"{flag} {path} {where}; it must be a directory")
    if not os.access(probe, os.W_OK):
        raise QuantgateError(f"{flag} {path}: {probe} is not writable")


FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _as_user_error(e: BaseException, path: Path) -> BaseException:
    """A full disk (or a file-size limit) while writing is the user's environment, not a bug: one line."""
    short_write = isinstance(e, OSError) and e.errno is None and "written" in str(e)  # numpy's tofile
    rust = re.search(r"os error (\d+)", str(e)) if type(e).__name__ == "SafetensorError" else None
    if (isinstance(e, OSError) and (e.errno in FULL or short_write)) or (rust and int(rust.group(1)) in FULL):
        why = getattr(e, "strerror", None) or ("short write" if short_write else os.strerror(int(rust.group(1))))
        return QuantgateError(f"cannot write {path}: {why} (disk full or file size limit); nothing was kept")
    return e


def _reraise(e: BaseException, path: Path):
    """After cleaning up: raise `e` itself, or its one-line user error (a full disk)."""
    err = _as_user_error(e, path)
    if err is e:
        raise e
    raise err from None


# Signals the CLI received (its handlers append here). A library may catch the KeyboardInterrupt a handler
# raised and carry on; the atomic writers check this list before committing, so an interrupted command still
# leaves nothing behind.
interrupts: list[int] = []


def _refuse_if_interrupted() -> None:
    if interrupts:
        raise KeyboardInterrupt()


def _mkstemp(path: Path, parent: Path) -> tuple[int, str]:
    try:
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise QuantgateError(f"cannot write into {parent}: {e.strerror}") from None


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path` for writers that open files themselves (gguf-py, llama.cpp,
    onnx); it is renamed to `path` on success and removed on failure."""
    path = Path(path)
    parent = _writable_parent(path)
    fd, tmp = _mkstemp(path, parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _refuse_if_interrupted()
        os.chmod(tmp, _default_mode(False))
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _reraise(e, path)


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "wb") -> Iterator:
    """An open file whose contents reach `path` only once written and synced (see atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path` (an old `path` is removed last)."""
    path = Path(path)
    parent = _writable_parent(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        raise QuantgateError(f"cannot write into {parent}: {e.strerror}") from None
    try:
        yield tmp
        _refuse_if_interrupted()
        os.chmod(tmp, _default_mode(True))
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _reraise(e, path)


def write_json(path: Path | str, obj) -> None:
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
