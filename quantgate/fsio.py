"""Outputs that never destroy what quantgate did not write, and writes that are never left half-done.

Every command that writes passes its output and all of its inputs through `check_output` before any work:
an output that is, contains or lies inside an input is refused (symlinks resolved, hard links compared),
and an existing output is only replaced when it is quantgate's own artifact of the same kind. Folders
quantgate writes carry a `quantgate.json` marker naming their kind (and, for artifacts written whole, the
files they hold); GGUF files carry a `quantgate.version` key; JSON outputs a `quantgate_artifact` field.

Files and folders are written under a temporary name beside their destination and renamed into place only
once complete (rename is atomic on one filesystem). The only things ever removed are those temporary
paths, folders this module created for an output that then failed, and an artifact of quantgate's own
that a new one of the same kind replaces. Signals arriving while a commit or a cleanup runs are held
until it has finished, so a second Ctrl-C cannot leave debris.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Iterator

from . import __version__
from .errors import DiskFull, QuantgateError

MARKER = "quantgate.json"

KINDS = {  # kind -> what a user calls it
    "checkpoint": "a model directory", "onnx": "an ONNX export", "run": "a training run",
    "report": "a report folder", "demo": "a demo folder", "plots": "a plots folder", "seeds": "a multi-seed training run",
    "gguf": "a GGUF file", "analysis": "an analysis JSON file", "attribution": "an attribution JSON file",
    "allocation": "an allocation JSON file",
}
FILE_KINDS = ("gguf", "analysis", "attribution", "allocation")
# Folders written piece by piece (resumable): quantgate writes into them and never replaces them whole.
CONTAINERS = ("run", "report", "demo", "plots", "seeds")
# What quantgate writes, by name, inside its own piece-by-piece folders: those entries are its own to replace
# whatever they hold (a folder from before the markers, say); anything else in there stays the user's.
CONTAINER_ENTRIES = {
    "demo": {"state", "baseline", "gated", "analysis.json", "plots", "report", "summary.json"},
    "report": {"cells", "artifacts", "plots", "report.json", "report.md", "report.html"},
    "run": {"state", "baseline", "gated"},
}
PLOT_FILES = {"max_activation.png", "bos_attention.png", "gate_histograms.png", "kld_vs_bits.png",
              "sqnr_vs_infnorm.png"}
# What an artifact folder written whole holds, for folders written before the marker listed its files.
DEFAULT_FILES = {
    "checkpoint": {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", MARKER},
    "onnx": {"model.onnx", "model.onnx.data", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", MARKER},
}


MAX_JSON_BYTES = 1 << 28  # a config, tokenizer or index file: Qwen3.5's tokenizer.json is 12 MB


def read_bounded(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. A device, pipe or socket (/dev/zero, a FIFO: reads
    that never end or never return) and an oversize file get one error line before anything is read."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise QuantgateError(f"{path} is not a regular file (a device, pipe or socket); quantgate reads files")
        if st.st_size > limit:
            raise QuantgateError(f"{path} is {st.st_size / 2**20:.0f} MiB, more than the {limit / 2**20:.0f} MiB "
                                 f"quantgate reads from such a file")
        with open(path, "rb") as f:
            raw = f.read(limit + 1)  # bounded even if the file grows while it is read
    except OSError as e:
        raise QuantgateError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) > limit:
        raise QuantgateError(f"{path} grew past {limit / 2**20:.0f} MiB while it was read")
    return raw


def read_json(path: Path | str, limit: int = MAX_JSON_BYTES):
    """Parse a JSON file a user handed us: one error line for an unreadable, oversize, non-regular, non-UTF-8,
    malformed or absurdly nested file (json raises ValueError or RecursionError for those)."""
    raw = read_bounded(path, limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise QuantgateError(f"{path}: not valid JSON ({str(e)[:80]})") from None


# --- what is ours ---------------------------------------------------------------------------------------

def read_marker(folder: Path) -> dict | None:
    """The folder's quantgate marker ({'artifact': kind, ...}), or None when quantgate did not write it.

    Folders from before the marker existed are recognised by what only quantgate writes there."""
    folder = Path(folder)
    f = folder / MARKER
    if f.is_file():
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        if isinstance(d, dict) and d.get("artifact") in KINDS:
            return d
        if isinstance(d, dict) and d.get("format") == "onnx":  # an ONNX export's metadata, before the marker
            return {"artifact": "onnx"}
        return None
    try:
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    except (OSError, ValueError, RecursionError):
        cfg = None
    if isinstance(cfg, dict) and isinstance(cfg.get("quantgate"), dict) and any(folder.glob("*.safetensors")):
        return {"artifact": "checkpoint"}
    if (folder / "summary.json").is_file() and (folder / "state" / "run.json").is_file():
        return {"artifact": "demo"}
    if (folder / "state" / "run.json").is_file():
        return {"artifact": "run"}
    if (folder / "cells").is_dir() and (folder / "report.json").is_file():
        return {"artifact": "report"}
    return None  # a folder of PNGs named like quantgate's plots is not proof: only a marker makes a plots folder


def _own_file(path: Path, kind: str) -> bool:
    """Is the existing file at `path` quantgate's own artifact of `kind`?"""
    if kind == "gguf":
        try:
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    return False
            from gguf import GGUFReader
            return GGUFReader(str(path), "r").get_field("quantgate.version") is not None
        except Exception:  # a parser of whatever the file holds: any failure means it is not ours
            return False
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(64 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("quantgate_artifact") == kind


# --- proof that quantgate wrote a file: the content hashes it recorded --------------------------------------
#
# A marker's name list alone proves nothing (a user may have put a file of that name there, or edited one). Each
# artifact written whole records the sha256 of every file it holds in its own marker; each file committed inside
# a container (run, report, demo, plots, seeds) is recorded in the nearest container's marker. A path is replaced
# or removed only when every file in it is recorded there with the content it has now.

HASHES = "sha256"  # the marker's {relative path: hex digest} table


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _container_of(path: Path) -> Path | None:
    """The nearest folder above `path` marked as a container (run, report, demo, plots, seeds), or None."""
    for folder in Path(os.path.abspath(path)).parents:
        f = folder / MARKER
        if f.is_file():
            mark = read_marker(folder)
            return folder if mark and mark["artifact"] in CONTAINERS else None
    return None


def _recorded(container: Path) -> dict:
    d = read_marker(container) or {}
    return d.get(HASHES) if isinstance(d.get(HASHES), dict) else {}


def _unproven(path: Path, table: dict, root: Path) -> str | None:
    """The first file under `path` (itself, or inside a folder) whose content is not what `table` (paths relative
    to `root`) recorded, or that is not a plain file or folder; None when all of them are."""
    if os.path.islink(path):
        return str(path.relative_to(root))
    if path.is_dir():
        for p in sorted(path.iterdir()):
            if p.name == MARKER and p.parent == root:
                continue
            bad = _unproven(p, table, root)
            if bad:
                return bad
        return None
    rel = path.relative_to(root).as_posix()
    if not path.is_file() or rel not in table or sha256_file(path) != table[rel]:
        return rel
    return None


def proven_ours(path: Path) -> str | None:
    """None when quantgate provably wrote everything at `path` (a file or folder inside one of its containers, or an
    artifact folder with its own recorded hashes); else what is not proven, as a reason."""
    path = Path(os.path.abspath(path))  # containers are found as absolute paths: a relative --out must compare too
    if os.path.islink(path):
        return f"{path} is a symbolic link, which quantgate does not write"
    own = read_marker(path) if path.is_dir() and (path / MARKER).is_file() else None
    if own and own["artifact"] not in CONTAINERS:
        table = own.get(HASHES) if isinstance(own.get(HASHES), dict) else {}
        bad = _unproven(path, table, path)
        return None if bad is None else f"{path / bad} is not what quantgate wrote there"
    container = _container_of(path)
    if container is None:
        return f"{path} lies in no folder quantgate marked as its own"
    bad = _unproven(path, _recorded(container), container)
    return None if bad is None else f"{container / bad} is not a file quantgate wrote (or it changed since)"


def _record(path: Path, digest: str | None = None) -> None:
    """Record the file just committed at `path` in its container's marker (nothing outside a container)."""
    if path.name == MARKER:
        return
    container = _container_of(path)
    if container is None:
        return
    rel = Path(os.path.abspath(path)).relative_to(container)
    if any(part.startswith(".") and part.endswith(".tmp") for part in rel.parts):
        return  # inside a folder still being written (atomic_dir): its own marker will hold the hashes
    f = container / MARKER
    d = json.loads(f.read_text())
    table = d.get(HASHES) if isinstance(d.get(HASHES), dict) else {}
    table[rel.as_posix()] = digest or sha256_file(path)
    d[HASHES] = table
    tmp = f.with_name(f".{MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d, indent=2) + "\n")
    os.replace(tmp, f)


def _why_not_replaceable(path: Path, kind: str, accept: tuple = ()) -> str | None:
    """None when writing `kind` at the existing `path` destroys nothing quantgate did not write; else why not."""
    kinds = (kind, *accept)
    if os.path.islink(path) and kind not in CONTAINERS:  # a container is written into through a link, not replaced
        return "is a symbolic link; quantgate never replaces a link (pass the path it points to, or another path)"
    if kind in (*FILE_KINDS, "plots") and _container_of(path) is not None and proven_ours(path) is None:
        return None  # a file or plots folder quantgate wrote, with the content it wrote, inside a folder of its own
    if kind in FILE_KINDS:
        if path.is_dir():
            return "is a folder; it must be a file path"
        if not _own_file(path, kind):
            return (f"exists and is not {KINDS[kind]} that quantgate wrote; choose another path "
                    f"(quantgate never replaces a file it did not write)")
        return None
    if not path.is_dir():
        return "is a file; it must be a folder"
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    mark = read_marker(path)
    if mark is None:
        return (f"is a folder quantgate did not write ({len(entries)} entries, no {MARKER}); choose a new or "
                f"empty folder (quantgate never replaces a folder it did not write)")
    if mark["artifact"] not in kinds:
        return f"holds {KINDS[mark['artifact']]}, not {KINDS[kind]}; choose another path"
    if kind not in CONTAINERS:
        allowed = set(mark.get("files") or DEFAULT_FILES.get(kind, ())) | {MARKER}
        foreign = [e for e in entries if e not in allowed]
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            return (f"holds {foreign[0]!r}{more}, which quantgate did not write; move it away or choose another "
                    f"path (replacing the folder would delete it)")
        if not isinstance(mark.get(HASHES), dict):
            return (f"carries a {MARKER} without the content hashes quantgate records for what it writes, so nothing "
                    f"proves quantgate wrote its files; remove it yourself or choose another path")
        bad = _unproven(path, mark[HASHES], path)
        if bad:
            return (f"holds {bad!r}, which is not what quantgate wrote there (changed or replaced since); move it "
                    f"away or choose another path (replacing the folder would delete it)")
    return None


# --- the one check ----------------------------------------------------------------------------------------

def _resolve(p: Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(p))))


