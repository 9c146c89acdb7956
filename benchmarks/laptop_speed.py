"""Speed at laptop scale: random-weight twins at real model shapes, every format, against the memory-bandwidth bound.

Shapes (speed does not depend on the weights' values, so the weights are random):
- qwen3-0.6b: Qwen3-0.6B's (d 1024, 28 layers, 16 heads x 128, 8 KV heads, ffn 3072, vocab 151,936, tied), as
  baseline (GGUF arch qwen3), gated (qwen35 + the identity recurrent layer) and the baseline written as qwen35
  (gate rows 0, o_proj doubled: the same function in the gated file's graph);
- qwen35-0.8b and qwen35-2b: the Qwen3.5 hybrids (18 Gated DeltaNet + 6 gated full-attention layers, vocab
  248,320, tied; QWEN35.md section 1.2), gated and a baseline whose full-attention layers have no gate, plus the
  GGUF llama.cpp's own convert_hf_to_gguf.py writes for the gated checkpoint (same quantizer afterwards).

Formats: llama.cpp F16, Q8_0, Q4_K_M (F16 KV cache); ONNX Runtime fp32, int8 (MatMulNBits 8-bit blocks, the
weight-only scheme, like Q8_0) and int4 (MatMulNBits, block 32), in both graph forms (`standard`: traced, ONNX
Attention; `gqa`: hand-built GroupQueryAttention); PyTorch eager fp32 as the reference. Every group of twins is
timed with the runners' one bench protocol (quantgate.runners.bench): a short untimed warm-up, then rounds that
alternate between the twins (A B A B ...) of prefill 512 tokens from an empty cache and decode 128 tokens one
at a time; medians, with the range of the per-round ratios (round k of each twin ran back to back).

Also: the machine's copy bandwidth (numpy, read + write counted) at the start and the end; each decode figure
as a fraction of its bound (bytes read per token, at the mean decode position, over that bandwidth); peak RSS
(the llama.cpp worker's VmHWM; for ONNX Runtime and PyTorch, the resident memory a runner added by loading and
its warm-up); file sizes; the gate's share of the matmul work, which the prefill cost is held against.

    python benchmarks/laptop_speed.py [--shapes qwen3-0.6b,qwen35-0.8b,qwen35-2b] [--rounds 3]
        [--llama-cpp-src DIR]   # the vendored llama.cpp tree of the llama-cpp-python sdist (else pip-downloaded)

Writes benchmarks/results/laptop_speed.json after every shape (so a long run keeps what it measured) and
laptop_speed.md from it (`--markdown-only` rewrites the .md from the .json).
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from quantgate.bandwidth import copy_bandwidth, gguf_decode_bytes, onnx_decode_bytes, read_bandwidth, torch_decode_bytes
from quantgate.export.gguf import export_checkpoint as export_gguf_checkpoint
from quantgate.export.gguf import export_gguf
from quantgate.formats import inspect_gguf, save_checkpoint
from quantgate.formats.onnx_io import onnx_bytes
from quantgate.quant.llama_cpp import quantize_gguf
from quantgate.model import Model, ModelConfig, hybrid, make_twins
from quantgate.runners import LlamaRunner, OrtRunner, TorchRunner
from quantgate.runners.bench import bench
from quantgate.tokenizer import byte_tokenizer, train_bpe

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CONVERT = HERE.parent / "tests" / "llama_convert.py"  # runs llama.cpp's converter (transformers 5 interpreter)


def qwen3_06b() -> ModelConfig:
    return ModelConfig(vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                       ffn_dim=3072, rope_theta=1e6, tie_embeddings=True, max_seq_len=2048)


def qwen35(dim: int, ffn: int) -> ModelConfig:
    base = ModelConfig(vocab_size=248320, dim=dim, n_layers=24, n_heads=8, n_kv_heads=2, head_dim=256, ffn_dim=ffn,
                       rope_theta=1e7, tie_embeddings=True, max_seq_len=2048)
    return replace(hybrid(base), linear_key_heads=16, linear_value_heads=16, linear_key_dim=128, linear_value_dim=128)


SHAPES = {"qwen3-0.6b": qwen3_06b, "qwen35-0.8b": lambda: qwen35(1024, 3584), "qwen35-2b": lambda: qwen35(2048, 6144),
          "smoke": lambda: ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128,
                                       ffn_dim=512, max_seq_len=2048),
          "smoke-hybrid": lambda: replace(hybrid(ModelConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=2,
                                                             n_kv_heads=1, head_dim=128, ffn_dim=512,
                                                             max_seq_len=2048)), linear_key_heads=2,
                                          linear_value_heads=2, linear_key_dim=128, linear_value_dim=128)}

CHILD_ENV = {"QUANTGATE_PROGRESS": "0", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}
EXPORT_ONNX = """
import resource, sys, time
from quantgate.export.onnx import export_checkpoint
t = time.perf_counter()
export_checkpoint(sys.argv[1], sys.argv[2], graph=sys.argv[3])
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
QUANT_ONNX = """
import resource, sys, time
from quantgate.quant.ort import quantize_onnx
t = time.perf_counter()
quantize_onnx(sys.argv[1], sys.argv[2], sys.argv[3])
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


# --- measuring ---------------------------------------------------------------------------------------------------

def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(script: str, *args: str) -> tuple[float, int]:
    """Run a step in a fresh interpreter (its memory is its own and is returned): (seconds, peak RSS bytes)."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd="/",
                       env={**os.environ, **CHILD_ENV})
    if r.returncode:
        raise RuntimeError(f"{script.split()[5]} failed: {r.stderr.strip()[-400:]}")
    secs, rss = r.stdout.strip().splitlines()[-1].split()
    return float(secs), int(rss) * 1024


