"""Perplexity under the one convention every backend shares (DESIGN section 1).

Tokenize without special tokens; cut into consecutive windows of ctx-1 tokens (the incomplete tail is
dropped); put BOS in front of each; score every token of the window given its prefix;
ppl = exp(mean NLL over all scored tokens). The ONNX Runtime and llama.cpp runners are scored by this
same code, so their numbers compare with PyTorch's and with transformers'.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .errors import QuantgateError
from .progress import track
from .runners import Runner, TorchRunner


@dataclass
class PerplexityResult:
    ppl: float
    mean_nll: float
    n_tokens: int
    n_windows: int
    ctx: int

    def to_dict(self) -> dict:
        return asdict(self)


def eval_windows(ids: np.ndarray, ctx: int, bos_id: int, max_windows: int | None = None) -> np.ndarray:
    """[N, ctx] int64: BOS + ctx-1 consecutive tokens per row, tail dropped."""
    if ctx < 2:
        raise QuantgateError(f"--ctx must be at least 2, got {ctx}")
    span = ctx - 1
    n = len(ids) // span
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise QuantgateError(f"the evaluation text has {len(ids)} tokens, too short for one window of {ctx}")
    body = np.asarray(ids[: n * span], dtype=np.int64).reshape(n, span)
    return np.concatenate([np.full((n, 1), bos_id, dtype=np.int64), body], axis=1)


def token_nll(logits: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Per-token NLL [B, T-1] of windows[:, 1:] under logits[:, :-1], in float64 for a stable sum."""
    lg = logits[:, :-1].astype(np.float64)
    m = lg.max(axis=-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(lg - m).sum(axis=-1)))
    target = np.take_along_axis(lg, windows[:, 1:, None], axis=-1)[..., 0]
    return lse - target


def perplexity(runner: Runner, windows: np.ndarray, batch: int = 4) -> PerplexityResult:
    total, count = 0.0, 0
    for i in track(range(0, len(windows), batch), f"eval {runner.name}", total=math.ceil(len(windows) / batch)):
        w = windows[i:i + batch]
        nll = token_nll(runner.logits(w), w)
        total += float(nll.sum())
        count += nll.size
    mean = total / count
    return PerplexityResult(ppl=math.exp(mean), mean_nll=mean, n_tokens=count, n_windows=len(windows),
                            ctx=windows.shape[1])


def default_split(data: str) -> str:
    """The embedded corpus is evaluated on its held-out test split; a user's file is evaluated whole."""
    from .calib_data.sources import EMBEDDED_NAMES
    return "test" if str(data) in EMBEDDED_NAMES else "all"


def evaluate_model(model_path: str, data: str, ctx: int, split: str = "auto",
                   max_windows: int | None = None, device: str = "cpu") -> dict:
    """Perplexity of a model directory on a text source; the dict the CLI prints as JSON."""
    from .calib_data import load_corpus, tokenize_corpus
    from .checkpoint import load_checkpoint

    loaded = load_checkpoint(model_path)
    if loaded.tokenizer is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot tokenize evaluation text")
    split = default_split(data) if split == "auto" else split
    corpus = load_corpus(data).split(split)
    if not corpus.documents:
        raise QuantgateError(f"{data}: the {split} split is empty")
    stream = tokenize_corpus(corpus, loaded.tokenizer)
    windows = eval_windows(stream.ids, ctx, loaded.tokenizer.bos_id, max_windows)
    result = perplexity(TorchRunner(loaded.model, device), windows)
    return {"model": str(model_path), "backend": "torch", "data": str(data), "split": split,
            "corpus_fingerprint": corpus.fingerprint, **result.to_dict()}
