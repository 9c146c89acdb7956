"""The twins in stock llama.cpp: accuracy and size per GGUF type, speed, and the identity layer's cost.

For a trained twin pair (default: the `quantgate demo` directory) this exports both twins to F32 and
F16 GGUF, quantizes them with llama.cpp's own quantizer into every listed type (plus the gate-aware
Q4_K_M and Q4_K_M with an importance matrix), and scores each file in llama.cpp (F32 KV cache) against
the float PyTorch twin on the same held-out windows: perplexity delta, KL divergence, top-1 agreement,
file size, bits per weight. Then: prefill (128 tokens) and decode (64 tokens) speed at F16, Q8_0 and
Q4_K_M for both twins (median of --repeats, one thread count), the gated/baseline ratio, and what the
identity recurrent layer costs (a file with two identity layers minus one with one), for several shapes.
KV-cache types f16/q8_0/q4_0 are scored at F32 weights.

    python benchmarks/gguf_twins.py [--run quantgate-demo] [--windows 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K"]
SPEED_TYPES = ["F16", "Q8_0", "Q4_K_M"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="quantgate-demo", help="run directory holding baseline/ and gated/")
    ap.add_argument("--work", default="/tmp/quantgate-gguf-bench", help="where the GGUF files go")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads for accuracy runs")
    ap.add_argument("--speed-threads", type=int, default=1,
                    help="llama.cpp threads for speed runs (1 leaves a core for everything else on a 2-core machine)")
    ap.add_argument("--repeats", type=int, default=15, help="alternating rounds per speed comparison")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_twins.json"))
    ap.add_argument("--sections", default="accuracy,speed,identity,arch",
                    help="comma list; sections not listed are kept from an existing --out file")
    args = ap.parse_args()
    sections = set(args.sections.split(","))

    import llama_cpp

    from quantgate.calib_data import load_corpus, tokenize_corpus
    from quantgate.formats import load_checkpoint
    from quantgate.evaluate import compare_to_reference, eval_windows, reference_logits
    from quantgate.export.gguf import IdentityLayerShape, export_checkpoint
    from quantgate.gate_survival import check_gate_survival
    from quantgate.formats import inspect_gguf
    from quantgate.quant.llama_cpp import quantize_gguf
    from quantgate.runners import LlamaRunner

    run, work = Path(args.run), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_checkpoint(run / "baseline").tokenizer
    corpus = load_corpus("embedded").split("test")
    windows = eval_windows(tokenize_corpus(corpus, tok).ids, args.ctx, tok.bos_id, args.windows)
    result = {"run": str(run), "windows": len(windows), "ctx": args.ctx, "threads": args.threads,
              "speed_threads": args.speed_threads, "speed_rounds": args.repeats,
              "llama_cpp_python": llama_cpp.__version__, "machine": platform.processor() or platform.machine(),
              "accuracy": {}, "speed": {}, "kv_cache": {}, "identity_layer": {}, "gate_survival": {}}
    kept = ("accuracy", "speed", "kv_cache", "identity_layer", "gate_survival", "arch")
    if Path(args.out).is_file() and sections != {"accuracy", "speed", "identity", "arch"}:
        result = {**result, **{k: v for k, v in json.loads(Path(args.out).read_text()).items() if k in kept}}

    def score(path: Path, ref: np.ndarray, kv: str = "f32") -> dict:
        with LlamaRunner(path, n_ctx=args.ctx, kv_type=kv, threads=args.threads) as r:
            m = compare_to_reference(r, ref, windows)
        info = inspect_gguf(path)
        return {"bytes": info.n_bytes, "bits_per_weight": round(info.bits_per_weight, 3),
                **{k: m[k] for k in ("ppl", "reference_ppl", "delta_ppl_pct", "kld_mean", "kld_p99", "top1_agreement")}}

    def paired_speed(paths: dict[str, Path]) -> dict[str, dict]:
        """Files loaded side by side and measured in alternation (A B A B ...), medians per file: drift
        and noise of this shared machine hit every file alike."""
        ids = [int(t) for t in windows[0]]
        runners = {k: LlamaRunner(p, n_ctx=args.ctx, kv_type="f16", threads=args.speed_threads, logits_all=False)
                   for k, p in paths.items()}
        try:
            samples = {k: [] for k in paths}
            for _ in range(args.repeats):
                for k, r in runners.items():
                    samples[k].append(r.bench(ids[:128], ids[128:192], repeats=1))
        finally:
            for r in runners.values():
                r.close()
        out = {}
        for k, rows in samples.items():
            pre, dec = np.median([x["prefill_s"] for x in rows]), np.median([x["decode_s"] for x in rows])
            out[k] = {"prefill_s": float(pre), "decode_s": float(dec), "prefill_tps": 128 / pre, "decode_tps": 64 / dec,
                      # the fastest round: interference from other processes only ever adds time
                      "prefill_min_s": float(min(x["prefill_s"] for x in rows)),
                      "decode_min_s": float(min(x["decode_s"] for x in rows))}
        return out

    t_start = time.time()
    for twin in ("baseline", "gated") if "accuracy" in sections else ():
        src = run / twin
        ref = reference_logits(str(src), windows, f"{corpus.fingerprint}|test|{args.ctx}")
        acc = result["accuracy"][twin] = {}
        export_checkpoint(src, work / f"{twin}-F32.gguf", "f32")
        export_checkpoint(src, work / f"{twin}-F16.gguf", "f16")
        for t in ["F32", "F16"]:
            acc[t] = score(work / f"{twin}-{t}.gguf", ref)
        variants = [(t, t, {}) for t in TYPES] + [("Q4_K_M+imatrix", "Q4_K_M", {"imatrix": "auto"})]
        if twin == "gated":
            variants += [("Q4_K_M+gate8", "Q4_K_M", {"gate_bits": 8}), ("Q4_0+gate8", "Q4_0", {"gate_bits": 8}),
                         ("Q2_K+gate8", "Q2_K", {"gate_bits": 8})]
        for name, t, kw in variants:
            out = work / f"{twin}-{name}.gguf"
            q = quantize_gguf(work / f"{twin}-F32.gguf", out, t, threads=args.threads, **kw)
            acc[name] = {**score(out, ref), "tensor_type_counts": q["tensor_type_counts"],
                         "attn_q_types": q["attn_q_types"]}
            print(f"{twin:8s} {name:16s} {acc[name]['bits_per_weight']:6.2f} bpw  KLD {acc[name]['kld_mean']:.5f}  "
                  f"top1 {acc[name]['top1_agreement']:.4f}  dppl {acc[name]['delta_ppl_pct']:+.2f}%", flush=True)
            if twin == "gated" and name in ("Q8_0", "Q4_K_M", "Q4_K_M+gate8", "Q2_K", "Q2_K+gate8"):
                gs = check_gate_survival(str(out), str(src), n_windows=4, ctx=args.ctx)
                result["gate_survival"][name] = {k: gs[k] for k in ("worst_layer", "worst_mean_abs_diff",
                                                                     "max_frac_crossed_0.5")}
        result["kv_cache"][twin] = {kv: score(work / f"{twin}-F32.gguf", ref, kv) for kv in ("f16", "q8_0", "q4_0")}
    if "speed" in sections:
        for t in SPEED_TYPES:
            for twin in ("baseline", "gated"):
                if not (work / f"{twin}-{t}.gguf").is_file():
                    raise SystemExit(f"{work}/{twin}-{t}.gguf is missing: run the accuracy section first")
            s = result["speed"][t] = paired_speed({tw: work / f"{tw}-{t}.gguf" for tw in ("baseline", "gated")})
            s["gated_over_baseline_prefill"] = s["gated"]["prefill_tps"] / s["baseline"]["prefill_tps"]
            s["gated_over_baseline_decode"] = s["gated"]["decode_tps"] / s["baseline"]["decode_tps"]
            print(f"speed {t}: gated/baseline prefill {s['gated_over_baseline_prefill']:.3f}, "
                  f"decode {s['gated_over_baseline_decode']:.3f}", flush=True)

    # identity layer: one more identity layer costs what the one we need costs
    shapes = {"256x256": IdentityLayerShape(256, 256), "32x32": IdentityLayerShape(32, 32),
              "1x1": IdentityLayerShape(1, 1)}
    for sname, shape in shapes.items() if "identity" in sections else ():
        files = {}
        for n in (1, 2):
            files[n] = work / f"identity-{sname}-{n}.gguf"
            export_checkpoint(run / "gated", files[n], "f16", identity_shape=shape, identity_layers=n)
        sp = paired_speed(files)
        one, two = ({"bytes": files[n].stat().st_size, **sp[n]} for n in (1, 2))
        result["identity_layer"][sname] = {
            "bytes": two["bytes"] - one["bytes"],
            "bytes_share": (two["bytes"] - one["bytes"]) / one["bytes"],
            "prefill_share": (two["prefill_s"] - one["prefill_s"]) / one["prefill_s"],
            "decode_share": (two["decode_s"] - one["decode_s"]) / one["decode_s"],
            "prefill_share_min": (two["prefill_min_s"] - one["prefill_min_s"]) / one["prefill_min_s"],
            "decode_share_min": (two["decode_min_s"] - one["decode_min_s"]) / one["decode_min_s"],
            "one": one, "two": two}
        il = result["identity_layer"][sname]
        print(f"identity {sname}: +{il['bytes']} bytes, prefill share {il['prefill_share']:+.1%} "
              f"(min {il['prefill_share_min']:+.1%}), decode share {il['decode_share']:+.1%} "
              f"(min {il['decode_share_min']:+.1%})", flush=True)
    if "arch" in sections:
        # Where the gated twin's time goes: the baseline itself written as qwen35 (gate rows 0, so
        # sigmoid = 0.5, and o_proj doubled: the same function) isolates llama.cpp's qwen35 graph from the gate.
        import copy

        import torch

        from quantgate.export.gguf import export_gguf
        base = load_checkpoint(run / "baseline")
        twin = copy.deepcopy(base.model)
        cfg = twin.cfg.with_gate("elementwise")
        from quantgate.model import Model
        as35 = Model(cfg).eval()
        sd = {k: v for k, v in twin.state_dict().items()}
        for i in range(cfg.n_layers):
            sd[f"layers.{i}.self_attn.o_proj.weight"] = 2 * sd[f"layers.{i}.self_attn.o_proj.weight"]
            sd[f"layers.{i}.self_attn.g_proj.weight"] = torch.zeros(cfg.gate_dim, cfg.dim)
        as35.load_state_dict(sd)
        export_gguf(as35, base.tokenizer, work / "baseline-as-qwen35-F16.gguf", "f16")
        sp = paired_speed({"qwen3": work / "baseline-F16.gguf", "qwen35": work / "baseline-as-qwen35-F16.gguf",
                           "gated": work / "gated-F16.gguf"})
        result["arch"] = {**sp, "qwen35_over_qwen3_prefill": sp["qwen35"]["prefill_tps"] / sp["qwen3"]["prefill_tps"],
                          "qwen35_over_qwen3_decode": sp["qwen35"]["decode_tps"] / sp["qwen3"]["decode_tps"],
                          "gated_over_qwen35_prefill": sp["gated"]["prefill_tps"] / sp["qwen35"]["prefill_tps"],
                          "gated_over_qwen35_decode": sp["gated"]["decode_tps"] / sp["qwen35"]["decode_tps"]}
        print("arch:", {k: round(v, 3) for k, v in result["arch"].items() if k.endswith(("prefill", "decode"))},
              flush=True)
    result["seconds"] = time.time() - t_start
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, Path(args.out).with_suffix(".md"))


def write_markdown(r: dict, path: Path) -> None:
    lines = [f"# GGUF twins in llama.cpp ({r['windows']} held-out windows x {r['ctx']}, "
             f"llama-cpp-python {r['llama_cpp_python']})", "",
             "Produced by `python benchmarks/gguf_twins.py --run <demo dir>` on the `small` twins of `quantgate demo`.", "",
             "Accuracy against the float PyTorch twin (F32 KV cache). bpw counts every tensor in the file.", "",
             "| type | bpw base | bpw gated | KLD base | KLD gated | top-1 base | top-1 gated | dppl base | dppl gated |",
             "|---|---|---|---|---|---|---|---|---|"]
    b, g = r["accuracy"]["baseline"], r["accuracy"]["gated"]
    for t in g:
        bb = b.get(t)
        def cell(d, k, f):
            return format(d[k], f) if d else "-"
        lines.append(f"| {t} | {cell(bb, 'bits_per_weight', '.2f')} | {g[t]['bits_per_weight']:.2f} | "
                     f"{cell(bb, 'kld_mean', '.5f')} | {g[t]['kld_mean']:.5f} | {cell(bb, 'top1_agreement', '.4f')} | "
                     f"{g[t]['top1_agreement']:.4f} | {cell(bb, 'delta_ppl_pct', '+.2f')}{'%' if bb else ''} | {g[t]['delta_ppl_pct']:+.2f}% |")
    lines += ["", "KV-cache types at F32 weights:", "", "| KV | KLD base | KLD gated | dppl base | dppl gated |",
              "|---|---|---|---|---|"]
    for kv in ("f16", "q8_0", "q4_0"):
        kb, kg = r["kv_cache"]["baseline"][kv], r["kv_cache"]["gated"][kv]
        lines.append(f"| {kv} | {kb['kld_mean']:.5f} | {kg['kld_mean']:.5f} | {kb['delta_ppl_pct']:+.2f}% | "
                     f"{kg['delta_ppl_pct']:+.2f}% |")
    lines += ["", f"Speed (tokens/s, median of {r.get('speed_rounds')} alternating rounds, {r.get('speed_threads')} "
              "thread; prefill 128 tokens in one batch, decode 64 tokens one at a time, F16 KV cache):", "",
              "| type | prefill base | prefill gated | ratio | decode base | decode gated | ratio |",
              "|---|---|---|---|---|---|---|"]
    for t, s in r["speed"].items():
        lines.append(f"| {t} | {s['baseline']['prefill_tps']:.0f} | {s['gated']['prefill_tps']:.0f} | "
                     f"{s['gated_over_baseline_prefill']:.3f} | {s['baseline']['decode_tps']:.0f} | "
                     f"{s['gated']['decode_tps']:.0f} | {s['gated_over_baseline_decode']:.3f} |")
    lines += ["", "Identity recurrent layer (F16 file; cost = file with two minus file with one; time shares from medians "
              "and, in brackets, from the fastest rounds; differences of a few percent are within this machine's noise):",
              "", "| shape (state x inner) | bytes | bytes share | prefill share | decode share |", "|---|---|---|---|---|"]
    for k, v in r["identity_layer"].items():
        lines.append(f"| {k} | {v['bytes']} | {v['bytes_share']:.1%} | {v['prefill_share']:+.1%} "
                     f"({v.get('prefill_share_min', float('nan')):+.1%}) | {v['decode_share']:+.1%} "
                     f"({v.get('decode_share_min', float('nan')):+.1%}) |")
    if r.get("arch"):
        a = r["arch"]
        lines += ["", "Where the gated twin's time goes (F16): the baseline written as qwen35 (gate rows 0, o_proj x2: "
                  "the same function) against the baseline as qwen3, and the gated twin against it:", "",
                  "| comparison | prefill ratio | decode ratio |", "|---|---|---|",
                  f"| baseline as qwen35 / baseline as qwen3 (llama.cpp's qwen35 graph + identity layer) | "
                  f"{a['qwen35_over_qwen3_prefill']:.3f} | {a['qwen35_over_qwen3_decode']:.3f} |",
                  f"| gated / baseline as qwen35 (the gate itself) | {a['gated_over_qwen35_prefill']:.3f} | "
                  f"{a['gated_over_qwen35_decode']:.3f} |"]
    lines += ["", "Gate survival (gated twin; gate values on calibration inputs, artifact vs float):", "",
              "| type | worst layer | mean abs diff | max fraction crossing 0.5 |", "|---|---|---|---|"]
    for k, v in r["gate_survival"].items():
        lines.append(f"| {k} | {v['worst_layer']} | {v['worst_mean_abs_diff']:.4f} | {v['max_frac_crossed_0.5']:.2%} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
