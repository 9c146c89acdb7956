"""A Qwen3.5-0.8B-shaped hybrid with random weights (speed and memory do not depend on the values) on this CPU:
what the GGUF path costs at a real model's shape.

Shape (QWEN35.md section 1.2): d 1024, 24 layers (18 Gated DeltaNet, every fourth full attention), 8 heads x 256
with 2 KV heads and partial rotary 64, GDN 16 key / 16 value heads of 128, ffn 3584, vocab 248,320, tied
embeddings, rope theta 1e7. Measures: save (safetensors), F32 GGUF export and llama.cpp Q4_K_M quantization times;
peak RSS of `quantgate analyze` (4 windows of 256, a child process); the fp32 ONNX export (a child process: its time
and peak RSS) and its onnxruntime int4 quantization (MatMulNBits, block 32); llama.cpp Q4_K_M and ONNX Runtime int4
prefill 128 / decode 64 tokens/s at 2 threads (the runners' bench protocol: one warm-up, then median of rounds).

    python benchmarks/hybrid_laptop_shape.py [--threads 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from quantgate.export.gguf import export_checkpoint
from quantgate.formats import inspect_gguf, save_checkpoint
from quantgate.formats.onnx_io import onnx_bytes
from quantgate.quant.llama_cpp import quantize_gguf
from quantgate.model import ModelConfig, build_model, hybrid
from quantgate.quant.ort import quantize_onnx
from quantgate.runners import LlamaRunner, OrtRunner
from quantgate.tokenizer import byte_tokenizer

EXPORT_ONNX = """
import resource, sys, time
from quantgate.export.onnx import export_checkpoint
t = time.perf_counter()
export_checkpoint(sys.argv[1], sys.argv[2])
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

ANALYZE = """
import resource, sys
from quantgate.analyze import analyze
analyze(sys.argv[1], sys.argv[2], ctx=256, n_windows=4)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def qwen35_08b() -> ModelConfig:
    base = ModelConfig(vocab_size=248320, dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, head_dim=256, ffn_dim=3584,
                       gate="elementwise", rope_theta=1e7, tie_embeddings=True, max_seq_len=4096)
    return replace(hybrid(base), linear_key_heads=16, linear_value_heads=16, linear_key_dim=128, linear_value_dim=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=None, help="parent of the fresh folder the files go to (default: the temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_laptop_shape.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="quantgate-hybrid-08b-", dir=args.work) as tmp:
        run(Path(tmp), args)


def run(work: Path, args) -> None:
    """Every step from scratch in `work` (a fresh folder, removed afterwards): the times are never of reused files."""
    cfg = qwen35_08b()
    times = {}
    t = time.perf_counter()
    model = build_model(cfg, seed=0).eval()
    n_params = model.num_params()
    save_checkpoint(model, work / "m", byte_tokenizer())
    del model
    times["build_and_save_s"] = time.perf_counter() - t
    (work / "text.txt").write_text(open(json.__file__).read() * 4)
    t = time.perf_counter()
    export_checkpoint(work / "m", work / "m-F32.gguf", "f32")
    times["export_f32_gguf_s"] = time.perf_counter() - t
    t = time.perf_counter()
    quantize_gguf(work / "m-F32.gguf", work / "m-Q4_K_M.gguf", "Q4_K_M", threads=args.threads)
    times["quantize_q4_k_m_s"] = time.perf_counter() - t
    r = subprocess.run([sys.executable, "-c", ANALYZE, str(work / "m"), str(work / "text.txt")], capture_output=True,
                       text=True, cwd="/", env={"QUANTGATE_PROGRESS": "0", "PATH": "/usr/bin:/bin"})
    peak_analyze = int(r.stdout.strip().splitlines()[-1]) * 1024 if r.returncode == 0 else None
    ids = list(range(3, 3 + 192))
    with LlamaRunner(work / "m-Q4_K_M.gguf", n_ctx=256, kv_type="f16", threads=args.threads, logits_all=False) as run:
        speed = run.bench(ids[:128], ids[128:], repeats=args.rounds, warmup=1)
    r2 = subprocess.run([sys.executable, "-c", EXPORT_ONNX, str(work / "m"), str(work / "onnx")], capture_output=True,
                        text=True, cwd="/", env={"QUANTGATE_PROGRESS": "0", "PATH": "/usr/bin:/bin"})
    onnx = {"error": r2.stderr[-300:]} if r2.returncode else {}
    if r2.returncode == 0:
        secs, rss = r2.stdout.strip().splitlines()[-1].split()
        times["export_fp32_onnx_s"] = float(secs)
        t = time.perf_counter()
        quantize_onnx(work / "onnx", work / "onnx-int4", "int4")
        times["quantize_onnx_int4_s"] = time.perf_counter() - t
        with OrtRunner(work / "onnx-int4", threads=args.threads) as ort_run:
            ort_speed = ort_run.bench(ids[:128], ids[128:], repeats=args.rounds, warmup=1)
        onnx = {"export_peak_rss_bytes": int(rss) * 1024, "fp32_bytes": onnx_bytes(work / "onnx"),
                "int4_bytes": onnx_bytes(work / "onnx-int4"),
                "int4_bits_per_weight": round(8 * onnx_bytes(work / "onnx-int4") / n_params, 3),
                "prefill_tps": ort_speed["prefill_tps"], "decode_tps": ort_speed["decode_tps"], "rounds": args.rounds,
                "prompt_tokens": 128, "decode_tokens": 64}
    info = inspect_gguf(work / "m-Q4_K_M.gguf")
    result = {
        "command": f"python benchmarks/hybrid_laptop_shape.py --threads {args.threads} --rounds {args.rounds}",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "shape": {k: v for k, v in cfg.to_dict().items() if k != "extra"}, "params": n_params,
        "times": {k: round(v, 1) for k, v in times.items()},
        "analyze_peak_rss_bytes": peak_analyze, "analyze_error": None if peak_analyze else r.stderr[-300:],
        "q4_k_m": {"bytes": info.n_bytes, "bits_per_weight": round(info.bits_per_weight, 3),
                   "prefill_tps": speed["prefill_tps"], "decode_tps": speed["decode_tps"], "rounds": args.rounds,
                   "kv_type": "f16", "prompt_tokens": 128, "decode_tokens": 64},
        "onnx_int4": onnx,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["times"]), result["q4_k_m"], result["onnx_int4"], peak_analyze)


if __name__ == "__main__":
    main()
