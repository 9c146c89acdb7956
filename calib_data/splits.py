"""Which text calibrates and which evaluates, and how it is cut into windows: the one policy every command uses.

The built-in corpora, embedded and synthetic, have held-out splits (DESIGN section 5): calibration (static activation ranges, GPTQ,
SmoothQuant, ONNX int8-static, GGUF importance matrices) samples its `valid` split, evaluation reads its `test`
split, so no scheme is calibrated on the text it is scored on. A user's text is used whole for either.
"""
from __future__ import annotations

import numpy as np

from quantgate.errors import QuantgateError

from .sampling import sample_windows, tokenize_corpus
from .sources import EMBEDDED_NAMES, load_corpus
from .synthetic import SYNTHETIC_NAMES


def has_splits(data: str) -> bool:
    """Whether `data` names a built-in corpus (embedded or synthetic), whose documents are split
    train/valid/test; a user's text has no held-out split and is used whole."""
    return str(data) in EMBEDDED_NAMES or str(data) in SYNTHETIC_NAMES


def default_split(data: str) -> str:
    """A built-in corpus is evaluated on its held-out test split; a user's file is evaluated whole."""
    return "test" if has_splits(data) else "all"


def calibration_split(data: str) -> str:
    """A built-in corpus calibrates on its valid split (never its test split); a user's text is used whole."""
    return "valid" if has_splits(data) else "all"


def calibration_windows(tokenizer, calib_data: str, n_windows: int, ctx: int, seed: int) -> np.ndarray:
    """Seeded calibration windows of `ctx` tokens (BOS first) from the calibration split of `calib_data`."""
    corpus = load_corpus(calib_data).split(calibration_split(calib_data))
    if not corpus.documents:
        raise QuantgateError(f"calibration data {calib_data} is empty")
    return sample_windows(tokenize_corpus(corpus, tokenizer), n_windows, ctx, seed)


def eval_windows(ids: np.ndarray, ctx: int, bos_id: int, max_windows: int | None = None) -> np.ndarray:
    """[N, ctx] int64: BOS + ctx-1 consecutive tokens per row, tail dropped. With `max_windows` below the number the
    text holds, that many windows evenly spaced over the whole text (in order), not the first ones: the first N
    windows come from the first few files, and benchmarks/results/interval_width.json shows such a prefix moving
    the twins' KLD ratio past its own bootstrap interval as more files come in."""
    rows = _window_rows(len(ids), ctx, max_windows)
    span = ctx - 1
    body = np.asarray(ids[: (rows.max() + 1) * span], dtype=np.int64).reshape(-1, span)[rows]
    return np.concatenate([np.full((len(body), 1), bos_id, dtype=np.int64), body], axis=1)


def _window_rows(n_tokens: int, ctx: int, max_windows: int | None) -> np.ndarray:
    """Which of the text's consecutive ctx-1 token spans eval_windows keeps, in text order."""
    if ctx < 2:
        raise QuantgateError(f"--ctx must be at least 2, got {ctx}")
    n = n_tokens // (ctx - 1)
    if n == 0:
        raise QuantgateError(f"the evaluation text has {n_tokens} tokens, too short for one window of {ctx}")
    if max_windows is not None and max_windows < n:
        return np.linspace(0, n - 1, max_windows).round().astype(np.int64)
    return np.arange(n, dtype=np.int64)


def window_documents(stream, ctx: int, max_windows: int | None = None) -> np.ndarray:
    """The text (document) each of eval_windows(stream.ids, ctx, ...)'s windows starts in: the units the report's
    bootstrap resamples (quantgate.stats), since windows of one file are not independent."""
    rows = _window_rows(len(stream.ids), ctx, max_windows)
    starts = stream.starts if stream.starts is not None else np.zeros(1, dtype=np.int64)
    return np.searchsorted(starts, rows * (ctx - 1), side="right") - 1


def check_ctx(ctx: int, context: int, model_path) -> None:
    """One rule on every backend: a window longer than the model's own context is refused, not extrapolated."""
    if ctx > context:
        raise QuantgateError(f"--ctx {ctx} is longer than {model_path}'s context of {context} tokens "
                             f"(its max_position_embeddings / context_length); use --ctx {context} or less")
