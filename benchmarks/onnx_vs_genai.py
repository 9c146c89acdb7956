"""quantgate's int4 ONNX export of a Qwen3.5 hybrid against onnxruntime-genai's build of the same checkpoint.

For each shape (Qwen3.5-0.8B and -2B text shapes, QWEN35.md section 1; random weights: speed, size and memory do
not depend on the values), in a fresh folder removed afterwards:

1. a random checkpoint in the released layout (`Qwen3_5ForConditionalGeneration`, bf16, a one-block vision tower),
   written by transformers 5 in a child process, with quantgate's byte tokenizer beside it;
2. onnxruntime-genai 0.18's builder, `-p int4 -e cpu` (its defaults: block 32, symmetric, accuracy level 4, the
   embedding GatherBlockQuantized, the tied head its own int4 copy), in a child process: seconds and peak RSS;
3. quantgate: `export onnx --graph gqa` then `quantize --scheme int4` (the same quantizer settings), each in a child
   process: seconds and peak RSS (the larger of the two);
4. decode and prefill tok/s of both graphs in one onnxruntime (2 threads), driven by the same loop (batch 1, caches
   bound with IOBinding, logits of the last position only where the graph allows); and each project's own
   runtime on its graph, as its users run it: quantgate's OrtRunner (`generate`'s loop, its SharedCache) and
   onnxruntime-genai's og.Generator. Rounds alternate the four with the order rotated, each round a 128-token
   prefill from empty caches then 64 decode steps; ratios are taken within a round (graph against graph in
   the one loop, runtime against runtime);
5. KLD of each graph's logits from quantgate's float PyTorch model of the checkpoint (transformers' logits to 1e-5,
   tests/test_parity_qwen35.py), on 4 windows of 128 random token ids (random weights: no text is more natural),
   with a bootstrap interval over positions;
6. file sizes (model.onnx + model.onnx.data).

    pip install onnxruntime-genai==0.18.0 --no-deps    # beside onnxruntime>=1.31 and transformers>=5.2
    python benchmarks/onnx_vs_genai.py [--shapes 0.8b,2b] [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {  # Qwen3.5 text configs (QWEN35.md section 1: hidden, layers, heads, linear heads, ffn; tied, vocab 248,320)
    "0.8b": dict(hidden_size=1024, intermediate_size=3584),
    "2b": dict(hidden_size=2048, intermediate_size=6144),
    "smoke": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=4096),  # the script's test
}
COMMON = dict(vocab_size=248320, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=0,
              eos_token_id=1, pad_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})

MAKE = """
import json, sys, torch, transformers
spec, out = json.loads(sys.argv[1]), sys.argv[2]
vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 2,
          "temporal_patch_size": 1, "spatial_merge_size": 1, "out_hidden_size": spec["hidden_size"]}
cfg = transformers.Qwen3_5Config(text_config=spec, vision_config=vision, tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device("meta"):
    m = transformers.Qwen3_5ForConditionalGeneration(cfg)
m = m.to_empty(device="cpu").to(torch.bfloat16)
with torch.no_grad():
    for n, p in m.named_parameters():
        p.copy_(0.3 * torch.randn(p.shape) if p.dim() == 1 else 0.02 * torch.randn(p.shape))
m.save_pretrained(out)
"""

# a child that runs argv and prints its peak RSS (KiB) last: the conversions' memory, each in a process of its own
PEAK = """
import resource, runpy, sys
kind, rest = sys.argv[1], sys.argv[2:]
try:
    if kind == "module":
        sys.argv = rest
        runpy.run_module(rest[0], run_name="__main__")
    else:
        from click.testing import CliRunner
        from quantgate.cli import main
        r = CliRunner().invoke(main, rest, catch_exceptions=False)
        assert r.exit_code == 0, r.output
finally:
    print("PEAK_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def child(args: list[str], log: Path) -> dict:
    env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True, cwd="/", env=env)
    secs = time.perf_counter() - t
    log.write_text(r.stdout[-20000:] + "\n--- stderr ---\n" + r.stderr[-20000:])
    peak = [int(x.split()[1]) for x in r.stdout.splitlines() if x.startswith("PEAK_KIB")]
    if r.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} failed: {r.stderr[-1500:]}")
    return {"seconds": round(secs, 1), "peak_rss_bytes": peak[-1] * 1024 if peak else None}


def onnx_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name in ("model.onnx", "model.onnx.data"))


