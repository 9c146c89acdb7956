"""One speed protocol for every runner: warm-up, alternating timed rounds, medians.

A runner times one round with `time_round(prefill_ids, decode_ids) -> (prefill_s, decode_s)`: prefill the
prompt in one batch from an empty cache, then decode `decode_ids` one token at a time on that cache. `bench`
gives every runner `warmup` untimed rounds, then alternates the timed rounds between the runners it is given
(A B A B ...), so the drift of a busy machine falls on all of them alike, and reports medians: these machines
are noisy, and a median of alternated rounds is what a ratio between two runners can rest on.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Timed(Protocol):
    def time_round(self, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
        ...


def bench(runners: Sequence[Timed], prefill_ids: list[int], decode_ids: list[int], rounds: int = 3,
          warmup: int = 1) -> list[dict]:
    """Per runner: median prefill and decode seconds over `rounds` alternated rounds, tokens per second, and every
    round's seconds (round k of every runner ran back to back, so per-round ratios between runners pair up)."""
    if rounds < 1 or not decode_ids or not prefill_ids:
        raise ValueError("bench needs at least one round, one prompt token and one decode token")
    for r in runners:
        for _ in range(warmup):
            r.time_round(prefill_ids, decode_ids)
    times: list[list[tuple[float, float]]] = [[] for _ in runners]
    for _ in range(rounds):
        for i, r in enumerate(runners):
            times[i].append(r.time_round(prefill_ids, decode_ids))
    out = []
    for t in times:
        pre, dec = float(np.median([p for p, _ in t])), float(np.median([d for _, d in t]))
        out.append({"prefill_s": pre, "decode_s": dec, "prefill_tps": len(prefill_ids) / pre,
                    "decode_tps": len(decode_ids) / dec, "rounds": rounds, "warmup": warmup,
                    "prefill_rounds_s": [p for p, _ in t], "decode_rounds_s": [d for _, d in t]})
    return out
