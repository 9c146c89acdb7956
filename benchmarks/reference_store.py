"""`eval --reference` at Qwen3.5's vocabulary: what the compact reference (quantgate.reference) stores, what it costs
in memory, and the KLD error it introduces against the exact float computation.

On a Qwen3.5-0.8B-shaped hybrid with random weights (benchmarks/hybrid_laptop_shape.py's shape: d 1024, 24 layers,
vocab 248,320, tied; saved in bf16, 1.5 GB), in a fresh folder removed afterwards:

1. the checkpoint exported to a BF16 GGUF and quantized to Q4_K_M by llama.cpp (the BF16 file then removed);
2. `quantgate eval Q4_K_M.gguf --reference CKPT --max-windows 16 --json` in a child process (2 threads, the embedded
   corpus's test split, windows of 256), its own cache folder: the main process's peak RSS, the llama.cpp worker's,
   the seconds, and the bytes the reference left in the cache;
   (peaks are each process's own VmHWM: getrusage's ru_maxrss, used until 2026-12-05, carried this script's own
   high-water mark into the child started from it, and read 6.44 GB whatever the eval held);
3. the exact KLD: in this process, the same 16 windows and the same Q4_K_M runner, compared by the same code
   (evaluate.compare_to_reference) against the float model's own fp32 logits from its full forward pass, a window at
   a time, instead of the stored reference; the relative difference of the KLD means, p99s and perplexities.

The issue's goals: reference storage <= 1 GB, KLD within 1e-3 relative of the exact computation, peak memory <= the
model's float size + 2 GB.

    python benchmarks/reference_store.py [--threads 2] [--windows 16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_laptop_shape import qwen35_08b  # noqa: E402  (the shape, one definition)

from quantgate.calib_data import eval_windows, load_corpus, tokenize_corpus  # noqa: E402
from quantgate.evaluate import compare_to_reference  # noqa: E402
from quantgate.export.gguf import export_checkpoint  # noqa: E402
from quantgate.formats import load_checkpoint, save_checkpoint  # noqa: E402
from quantgate.quant.llama_cpp import quantize_gguf  # noqa: E402
from quantgate.model import build_model  # noqa: E402
from quantgate.reference import reference_logits  # noqa: E402
from quantgate.runners import LlamaRunner  # noqa: E402
from quantgate.tokenizer import byte_tokenizer  # noqa: E402

EVAL = """
import json, sys
from click.testing import CliRunner
from quantgate.cli import main
from quantgate.memory import peak_rss_bytes
r = CliRunner().invoke(main, sys.argv[1:], catch_exceptions=False)
assert r.exit_code == 0, r.output
peak = peak_rss_bytes()  # each process's own VmHWM: ru_maxrss would carry this script's parent's peak (memory.py)
print(json.dumps({"result": json.loads(r.stdout), "peak_self_kib": peak["quantgate"] // 1024,
                  "peak_children_kib": peak["children"] // 1024}))
"""


class ExactReference:
    """The float model's own fp32 logits, computed by its full forward pass a slice of windows at a time: the
    exact reference the stored one is measured against (never held whole: 254 MB per window)."""

    def __init__(self, model, windows: np.ndarray):
        self.model, self.windows = model, windows
        self.shape = (*windows.shape, model.cfg.vocab_size)

    def __len__(self) -> int:
        return self.shape[0]

    @torch.inference_mode()
    def __getitem__(self, key) -> np.ndarray:
        return self.model(torch.as_tensor(self.windows[key])).logits.numpy()


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run(work: Path, args) -> dict:
    cfg = qwen35_08b()
    t = time.perf_counter()
    model = build_model(cfg, seed=0).eval()
    save_checkpoint(model, work / "m", byte_tokenizer())
    del model
    sd = load_file(work / "m" / "model.safetensors")  # stored in bf16, as released checkpoints are
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(work / "m" / "model.safetensors"))
    del sd
    export_checkpoint(work / "m", work / "m-BF16.gguf", "bf16")
    quantize_gguf(work / "m-BF16.gguf", work / "m-Q4_K_M.gguf", "Q4_K_M", threads=args.threads)
    (work / "m-BF16.gguf").unlink()
    prep_s = time.perf_counter() - t
    ckpt_bytes = sum(f.stat().st_size for f in (work / "m").iterdir())

    cache = work / "cache"
    env = {**os.environ, "QUANTGATE_PROGRESS": "0", "QUANTGATE_CACHE": str(cache)}
    cmd = ["eval", str(work / "m-Q4_K_M.gguf"), "--reference", str(work / "m"), "--max-windows", str(args.windows),
           "--ctx", "256", "--threads", str(args.threads), "--json"]
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", EVAL, *cmd], capture_output=True, text=True, cwd="/", env=env)
    eval_s = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    child = json.loads(r.stdout.strip().splitlines()[-1])
    res = child["result"]
    stored = sorted(cache.glob("ref-*.npy"))
    stored_bytes = sum(f.stat().st_size for f in stored)

    # the exact computation on the same windows, with the same runner and the same scoring code
    loaded = load_checkpoint(work / "m")
    tok = loaded.tokenizer
    corpus = load_corpus("embedded").split("test")
    windows = eval_windows(tokenize_corpus(corpus, tok).ids, 256, tok.bos_id, args.windows)
    model = loaded.model.float().eval()
    t = time.perf_counter()
    with LlamaRunner(work / "m-Q4_K_M.gguf", n_ctx=256, threads=args.threads) as runner:
        exact = compare_to_reference(runner, ExactReference(model, windows), windows)
        exact_s = time.perf_counter() - t
        again = compare_to_reference(runner, reference_logits(str(work / "m"), windows,
                                                              f"{corpus.fingerprint}|test|256"), windows)
    float_bytes = 4 * loaded.model.num_params()  # the model in fp32, as PyTorch runs it
    return {
        "command": f"python benchmarks/reference_store.py --threads {args.threads} --windows {args.windows}",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "shape": {k: v for k, v in cfg.to_dict().items() if k != "extra"}, "params": loaded.model.num_params(),
        "checkpoint_bytes": ckpt_bytes, "float_fp32_bytes": float_bytes,
        "windows": args.windows, "ctx": 256, "data": "embedded (test split)", "prepare_s": round(prep_s, 1),
        "eval": {"seconds": round(eval_s, 1), "peak_rss_main_bytes": child["peak_self_kib"] * 1024,
                 "peak_rss_llama_worker_bytes": child["peak_children_kib"] * 1024,
                 "kld_mean": res["kld_mean"], "kld_p99": res["kld_p99"], "ppl": res["ppl"],
                 "reference_ppl": res["reference_ppl"], "top1_agreement": res["top1_agreement"]},
        "reference_store": {"files": [f.name for f in stored], "bytes": stored_bytes,
                            "fp32_logits_bytes_for_comparison": args.windows * 256 * cfg.vocab_size * 4},
        "exact": {"seconds": round(exact_s, 1), "kld_mean": exact["kld_mean"], "kld_p99": exact["kld_p99"],
                  "ppl": exact["ppl"], "reference_ppl": exact["reference_ppl"],
                  "top1_agreement": exact["top1_agreement"]},
        "stored_in_process": {"kld_mean": again["kld_mean"]},
        "relative_error": {"kld_mean": rel(res["kld_mean"], exact["kld_mean"]),
                           "kld_p99": rel(res["kld_p99"], exact["kld_p99"]),
                           "reference_ppl": rel(res["reference_ppl"], exact["reference_ppl"])},
        "goals": {"storage_le_1GB": stored_bytes <= 1e9,
                  "kld_within_1e-3": rel(res["kld_mean"], exact["kld_mean"]) <= 1e-3,
                  "peak_le_float_plus_2GB": child["peak_self_kib"] * 1024 <= float_bytes + 2e9},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=None, help="parent of the fresh folder the files go to (default: the temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "reference_store.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="quantgate-refstore-", dir=args.work) as tmp:
        result = run(Path(tmp), args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("eval", "reference_store", "exact", "relative_error", "goals")}, indent=1))


if __name__ == "__main__":
    main()