class Graph:
    """One decoder in an InferenceSession, driven by a loop that knows only I/O names: input_ids, attention_mask,
    position_ids ([B, S], or [3, B, S] for genai's M-RoPE), past* caches fed from the matching present* outputs
    (bound with IOBinding, so they stay in onnxruntime's buffers), and logits_to_keep where the graph has it."""

    def __init__(self, path: Path, threads: int, dims: dict | None = None):
        import onnxruntime as ort
        self.dims = dims or {}  # named dims that are not lengths (genai's kv_cache_dim: the head size)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        self.s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.s.get_inputs()}
        self.outputs = [o.name for o in self.s.get_outputs()]
        self.pos3 = len(self.inputs["position_ids"].shape) == 3
        self.past_of = {}
        for o in self.outputs[1:]:
            tail = o.removeprefix("present.")
            self.past_of[o] = next(n for n in (f"past.{tail}", f"past_key_values.{tail}") if n in self.inputs)

    def empty(self) -> dict:
        out = {}
        for name, i in self.inputs.items():
            if name.startswith("past"):
                shape = [1 if k == 0 else d if isinstance(d, int) else self.dims.get(d, 0) for k, d in enumerate(i.shape)]
                out[name] = np.zeros(shape, dtype=np.float32)
        return out

    def run(self, ids: list[int], past: dict, start: int, keep_all: bool = False):
        import onnxruntime as ort
        T = len(ids)
        pos = np.arange(start, start + T, dtype=np.int64)[None]
        feed = {"input_ids": np.array([ids], dtype=np.int64),
                "attention_mask": np.ones((1, start + T), dtype=np.int64),
                "position_ids": np.broadcast_to(pos, (3, 1, T)).copy() if self.pos3 else pos, **past}
        if "logits_to_keep" in self.inputs:
            feed["logits_to_keep"] = np.array(T if keep_all else 1, dtype=np.int64)
        io = self.s.io_binding()
        for k, v in feed.items():
            if isinstance(v, ort.OrtValue):
                io.bind_ortvalue_input(k, v)
            else:
                io.bind_cpu_input(k, np.asarray(v, order="C"))
        for o in self.outputs:
            io.bind_output(o, "cpu")
        self.s.run_with_iobinding(io)
        outs = io.get_outputs()
        return outs[0].numpy(), {self.past_of[o]: v for o, v in zip(self.outputs[1:], outs[1:])}

    def time_round(self, prompt: list[int], decode: list[int]) -> tuple[float, float]:
        t0 = time.perf_counter()
        _, past = self.run(prompt, self.empty(), 0)
        t1 = time.perf_counter()
        pos = len(prompt)
        for t in decode:
            _, past = self.run([t], past, pos)
            pos += 1
        return t1 - t0, time.perf_counter() - t1

    def logits(self, window: list[int]) -> np.ndarray:
        return self.run(window, self.empty(), 0, keep_all=True)[0][0]


class GenaiRuntime:
    """onnxruntime-genai's own runtime on its graph (greedy, the threads set in its genai_config.json)."""

    def __init__(self, folder: Path, threads: int):
        import onnxruntime_genai as og
        cfg_file = folder / "genai_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        cfg_file.write_text(json.dumps(cfg, indent=2))
        self.og, self.model = og, og.Model(str(folder))

    def time_round(self, prompt: list[int], decode: list[int]) -> tuple[float, float]:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + len(decode) + 1, do_sample=False)
        gen = self.og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        t1 = time.perf_counter()
        for _ in decode:
            gen.generate_next_token()
        return t1 - t0, time.perf_counter() - t1


