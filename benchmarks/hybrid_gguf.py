"""Hybrid twins (Qwen3.5-style: Gated DeltaNet + gated attention) in stock llama.cpp: accuracy per GGUF type.

Trains a `small` hybrid twin pair briefly on the embedded corpus (`quantgate train --arch hybrid --twins`; a short
run, so the twins are young models, not the demo's), exports both to F32 GGUF (llama.cpp's qwen35 graph with the
real GDN layers), quantizes them with llama.cpp's quantizer to Q8_0, Q4_K_M and (gated twin) Q4_K_M with both gates
at Q8_0, and scores each file in llama.cpp (F32 KV cache) against its float PyTorch twin on the same held-out
windows: KL divergence (mean, with a 95% interval over windows: mean +- 1.96 standard errors of the per-window
means), top-1 agreement, perplexity delta, bits per weight. No twin-vs-twin verdict is drawn here: one short run
on one seed does not carry one.

    python benchmarks/hybrid_gguf.py [--steps 100] [--windows 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from quantgate.calib_data import default_split, eval_windows, load_corpus, tokenize_corpus
from quantgate.export.gguf import export_checkpoint
from quantgate.formats import inspect_gguf, load_checkpoint
from quantgate.gguf_quantize import quantize_gguf
from quantgate.metrics import position_kld, token_nll, top1_match
from quantgate.runners import LlamaRunner, TorchRunner
from quantgate.train import TrainConfig, train

TYPES = [("Q8_0", None), ("Q4_K_M", None), ("Q4_K_M", 8)]


def score(path: Path, ref: np.ndarray, windows: np.ndarray, threads: int) -> dict:
    with LlamaRunner(path, n_ctx=windows.shape[1], kv_type="f32", threads=threads) as r:
        lg = r.logits(windows)
    kld = position_kld(ref, lg)  # [N, T]
    per_window = kld.mean(axis=1)
    se = float(per_window.std(ddof=1) / np.sqrt(len(per_window)))
    ppl, ref_ppl = float(np.exp(token_nll(lg, windows).mean())), float(np.exp(token_nll(ref, windows).mean()))
    info = inspect_gguf(path)
    return {"kld_mean": float(kld.mean()), "kld_ci95": [float(kld.mean()) - 1.96 * se, float(kld.mean()) + 1.96 * se],
            "top1_agreement": float(top1_match(ref, lg).mean()), "ppl": ppl, "delta_ppl_pct": 100 * (ppl / ref_ppl - 1),
            "bits_per_weight": round(info.bits_per_weight, 3), "bytes": info.n_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/quantgate-hybrid-gguf")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_gguf.json"))
    args = ap.parse_args()
    work = Path(args.work)
    t0 = time.time()
    tc = TrainConfig(preset="small", arch="hybrid", twins=True, steps=args.steps, threads=args.threads,
                     ckpt_every=args.steps)
    run = work / "run"
    paths = train(tc, run, resume=(run / "state" / "train_state.pt").is_file())
    train_s = time.time() - t0
    tok = load_checkpoint(paths["baseline"]).tokenizer
    data = "embedded"
    windows = eval_windows(tokenize_corpus(load_corpus(data).split(default_split(data)), tok).ids, args.ctx,
                           tok.bos_id, args.windows)
    result = {"command": f"python benchmarks/hybrid_gguf.py --steps {args.steps} --windows {args.windows} "
                         f"--ctx {args.ctx} --threads {args.threads}",
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
              "train": {"preset": "small", "arch": "hybrid", "steps": args.steps, "seconds": round(train_s, 1)},
              "windows": int(len(windows)), "ctx": args.ctx, "data": f"{data} ({default_split(data)} split)",
              "twins": {}}
    for twin in ("baseline", "gated"):
        model = load_checkpoint(paths[twin]).model
        ref = TorchRunner(model).logits(windows)
        f32 = work / f"{twin}-F32.gguf"
        if not f32.exists():
            export_checkpoint(paths[twin], f32, "f32")
        cells = {"F32": score(f32, ref, windows, args.threads)}
        for qtype, gate_bits in TYPES:
            if gate_bits and twin == "baseline":
                continue
            name = qtype + ("+gate8" if gate_bits else "")
            out = work / f"{twin}-{name}.gguf"
            if not out.exists():
                q = quantize_gguf(f32, out, qtype, gate_bits=gate_bits, threads=args.threads)
                kept = {"kept_high": q["kept_high"], "attn_q": q["attn_q_types"], "attn_gate": q["gdn_gate_types"]}
            else:
                kept = {}
            cells[name] = {**score(out, ref, windows, args.threads), **kept}
            print(twin, name, {k: cells[name][k] for k in ("kld_mean", "top1_agreement", "bits_per_weight")}, flush=True)
        result["twins"][twin] = cells
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
