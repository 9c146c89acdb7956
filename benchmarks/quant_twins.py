"""What quantization costs the baseline and the gated twin, next to how large their outliers are.

For a trained twin pair (default: the `quantgate demo` directory) this runs, with the library's own
functions: the outlier analysis of both twins on the same windows, then every scheme below applied in
PyTorch and scored against the float twin on the same held-out windows (delta perplexity, KL divergence,
top-1 agreement). Calibration uses the embedded corpus's valid split; scoring uses its test split.

    python benchmarks/quant_twins.py [--run quantgate-demo] [--windows 64] [--calib 32]
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np

SCHEMES = ["w8a8-static", "w8a8-static-sym", "w8a8-static-pct", "w8a8-static-sink", "w8a8-smoothquant",
           "w8a8-dynamic", "w8a16", "kv-int8", "kv-int4",
           "w4a16-g32", "w4a16-g128", "gptq-w4a16-g32", "w4a16-g32-gate8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="quantgate-demo", help="run directory holding baseline/ and gated/")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows scored")
    ap.add_argument("--calib", type=int, default=32, help="calibration windows")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_twins.json"))
    args = ap.parse_args()

    from quantgate.calib_data import load_corpus, sample_windows, tokenize_corpus
    from quantgate.formats import load_checkpoint
    from quantgate.evaluate import compare_to_reference, eval_windows
    from quantgate.metrics import layer_sqnr
    from quantgate.outliers import analyze_model
    from quantgate.quant.torch_backend import quantize_
    from quantgate.runners import TorchRunner
    from quantgate.quant.schemes import get_scheme
    from quantgate.quant.smoothquant import smooth_

    run = Path(args.run)
    twins = {k: load_checkpoint(run / k) for k in ("baseline", "gated")}
    tok = twins["baseline"].tokenizer
    corpus = load_corpus("embedded")
    test_ids = tokenize_corpus(corpus.split("test"), tok).ids
    windows = eval_windows(test_ids, args.ctx, tok.bos_id, args.windows)
    calib = sample_windows(tokenize_corpus(corpus.split("valid"), tok), args.calib, args.ctx, seed=0)

    result = {"run": str(run), "ctx": args.ctx, "eval_windows": len(windows), "calib_windows": len(calib),
              "corpus_fingerprint": corpus.fingerprint, "outliers": {}, "schemes": {}}
    for name, lt in twins.items():
        rep = analyze_model(lt.model, calib[:16])
        L = rep["layers"]
        lin = rep["linear_inputs"]
        result["outliers"][name] = {
            "max_abs_per_layer": [round(l["max_abs"], 2) for l in L],
            "max_position_per_layer": [l["max_position"] for l in L],
            "max_over_median_per_layer": [round(l["max_over_median"], 1) for l in L],
            "bos_attention_mean_per_layer": [round(l["bos_attention_mean"], 4) for l in L],
            "uniform_bos_share": round(rep["uniform_bos_share"], 4),
            "down_proj_kurtosis": [round(lin[f"layers.{i}.mlp.down_proj"]["kurtosis"], 1) for i in range(len(L))],
            "o_proj_kurtosis": [round(lin[f"layers.{i}.self_attn.o_proj"]["kurtosis"], 1) for i in range(len(L))],
            "down_proj_input_max_abs": [round(lin[f"layers.{i}.mlp.down_proj"]["max_abs"], 2) for i in range(len(L))],
            "o_proj_input_max_abs": [round(lin[f"layers.{i}.self_attn.o_proj"]["max_abs"], 2) for i in range(len(L))],
            "gate_mean": ([round(float(np.mean(l["gate_mean"])), 3) for l in L] if "gate_mean" in L[0] else None),
            "gate_frac_below_0.1": ([round(float(np.mean(l["gate_frac_below_0.1"])), 3) for l in L]
                                    if "gate_mean" in L[0] else None),
        }
        ref = TorchRunner(lt.model, name=name).logits(windows)
        for scheme in SCHEMES:
            s = get_scheme(scheme)
            if s.gate_bits is not None and lt.model.cfg.gate == "none":
                continue
            t = time.time()
            q = quantize_(copy.deepcopy(lt.model), s, calib)
            m = compare_to_reference(TorchRunner(q, name=f"{name}:{scheme}"), ref, windows)
            # SmoothQuant rescales layer inputs: compare against the smoothed float model, its exact float twin
            fp = smooth_(copy.deepcopy(lt.model), calib, s.smooth_alpha) if s.smooth_alpha is not None else lt.model
            sq = layer_sqnr(fp, q, windows[:4])
            finite = {k: v for k, v in sq.items() if v["output_db"] is not None}
            if finite:
                worst = min(finite, key=lambda k: finite[k]["output_db"])
                m["worst_layer_output_sqnr"] = {"layer": worst, **finite[worst]}
            result["schemes"].setdefault(scheme, {})[name] = {
                k: round(v, 6) if isinstance(v, float) else v for k, v in m.items()} | {"seconds": round(time.time() - t, 1)}
            ws = m.get("worst_layer_output_sqnr")
            print(f"{name:9s} {scheme:18s} ppl {m['reference_ppl']:.3f} -> {m['ppl']:.3f} "
                  f"({m['delta_ppl_pct']:+.2f}%)  KLD {m['kld_mean']:.5f}  top-1 {m['top1_agreement']:.4f}  worst layer "
                  + (f"{ws['layer']} {ws['output_db']:.1f} dB" if ws else "-"), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| scheme | baseline dppl % | gated dppl % | baseline KLD | gated KLD | baseline top-1 | gated top-1 "
             "| worst-layer output SQNR dB (baseline / gated) |",
             "|---|---|---|---|---|---|---|---|"]
    for scheme, by in result["schemes"].items():
        b, g = by.get("baseline"), by["gated"]
        f = lambda d, k, fmt: "-" if d is None else format(d[k], fmt)  # noqa: E731
        sqnr = lambda d: ("-" if d is None or "worst_layer_output_sqnr" not in d  # noqa: E731
                          else f"{d['worst_layer_output_sqnr']['output_db']:.1f} "
                               f"({d['worst_layer_output_sqnr']['layer'].replace('layers.', 'L')})")
        lines.append(f"| {scheme} | {f(b, 'delta_ppl_pct', '+.2f')} | {f(g, 'delta_ppl_pct', '+.2f')} | "
                     f"{f(b, 'kld_mean', '.5f')} | {f(g, 'kld_mean', '.5f')} | {f(b, 'top1_agreement', '.4f')} | "
                     f"{f(g, 'top1_agreement', '.4f')} | {sqnr(b)} / {sqnr(g)} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
