"""Text sources: the embedded default, synthetic corpora, files, folders, globs, WikiText-style files, local HF
datasets.

Every source becomes a Corpus of named documents. Nothing here touches the network: a HF `datasets`
source must be a folder written by `save_to_disk`.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.fsio import read_bounded

from .documents import Corpus, Document
from .embedded import stdlib_documents
from .synthetic import SYNTHETIC_NAMES, synthetic_documents

EMBEDDED_NAMES = ("embedded", "stdlib")
SYNTHETIC_PREFIX = "synthetic:"  # generated corpora (calib_data.synthetic): nothing on disk
CHUNK_CHARS = 4000  # plain text is cut into documents of about this size, at paragraph or line breaks
_WIKI_HEADING = re.compile(r"^ = [^=].* = $", re.M)


def load_corpus(spec: str | Path, max_chars: int | None = None) -> Corpus:
    """Resolve a user's `--data` value into a Corpus. `max_chars` caps the size (first documents kept)."""
    s = str(spec)
    if s in EMBEDDED_NAMES:
        docs = stdlib_documents(max_chars)
    elif s.startswith(SYNTHETIC_PREFIX):
        if s not in SYNTHETIC_NAMES:
            raise QuantgateError(f"unknown synthetic corpus {s}; choose from {', '.join(SYNTHETIC_NAMES)}")
        docs = synthetic_documents(s)
    elif any(ch in s for ch in "*?[") and not Path(s).exists():
        paths = sorted(Path(p) for p in glob.glob(s, recursive=True) if Path(p).is_file())
        if not paths:
            raise QuantgateError(f"no files match {s}")
        docs = [d for p in paths for d in file_documents(p)]
    else:
        path = Path(s)
        if not path.exists():
            raise QuantgateError(f"data path {s} does not exist")
        if path.is_dir() and _is_hf_dataset(path):
            docs = hf_dataset_documents(path)
        elif path.is_dir():
            paths = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
            if not paths:
                raise QuantgateError(f"folder {s} holds no files")
            docs = [d for p in paths for d in file_documents(p)]
        else:
            docs = file_documents(path)
    if max_chars is not None:
        docs = _cap(docs, max_chars)
    if not docs:
        raise QuantgateError(f"{s}: no text found")
    return Corpus(s, docs)


def data_paths(spec: str | Path | None) -> list[Path]:
    """The files and folders on disk that a `--data` value reads: the inputs an output must never overwrite."""
    if spec is None or str(spec) in EMBEDDED_NAMES or str(spec) in SYNTHETIC_NAMES:
        return []
    s = str(spec)
    if Path(s).exists():
        return [Path(s)]
    if any(ch in s for ch in "*?["):
        return sorted(Path(p) for p in glob.glob(s, recursive=True))
    return []


MAX_TEXT_BYTES = 1 << 30  # one text file held in memory as a str (and tokenized whole): 1 GiB is far past any corpus here


def read_text_file(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """Strict UTF-8 read of a regular file of at most `limit` bytes (fsio.read_bounded: no device or pipe), with
    one clear error line for binary, non-UTF-8 and empty files."""
    raw = read_bounded(path, limit)
    if b"\0" in raw[:1 << 20]:
        raise QuantgateError(f"{path} looks binary (NUL bytes), not text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantgateError(f"{path} is not UTF-8 text (bad byte at offset {e.start})") from None
    if not text.strip():
        raise QuantgateError(f"{path} is empty")
    return text


def file_documents(path: Path) -> list[Document]:
    return text_documents(str(path), read_text_file(path))


def text_documents(name: str, text: str) -> list[Document]:
    """WikiText-style text splits at its ` = Title = ` headings into articles (documents of their own); other
    text into ~4k-character pieces of one source, which are joined back whenever consecutive pieces are read
    together (so a whole file is tokenized as one text; the pieces only let a split take part of it)."""
    starts = [m.start() for m in _WIKI_HEADING.finditer(text)]
    if len(starts) >= 2:
        bounds = ([0] if starts[0] > 0 else []) + starts + [len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        return [Document(f"{name}#{i}", p) for i, p in enumerate(pieces) if p.strip()]
    return [Document(f"{name}#{i}", p, source=name, part=i) for i, p in enumerate(p for p in _chunk(text) if p)]


def _chunk(text: str) -> list[str]:
    """Cut at paragraph (else line) breaks into pieces of >= CHUNK_CHARS; joined they give back `text`."""
    sep = "\n\n" if "\n\n" in text else "\n"
    parts = text.split(sep)
    pieces, cur, size = [], [], 0
    for i, part in enumerate(parts):
        cur.append(part)
        size += len(part) + len(sep)
        if size >= CHUNK_CHARS and i < len(parts) - 1:
            pieces.append(sep.join(cur) + sep)
            cur, size = [], 0
    pieces.append(sep.join(cur))
    return pieces


def _cap(docs: list[Document], max_chars: int) -> list[Document]:
    out, total = [], 0
    for d in docs:
        if total >= max_chars:
            break
        out.append(d)
        total += len(d.text)
    return out


def _hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


def _is_hf_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file()


def hf_dataset_documents(path: Path, column: str = "text") -> list[Document]:
    """Rows of a `save_to_disk` folder (Dataset or DatasetDict), joined per split and cut as text."""
    try:
        import datasets
    except ImportError:
        raise QuantgateError("reading a HF datasets folder needs the `datasets` package: "
                             "pip install 'quantgate[datasets]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for a broken folder
        raise QuantgateError(f"{path}: not a readable HF datasets folder ({type(e).__name__})") from None
    parts = ds.items() if isinstance(ds, datasets.DatasetDict) else [("data", ds)]
    docs = []
    for split, d in parts:
        if column not in d.column_names:
            raise QuantgateError(f"{path} [{split}]: no '{column}' column (has {d.column_names})")
        rows = d[column]
        bad = next((type(t).__name__ for t in rows if t is not None and not isinstance(t, str)), None)
        if bad:
            raise QuantgateError(f"{path} [{split}]: the '{column}' column holds {bad} values, not text")
        text = "\n".join(t for t in rows if t is not None)
        docs += text_documents(f"{path.name}/{split}", text)
    if not docs:
        raise QuantgateError(f"{path}: the dataset holds no text")
    return docs
