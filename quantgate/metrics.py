"""Scores of logits, per position (DESIGN section 1): token NLL, KL(P_ref || P_test) and top-1 agreement (the
quantities llama.cpp's --kl-divergence reports), and per-layer SQNR of a quantized model against its float twin.
"""
from __future__ import annotations

import numpy as np
import torch

from .capture import capture
from .quant.qlinear import QuantLinear
from .quant.simulate import block_linears


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Per-token NLL [B, T-1] of windows[:, 1:] under logits[:, :-1], in float64 for a stable sum."""
    lg = logits[:, :-1].astype(np.float64)
    m = lg.max(axis=-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(lg - m).sum(axis=-1)))
    target = np.take_along_axis(lg, windows[:, 1:, None], axis=-1)[..., 0]
    return lse - target


def position_kld(ref_logits: np.ndarray, test_logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_test) for every position: [..., V] -> [...]."""
    lp, lq = _log_softmax(ref_logits), _log_softmax(test_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def top1_match(ref_logits: np.ndarray, test_logits: np.ndarray) -> np.ndarray:
    """Whether the two agree on the most likely token, per position: [..., V] -> [...]."""
    return ref_logits.argmax(-1) == test_logits.argmax(-1)


def window_scores(ref_logits: np.ndarray, test_logits: np.ndarray, window: np.ndarray,
                  chunk: int = 64) -> dict[str, np.ndarray]:
    """One window's scores, `chunk` positions at a time so the float64 log-probabilities stay small at any vocabulary
    (64 x 248,320 x 8 bytes: 127 MB): token NLL of the test and of the reference [T-1] (as token_nll), KL(P_ref ||
    P_test) [T] and top-1 agreement [T]. ref_logits, test_logits: [T, V]; window: [T] token ids."""
    T = len(window)
    nll, ref_nll, kld, top1 = (np.empty(T - 1), np.empty(T - 1), np.empty(T), np.empty(T, dtype=bool))
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        r, q = ref_logits[t0:t1], test_logits[t0:t1]
        lp, lq = _log_softmax(r), _log_softmax(q)
        kld[t0:t1] = (np.exp(lp) * (lp - lq)).sum(axis=-1)
        top1[t0:t1] = r.argmax(-1) == q.argmax(-1)
        n = min(t1, T - 1) - t0  # positions here that predict a next token
        if n > 0:
            target = window[t0 + 1:t0 + 1 + n, None]
            nll[t0:t0 + n] = -np.take_along_axis(lq[:n], target, axis=-1)[:, 0]
            ref_nll[t0:t0 + n] = -np.take_along_axis(lp[:n], target, axis=-1)[:, 0]
        del lp, lq
    return {"nll": nll, "ref_nll": ref_nll, "kld": kld, "top1": top1}


def kld_summary(kld: np.ndarray, top1: np.ndarray) -> dict:
    """The one summary every comparison reports: KLD mean, p99 and max over positions, and top-1 agreement."""
    kld, top1 = kld.reshape(-1), top1.reshape(-1)
    return {"kld_mean": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()),
            "top1_agreement": float(top1.mean()), "positions": int(kld.size)}


def logit_errors(ref_logits: np.ndarray, test_logits: np.ndarray) -> dict:
    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {test_logits.shape}")
    return kld_summary(position_kld(ref_logits, test_logits), top1_match(ref_logits, test_logits))


SQNR_CAP_DB = 120.0  # a token quantized without error counts as this, so means stay finite


def _token_db(signal: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, bool]:
    s = (signal.double() ** 2).sum(-1).reshape(-1)
    n = (noise.double() ** 2).sum(-1).reshape(-1)
    db = 10 * torch.log10(s.clamp(min=1e-300) / n.clamp(min=1e-300))
    return db.clamp(max=SQNR_CAP_DB), bool((n > 0).any())


def layer_sqnr(fp_model, q_model, windows: np.ndarray, batch: int = 4) -> dict:
    """Per block Linear: SQNR (dB) of its quantized input and of its output, on the float model's inputs.

    Each quantized Linear of `q_model` is applied to exactly the input its float twin in `fp_model` sees,
    so the numbers isolate that layer's own error (not the drift accumulated before it). SQNR is taken per
    token (over channels) and averaged in dB: a single massive token would otherwise dominate the energy
    ratio and hide that every other token was rounded away. Untouched values report None (no error).
    """
    device = next(q_model.parameters()).device  # both models on the quantized model's device (it may be CUDA)
    fp_model = fp_model.to(device)
    fp_lin, q_lin = block_linears(fp_model), block_linears(q_model)
    acc = {n: {"in": [], "out": [], "in_noisy": False, "out_noisy": False} for n in fp_lin}

    def hook_for(name):
        def hook(mod, args, out):
            x = args[0].detach()
            ql = q_lin[name]
            xq = ql.quantize_input(x) if isinstance(ql, QuantLinear) else x
            a = acc[name]
            db, noisy = _token_db(x, x - xq)
            a["in"].append(db)
            a["in_noisy"] |= noisy
            db, noisy = _token_db(out, out - ql(x))
            a["out"].append(db)
            a["out_noisy"] |= noisy
        return hook

    capture(fp_model, windows, post=[(m, hook_for(n)) for n, m in fp_lin.items()], batch=batch, device=device)
    return {n: {"input_db": float(torch.cat(a["in"]).mean()) if a["in_noisy"] else None,
                "output_db": float(torch.cat(a["out"]).mean()) if a["out_noisy"] else None}
            for n, a in acc.items()}
