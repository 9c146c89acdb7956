"""The twins in ONNX Runtime: accuracy and size per scheme, fp16 overflow, speed against PyTorch eager.

For a trained twin pair (default: the `quantgate demo` directory) this exports both twins (fp32, fp16),
quantizes them with onnxruntime.quantization (int8-dynamic, int8-static, int8-weight, int4, and int4
with the gate MatMul at 8 bits for the gated twin) and scores each against the float PyTorch twin on
the same held-out windows. fp16: the largest residual-stream value of each twin (PyTorch) against
fp16's 65504, and whether the fp16 export's logits stay finite. Speed: prefill (128 tokens) and decode
(64 tokens) tokens/s for PyTorch eager fp32, ORT fp32, int8-dynamic and int4, measured in alternation,
medians; int4 decode over PyTorch decode (goal >= 3x) and gated over baseline (goal >= 0.97).

    python benchmarks/onnx_twins.py [--run quantgate-demo] [--windows 16] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SCHEMES = ["int8-dynamic", "int8-static", "int8-weight", "int4"]
SPEED = ["fp32", "int8-dynamic", "int4", "gqa-int4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="quantgate-demo")
    ap.add_argument("--work", default="/tmp/quantgate-onnx-bench")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="threads for speed runs (ORT and PyTorch alike)")
    ap.add_argument("--repeats", type=int, default=15, help="alternating rounds per speed comparison")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "onnx_twins.json"))
    args = ap.parse_args()

    import onnxruntime
    import torch

    from quantgate.calib_data import load_corpus, tokenize_corpus
    from quantgate.formats import load_checkpoint
    from quantgate.evaluate import compare_to_reference, eval_windows, reference_logits
    from quantgate.export.onnx import export_checkpoint
    from quantgate.gate_survival import check_gate_survival
    from quantgate.quant.ort import quantize_onnx
    from quantgate.runners import OrtRunner, TorchRunner

    run, work = Path(args.run), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_checkpoint(run / "baseline").tokenizer
    corpus = load_corpus("embedded").split("test")
    windows = eval_windows(tokenize_corpus(corpus, tok).ids, args.ctx, tok.bos_id, args.windows)
    result = {"run": str(run), "windows": len(windows), "ctx": args.ctx, "threads": args.threads,
              "rounds": args.repeats, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
              "accuracy": {}, "fp16": {}, "speed": {}, "gate_survival": {}}
    t0 = time.time()
    for twin in ("baseline", "gated"):
        src = run / twin
        ref = reference_logits(str(src), windows, f"{corpus.fingerprint}|test|{args.ctx}")
        acc = result["accuracy"][twin] = {}
        for dtype in ("fp32", "fp16"):
            export_checkpoint(src, work / f"{twin}-{dtype}", dtype=dtype)
        export_checkpoint(src, work / f"{twin}-gqa-fp32", graph="gqa")
        variants = [(s, s, None) for s in SCHEMES] + ([("int4+gate8", "int4", 8)] if twin == "gated" else [])
        for name, scheme, gb in variants:
            quantize_onnx(work / f"{twin}-fp32", work / f"{twin}-{name}", scheme, gb, ctx=args.ctx)
        quantize_onnx(work / f"{twin}-gqa-fp32", work / f"{twin}-gqa-int4", "int4")
        for name in ["fp32", "fp16", "gqa-fp32", "gqa-int4"] + [v[0] for v in variants]:
            with OrtRunner(work / f"{twin}-{name}", threads=2) as r:
                m = compare_to_reference(r, ref, windows)
                finite = bool(np.isfinite(r.logits(windows[:2])).all())
            acc[name] = {"bytes": (work / f"{twin}-{name}" / "model.onnx").stat().st_size, "finite": finite,
                         **{k: m[k] for k in ("ppl", "reference_ppl", "delta_ppl_pct", "kld_mean", "top1_agreement")}}
            print(f"{twin:8s} {name:12s} {acc[name]['bytes'] / 1e6:6.2f} MB  KLD {acc[name]['kld_mean']:.5f}  "
                  f"top1 {acc[name]['top1_agreement']:.4f}  dppl {acc[name]['delta_ppl_pct']:+.2f}%", flush=True)
            if twin == "gated" and name in ("int8-dynamic", "int4", "int4+gate8"):
                gs = check_gate_survival(str(work / f"{twin}-{name}"), str(src), n_windows=4, ctx=args.ctx)
                result["gate_survival"][name] = {k: gs[k] for k in ("worst_layer", "worst_mean_abs_diff",
                                                                     "max_frac_crossed_0.5")}
        model = load_checkpoint(src).model
        with torch.no_grad():
            hidden = model(torch.as_tensor(windows), return_hidden=True).hidden
        peak = max(float(h.abs().max()) for h in hidden)
        result["fp16"][twin] = {"max_abs_residual": peak, "fp16_max": 65504.0, "headroom": 65504.0 / peak,
                                "fp16_logits_finite": acc["fp16"]["finite"], "fp16_kld": acc["fp16"]["kld_mean"]}

    torch.set_num_threads(args.threads)
    ids = [int(t) for t in windows[0]]
    for twin in ("baseline", "gated"):
        torch_runner = TorchRunner(load_checkpoint(run / twin).model)  # eager fp32 with our KV cache
        runners = {name: OrtRunner(work / f"{twin}-{name}", threads=args.threads) for name in SPEED}
        samples = {k: [] for k in ["torch", *SPEED]}
        for _ in range(args.repeats):
            samples["torch"].append(dict(zip(("prefill_s", "decode_s"), torch_runner.time_round(ids[:128], ids[128:192]))))
            for name, r in runners.items():
                samples[name].append(r.bench(ids[:128], ids[128:192], repeats=1))
        for r in runners.values():
            r.close()
        result["speed"][twin] = {k: {"prefill_tps": 128 / np.median([x["prefill_s"] for x in v]),
                                     "decode_tps": 64 / np.median([x["decode_s"] for x in v])}
                                 for k, v in samples.items()}
        sp = result["speed"][twin]
        for k in SPEED:
            sp[k]["decode_over_torch"] = sp[k]["decode_tps"] / sp["torch"]["decode_tps"]
            sp[k]["prefill_over_torch"] = sp[k]["prefill_tps"] / sp["torch"]["prefill_tps"]
        print(twin, {k: (round(v["prefill_tps"]), round(v["decode_tps"])) for k, v in sp.items()}, flush=True)
    result["gated_over_baseline"] = {
        k: {"prefill": result["speed"]["gated"][k]["prefill_tps"] / result["speed"]["baseline"][k]["prefill_tps"],
            "decode": result["speed"]["gated"][k]["decode_tps"] / result["speed"]["baseline"][k]["decode_tps"]}
        for k in ["torch", *SPEED]}
    result["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, Path(args.out).with_suffix(".md"))


def write_markdown(r: dict, path: Path) -> None:
    b, g = r["accuracy"]["baseline"], r["accuracy"]["gated"]
    lines = [f"# ONNX twins in ONNX Runtime {r['onnxruntime']} ({r['windows']} held-out windows x {r['ctx']})", "",
             "Produced by `python benchmarks/onnx_twins.py --run <demo dir>` on the `small` twins of `quantgate demo`.",
             "", "| scheme | MB base | MB gated | KLD base | KLD gated | top-1 base | top-1 gated | dppl base | dppl gated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in g:
        bb = b.get(k)
        f = (lambda d, key, fmt: format(d[key], fmt) if d else "-")
        lines.append(f"| {k} | {f(bb, 'bytes', ',')} | {g[k]['bytes']:,} | {f(bb, 'kld_mean', '.5f')} | "
                     f"{g[k]['kld_mean']:.5f} | {f(bb, 'top1_agreement', '.4f')} | {g[k]['top1_agreement']:.4f} | "
                     f"{f(bb, 'delta_ppl_pct', '+.2f')}% | {g[k]['delta_ppl_pct']:+.2f}% |")
    lines += ["", "fp16: largest residual-stream value (PyTorch, same windows) against fp16's maximum 65504:", "",
              "| twin | max abs h | headroom | fp16 logits finite | fp16 KLD |", "|---|---|---|---|---|"]
    for t, v in r["fp16"].items():
        lines.append(f"| {t} | {v['max_abs_residual']:.1f} | {v['headroom']:.0f}x | {v['fp16_logits_finite']} | "
                     f"{v['fp16_kld']:.6f} |")
    lines += ["", f"Speed (tokens/s, median of {r['rounds']} alternating rounds, {r['threads']} thread; prefill 128, "
              "decode 64 one at a time):", "",
              "| twin | runtime | prefill | decode | prefill / torch | decode / torch |", "|---|---|---|---|---|---|"]
    for t, sp in r["speed"].items():
        for k, v in sp.items():
            lines.append(f"| {t} | {k} | {v['prefill_tps']:.0f} | {v['decode_tps']:.0f} | "
                         f"{v.get('prefill_over_torch', 1.0):.2f} | {v.get('decode_over_torch', 1.0):.2f} |")
    lines += ["", "Gated over baseline (tokens/s ratio):", "", "| runtime | prefill | decode |", "|---|---|---|"]
    for k, v in r["gated_over_baseline"].items():
        lines.append(f"| {k} | {v['prefill']:.3f} | {v['decode']:.3f} |")
    lines += ["", "Gate survival (gated twin):", "", "| scheme | worst layer | mean abs diff | max crossing 0.5 |",
              "|---|---|---|---|"]
    for k, v in r["gate_survival"].items():
        lines.append(f"| {k} | {v['worst_layer']} | {v['worst_mean_abs_diff']:.4f} | {v['max_frac_crossed_0.5']:.2%} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
