"""Documents and the deterministic train/valid/test split by document."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass
class Corpus:
    """A named list of documents with a content fingerprint (for caches and reports)."""
    source: str
    documents: list[Document]
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            h = hashlib.sha256()
            for d in self.documents:
                h.update(d.name.encode() + b"\0" + d.text.encode("utf-8", "surrogatepass") + b"\0")
            self.fingerprint = h.hexdigest()[:16]

    @property
    def n_chars(self) -> int:
        return sum(len(d.text) for d in self.documents)

    def split(self, name: str, valid_frac: float = 0.05, test_frac: float = 0.05) -> "Corpus":
        """Documents of one split. The bucket of a document depends only on its name, so adding or
        removing other documents never moves it. `all` returns the corpus unchanged."""
        if name == "all":
            return self
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS + ('all',)}")
        docs = [d for d in self.documents if split_of(d.name, valid_frac, test_frac) == name]
        return Corpus(f"{self.source}[{name}]", docs)


def split_of(doc_name: str, valid_frac: float, test_frac: float) -> str:
    u = int.from_bytes(hashlib.sha256(doc_name.encode()).digest()[:8], "big") / 2**64
    if u < valid_frac:
        return "valid"
    if u < valid_frac + test_frac:
        return "test"
    return "train"