def timed_group(opened: dict, ids: list[int], n_prefill: int, rounds: int, bytes_per_token: dict,
                bandwidth: float) -> dict:
    """Alternated rounds over the open runners of one group; per runner its medians, its decode as a fraction of
    its bandwidth bound and its memory; per pair against the group's first runner, medians and per-round ratios."""
    names = list(opened)
    runners = [opened[n]["runner"] for n in names]
    res = bench(runners, ids[:n_prefill], ids[n_prefill:], rounds=rounds, warmup=0)
    out = {}
    n_decode = len(ids) - n_prefill
    for n, r in zip(names, res):
        db = bytes_per_token[n]
        bound = db.bound_tps(bandwidth, n_prefill + n_decode / 2)
        out[n] = {**{k: v for k, v in r.items()}, "bytes_read_per_token": int(db.at(n_prefill + n_decode / 2)),
                  "bound_tps": bound, "fraction_of_bound": r["decode_tps"] / bound,
                  "peak_rss_bytes": opened[n]["rss"](), "file_bytes": opened[n]["bytes"]}
    ref = names[0]
    for n in names[1:]:
        out[n]["vs_" + ref] = ratios(out[n], out[ref])
    return out


def ratios(a: dict, b: dict) -> dict:
    """a over b in tokens/s: the ratio of medians, and the min and max of the per-round ratios."""
    def one(key: str) -> dict:
        per = [tb / ta for ta, tb in zip(a[f"{key}_rounds_s"], b[f"{key}_rounds_s"])]
        return {"median": b[f"{key}_s"] / a[f"{key}_s"], "min": min(per), "max": max(per)}
    return {"prefill": one("prefill"), "decode": one("decode")}


class ArraysRunner:
    """An OrtRunner timed the way it ran before its cache was bound: every step's present k/v back as numpy."""

    def __init__(self, runner: OrtRunner):
        self.runner = runner

    def time_round(self, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
        r = self.runner
        t0 = time.perf_counter()
        _, past = r.step(np.asarray([prefill_ids]), r._empty_past(1), 0)
        t1 = time.perf_counter()
        for k, t in enumerate(decode_ids):
            _, past = r.step(np.asarray([[t]]), past, len(prefill_ids) + k)
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self.runner.close()


def warm(runner, ids: list[int]) -> None:
    runner.time_round(ids[:64], ids[64:72])  # pages the weights in and builds the graphs; not timed


def open_llama(path: Path, threads: int, n_ctx: int, ids: list[int]) -> dict:
    r = LlamaRunner(path, n_ctx=n_ctx, kv_type="f16", threads=threads, logits_all=False)
    warm(r, ids)
    return {"runner": r, "rss": r.peak_rss_bytes, "bytes": path.stat().st_size}


def open_ort(path: Path, threads: int, ids: list[int]) -> dict:
    before = rss_bytes()
    r = OrtRunner(path, threads=threads)
    warm(r, ids)
    grew = rss_bytes() - before
    return {"runner": r, "rss": lambda: grew, "bytes": onnx_bytes(path)}


def open_torch(model: Model, ids: list[int]) -> dict:
    before = rss_bytes()
    r = TorchRunner(model)
    warm(r, ids)
    grew = rss_bytes() - before + sum(p.numel() * p.element_size() for p in model.parameters())
    return {"runner": r, "rss": lambda: grew, "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def close_all(opened: dict) -> None:
    for o in opened.values():
        o["runner"].close()
    opened.clear()
    gc.collect()


# --- the gate's share of the work ---------------------------------------------------------------------------------

def matmul_flops(cfg: ModelConfig, gate: str, n_tokens: int) -> float:
    """Multiply-adds x 2 of a prefill over n_tokens: every Linear (lm_head on every position, as ONNX computes it)
    plus attention scores and values (causal: n/2 keys on average). A GDN layer counts its projections."""
    d, f = cfg.dim, cfg.ffn_dim
    per_token = 0.0
    for i in range(cfg.n_layers):
        per_token += 3 * d * f
        if cfg.layer_type(i) == "linear_attention":
            hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
            per_token += d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * d + hv * dk * dv * 2
        else:
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            per_token += d * (q + 2 * kv) + q * d + 2 * q * n_tokens / 2
            if gate != "none":
                per_token += d * (q if gate == "elementwise" else cfg.n_heads)
    per_token += d * cfg.vocab_size
    return 2 * per_token * n_tokens


# --- files -------------------------------------------------------------------------------------------------------

def baseline_as_qwen35(base: Model) -> Model:
    """The baseline as a gated model computing the same function: gate rows 0 (sigmoid 0.5), o_proj doubled."""
    cfg = base.cfg.with_gate("elementwise")
    m = Model(cfg).eval()
    sd = dict(base.state_dict())
    for i in range(cfg.n_layers):
        sd[f"layers.{i}.self_attn.o_proj.weight"] = 2 * sd[f"layers.{i}.self_attn.o_proj.weight"]
        sd[f"layers.{i}.self_attn.g_proj.weight"] = torch.zeros(cfg.gate_dim, cfg.dim)
    m.load_state_dict(sd)
    return m


def llama_cpp_tree(work: Path, given: str | None) -> Path:
    """The vendored llama.cpp of the installed llama-cpp-python's sdist: its convert_hf_to_gguf.py and gguf-py."""
    if given:
        return Path(given)
    version = importlib.metadata.version("llama-cpp-python")
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
                    "--no-deps", "-q", "-d", str(work)], check=True, capture_output=True, timeout=900)
    tar = next(work.glob("llama_cpp_python-*.tar.gz"))
    root = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(tar) as t:
        t.extractall(work, members=[m for m in t.getmembers() if m.name == root + "convert_hf_to_gguf.py"
                                    or m.name.startswith((root + "conversion/", root + "gguf-py/"))], filter="data")
    return work / root


