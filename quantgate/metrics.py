"""Distances between a model's logits and a reference's, per position (DESIGN section 1).

KL(P_ref || P_test) and top-1 agreement, the quantities llama.cpp's --kl-divergence reports.
"""
from __future__ import annotations

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def position_kld(ref_logits: np.ndarray, test_logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_test) for every position: [..., V] -> [...]."""
    lp, lq = _log_softmax(ref_logits), _log_softmax(test_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def logit_errors(ref_logits: np.ndarray, test_logits: np.ndarray) -> dict:
    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {test_logits.shape}")
    kld = position_kld(ref_logits, test_logits).reshape(-1)
    top1 = (ref_logits.argmax(-1) == test_logits.argmax(-1)).reshape(-1)
    return {"kld_mean": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()),
            "top1_agreement": float(top1.mean()), "positions": int(kld.size)}
