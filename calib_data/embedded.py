"""The embedded default corpus: the running interpreter's own standard-library sources.

It exists offline on every machine that runs Python, so `quantgate demo` needs no download. Files are
read in sorted order; test suites, site-packages and IDLE are left out (they are mostly fixtures).
The text differs between Python versions, so every corpus records a fingerprint (sha256 over relative
paths and contents) that reports and caches carry.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from .documents import Document

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                 "idlelib", "lib2to3", "turtledemo", "ensurepip", "config-3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: int | None = None) -> list[Document]:
    """Every stdlib .py file (one document each), sorted by relative path."""
    root = stdlib_root()
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are Latin-1 test fixtures; skipping keeps the set stable
        if not text.strip():
            continue
        docs.append(Document(name=f"stdlib/{rel.as_posix()}", text=text))
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return docs