def convert_with_llama_cpp(src_tree: Path, model_dir: Path, out: Path) -> float:
    jobs = out.with_suffix(".jobs.json")
    jobs.write_text(json.dumps([[str(model_dir), "--outfile", str(out), "--outtype", "f16", "--no-mtp"]]))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(CONVERT), str(src_tree), str(jobs)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {r.stderr.strip()[-400:]}")
    return time.perf_counter() - t


def gguf_types(path: Path) -> dict:
    counts: dict[str, int] = {}
    for t in inspect_gguf(path).tensor_types.values():
        counts[t] = counts.get(t, 0) + 1
    return counts


# --- one shape ---------------------------------------------------------------------------------------------------

def run_shape(name: str, work: Path, args, bandwidth: float, log) -> dict:
    cfg = SHAPES[name]()
    is_hybrid = cfg.is_hybrid
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(3, cfg.vocab_size, args.prefill + args.decode)]
    n_ctx = args.prefill + args.decode
    out: dict = {"shape": {k: v for k, v in cfg.to_dict().items() if k not in ("extra", "layer_types")},
                 "groups": {}, "files": {}, "setup_s": {}}
    t = time.perf_counter()
    base, gated = make_twins(cfg, "elementwise", seed=0)
    base, gated = base.eval(), gated.eval()
    out["params"] = {"baseline": base.num_params(), "gated": gated.num_params()}
    n = args.prefill
    fb, fg = matmul_flops(cfg, "none", n), matmul_flops(cfg, "elementwise", n)
    out["gate_share_of_matmul_work"] = (fg - fb) / fb
    out["headwise_gate_share_of_matmul_work"] = (matmul_flops(cfg, "headwise", n) - fb) / fb
    out["prefill_tokens"], out["decode_tokens"] = args.prefill, args.decode
    tok = train_bpe([open(json.__file__).read() * 4], 512) if is_hybrid else byte_tokenizer()
    save_checkpoint(base, work / "baseline", tok)
    save_checkpoint(gated, work / "gated", tok)
    if not is_hybrid:  # a headwise gate (one row per head) for ONNX Runtime, whose graph keeps it that small
        save_checkpoint(make_twins(cfg, "headwise", seed=0)[1], work / "gated-headwise", tok)
    out["setup_s"]["build_and_save"] = time.perf_counter() - t
    log(f"{name}: built and saved ({out['params']}) in {out['setup_s']['build_and_save']:.0f} s")

    def group(label: str, opened: dict, bpt: dict) -> None:
        t0 = time.perf_counter()
        out["groups"][label] = timed_group(opened, ids, n, args.rounds, bpt, bandwidth)
        close_all(opened)
        g = out["groups"][label]
        log(f"{name} {label} ({time.perf_counter() - t0:.0f} s): " + "; ".join(
            f"{k} {v['prefill_tps']:.1f}/{v['decode_tps']:.2f} tok/s ({v['fraction_of_bound']:.0%} of bound)"
            for k, v in g.items()))
        save()

    def save() -> None:
        args.partial[name] = out
        write(args)

    # PyTorch eager fp32: the reference (dense shape only: our GDN's prefill is a per-token scan in eager mode)
    if not is_hybrid and not args.skip_torch:
        torch.set_num_threads(max(args.threads))
        opened = {"baseline": open_torch(base, ids), "gated": open_torch(gated, ids)}
        group(f"torch fp32 eager, {max(args.threads)} threads", opened,
              {"baseline": torch_decode_bytes(base), "gated": torch_decode_bytes(gated)})
    as35 = None if is_hybrid else baseline_as_qwen35(base)
    del base, gated
    gc.collect()

    # GGUF files
    t = time.perf_counter()
    f16 = {"baseline": work / "baseline-F16.gguf", "gated": work / "gated-F16.gguf"}
    for role in f16:
        export_gguf_checkpoint(work / role, f16[role], "f16")
    if as35 is not None:
        f16["baseline-as-qwen35"] = work / "baseline-as-qwen35-F16.gguf"
        export_gguf(as35, byte_tokenizer(), f16["baseline-as-qwen35"], "f16")
        f16["gated-2-identity"] = work / "gated-2-identity-F16.gguf"
        export_gguf_checkpoint(work / "gated", f16["gated-2-identity"], "f16", identity_layers=2)
        del as35
    else:
        f16["gated-llama.cpp-converter"] = work / "gated-converter-F16.gguf"
        out["setup_s"]["convert_hf_to_gguf"] = convert_with_llama_cpp(args.src_tree, work / "gated",
                                                                        f16["gated-llama.cpp-converter"])
    out["setup_s"]["export_gguf_f16"] = time.perf_counter() - t
    t = time.perf_counter()
    ggufs = {("F16", r): p for r, p in f16.items()}
    types = ("F16", "Q8_0", "Q4_K_M") if not is_hybrid else ("Q4_K_M",)
    for qt in types[1:] if not is_hybrid else types:
        for role, src in f16.items():
            if qt != "Q4_K_M" and role not in ("baseline", "gated"):
                continue
            ggufs[(qt, role)] = work / f"{role}-{qt}.gguf"
            quantize_gguf(src, ggufs[(qt, role)], qt, threads=2)
    out["setup_s"]["quantize_gguf"] = time.perf_counter() - t
    for (qt, role), p in ggufs.items():
        out["files"][f"gguf {qt} {role}"] = {"bytes": p.stat().st_size, "types": gguf_types(p),
                                             "bits_per_weight": round(inspect_gguf(p).bits_per_weight, 3)}
    save()
    for qt in types:
        roles = [r for (q, r) in ggufs if q == qt and r != "gated-2-identity"]
        for threads in (args.threads if qt == "Q4_K_M" and not is_hybrid else [max(args.threads)]):
            opened = {r: open_llama(ggufs[(qt, r)], threads, n_ctx, ids) for r in roles}
            group(f"llama.cpp {qt}, {threads} threads", opened, {r: gguf_decode_bytes(ggufs[(qt, r)]) for r in roles})
    if ("Q4_K_M", "gated-2-identity") in ggufs:  # one more identity layer: what the one we need costs
        roles = ["gated", "gated-2-identity"]
        opened = {r: open_llama(ggufs[("Q4_K_M", r)], max(args.threads), n_ctx, ids) for r in roles}
        group(f"llama.cpp Q4_K_M identity layer, {max(args.threads)} threads", opened,
              {r: gguf_decode_bytes(ggufs[("Q4_K_M", r)]) for r in roles})
    for p in ggufs.values():
        remove_own(p, work)

    # ONNX
    if is_hybrid and name in args.skip_onnx:
        out["onnx_skipped"] = args.skip_onnx[name]
        save()
        return out
    forms = ("standard",) if is_hybrid else ("standard", "gqa")
    schemes = ("int4",) if is_hybrid else ("fp32", "int8-weight", "int4")
    for form in forms:
        dirs = {}
        headwise = form == "gqa" and not is_hybrid
        for role in ("baseline", "gated") + (("gated-headwise",) if headwise else ()):
            d = work / f"{role}-onnx-{form}"
            secs, rss = child(EXPORT_ONNX, str(work / role), str(d), form)
            out["setup_s"][f"export_onnx_{form}_{role}"] = secs
            out["files"][f"onnx {form} fp32 {role}"] = {"bytes": onnx_bytes(d), "export_peak_rss_bytes": rss}
            dirs[("fp32", role)] = d
            for scheme in (("int4",) if role == "gated-headwise" else schemes[1:] if not is_hybrid else schemes):
                q = work / f"{role}-onnx-{form}-{scheme}"
                secs, rss = child(QUANT_ONNX, str(d), str(q), scheme)
                out["setup_s"][f"quantize_onnx_{form}_{scheme}_{role}"] = secs
                out["files"][f"onnx {form} {scheme} {role}"] = {"bytes": onnx_bytes(q), "quantize_peak_rss_bytes": rss}
                dirs[(scheme, role)] = q
        save()
        log(f"{name}: ONNX {form} exported and quantized")
        for scheme in schemes:
            for threads in (args.threads if scheme == "int4" and not is_hybrid else [max(args.threads)]):
                roles = [r for r in ("baseline", "gated", "gated-headwise") if (scheme, r) in dirs
                         and (r != "gated-headwise" or threads == max(args.threads))]
                opened = {r: open_ort(dirs[(scheme, r)], threads, ids) for r in roles}
                group(f"onnxruntime {form} {scheme}, {threads} threads", opened,
                      {r: onnx_decode_bytes(dirs[(scheme, r)]) for r in roles})
        if form == "gqa":  # the same int4 file decoding with its cache bound (OrtValues) and as numpy arrays
            opened = {"gated, cache bound": open_ort(dirs[("int4", "gated")], max(args.threads), ids)}
            arrays = open_ort(dirs[("int4", "gated")], max(args.threads), ids)
            arrays["runner"] = ArraysRunner(arrays["runner"])
            opened["gated, cache as arrays"] = arrays
            group(f"onnxruntime gqa int4 KV binding, {max(args.threads)} threads", opened,
                  {r: onnx_decode_bytes(dirs[("int4", "gated")]) for r in opened})
        for d in dirs.values():
            remove_own(d, work)
    return out