def check_not_input(out: Path | str, inputs: Iterable, flag: str = "--out") -> None:
    """Refuse an output that is, contains, or lies inside one of `inputs` (symlinks resolved, hard links
    compared). Inputs that are not paths on disk (e.g. 'embedded') have nothing to protect."""
    o = _resolve(Path(out))
    for i in inputs:
        if i is None or not os.path.lexists(os.path.expanduser(str(i))):
            continue
        ip = _resolve(Path(i))
        same = o == ip
        if not same and o.exists():
            with contextlib.suppress(OSError):
                same = os.path.samefile(o, ip)
        how = ("is the input" if same else "lies inside the input" if ip in o.parents
               else "contains the input" if o in ip.parents else None)
        if how:
            raise QuantgateError(f"{flag} {out} {how} {i}; quantgate never writes over its inputs, choose another path")


def _check_creatable(path: Path, flag: str) -> None:
    """The nearest existing ancestor must be a writable folder (checked before work; creates nothing)."""
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise QuantgateError(f"{flag} {path} lies under {probe}, which is a file; it must be a folder")
    if not os.access(probe, os.W_OK):
        raise QuantgateError(f"{flag} {path}: {probe} is not writable")


def check_output(out: Path | str, kind: str, inputs: Iterable = (), flag: str = "--out",
                 accept: tuple = ()) -> None:
    """The one check every writing command passes its output through, before any work.

    Refuses an output that overlaps an input; an existing output must be quantgate's own artifact of `kind`
    (or of one of `accept`): a folder marked by quantgate.json that holds nothing else, a GGUF carrying
    `quantgate.version`, a JSON file carrying `quantgate_artifact`. An empty folder is fine. Creates nothing."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    out = Path(out)
    check_not_input(out, inputs, flag)
    if os.path.lexists(out):
        if not out.exists():
            raise QuantgateError(f"{flag} {out} is a broken symbolic link; remove it or choose another path")
        if os.path.islink(out) and kind not in CONTAINERS:  # a container is written into, a link to it is fine
            raise QuantgateError(f"{flag} {out} is a symbolic link; quantgate never replaces a link with what it "
                                 f"writes (pass the path it points to, or another path)")
        why = _why_not_replaceable(out, kind, accept)
        if why:
            raise QuantgateError(f"{flag} {out} {why}")
    else:
        _check_creatable(out, flag)


def check_output_dir(path: Path | str, flag: str = "--out") -> None:
    """Only that `path` could become a folder (a file is not in the way, the parent is writable)."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise QuantgateError(f"{flag} {path} is a file; it must be a folder")
    _check_creatable(path, flag)


