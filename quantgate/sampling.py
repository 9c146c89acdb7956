"""One sampler and one generation loop for every backend (PyTorch, ONNX Runtime, llama.cpp).

A runner that generates implements two calls on its own KV cache: `prefill(ids)` (an empty cache, then the
prompt in one batch) and `decode(token)` (one more token), each returning the last position's logits. `stream`
drives them with a `Sampler` and yields one record per new token, then one `Done` with the prompt and decode
speeds. The same seed and settings therefore pick the same tokens whichever backend computed the logits.

Written by hand: llama.cpp's sampler lives inside llama.cpp and ONNX Runtime has none, so only a sampler of our
own is the same on all three. It imports numpy alone: the llama.cpp worker process runs it next to the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np


class Steps(Protocol):
    def prefill(self, ids: list[int]) -> np.ndarray:
        ...

    def decode(self, token: int) -> np.ndarray:
        ...


@dataclass
class Sampler:
    """temperature 0: greedy (argmax). Otherwise top-k, then top-p (nucleus), then a draw from softmax(logits / T)
    with a seeded generator: llama.cpp's defaults (top_k 40, top_p 0.95)."""
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> int:
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if not np.isfinite(x).all():
            raise NonFiniteLogits("the model produced NaN or Inf logits: its weights or activations are not finite")
        if self.temperature <= 0:
            return int(x.argmax())
        k = min(self.top_k, x.size) if self.top_k > 0 else x.size
        top = np.argpartition(-x, k - 1)[:k]
        top = top[np.argsort(-x[top], kind="stable")]  # most likely first
        p = np.exp((x[top] - x[top[0]]) / self.temperature)
        p /= p.sum()
        keep = min(int(np.searchsorted(np.cumsum(p), self.top_p)) + 1, p.size)  # smallest head with top_p of mass
        p = p[:keep] / p[:keep].sum()
        return int(top[self.rng.choice(keep, p=p)])


class NonFiniteLogits(ValueError):
    """Raised by Sampler.pick; the runners turn it into their QuantgateError."""


@dataclass
class Token:
    id: int


@dataclass
class Done:
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        """New tokens after the first per second: the first comes out of the prefill."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else float("nan")


def stream(steps: Steps, ids: list[int], max_tokens: int, sampler: Sampler,
           stop_ids: tuple[int, ...] = ()) -> Iterator[Token | Done]:
    """Up to `max_tokens` new tokens after the prompt `ids` (stopping early at any of `stop_ids`), as records."""
    t0 = time.perf_counter()
    logits = steps.prefill(list(ids))
    t1 = time.perf_counter()
    n = 0
    while True:
        tok = sampler.pick(logits)
        if tok in stop_ids:
            break
        n += 1
        yield Token(tok)
        if n >= max_tokens:
            break
        logits = steps.decode(tok)
    yield Done(len(ids), n, t1 - t0, time.perf_counter() - t1)
