"""Peak memory of `quantgate analyze` on a 1B-shaped model (random weights, fp32, CPU).

The analysis keeps the weights whole and handles activations one layer at a time (the model's
`on_layer` callback: each block's hidden state and attention probabilities are reduced to statistics
before the next block runs), so peak memory is about the weights plus one layer's activations.

    python benchmarks/analyze_memory.py [--windows 4] [--ctx 512]
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import torch


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "analyze_memory.json"))
    args = ap.parse_args()
    from quantgate.model import ModelConfig, build_model
    from quantgate.outliers import analyze_model

    cfg = ModelConfig(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128,
                      ffn_dim=5632, gate="elementwise", max_seq_len=4096)
    t = time.time()
    model = build_model(cfg, seed=0)
    build_s = time.time() - t
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    after_build = rss_gib()
    windows = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(args.windows, args.ctx))
    windows[:, 0] = cfg.bos_id
    t = time.time()
    rep = analyze_model(model, windows, batch=1)
    result = {
        "model": {"params": model.num_params(), "dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                  "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "ffn": cfg.ffn_dim,
                  "vocab": cfg.vocab_size, "gate": cfg.gate, "dtype": "float32"},
        "windows": args.windows, "ctx": args.ctx, "weights_gib": round(weights_gib, 2),
        "peak_rss_after_build_gib": round(after_build, 2), "peak_rss_gib": round(rss_gib(), 2),
        "analysis_overhead_gib": round(rss_gib() - after_build, 2),
        "build_s": round(build_s, 1), "analyze_s": round(time.time() - t, 1),
        "layers_reported": len(rep["layers"]), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
