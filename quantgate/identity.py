"""What produced a cached result: the content of its inputs and the code that computed it.

Caches (report cells and artifacts, reference logits) are keyed by these, never by paths, modification
times or the package's constant version string: an edited model, an edited text file or a changed line of
quantgate recomputes; an unchanged one is reused.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from .calib_data import load_corpus

CHUNK = 1 << 20


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int, ino: int) -> str:
    """sha256 of a file's bytes (memoised per process on its stat, which only saves re-reading it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def content_id(path: str | Path) -> str:
    """Identity of a file's or a folder's contents: sha256 over relative names and file bytes (folders
    recursively, quantgate's temporary entries skipped)."""
    p = Path(path)
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()
                                            and not any(part.startswith(".") for part in q.relative_to(p).parts))
    for f in files:
        st = f.stat()
        rel = "" if f == p else f.relative_to(p).as_posix()
        h.update(f"{rel}\0{_file_digest(str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)}\0".encode())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def code_id() -> str:
    """Identity of the code that computes results: every source file of the installed quantgate package
    (library, exporters, text sources, CLI) and the versions of the libraries it drives."""
    import importlib
    import importlib.metadata as md

    h = hashlib.sha256()
    for d in importlib.import_module("quantgate").__path__:  # every subpackage lies under it once installed
        for f in sorted(Path(d).rglob("*.py")):
            h.update(f"{f.relative_to(d).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    versions = {}
    for dist in ("torch", "numpy", "onnx", "onnxruntime", "llama_cpp_python", "gguf", "tokenizers", "safetensors"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    h.update(json.dumps(versions, sort_keys=True).encode())
    return h.hexdigest()[:24]


def key(*parts) -> str:
    """A short stable hash of JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def data_id(spec: str) -> str:
    """Content fingerprint of a `--data` source (the corpus fingerprint: document names and texts)."""
    return load_corpus(spec).fingerprint
