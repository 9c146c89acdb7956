"""Synthetic corpora: the Bigram-Backcopy task, a toy language on which small transformers grow attention sinks.

Guo, Pai, Bai, Jiao, Jordan, Mei (2024), "Active-Dormant Attention Heads: Mechanistically Demystifying
Extreme-Token Phenomena in LLMs", arXiv:2410.13835. In their Bigram-Backcopy (BB) task a sequence starts with
one BOS token and follows a bigram Markov chain over a small vocabulary, except after one of k=3 *trigger*
tokens: there the next token copies the token just before the trigger. One- to three-layer transformers trained
on it grow the extreme-token phenomena of LLMs: the head that does the back-copy is *active* on triggers and
*dormant* elsewhere, where it parks its attention on BOS (an attention sink), BOS's value state shrinks (value
drain) and its residual norm grows (residual peak).

Here (`synthetic:bigram-backcopy`):

- Symbols are single ASCII letters and digits, so each symbol is exactly one token of quantgate's byte tokenizer
  (no whitespace: the byte-level pre-tokenizer sees one word per document). The first `N_TRIGGERS` symbols of
  `SYMBOLS` are the triggers.
- Guo et al. estimate their transition matrix from real text; having none here, each row of ours is drawn from
  a sparse Dirichlet(`ALPHA`) over all symbols from a fixed seed (a low-entropy, learnable bigram; triggers are
  reached with their Dirichlet share, about k/V of the transitions).
- Each document is a fresh chain (its first symbol drawn uniformly among the non-triggers), so a document never
  starts with a trigger; a trigger is always preceded by a non-trigger, which it copies. quantgate supplies the
  BOS itself: every training and evaluation window starts with one (calib_data.sampling.sample_windows,
  splits.eval_windows), and windows start at random offsets, as the task's sequences after their BOS.
- Everything is seeded: the same call gives the same documents, byte for byte.
"""
from __future__ import annotations

import string
from functools import lru_cache

import numpy as np

from .documents import Document

BIGRAM_BACKCOPY = "synthetic:bigram-backcopy"
SYNTHETIC_NAMES = (BIGRAM_BACKCOPY,)
SYMBOLS = string.ascii_letters + string.digits  # 62 one-byte, non-whitespace symbols
N_TRIGGERS = 3
TRIGGERS = SYMBOLS[:N_TRIGGERS]
ALPHA = 0.1            # Dirichlet concentration of each transition row (small: each row puts its mass on a few)
N_DOCUMENTS = 6000
DOC_LEN = 500          # symbols per document: 3.0 M symbols in all
SEED = 20241017


def transition_matrix(n_symbols: int = len(SYMBOLS), alpha: float = ALPHA, seed: int = SEED) -> np.ndarray:
    """[V, V] float64 row-stochastic bigram matrix, each row a Dirichlet(alpha) draw."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(n_symbols, alpha), size=n_symbols)


def generate_chains(n_docs: int, length: int, probs: np.ndarray, n_triggers: int = N_TRIGGERS,
                    seed: int = SEED + 1) -> np.ndarray:
    """[n_docs, length] int symbol indices: bigram steps from `probs`, and after a trigger (indices below
    `n_triggers`) a copy of the symbol before it. All documents step together (vectorized over documents)."""
    rng = np.random.default_rng(seed)
    cum = np.cumsum(probs, axis=1)
    cum[:, -1] = 1.0
    out = np.empty((n_docs, length), dtype=np.int64)
    out[:, 0] = rng.integers(n_triggers, probs.shape[0], size=n_docs)
    u = rng.random((n_docs, length))
    for t in range(1, length):
        prev = out[:, t - 1]
        nxt = (u[:, t, None] > cum[prev]).sum(axis=1)
        if t >= 2:
            nxt = np.where(prev < n_triggers, out[:, t - 2], nxt)
        out[:, t] = nxt
    return out


def backcopy_violations(text: str, triggers: str = TRIGGERS) -> int:
    """How many times the symbol after a trigger is not the symbol before it (0 for every generated text)."""
    return sum(1 for i in range(1, len(text) - 1) if text[i] in triggers and text[i + 1] != text[i - 1])


@lru_cache(maxsize=2)
def _bigram_backcopy_texts(n_docs: int, length: int) -> tuple[str, ...]:
    chains = generate_chains(n_docs, length, transition_matrix())
    table = np.frombuffer(SYMBOLS.encode("ascii"), dtype=np.uint8)
    return tuple(row.tobytes().decode("ascii") for row in table[chains])


def bigram_backcopy_documents(n_docs: int = N_DOCUMENTS, length: int = DOC_LEN) -> list[Document]:
    """The corpus as standalone documents named `synthetic:bigram-backcopy#i`."""
    return [Document(f"{BIGRAM_BACKCOPY}#{i}", t) for i, t in enumerate(_bigram_backcopy_texts(n_docs, length))]


def synthetic_documents(name: str) -> list[Document]:
    """Documents of one synthetic corpus by its `--data` name (one of SYNTHETIC_NAMES)."""
    if name == BIGRAM_BACKCOPY:
        return bigram_backcopy_documents()
    raise ValueError(f"unknown synthetic corpus {name!r}; choose from {', '.join(SYNTHETIC_NAMES)}")