# --- results -----------------------------------------------------------------------------------------------------

def remove_own(path: Path, work: Path) -> None:
    """Delete a file or folder this script wrote, to free disk between groups: only inside its own temporary work
    folder, never anything else."""
    if not path.resolve().is_relative_to(work.resolve()):
        raise RuntimeError(f"refusing to remove {path}: it is not inside the benchmark's work folder {work}")
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def check_out(out: Path) -> None:
    """--out is replaced only when it is this benchmark's own result file (or does not exist yet)."""
    if out.exists():
        try:
            ours = "shapes" in json.loads(out.read_text()) and "protocol" in json.loads(out.read_text())
        except (ValueError, OSError):
            ours = False
        if not ours:
            raise SystemExit(f"error: {out} exists and is not a laptop_speed result; choose another --out")


def write(args) -> None:
    result = {"command": args.command, "machine": args.machine, "when": args.when, "protocol": args.protocol,
              "bandwidth": args.bw, "shapes": args.partial}
    RESULTS.mkdir(exist_ok=True)
    tmp = Path(args.out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    write_markdown(result, Path(args.out).with_suffix(".md"))


def _r(x: dict) -> str:
    return f"{x['median']:.3f} [{x['min']:.3f}, {x['max']:.3f}]"


def write_markdown(r: dict, path: Path) -> None:
    bw = r["bandwidth"]
    lines = ["# Speed at laptop scale (`benchmarks/laptop_speed.py`)", "",
             f"Command: `{r['command']}`, {r['when']}. Machine: {r['machine']}.", "",
             f"Protocol: {r['protocol']}", "",
             "Bandwidth (GB/s; copy: numpy, one thread, read + write counted; read: torch.sum over 512 MB on every "
             "core): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if isinstance(v, float)) + ". The bound on "
             f"decode is `{bw.get('bound_uses', 'start_gbs')}` over the bytes one decode step reads (weights, the KV cache at the mean "
             "decode position, recurrent states); a fraction near or over 100% means decode is bandwidth-bound.", ""]
    for name, s in r["shapes"].items():
        lines += [f"## {name}", "", f"Parameters: baseline {s['params']['baseline'] / 1e6:.1f} M, gated "
                  f"{s['params']['gated'] / 1e6:.1f} M. The elementwise gate adds {s['gate_share_of_matmul_work']:.1%} to "
                  f"the matmul work of a {s.get('prefill_tokens', 512)}-token prefill.", "",
                  "| group | model | prefill tok/s | decode tok/s | decode / bound | peak RSS GB | file GB | "
                  "prefill ratio [per-round range] | decode ratio [per-round range] |", "|---|---|---|---|---|---|---|---|---|"]
        for label, g in s["groups"].items():
            for m, v in g.items():
                vs = next((k for k in v if k.startswith("vs_")), None)
                ratio = (f"{_r(v[vs]['prefill'])} vs {vs[3:]} | {_r(v[vs]['decode'])}" if vs else "| ")
                rss = v["peak_rss_bytes"]  # a worker's VmHWM for llama.cpp; in-process growth is not a peak
                rss_cell = f"{rss / 1e9:.2f}" if label.startswith("llama.cpp") and rss else "–"
                lines.append(f"| {label} | {m} | {v['prefill_tps']:.1f} | {v['decode_tps']:.2f} | "
                             f"{v['fraction_of_bound']:.0%} | {rss_cell} | {v['file_bytes'] / 1e9:.3f} | {ratio} |")
        lines += ["", "Peak RSS is the llama.cpp worker process's (VmHWM, the model loaded and every round run). ONNX "
                  "Runtime and PyTorch run inside the benchmark's process, where the growth of resident memory at load "
                  "is not a peak (the allocator reuses what earlier groups freed; the .json keeps it as measured), so "
                  "the table gives none for them; the files table has the peaks of the export and quantization "
                  "children.", "", "| file | bytes | bits/weight | peak RSS of the step that wrote it (GB) |",
                  "|---|---|---|---|"]
        for k, f in s.get("files", {}).items():
            peak = f.get("export_peak_rss_bytes") or f.get("quantize_peak_rss_bytes")
            lines.append(f"| {k} | {f['bytes']:,} | {f.get('bits_per_weight', '–')} | "
                         f"{peak / 1e9 if peak else float('nan'):.1f} |".replace("nan", "–"))
        if s.get("onnx_skipped"):
            lines += ["", f"ONNX Runtime not measured at this shape: {s['onnx_skipped']}"]
        lines += [""]
        notes = note_lines(s)
        if notes:
            lines += [f"### Why, at {name}", ""] + [f"- {x}" for x in notes] + [""]
        goals = goal_lines(name, s)
        if goals:
            lines += [f"### Goals at {name}", ""] + [f"- {x}" for x in goals] + [""]
        scaling = scaling_lines(s)
        if scaling:
            lines += ["### 1 -> 2 threads (medians of one run; tokens/s at 2 threads over 1 thread)", "",
                      "| group | model | prefill | decode |", "|---|---|---|---|"] + scaling + [""]
    path.write_text("\n".join(lines) + "\n")


GOAL = 0.97


def verdict(x: dict, goal: float, name: str) -> str:
    """A ratio with its per-round range against a goal: met only where every round met it, missed only where none
    did; otherwise the rounds do not resolve it."""
    if x["min"] >= goal:
        v = "met"
    elif x["max"] < goal:
        v = f"missed by {goal - x['median']:.3f}"
    else:
        v = "not resolved by the rounds"
    return f"{name}: {_r(x)} (goal >= {goal}): {v}"


def goal_lines(name: str, s: dict) -> list[str]:
    """The issue's goals, read off one shape's groups (nothing here is measured; it is arithmetic on the JSON)."""
    g, out = s["groups"], []
    share = s["gate_share_of_matmul_work"]

    def prefill_cost(x: dict) -> str:
        cost = 1 / x["median"] - 1  # extra prefill time of the gated file
        return (f"prefill time +{cost:.1%} (per-round ratios {x['min']:.3f}-{x['max']:.3f}) against the gate's "
                f"{share:.1%} share of the matmul work: {'within it' if cost <= share else 'over it by ' + format(cost - share, '.1%')}")
    for label in [k for k in g if k.startswith("llama.cpp Q4_K_M,")]:
        v = g[label]
        if "gated" in v and "vs_baseline" in v["gated"]:
            out.append(verdict(v["gated"]["vs_baseline"]["decode"], GOAL, f"{label}: shipped files, gated / baseline "
                               "decode") + "; " + prefill_cost(v["gated"]["vs_baseline"]["prefill"]))
        if "baseline-as-qwen35" in v:
            own = ratios(v["gated"], v["baseline-as-qwen35"])
            out.append(verdict(own["decode"], GOAL, f"{label}: graph held equal, gated / baseline-as-qwen35 decode "
                               "(the same kernels on the same shapes: this is the protocol's noise floor, not the "
                               "gate, which costs its extra rows in both files)"))
            out.append(f"{label}: llama.cpp's qwen35 graph on the baseline, baseline-as-qwen35 / baseline: decode "
                       f"{_r(v['baseline-as-qwen35']['vs_baseline']['decode'])}, prefill "
                       f"{_r(v['baseline-as-qwen35']['vs_baseline']['prefill'])}")
        if "gated-llama.cpp-converter" in v:
            conv = ratios(v["gated"], v["gated-llama.cpp-converter"])  # ours over the converter's
            out.append(verdict(conv["decode"], 0.99, f"{label}: our hybrid GGUF / llama.cpp converter's file, decode"))
    for label in [k for k in g if k.startswith("onnxruntime") and " int4," in k]:
        v = g[label]
        out.append(verdict(v["gated"]["vs_baseline"]["decode"], GOAL, f"{label}: gated / baseline decode (the graphs "
                           "differ only by the gate's rows, Split, Sigmoid and Mul)") + "; "
                   + prefill_cost(v["gated"]["vs_baseline"]["prefill"]))
        if "gated-headwise" in v:
            out.append(verdict(v["gated-headwise"]["vs_baseline"]["decode"], GOAL,
                               f"{label}: headwise gate / baseline decode"))
    torch_label = next((k for k in g if k.startswith("torch")), None)
    llama_label = next((k for k in g if k.startswith("llama.cpp Q4_K_M,") and k.endswith(" 2 threads")), None)
    for label in [k for k in g if k.startswith("onnxruntime") and " int4, 2 threads" in k]:
        for role in ("baseline", "gated"):
            ort = g[label][role]["decode_tps"]
            if torch_label:
                x = ort / g[torch_label][role]["decode_tps"]
                out.append(f"{label} {role}: decode {x:.2f}x PyTorch fp32 eager's (goal >= 3x; medians of two groups "
                           f"run one after the other, not alternated): {'met' if x >= 3 else 'missed'}")
            if llama_label and role in g[llama_label]:
                x = g[llama_label][role]["decode_tps"] / ort
                out.append(f"{label} {role}: llama.cpp Q4_K_M decodes {x:.2f}x as fast (goal <= 1.5x; medians of two "
                           f"groups): {'met' if x <= 1.5 else 'missed'}")
    return out


def note_lines(s: dict) -> list[str]:
    """Arithmetic on the stored figures that explains the ratios: bytes read per token, the identity layer, drift."""
    g, out = s["groups"], []
    for label in [k for k in g if k.startswith(("llama.cpp Q4_K_M,", "onnxruntime")) and "2 threads" in k
                  and "binding" not in k]:
        v = g[label]
        if "gated" in v and "baseline" in v:
            b = v["baseline"]["bytes_read_per_token"] / v["gated"]["bytes_read_per_token"]
            if b == 1 and label.startswith("llama.cpp"):
                out.append(f"{label}: llama.cpp's qwen35 has no attention without the gate, so the hybrid baseline is "
                           f"written with zero gate rows (and o_proj doubled): both files run the same kernels on the "
                           f"same shapes, and their ratio, {_r(v['gated']['vs_baseline']['decode'])} for decode, "
                           f"is this protocol's noise on this machine")
                continue
            out.append(f"{label}: the gated file reads {v['gated']['bytes_read_per_token'] / 1e6:.0f} MB per decoded "
                       f"token against the baseline's {v['baseline']['bytes_read_per_token'] / 1e6:.0f} MB: a decode "
                       f"bound by bandwidth alone would run at {b:.3f} of the baseline's; measured "
                       f"{v['gated']['vs_baseline']['decode']['median']:.3f}")
    for label, v in g.items():
        if "gated-llama.cpp-converter" in v and "gated" in v:
            diff = v["gated"]["file_bytes"] - v["gated-llama.cpp-converter"]["file_bytes"]
            out.append(f"{label}: our file and the converter's hold the same tensors (names, types, shapes and bytes: "
                       f"tests/test_llama_convert.py); they differ in metadata only ({diff:+,} bytes: the padded token "
                       f"table, our provenance keys), so their ratio, "
                       f"{_r(ratios(v['gated'], v['gated-llama.cpp-converter'])['decode'])} for decode, is noise too; "
                       f"the order inside a round is fixed (baseline, ours, the converter's), which may add to it")
    ident = next((v for k, v in g.items() if "identity layer" in k), None)
    if ident:
        x = ident["gated-2-identity"]["vs_gated"]["decode"]
        p = ident["gated-2-identity"]["vs_gated"]["prefill"]
        cost = (f"so the one the workaround needs costs about {1 - x['median']:.1%} of decode" if x["max"] < 1 else
                "the rounds resolve no cost (the file with two was not slower in every round)" if x["median"] < 1
                else "the file with two decoded faster: this run resolves no cost of the identity layer")
        out.append(f"One more identity recurrent layer (a file with two against the shipped one): decode "
                   f"{_r(x)}, prefill {_r(p)}; {cost}. Its MLP is full width ({s['shape']['ffn_dim']}): llama.cpp's qwen35 loader sizes every "
                   f"layer's FFN from the one global feed_forward_length (src/models/qwen35.cpp, LLAMA_LOAD_LOCALS' "
                   f"n_ff), so no identity shape is cheaper than one MLP")
    same = [(k, v["gated"]["decode_tps"]) for k, v in g.items() if k.startswith("llama.cpp Q4_K_M") and
            k.endswith(" 2 threads") and "gated" in v]
    if len(same) > 1:
        out.append("The same gated Q4_K_M file in two groups run one after the other: " + ", ".join(
            f"{t:.2f} tok/s ({k})" for k, t in same) + ": this machine drifts by that much between groups, which is "
            "why every ratio above is taken within a group, round by round")
    kv = next((v for k, v in g.items() if "KV binding" in k), None)
    if kv:
        x = kv["gated, cache as arrays"]["vs_gated, cache bound"]["decode"]
        out.append(f"ONNX Runtime's cache kept in its own buffers between steps (IOBinding) against numpy arrays: "
                   f"arrays / bound decode {_r(x)}")
    return out


def scaling_lines(s: dict) -> list[str]:
    g, rows = s["groups"], []
    for label in [k for k in g if k.endswith(", 1 threads")]:
        two = label.replace(", 1 threads", ", 2 threads")
        if two not in g:
            continue
        for m, v in g[label].items():
            if m in g[two]:
                rows.append(f"| {label[:-len(', 1 threads')]} | {m} | {g[two][m]['prefill_tps'] / v['prefill_tps']:.2f}x"
                            f" | {g[two][m]['decode_tps'] / v['decode_tps']:.2f}x |")
    return rows


def remeasure_bandwidth(path: Path) -> None:
    """For a result written before the read bandwidth was measured (its bound used a one-thread numpy copy, which a
    decode beat): measure copy and read bandwidth now, on the quiet machine right after the run, and recompute every
    runner's bound from its stored bytes per token. The .json says which figure each bound uses."""
    result = json.loads(path.read_text())
    bw = result["bandwidth"]
    bw = {("copy_gbs_" + k[:-4] if k in ("start_gbs", "end_gbs") else k): v for k, v in bw.items()}
    bw["copy_gbs_after_run"] = copy_bandwidth() / 1e9
    bw["read_gbs_after_run"] = read_bandwidth(threads=2) / 1e9
    bw["read_gbs_after_run_1_thread"] = read_bandwidth(threads=1) / 1e9
    bw["bound_uses"] = "read_gbs_after_run"
    result["bandwidth"] = bw
    result["command"] += " && python benchmarks/laptop_speed.py --remeasure-bandwidth"
    for s in result["shapes"].values():
        for g in s["groups"].values():
            for v in g.values():
                v["bound_tps"] = bw["read_gbs_after_run"] * 1e9 / v["bytes_read_per_token"]
                v["fraction_of_bound"] = v["decode_tps"] / v["bound_tps"]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    write_markdown(result, path.with_suffix(".md"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen35-0.8b,qwen35-2b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="thread counts for Q4_K_M and int4 (others: the largest)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--llama-cpp-src", default=None, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--work", default=None, help="parent of the fresh folder the files go to (default: temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "laptop_speed.json"))
    ap.add_argument("--markdown-only", action="store_true")
    ap.add_argument("--remeasure-bandwidth", action="store_true",
                    help="measure the bandwidths now and recompute every bound in the .json from its stored bytes")
    args = ap.parse_args()
    if args.remeasure_bandwidth:
        remeasure_bandwidth(Path(args.out))
        return
    if args.markdown_only:
        result = json.loads(Path(args.out).read_text())
        for name, s in result["shapes"].items():  # arithmetic, not measured: recomputed from the shape's definition
            cfg, n = SHAPES[name](), s.get("prefill_tokens", 512)
            fb = matmul_flops(cfg, "none", n)
            s["gate_share_of_matmul_work"] = (matmul_flops(cfg, "elementwise", n) - fb) / fb
            s["headwise_gate_share_of_matmul_work"] = (matmul_flops(cfg, "headwise", n) - fb) / fb
        tmp = Path(args.out).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)
        write_markdown(result, Path(args.out).with_suffix(".md"))
        return
    check_out(Path(args.out))
    args.threads = [int(x) for x in args.threads.split(",")]
    args.command = "python benchmarks/laptop_speed.py " + " ".join(sys.argv[1:])
    args.machine = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
                    "onnxruntime": importlib.metadata.version("onnxruntime"), "torch": torch.__version__}
    args.when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.protocol = (f"prefill {args.prefill} tokens from an empty cache, then decode {args.decode} one at a time; "
                     f"one short untimed warm-up per runner; {args.rounds} rounds alternating between the runners of "
                     f"a group; medians; ratios are gated (or the named file) over the group's first runner, "
                     f"with the range of the per-round ratios in brackets")
    # ONNX export of the 2B hybrid: its fp32 export peaked at 14.1 GB RSS for the 0.8B (hybrid_laptop_shape.json);
    # 2.5x the weights would not fit this machine's memory
    args.skip_onnx = {"qwen35-2b": "the fp32 ONNX export of a 1.9 B model needs about 35 GB of memory (the 0.8B's "
                                   "export peaked at 14.1 GB, hybrid_laptop_shape.json); this machine has 23 GB"}
    args.partial = {}
    logf = RESULTS / "logs" / "laptop_speed.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    logh = logf.open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logh.write(line + "\n")
        logh.flush()

    args.bw = {"copy_gbs_start": copy_bandwidth() / 1e9, "read_gbs_start": read_bandwidth(threads=max(args.threads)) / 1e9,
               "bound_uses": "read_gbs_start"}
    log(f"bandwidth: copy {args.bw['copy_gbs_start']:.1f} GB/s, read {args.bw['read_gbs_start']:.1f} GB/s")
    bandwidth = args.bw["read_gbs_start"] * 1e9
    with tempfile.TemporaryDirectory(prefix="quantgate-laptop-speed-", dir=args.work) as tmp:
        work = Path(tmp)
        args.src_tree = None
        if any(SHAPES[s]().is_hybrid for s in args.shapes.split(",")):
            args.src_tree = llama_cpp_tree(work / "sdist", args.llama_cpp_src)
        for name in args.shapes.split(","):
            d = work / name
            d.mkdir()
            run_shape(name, d, args, bandwidth, log)
            remove_own(d, work)
    args.bw["copy_gbs_end"] = copy_bandwidth() / 1e9
    args.bw["read_gbs_end"] = read_bandwidth(threads=max(args.threads)) / 1e9
    log(f"bandwidth at the end: copy {args.bw['copy_gbs_end']:.1f} GB/s, read {args.bw['read_gbs_end']:.1f} GB/s")
    write(args)


if __name__ == "__main__":
    main()
