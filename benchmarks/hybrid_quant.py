"""Hybrid twins (Qwen3.5-style: Gated DeltaNet + gated attention): accuracy per quantized type in stock llama.cpp
and in ONNX Runtime.

Trains a `small` hybrid twin pair briefly on the embedded corpus (`quantgate train --arch hybrid --twins`; a short
run, so the twins are young models, not the demo's), then for each twin:
- GGUF: F32 export (llama.cpp's qwen35 graph with the real GDN layers), llama.cpp's quantizer to Q8_0, Q4_K_M and
  (gated twin) Q4_K_M with both gates at Q8_0, scored in llama.cpp (F32 KV cache);
- ONNX: fp32 export (each GDN layer's rule an ONNX Scan), onnxruntime.quantization to int8-dynamic, int4 and
  (gated twin) int4 with both gates at 8 bits, scored in ONNX Runtime;
each against its float PyTorch twin on the same held-out windows: KL divergence (mean, with a 95% interval over
windows: mean +- 1.96 standard errors of the per-window means), top-1 agreement, perplexity delta, size. No
twin-vs-twin verdict is drawn here: one short run on one seed does not carry one. Every file is built afresh in a
temporary folder (removed afterwards), so a rerun never scores stale files.

    python benchmarks/hybrid_quant.py [--steps 100] [--windows 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from quantgate.calib_data import default_split, eval_windows, load_corpus, tokenize_corpus
from quantgate.export.gguf import export_checkpoint as export_gguf
from quantgate.export.onnx import export_checkpoint as export_onnx
from quantgate.formats import inspect_gguf, load_checkpoint
from quantgate.formats.onnx_io import onnx_bytes
from quantgate.quant.llama_cpp import quantize_gguf
from quantgate.metrics import position_kld, token_nll, top1_match
from quantgate.quant.ort import quantize_onnx
from quantgate.runners import LlamaRunner, OrtRunner, TorchRunner
from quantgate.train import TrainConfig, train

GGUF_TYPES = [("Q8_0", None), ("Q4_K_M", None), ("Q4_K_M", 8)]
ONNX_SCHEMES = [("int8-dynamic", None), ("int4", None), ("int4", 8)]


def metrics(lg: np.ndarray, ref: np.ndarray, windows: np.ndarray, n_bytes: int, n_params: int) -> dict:
    kld = position_kld(ref, lg)  # [N, T]
    per_window = kld.mean(axis=1)
    se = float(per_window.std(ddof=1) / np.sqrt(len(per_window)))
    ppl, ref_ppl = float(np.exp(token_nll(lg, windows).mean())), float(np.exp(token_nll(ref, windows).mean()))
    return {"kld_mean": float(kld.mean()), "kld_ci95": [float(kld.mean()) - 1.96 * se, float(kld.mean()) + 1.96 * se],
            "top1_agreement": float(top1_match(ref, lg).mean()), "ppl": ppl, "delta_ppl_pct": 100 * (ppl / ref_ppl - 1),
            "bits_per_weight": round(8 * n_bytes / n_params, 3), "bytes": n_bytes}


def gguf_cells(twin: str, src: Path, work: Path, ref, windows, n_params: int, threads: int) -> dict:
    def score(path: Path) -> dict:
        with LlamaRunner(path, n_ctx=windows.shape[1], kv_type="f32", threads=threads) as r:
            lg = r.logits(windows)
        out = metrics(lg, ref, windows, inspect_gguf(path).n_bytes, n_params)
        out["bits_per_weight"] = round(inspect_gguf(path).bits_per_weight, 3)  # llama.cpp's count (tensors only)
        return out

    f32 = work / f"{twin}-F32.gguf"
    export_gguf(src, f32, "f32")
    cells = {"F32": score(f32)}
    for qtype, gate_bits in GGUF_TYPES:
        if gate_bits and twin == "baseline":
            continue
        name = qtype + ("+gate8" if gate_bits else "")
        out = work / f"{twin}-{name}.gguf"
        q = quantize_gguf(f32, out, qtype, gate_bits=gate_bits, threads=threads)
        cells[name] = {**score(out), "kept_high": q["kept_high"], "attn_q": q["attn_q_types"],
                       "attn_gate": q["gdn_gate_types"]}
        print(twin, "gguf", name, {k: cells[name][k] for k in ("kld_mean", "top1_agreement")}, flush=True)
    return cells


def onnx_cells(twin: str, src: Path, work: Path, ref, windows, n_params: int, threads: int) -> dict:
    def score(path: Path) -> dict:
        with OrtRunner(path, threads=threads) as r:
            lg = r.logits(windows)
        return metrics(lg, ref, windows, onnx_bytes(path), n_params)

    fp32 = work / f"{twin}-onnx-fp32"
    t = time.perf_counter()
    export_onnx(src, fp32)
    cells = {"fp32": {**score(fp32), "export_s": round(time.perf_counter() - t, 1)}}
    for scheme, gate_bits in ONNX_SCHEMES:
        if gate_bits and twin == "baseline":
            continue
        name = scheme + ("+gate8" if gate_bits else "")
        out = work / f"{twin}-onnx-{name}"
        q = quantize_onnx(fp32, out, scheme, gate_bits=gate_bits)
        cells[name] = {**score(out), "gate_matmuls_at_8_bits": q["gate_matmuls"] if gate_bits else 0,
                       "kept_float": q["kept_float"]}
        print(twin, "onnx", name, {k: cells[name][k] for k in ("kld_mean", "top1_agreement")}, flush=True)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=None, help="parent of the fresh folder the files go to (default: the temp dir)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_quant.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="quantgate-hybrid-quant-", dir=args.work) as tmp:
        run(Path(tmp), args)


def run(work: Path, args) -> None:
    t0 = time.time()
    tc = TrainConfig(preset="small", arch="hybrid", twins=True, steps=args.steps, threads=args.threads,
                     ckpt_every=args.steps)
    paths = train(tc, work / "run")
    train_s = time.time() - t0
    tok = load_checkpoint(paths["baseline"]).tokenizer
    data = "embedded"
    windows = eval_windows(tokenize_corpus(load_corpus(data).split(default_split(data)), tok).ids, args.ctx,
                           tok.bos_id, args.windows)
    result = {"command": f"python benchmarks/hybrid_quant.py --steps {args.steps} --windows {args.windows} "
                         f"--ctx {args.ctx} --threads {args.threads}",
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
              "train": {"preset": "small", "arch": "hybrid", "steps": args.steps, "seconds": round(train_s, 1)},
              "windows": int(len(windows)), "ctx": args.ctx, "data": f"{data} ({default_split(data)} split)",
              "bits_per_weight": "GGUF: llama.cpp's count over the tensors; ONNX: 8 x file bytes / parameters",
              "twins": {}}
    for twin in ("baseline", "gated"):
        model = load_checkpoint(paths[twin]).model
        ref = TorchRunner(model).logits(windows)
        n = model.num_params()
        result["twins"][twin] = {
            "gguf": gguf_cells(twin, paths[twin], work, ref, windows, n, args.threads),
            "onnx": onnx_cells(twin, paths[twin], work, ref, windows, n, args.threads)}
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
