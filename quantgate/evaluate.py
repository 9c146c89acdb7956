"""Perplexity under the one convention every backend shares (DESIGN section 1).

Tokenize without special tokens; cut into consecutive windows of ctx-1 tokens (the incomplete tail is
dropped); put BOS in front of each; score every token of the window given its prefix;
ppl = exp(mean NLL over all scored tokens). The ONNX Runtime and llama.cpp runners are scored by this
same code, so their numbers compare with PyTorch's and with transformers'.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import numpy as np

from .calib_data import check_ctx, default_split, eval_windows, load_corpus, tokenize_corpus, window_documents
from .errors import QuantgateError
from .formats import artifact_kind, load_checkpoint
from .formats.hf import open_hf
from .layerwise import iter_logits
from .metrics import kld_summary, layer_sqnr, token_nll, window_scores
from .progress import track
from .reference import REFERENCE_WINDOWS, reference_logits
from .runners import Runner
from .runners.open import fixed_ctx, open_runner
from .stats import cell_intervals, quantile_interval

# eval_windows, default_split and check_ctx (the split and window policy) live in quantgate.calib_data and
# token_nll in quantgate.metrics; re-exported here for one release
__all__ = ["PerplexityResult", "compare_to_reference", "evaluate_model", "perplexity",
           "reference_logits", "check_ctx", "default_split", "eval_windows", "token_nll"]


@dataclass
class PerplexityResult:
    ppl: float
    mean_nll: float
    n_tokens: int
    n_windows: int
    ctx: int

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(runner: Runner, windows: np.ndarray, batch: int = 4) -> PerplexityResult:
    total, count = 0.0, 0
    for i, lg in track(iter_logits(runner, windows, batch), f"eval {runner.name}", total=math.ceil(len(windows) / batch)):
        w = windows[i:i + batch]
        check_finite(lg, runner.name)
        nll = token_nll(lg, w)
        total += float(nll.sum())
        count += nll.size
    mean = total / count
    return PerplexityResult(ppl=math.exp(mean), mean_nll=mean, n_tokens=count, n_windows=len(windows),
                            ctx=windows.shape[1])


SQNR_WINDOWS = 4  # windows used for the per-layer SQNR of a quantized model


def check_finite(logits: np.ndarray, who: str) -> None:
    """NaN or Inf logits mean non-finite weights (or activations that overflowed): never a perplexity."""
    if not np.isfinite(logits).all():
        raise QuantgateError(f"{who} produced NaN or Inf logits: its weights or activations are not finite")


def tokenizers_match(a, b, sample: str) -> bool:
    """Same ids for the same text and the same token strings: what makes two models' logits comparable."""
    if a.tok.to_str() == b.tok.to_str():
        return True
    n = min(a.vocab_size, b.vocab_size)
    if any(a.tok.id_to_token(i) != b.tok.id_to_token(i) for i in range(n)):
        return False
    return a.encode(sample) == b.encode(sample) and (a.bos_id, a.eos_id) == (b.bos_id, b.eos_id)


def evaluate_model(model_path: str, data: str, ctx: int, split: str = "auto",
                   max_windows: int | None = None, device: str = "cpu", reference: str | None = None,
                   torchao: str | None = None, kv_type: str = "f32", threads: int | None = None,
                   layerwise: bool | None = None) -> dict:
    """Perplexity of a model directory, GGUF file or ONNX export on a text source; with `reference`, also KL
    divergence and top-1 agreement against the reference's fp32 PyTorch logits on the same windows, and the
    perplexity delta."""
    split = default_split(data) if split == "auto" else split
    corpus = load_corpus(data).split(split)
    if not corpus.documents:
        raise QuantgateError(f"{data}: the {split} split is empty")
    opened = open_runner(model_path, fixed_ctx(ctx, model_path), device, kv_type, threads, torchao=torchao,
                         layerwise=layerwise)
    runner, tok, backend, extra = opened.runner, opened.tokenizer, opened.backend, opened.record
    try:
        stream = tokenize_corpus(corpus, tok)
        max_windows, note = reference_window_count(reference, max_windows, len(stream.ids), ctx)
        windows = eval_windows(stream.ids, ctx, tok.bos_id, max_windows)
        out = {"model": str(model_path), "backend": backend, "device": device, "data": str(data), "split": split,
               "corpus_fingerprint": corpus.fingerprint}
        out.update(extra)  # the GGUF's KV type, rotation and bytes; the ONNX export's bytes; a rounded KV cache
        if reference is None:
            return {**out, **perplexity(runner, windows).to_dict()}
        ref_cfg, ref_tok = reference_header(reference)
        check_ctx(ctx, ref_cfg.max_seq_len, reference)
        if runner.vocab_size and runner.vocab_size != ref_cfg.vocab_size:
            raise QuantgateError(f"{reference} has a vocabulary of {ref_cfg.vocab_size} and {model_path} of "
                                 f"{runner.vocab_size}: KL divergence compares two distributions over one vocabulary")
        sample = corpus.documents[0].text[:20000]
        if ref_tok is not None and not tokenizers_match(ref_tok, tok, sample):
            raise QuantgateError(f"{reference} and {model_path} use different tokenizers: their logits do not compare")
        # the note is said once every input, the disk included, is checked: a refused run prints one error line only
        ref_logits = reference_logits(reference, windows, f"{corpus.fingerprint}|{split}|{ctx}", announce=note)
        docs = window_documents(stream, ctx, max_windows)
        result = {**out, "reference": str(reference), **compare_to_reference(runner, ref_logits, windows, docs=docs)}
    finally:
        if hasattr(runner, "close"):
            runner.close()
    loaded = opened.loaded
    scheme = loaded.model.cfg.extra.get("quant_scheme") if loaded else None
    if scheme and not torchao and scheme.get("smooth_alpha") is None:
        result["layer_sqnr_db"] = layer_sqnr(load_checkpoint(reference).model, loaded.model, windows[:SQNR_WINDOWS])
    elif scheme:  # SmoothQuant rescaled the layer inputs: the float reference's inputs no longer match
        result["layer_sqnr_db"] = None
    return result


