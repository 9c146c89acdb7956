"""Synthetic corpora: the Bigram-Backcopy task, a toy language on which small transformers grow attention sinks.

Guo, Pai, Bai, Jiao, Jordan, Mei (2024), "Active-Dormant Attention Heads: Mechanistically Demystifying
Extreme-Token Phenomena in LLMs", arXiv:2410.13835. In their Bigram-Backcopy (BB) task a sequence starts with
one BOS token and follows a bigram Markov chain over a small vocabulary, except after one of k=3 *trigger*
tokens: there the next token copies the token just before the trigger. One- to three-layer transformers trained
on it grow the extreme-token phenomena of LLMs: the head that does the back-copy is *active* on triggers and
*dormant* elsewhere, where it parks its attention on BOS (an attention sink), BOS's value state shrinks (value
drain) and its residual norm grows (residual peak).

Here (`synthetic:bigram-backcopy`), as Guo et al.'s `BBM/` builds it:

- Symbols are single ASCII letters and digits, so each symbol is exactly one token of quantgate's byte tokenizer
  (no whitespace: the byte-level pre-tokenizer sees one word per document).
- Guo et al. estimate their transition matrix from real text, whose symbol frequencies are skewed, and take the 3
  most frequent symbols as triggers (about a quarter of all positions). Having no text to estimate from, each row
  of ours is a Dirichlet draw whose concentration follows a Zipf law over the symbols (ZIPF_S, total ALPHA_TOTAL),
  from a fixed seed: a skewed marginal as text has; the triggers are the N_TRIGGERS most frequent symbols under the
  chain's stationary distribution (`trigger_indices`). An earlier version drew flat Dirichlet(0.1) rows and took
  three arbitrary symbols as triggers: they fell on ~6% of positions and the lab's baseline did not sink
  (benchmarks/sink_lab_recipe.py has both measured).
- Each document is a fresh chain whose first symbol is drawn from the non-trigger symbols' stationary shares, so a
  trigger is always preceded by a symbol, which it copies. quantgate supplies the BOS itself: every training and
  evaluation window starts with one (calib_data.sampling.sample_windows, splits.eval_windows), and windows start at
  random offsets, as the task's sequences after their BOS.
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
ZIPF_S = 0.9           # row concentrations proportional to 1 / rank^s over the symbols: a skewed marginal
ALPHA_TOTAL = 6.2      # their sum (0.1 per symbol on average): each row puts its mass on a few symbols
N_DOCUMENTS = 6000
DOC_LEN = 500          # symbols per document: 3.0 M symbols in all
SEED = 20241017


def transition_matrix(n_symbols: int = len(SYMBOLS), s: float = ZIPF_S, total: float = ALPHA_TOTAL,
                      seed: int = SEED) -> np.ndarray:
    """[V, V] float64 row-stochastic bigram matrix, each row a Dirichlet draw with Zipf(s) concentrations."""
    w = 1.0 / np.arange(1, n_symbols + 1) ** s
    return np.random.default_rng(seed).dirichlet(total * w / w.sum(), size=n_symbols)


def stationary(probs: np.ndarray) -> np.ndarray:
    """The chain's stationary distribution (the left eigenvector of eigenvalue 1)."""
    vals, vecs = np.linalg.eig(probs.T)
    pi = np.abs(np.real(vecs[:, np.argmin(np.abs(vals - 1))]))
    return pi / pi.sum()


def trigger_indices(probs: np.ndarray, n_triggers: int = N_TRIGGERS) -> np.ndarray:
    """The n most frequent symbols under the chain's stationary distribution (Guo et al.'s choice), sorted."""
    return np.sort(np.argsort(-stationary(probs), kind="stable")[:n_triggers])


def generate_chains(n_docs: int, length: int, probs: np.ndarray, triggers: np.ndarray,
                    seed: int = SEED + 1) -> np.ndarray:
    """[n_docs, length] int symbol indices: bigram steps from `probs`, and after a trigger a copy of the symbol
    before it. The first symbol is drawn from the non-triggers' stationary shares. All documents step together."""
    rng = np.random.default_rng(seed)
    is_trigger = np.zeros(probs.shape[0], dtype=bool)
    is_trigger[triggers] = True
    first = np.where(is_trigger, 0.0, stationary(probs))
    cum = np.cumsum(probs, axis=1)
    cum[:, -1] = 1.0
    out = np.empty((n_docs, length), dtype=np.int64)
    out[:, 0] = rng.choice(probs.shape[0], size=n_docs, p=first / first.sum())
    u = rng.random((n_docs, length))
    for t in range(1, length):
        prev = out[:, t - 1]
        nxt = np.minimum((u[:, t, None] > cum[prev]).sum(axis=1), probs.shape[0] - 1)
        if t >= 2:
            nxt = np.where(is_trigger[prev], out[:, t - 2], nxt)
        out[:, t] = nxt
    return out


TRIGGERS = "".join(SYMBOLS[i] for i in trigger_indices(transition_matrix()))


def backcopy_violations(text: str, triggers: str = TRIGGERS) -> int:
    """How many times the symbol after a trigger is not the symbol before it (0 for every generated text)."""
    return sum(1 for i in range(1, len(text) - 1) if text[i] in triggers and text[i + 1] != text[i - 1])


@lru_cache(maxsize=2)
def _bigram_backcopy_texts(n_docs: int, length: int) -> tuple[str, ...]:
    probs = transition_matrix()
    chains = generate_chains(n_docs, length, probs, trigger_indices(probs))
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