def kld(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per-position KL(ref || got) of two logit arrays [T, V] (float64)."""
    def logsm(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    p, q = logsm(ref), logsm(got)
    return (np.exp(p) * (p - q)).sum(-1)


def interval(x: np.ndarray, seed: int = 0, n: int = 2000) -> list[float]:
    rng = np.random.default_rng(seed)
    means = [x[rng.integers(0, len(x), len(x))].mean() for _ in range(n)]
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def run_shape(name: str, work: Path, args) -> dict:
    spec = {**COMMON, **SHAPES[name]}
    if name == "smoke":
        spec["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    ckpt = work / "ckpt"
    r = subprocess.run([sys.executable, "-c", MAKE, json.dumps(spec), str(ckpt)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    from quantgate.tokenizer import byte_tokenizer
    byte_tokenizer().save(ckpt)
    conv = {"genai": child(["module", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(work / "genai"),
                            "-p", "int4", "-e", "cpu"], work / "genai.log")}
    export = child(["cli", "export", "onnx", str(ckpt), "--graph", "gqa", "--out", str(work / "qg-fp32")],
                   work / "qg-export.log")
    quant = child(["cli", "quantize", str(work / "qg-fp32"), "--scheme", "int4", "--out", str(work / "qg")],
                  work / "qg-quant.log")
    conv["quantgate"] = {"seconds": round(export["seconds"] + quant["seconds"], 1),
                         "peak_rss_bytes": max(export["peak_rss_bytes"] or 0, quant["peak_rss_bytes"] or 0),
                         "export": export, "quantize": quant}
    shutil.rmtree(work / "qg-fp32")
    sizes = {"genai": onnx_bytes(work / "genai"), "quantgate": onnx_bytes(work / "qg")}

    rng = np.random.default_rng(0)
    windows = [[0] + [int(t) for t in rng.integers(3, spec["vocab_size"], 127)] for _ in range(4)]
    from quantgate.formats import load_checkpoint
    import torch
    model = load_checkpoint(ckpt).model.eval()
    with torch.no_grad():
        ref = [model(torch.tensor([w])).logits[0].numpy() for w in windows]
    del model
    graphs = {"quantgate": Graph(work / "qg" / "model.onnx", args.threads),
              "genai": Graph(work / "genai" / "model.onnx", args.threads, {"kv_cache_dim": spec["head_dim"]})}
    per_pos = {k: np.concatenate([kld(r, g.logits(w)) for r, w in zip(ref, windows)]) for k, g in graphs.items()}
    del ref
    klds = {k: {"mean": float(v.mean()), "ci95": interval(v), "p99": float(np.percentile(v, 99))}
            for k, v in per_pos.items()}
    ratio = per_pos["quantgate"] - per_pos["genai"]
    klds["quantgate_minus_genai"] = {"mean": float(ratio.mean()), "ci95": interval(ratio)}

    from quantgate.runners import OrtRunner
    timers = {**graphs, "quantgate-runner": OrtRunner(work / "qg", threads=args.threads),
              "genai-runtime": GenaiRuntime(work / "genai", args.threads)}
    prompt, decode = [0] + [int(t) for t in rng.integers(3, 30000, 127)], [int(t) for t in rng.integers(3, 30000, 64)]
    for t in timers.values():  # warm-up
        t.time_round(prompt[:16], decode[:4])
    names = list(timers)
    rounds = {k: [] for k in names}
    for k in range(args.rounds):
        for n in names[k % len(names):] + names[:k % len(names)]:
            a, b = timers[n].time_round(prompt, decode)
            rounds[n].append({"prefill_tok_s": len(prompt) / a, "decode_tok_s": len(decode) / b})
    speed = {n: {m: float(np.median([r[m] for r in v])) for m in ("prefill_tok_s", "decode_tok_s")}
             for n, v in rounds.items()}
    ratios = {}
    for ours, other in (("quantgate", "genai"), ("quantgate-runner", "genai-runtime")):
        per = {m: [a[m] / b[m] for a, b in zip(rounds[ours], rounds[other])] for m in ("prefill_tok_s", "decode_tok_s")}
        ratios[f"{ours}/{other}"] = {m: {"median": float(np.median(v)), "range": [float(min(v)), float(max(v))]}
                                     for m, v in per.items()}
    ops = {}
    import onnx
    for k in ("quantgate", "genai"):
        g = onnx.load(str(work / {"quantgate": "qg", "genai": "genai"}[k] / "model.onnx"), load_external_data=False)
        ops[k] = len(g.graph.node)
    return {"config": spec, "conversion": conv, "bytes": sizes, "size_ratio": sizes["quantgate"] / sizes["genai"],
            "peak_rss_ratio": conv["quantgate"]["peak_rss_bytes"] / conv["genai"]["peak_rss_bytes"],
            "kld": klds, "speed_median": speed, "speed_ratio_per_round": ratios, "rounds": rounds,
            "graph_nodes": ops, "kld_windows": "4 x 128 random token ids (BOS first)",
            "speed_protocol": f"{len(prompt)}-token prefill then {len(decode)} decode steps, batch 1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.8b,2b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="parent of the fresh folder (default: the temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "onnx_vs_genai.json"))
    args = ap.parse_args()
    import onnxruntime
    import onnxruntime_genai
    out_file = Path(args.out)
    result = json.loads(out_file.read_text()) if out_file.is_file() else {}
    result.update({"command": "python benchmarks/onnx_vs_genai.py " + " ".join(sys.argv[1:]),
                   "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
                   "onnxruntime": onnxruntime.__version__, "onnxruntime_genai": onnxruntime_genai.__version__})
    result.setdefault("shapes", {})
    for name in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"quantgate-genai-{name}-", dir=args.work) as tmp:
            t = time.perf_counter()
            res = run_shape(name, Path(tmp), args)
            res["wall_s"] = round(time.perf_counter() - t, 1)
        result["shapes"][name] = res
        out_file.write_text(json.dumps(result, indent=2) + "\n")  # each shape as soon as it is measured
        print(name, json.dumps({k: res[k] for k in ("bytes", "size_ratio", "peak_rss_ratio", "kld", "speed_median",
                                                    "speed_ratio_per_round")}, indent=1), flush=True)


if __name__ == "__main__":
    main()
