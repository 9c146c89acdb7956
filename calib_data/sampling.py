"""Token streams and seeded window samplers shared by training, calibration and evaluation."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantgate.errors import QuantgateError

from .documents import Corpus


@dataclass
class TokenStream:
    """A corpus tokenized text by text (Corpus.texts: whole files, articles, documents) and joined with one EOS
    between consecutive texts: a single text file is exactly its own tokens."""
    ids: np.ndarray  # int64, 1-D
    bos_id: int
    source: str
    fingerprint: str
    starts: np.ndarray | None = None  # offset in `ids` where each text begins (its document, for the bootstrap)

    def __len__(self) -> int:
        return len(self.ids)


def tokenize_corpus(corpus: Corpus, tokenizer) -> TokenStream:
    if not corpus.documents:
        raise QuantgateError(f"{corpus.source}: no documents to tokenize")
    encoded = tokenizer.encode_batch(corpus.texts())
    unk = getattr(tokenizer, "unk_id", None)
    if unk is not None:  # a symbol tokenizer: text outside its alphabet would be read as <|unk|>, silently
        for i, e in enumerate(encoded):
            if unk in e:
                raise QuantgateError(f"{corpus.source} (text {i + 1}): characters outside the tokenizer's alphabet (a symbol tokenizer's; "
                                     f"this model reads only its synthetic corpus)")
    parts = [np.asarray(([tokenizer.eos_id] if i else []) + e, dtype=np.int64) for i, e in enumerate(encoded)]
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    return TokenStream(np.concatenate(parts), tokenizer.bos_id, corpus.source, corpus.fingerprint, starts)


def sample_windows(stream: TokenStream, n: int, T: int, seed: int) -> np.ndarray:
    """n windows of T tokens, each BOS + T-1 consecutive stream tokens from a seeded random offset.

    The same (stream, n, T, seed) always gives the same windows: training derives its per-step seed
    from (run seed, step), which is what makes `--resume` and twin training see identical batches.
    """
    span = T - 1
    out = np.empty((n, T), dtype=np.int64) if n > 0 else None
    for row, s in enumerate(_starts(stream, n, T, seed)):
        out[row, 1:] = stream.ids[s:s + span]
    out[:, 0] = stream.bos_id
    return out


def _starts(stream: TokenStream, n: int, T: int, seed: int) -> np.ndarray:
    if n <= 0:
        raise QuantgateError("the number of calibration windows must be positive")
    if len(stream) < T:
        raise QuantgateError(f"{stream.source}: {len(stream)} tokens is too short for one window of {T}")
    return np.random.default_rng(seed).integers(0, len(stream) - (T - 1) + 1, size=n)


def sampled_documents(stream: TokenStream, n: int, T: int, seed: int) -> np.ndarray:
    """The text (document) each of sample_windows(stream, n, T, seed)'s windows starts in: the units an analysis'
    intervals resample (quantgate.stats)."""
    starts = stream.starts if stream.starts is not None else np.zeros(1, dtype=np.int64)
    return np.searchsorted(starts, _starts(stream, n, T, seed), side="right") - 1
