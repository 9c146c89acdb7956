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

    def __len__(self) -> int:
        return len(self.ids)


def tokenize_corpus(corpus: Corpus, tokenizer) -> TokenStream:
    if not corpus.documents:
        raise QuantgateError(f"{corpus.source}: no documents to tokenize")
    encoded = tokenizer.encode_batch(corpus.texts())
    parts = [np.asarray(([tokenizer.eos_id] if i else []) + e, dtype=np.int64) for i, e in enumerate(encoded)]
    return TokenStream(np.concatenate(parts), tokenizer.bos_id, corpus.source, corpus.fingerprint)


def sample_windows(stream: TokenStream, n: int, T: int, seed: int) -> np.ndarray:
    """n windows of T tokens, each BOS + T-1 consecutive stream tokens from a seeded random offset.

    The same (stream, n, T, seed) always gives the same windows: training derives its per-step seed
    from (run seed, step), which is what makes `--resume` and twin training see identical batches.
    """
    if n <= 0:
        raise QuantgateError("the number of calibration windows must be positive")
    span = T - 1
    if len(stream) < span + 1:
        raise QuantgateError(f"{stream.source}: {len(stream)} tokens is too short for one window of {T}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - span + 1, size=n)
    out = np.empty((n, T), dtype=np.int64)
    out[:, 0] = stream.bos_id
    for row, s in enumerate(starts):
        out[row, 1:] = stream.ids[s:s + span]
    return out
