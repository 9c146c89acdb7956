"""Which of ONNX Runtime's Gated DeltaNet ops the `--graph gqa` export uses by default, measured.

One Qwen3.5-0.8B-shaped stack (dim 1024, 16 key and 16 value heads of 128, conv 4, full attention 8 x 256 with 2 KV
heads, partial rotary 0.25) cut to 8 layers (6 GDN + 2 attention) and a 4,096-token vocabulary, so the mixers, not
the head, set the time; random weights (speed does not depend on the values), fp32, 2 threads. Three graphs of the
same weights: --graph gqa with LinearAttention (ORT 1.31+), with GatedDeltaNet (ORT 1.32+), and the traced
standard graph (the GDN rule as an ONNX Scan). Rounds alternate the graphs with the order rotated; each round
prefills 128 tokens and decodes 32. Also: the largest logit difference from float64 PyTorch, relative to the
largest logit, on a tiny hybrid (prefill of 2 x 24 tokens).

    python benchmarks/onnx_gdn_ops.py [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_laptop_shape import qwen35_08b  # noqa: E402

from quantgate.export.onnx import write_onnx  # noqa: E402
from quantgate.export.onnx_gqa import build_gqa_graph  # noqa: E402
from quantgate.model import build_model, hybrid, preset  # noqa: E402
from quantgate.runners import OrtRunner  # noqa: E402

FORMS = ("linear_attention", "gated_delta_net", "standard")


def write(form: str, model, folder: Path) -> Path:
    folder.mkdir()
    if form == "standard":
        write_onnx(model.cfg, model.state_dict(), folder / "model.onnx")
    else:
        build_gqa_graph(model.cfg, model.state_dict(), folder / "model.onnx", gdn_op=form)
    return folder / "model.onnx"


def parity(work: Path) -> dict:
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=64, gate="elementwise"),
                 value_heads_per_key_head=2)
    m = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = np.random.default_rng(0).integers(3, 300, size=(2, 24))
    ids[:, 0] = 0
    with torch.no_grad():
        ref = m.double()(torch.as_tensor(ids)).logits.numpy()
    m.float()
    out = {}
    for form in FORMS:
        with OrtRunner(write(form, m, work / f"tiny-{form}")) as r:
            out[form] = float(np.abs(r.logits(ids) - ref).max() / np.abs(ref).max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "onnx_gdn_ops.json"))
    args = ap.parse_args()
    import onnxruntime as ort
    work = Path(tempfile.mkdtemp(prefix="quantgate-gdn-ops-"))
    try:
        full = qwen35_08b()
        cfg = replace(full, n_layers=8, vocab_size=4096, layer_types=full.layer_types[:8])
        model = build_model(cfg, seed=0).eval()
        runners = {f: OrtRunner(write(f, model, work / f), threads=args.threads) for f in FORMS}
        rng = np.random.default_rng(0)
        pre, dec = [int(t) for t in rng.integers(3, 4000, 128)], [int(t) for t in rng.integers(3, 4000, 32)]
        for r in runners.values():  # warm-up
            r.time_round(pre[:16], dec[:4])
        rounds = {f: [] for f in FORMS}
        for k in range(args.rounds):
            order = FORMS[k % 3:] + FORMS[:k % 3]
            for f in order:
                a, b = runners[f].time_round(pre, dec)
                rounds[f].append({"prefill_tok_s": len(pre) / a, "decode_tok_s": len(dec) / b})
        med = {f: {k: float(np.median([r[k] for r in v])) for k in ("prefill_tok_s", "decode_tok_s")}
               for f, v in rounds.items()}
        ratio = {f: {k: [float(min(a[k] / b[k] for a, b in zip(rounds[f], rounds["standard"]))),
                         float(max(a[k] / b[k] for a, b in zip(rounds[f], rounds["standard"])))]
                     for k in ("prefill_tok_s", "decode_tok_s")} for f in FORMS[:2]}
        out = {"what": "fp32 --graph gqa GDN ops vs the traced Scan graph, Qwen3.5-0.8B layer shapes, 8 layers",
               "onnxruntime": ort.__version__, "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "rounds": args.rounds, "prefill_tokens": len(pre), "decode_tokens": len(dec),
               "median": med, "per_round_ratio_to_standard_range": ratio, "rounds_detail": rounds,
               "max_rel_logit_diff_vs_float64_torch": parity(work)}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: out[k] for k in ("median", "per_round_ratio_to_standard_range",
                                               "max_rel_logit_diff_vs_float64_torch")}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