def reference_window_count(reference: str | None, max_windows: int | None, n_tokens: int,
                           ctx: int) -> tuple[int | None, str | None]:
    """With a reference and no --max-windows: REFERENCE_WINDOWS windows spread evenly over the text (the report's
    count; every window of a long text costs the reference's pass and its stored states), and the line saying so."""
    if reference is None or max_windows is not None:
        return max_windows, None
    n = n_tokens // max(ctx - 1, 1)
    if n > REFERENCE_WINDOWS:
        return REFERENCE_WINDOWS, (f"eval: {REFERENCE_WINDOWS} of the text's {n:,} windows, spread evenly (the "
                                   f"report's count); --max-windows {n} scores every one")
    return None, None


def reference_header(reference: str):
    """(config, tokenizer) of the reference: from the headers of a model directory (nothing loaded), else loaded."""
    if artifact_kind(reference) == "hf":
        ckpt = open_hf(reference)
        return ckpt.cfg, ckpt.tokenizer
    ref = load_checkpoint(reference, with_tokenizer=True)
    return ref.model.cfg, ref.tokenizer


LOGITS_BATCH_BYTES = 256 << 20  # a batch of the compared runner's logits stays under this (at least one window)


def batch_for_vocab(batch: int, ctx: int, vocab: int) -> int:
    """Windows per batch so that one batch's fp32 logits stay under LOGITS_BATCH_BYTES (one window at least): at
    Qwen3.5's vocabulary a window of 256 is 254 MB, and the runner's logits are held while the window is scored."""
    return max(1, min(batch, LOGITS_BATCH_BYTES // (ctx * vocab * 4)))


def compare_to_reference(runner: Runner, ref_logits: np.ndarray, windows: np.ndarray, batch: int = 4,
                         docs: np.ndarray | None = None) -> dict:
    """Perplexity of `runner` and of the reference logits on the same windows, with per-position KL
    divergence KL(P_ref || P_runner) (mean, p99, max) and top-1 agreement. `docs`: the document each window comes
    from, which the intervals resample (quantgate.stats); without it, windows are resampled one by one."""
    nll, ref_nll, kld, top1 = [], [], [], []
    batch = batch_for_vocab(batch, windows.shape[1], ref_logits.shape[-1])
    for i, lg in track(iter_logits(runner, windows, batch), f"eval {runner.name} vs reference",
                       total=-(-len(windows) // batch)):
        check_finite(lg, runner.name)
        for j in range(len(lg)):  # one window's reference logits at a time: [T, V] (254 MB at Qwen3.5's vocab)
            s = window_scores(np.asarray(ref_logits[i + j:i + j + 1])[0], lg[j], windows[i + j])
            for out, k in ((nll, "nll"), (ref_nll, "ref_nll"), (kld, "kld"), (top1, "top1")):
                out.append(s[k])
        del lg
    nll, ref_nll, kld, top1 = (np.concatenate(a) for a in (nll, ref_nll, kld, top1))
    ppl, ref_ppl = math.exp(nll.mean()), math.exp(ref_nll.mean())
    summary = {k: v for k, v in kld_summary(kld, top1).items() if k != "positions"}  # n_tokens says it
    per_window = {k: a.reshape(len(windows), -1).mean(axis=1).tolist()
                  for k, a in (("kld", kld), ("nll", nll), ("ref_nll", ref_nll), ("top1", top1.astype(np.float64)))}
    if docs is not None:
        per_window["doc"] = [int(d) for d in docs]
    return {"ppl": ppl, "mean_nll": float(nll.mean()), "n_tokens": int(nll.size), "n_windows": len(windows),
            "ctx": int(windows.shape[1]), "reference_ppl": ref_ppl, "delta_ppl": ppl - ref_ppl,
            "delta_ppl_pct": 100 * (ppl / ref_ppl - 1), **summary, **cell_intervals(per_window),
            "kld_p99_ci95": quantile_interval(kld.reshape(len(windows), -1), 99, docs),
            # per-window means, the units the report's bootstrap resamples; the windows' id pairs two twins' cells
            "per_window": per_window, "windows_id": hashlib.sha256(windows.tobytes()).hexdigest()[:16]}