# --- signals held during commits and cleanups ---------------------------------------------------------------

# Signals the CLI received (its handlers append here). A library may catch the KeyboardInterrupt a handler
# raised and carry on; the atomic writers check this list before committing, so an interrupted command still
# leaves nothing behind.
interrupts: list[int] = []


def _refuse_if_interrupted() -> None:
    if interrupts:
        raise KeyboardInterrupt()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while a rename sequence or a cleanup runs, then deliver them: a second Ctrl-C
    cannot interrupt the removal of a temporary folder half-way. Only the main thread sets handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in got[:1]:
            h = old[s]
            if callable(h):
                h(s, None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), s)


# --- folders created for an output -----------------------------------------------------------------------

def _make_parents(path: Path) -> list[Path]:
    """Create the missing folders above `path`; returns those created (outermost first)."""
    missing = []
    p = path.parent if str(path.parent) else Path(".")
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            _remove_created(created)
            raise QuantgateError(f"cannot create {d}: {e.strerror}") from None
        created.append(d)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        _remove_created(created)
        raise QuantgateError(f"cannot write {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        _remove_created(created)
        raise QuantgateError(f"output folder {parent} is not writable")
    return created


def _remove_created(created: list[Path]) -> None:
    """Remove folders `_make_parents` created, innermost first, and only while they are empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def claim_folder(path: Path | str, kind: str) -> Path:
    """Create `path` as a quantgate folder of `kind` (a container: run, report, demo, plots) and mark it.

    Call it right before the first write, after every check, so that a refused run creates nothing."""
    path = Path(path)
    _make_parents(path / MARKER)
    mark = path / MARKER
    if not mark.is_file() or (read_marker(path) or {}).get("artifact") != kind:
        with atomic_file(mark, "w") as f:
            json.dump({"artifact": kind, "quantgate_version": __version__}, f, indent=2)
            f.write("\n")
    return path


# --- atomic writers ---------------------------------------------------------------------------------------

FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


# How libraries report a write that the disk refused, when they do not pass the OSError on.
WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed|file write failed|iostream error")


def _disk_is_full(path: Path) -> bool:
    with contextlib.suppress(OSError):
        st = os.statvfs(path.parent if str(path.parent) else ".")
        return st.f_bavail * st.f_frsize < (1 << 20)
    return False


def _as_user_error(e: BaseException, path: Path) -> BaseException:
    """A full disk (or a file-size limit) while writing is the user's environment, not a bug: one line."""
    if isinstance(e, DiskFull):
        return e
    short_write = isinstance(e, OSError) and e.errno is None and "written" in str(e)  # numpy's tofile
    rust = re.search(r"os error (\d+)", str(e)) if type(e).__name__ == "SafetensorError" else None
    if (isinstance(e, OSError) and (e.errno in FULL or short_write)) or (rust and int(rust.group(1)) in FULL):
        why = getattr(e, "strerror", None) or ("short write" if short_write else os.strerror(int(rust.group(1))))
        return DiskFull(f"cannot write {path}: {why} (disk full or file size limit); nothing was kept")
    if isinstance(e, Exception) and not isinstance(e, QuantgateError) and (
            WRITE_FAILED.search(str(e)) or _disk_is_full(path)):
        return DiskFull(f"cannot write {path}: the write failed (disk full or file size limit); nothing was kept")
    return e


def _reraise(e: BaseException, path: Path):
    """After cleaning up: raise `e` itself, or its one-line user error (a full disk)."""
    err = _as_user_error(e, path)
    if err is e:
        raise e
    raise err from None


def _mkstemp(path: Path, parent: Path) -> tuple[int, str]:
    try:
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise QuantgateError(f"cannot write into {parent}: {e.strerror}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode(is_dir: bool) -> int:
    """mkstemp/mkdtemp create private (0600/0700) entries; finished outputs get the usual umask mode."""
    return (0o777 if is_dir else 0o666) & ~_umask()


def _pause_before_commit(path: Path) -> None:
    """Test hook: QUANTGATE_TEST_PAUSE_BEFORE_COMMIT=SECONDS:GLOB makes a finished write whose name matches GLOB
    wait before its rename, so the signal tests can interrupt a command that is provably mid-write (never set
    in normal use)."""
    s = os.environ.get("QUANTGATE_TEST_PAUSE_BEFORE_COMMIT")
    if s:
        import fnmatch
        import time
        seconds, _, pattern = s.partition(":")
        if fnmatch.fnmatch(path.name, pattern or "*"):
            time.sleep(float(seconds))


@contextlib.contextmanager
def atomic_path(path: Path | str, kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path` for writers that open files themselves (gguf-py, llama.cpp,
    onnx); it is renamed to `path` on success and removed on failure. With `kind`, an existing `path` is
    replaced only if it is quantgate's own file of that kind (see check_output)."""
    path = Path(path)
    created = _make_parents(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = _mkstemp(path, parent)
    except BaseException:
        _remove_created(created)
        raise
    os.close(fd)
    try:
        yield Path(tmp)
        _refuse_if_interrupted()
        _pause_before_commit(path)
        _refuse_if_interrupted()
        digest = sha256_file(Path(tmp)) if _container_of(path) is not None else None
        with signals_held():
            if os.path.lexists(path):
                why = _why_not_replaceable(path, kind) if kind is not None else _replace_inside(path)
                if why:
                    raise QuantgateError(f"{path} {why}")
            os.chmod(tmp, _default_mode(False))
            os.replace(tmp, path)
            if digest:
                _record(path, digest)
    except BaseException as e:
        with signals_held():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            _remove_created(created)
        _reraise(e, path)


def _replace_inside(path: Path) -> str | None:
    """Why a file without a kind of its own (a report page, a training state) may not be replaced: inside a
    container it must be one quantgate recorded, unchanged; a symbolic link never is. Elsewhere (quantgate's own
    cache) the caller owns the name."""
    if os.path.islink(path):
        return "is a symbolic link; quantgate never replaces a link"
    if _container_of(path) is None:
        return None
    why = proven_ours(path)
    return None if why is None else f"exists and is not a file quantgate wrote ({why}); move it away"


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "wb", kind: str | None = None) -> Iterator:
    """An open file whose contents reach `path` only once written and synced (see atomic_path)."""
    with atomic_path(path, kind) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def _write_marker(folder: Path, kind: str) -> None:
    """Mark a finished artifact folder: its kind and every file it holds (merged into a quantgate.json the
    writer wrote itself, e.g. an ONNX export's metadata)."""
    f = folder / MARKER
    meta = json.loads(f.read_text()) if f.is_file() else {"quantgate_version": __version__}
    meta["artifact"] = kind
    meta["files"] = sorted({p.name for p in folder.iterdir()} | {MARKER})
    meta[HASHES] = {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
                    if p.is_file() and p != f}
    f.write_text(json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def atomic_dir(path: Path | str, kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path`. With `kind` (an artifact written whole:
    checkpoint, onnx) the folder is marked, and an existing `path` is replaced only when it is quantgate's
    own artifact of that kind holding nothing else (see check_output); the old one is removed last."""
    path = Path(path)
    created = _make_parents(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        _remove_created(created)
        raise QuantgateError(f"cannot write into {parent}: {e.strerror}") from None
    old = None
    try:
        yield tmp
        if kind is not None:
            _write_marker(tmp, kind)
        _refuse_if_interrupted()
        _pause_before_commit(path)
        _refuse_if_interrupted()
        with signals_held():
            os.chmod(tmp, _default_mode(True))
            if os.path.lexists(path):
                why = _why_not_replaceable(path, kind) if kind is not None else _replace_inside(path)
                if why:
                    raise QuantgateError(f"{path} {why}")
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=parent))
                os.replace(path, old / "x")
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
    except BaseException as e:
        with signals_held():
            if old is not None and (old / "x").exists() and not os.path.lexists(path):
                os.replace(old / "x", path)  # put the old artifact back
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_created(created)
        _reraise(e, path)


@contextlib.contextmanager
def staged_into(folder: Path | str, kind: str) -> Iterator[Path]:
    """Files written into a temporary folder beside `folder`, moved into it (a quantgate container of `kind`, created
    and marked when new) only once every one is written: a failure (a full disk half way through a set of plots)
    leaves `folder` as it was, and removes it when this call created it."""
    folder = Path(folder)
    created = _make_parents(folder)
    parent = folder.parent if str(folder.parent) else Path(".")
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        _remove_created(created)
        raise QuantgateError(f"cannot write into {parent}: {e.strerror}") from None
    new = not os.path.lexists(folder)
    try:
        yield stage
        _refuse_if_interrupted()
        claim_folder(folder, kind)
        with signals_held():
            for f in sorted(stage.iterdir()):
                os.replace(f, folder / f.name)
                _record(folder / f.name)
    except BaseException as e:
        with signals_held():
            shutil.rmtree(stage, ignore_errors=True)
            if new:
                shutil.rmtree(folder, ignore_errors=True)  # created by this call: nothing of it is kept
            _remove_created(created)
        _reraise(e, folder)
    shutil.rmtree(stage, ignore_errors=True)


def strict_json(obj):
    """`obj` with every non-finite float (NaN, +-Inf: a kurtosis of a constant input, a ratio over zero) as None, so
    the JSON written is strict (Python writes a bare NaN, which other parsers reject)."""
    if isinstance(obj, float) or (hasattr(obj, "dtype") and getattr(obj, "ndim", None) == 0
                                  and getattr(obj.dtype, "kind", "") == "f"):
        return float(obj) if math.isfinite(float(obj)) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def write_json(path: Path | str, obj, kind: str | None = None) -> None:
    """Write strict JSON (strict_json) atomically. With `kind` (an output a user names: analysis, attribution) the
    object carries `quantgate_artifact` so a later run knows the file is quantgate's to replace."""
    if kind is not None:
        obj = {"quantgate_artifact": kind, **obj}
    with atomic_file(path, "w", kind=kind) as f:
        json.dump(strict_json(obj), f, indent=2, allow_nan=False)
        f.write("\n")
