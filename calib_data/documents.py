"""Documents and the deterministic train/valid/test split by document."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Document:
    """One text, or one piece of a longer text: pieces of the same `source` with consecutive `part` numbers are
    joined back into one text before tokenizing (a text file is cut into pieces only so that it can be split
    into train/valid/test by piece)."""
    name: str
    text: str
    source: str = ""   # the text this piece was cut from ("" for a document that stands alone)
    part: int = 0


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

    def texts(self) -> list[str]:
        """The corpus as the texts that are tokenized one by one: every standalone document, and every run of
        consecutive pieces of one source joined back into the text they were cut from."""
        out, prev = [], None
        for d in self.documents:
            if prev is not None and d.source and d.source == prev.source and d.part == prev.part + 1:
                out[-1] += d.text
            else:
                out.append(d.text)
            prev = d
        return out


def split_of(doc_name: str, valid_frac: float, test_frac: float) -> str:
    u = int.from_bytes(hashlib.sha256(doc_name.encode()).digest()[:8], "big") / 2**64
    if u < valid_frac:
        return "valid"
    if u < valid_frac + test_frac:
        return "test"
    return "train"
