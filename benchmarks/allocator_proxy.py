"""The allocator's weight-error proxy (`quantize --sensitivity proxy`): how well it ranks what measured KLD ranks, what
its files lose against measured allocations, and what it costs at a Qwen3.5-9B shape (issue 36).

`--part rank` (a CPU-trained pair, `--run DIR` from `benchmarks/allocator.py --arch medium --keep-run DIR`, or
trained here): for each twin's F32 GGUF,

1. measured sensitivity (each tensor alone at each type, KLD on 8 calibration windows of 128 tokens, valid split)
   and the proxy's (importance 1: no calibration at all; 256 sampled rows per tensor);
2. Spearman's rank correlation between the two over every (tensor, type) pair, and over tensors at one type
   (Q4_K: which tensors suffer most), each with a 95% bootstrap interval over tensors;
3. at budgets of 4.25, 5.25 and 6.5 bpw: the measured allocation, the proxy allocation and the best llama.cpp
   standard type at <= the proxy file's size, mean KLD against the float twin on 64 test windows of 128 tokens,
   with paired window-bootstrap ratios proxy / measured and proxy / standard.

`--part rows` (with `--run DIR`, whose cache holds the measured sensitivity): the proxy at 256, 128 and 64 sampled
rows per tensor, three row draws each: seconds, rank agreement, and its allocations' KLD as the measured deltas
predict it, over the measured allocation's (part_rows).

`--part scale`: a Qwen3.5-9B-shape checkpoint with random bf16 weights (benchmarks/scale.py's writer), exported to
a bf16 GGUF, then `quantize --type Q4_K_M` and `quantize --target-size <that file's size> --sensitivity proxy`, each
in its own process: wall time and peak RSS of its largest process (getrusage of the waited children, one command
per wrapper). The allocation's quality at 9B is not measured (random weights; a 9B float reference does not run
here); its time and memory against plain quantization are the point. Every file is removed when its numbers are
written; needs ~45 GB free.

    python benchmarks/allocator_proxy.py --part rank --run /tmp/qg/medrun
    python benchmarks/allocator_proxy.py --part rows --run /tmp/qg/medrun
    python benchmarks/allocator_proxy.py --part scale [--work DIR] [--shape qwen35-9b]

Each part replaces its entry in benchmarks/results/allocator_proxy.json and rewrites allocator_proxy.md.
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

sys.path.insert(0, str(Path(__file__).parent))
from allocator import CALIB, EVAL, STANDARD, cli, evaluate, paired_ratio  # noqa: E402  (the same protocol)

RESULTS = Path(__file__).parent / "results"
BUDGETS = (4.25, 5.25, 6.5)
ONE_TYPE = "Q4_K"


def ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def rank_agreement(measured: dict, proxy: dict, types: list[str] | None = None, n: int = 2000, seed: int = 0,
                   base: str = "Q8_0") -> dict:
    """Spearman's rho between measured and proxy deltas over (tensor, type) pairs (types other than the base, or
    `types`), with a 95% bootstrap interval resampling tensors."""
    names = sorted(measured)
    pairs = [(i, t) for i, nm in enumerate(names) for t in measured[nm] if t != base and (types is None or t in types)
             and t in proxy[nm]]
    m = np.array([measured[names[i]][t] for i, t in pairs])
    p = np.array([proxy[names[i]][t] for i, t in pairs])
    unit = np.array([i for i, _ in pairs])
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n):
        pick = rng.integers(0, len(names), len(names))
        idx = np.concatenate([np.flatnonzero(unit == u) for u in pick])
        if len(idx) > 2:
            draws.append(spearman(m[idx], p[idx]))
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    return {"rho": spearman(m, p), "ci95": [float(lo), float(hi)], "pairs": len(pairs), "tensors": len(names)}


def base_kld_now(f32: Path, units) -> tuple[float, np.ndarray]:
    """KLD of the base file (every unit at the base type) on the calibration windows, computed now: the number a
    measured sensitivity starts from, which identifies the sensitivity file that belongs to this model."""
    from quantgate.calib_data import calibration_windows
    from quantgate.formats.gguf import open_reader, tokenizer_from_gguf
    from quantgate.metrics import window_scores
    from quantgate.quant.allocate import BASE, _logits
    from quantgate.quant.llama_cpp import exact_overrides, run_quantizer
    windows = calibration_windows(tokenizer_from_gguf(open_reader(f32)), "embedded", CALIB["windows"], CALIB["ctx"], 0)
    ref = _logits(f32, windows, None)
    base = f32.with_name(f32.stem + "-base.gguf")
    try:
        run_quantizer(f32, base, BASE, exact_overrides({u.name: BASE for u in units}))
        lg = _logits(base, windows, None)
    finally:
        base.unlink(missing_ok=True)
    return float(np.mean([window_scores(ref[i], lg[i], windows[i])["kld"].mean() for i in range(len(windows))])), windows


def measured_from(folder: Path, f32: Path, units):
    """A measured sensitivity that an earlier run (benchmarks/allocator.py) cached in `folder` for this model: the
    sens-*.json whose tensors are this model's and whose base KLD equals the one computed now (relative 1e-4);
    None when there is none. Saves re-measuring when the code (and so the cache key) has changed since: the file is
    copied to this code's cache key, so `quantize --sensitivity measured` reads it too."""
    from quantgate.fsio import write_json
    from quantgate.quant.allocate import Sensitivity, sensitivity_cache
    now, windows = base_kld_now(f32, units)
    names = {u.name for u in units}
    for p in sorted(folder.glob("sens-*.json")):
        d = json.loads(p.read_text())
        if set(d["delta"]) <= names and abs(d["base_kld"] - now) <= 1e-4 * abs(now):
            target = sensitivity_cache(f32, units, windows, None)
            if not target.is_file():
                write_json(target, d)
            return Sensitivity(d["base_kld"], d["delta"], d["windows"], d["ctx"], d["data"]), p.name
    return None


def part_rank(run: Path, cache: Path) -> dict:
    from quantgate.quant.allocate import BASE, measure_sensitivity, proxy_sensitivity, units_of
    os.environ["QUANTGATE_CACHE"] = str(cache)
    out = {"run": str(run), "twins": []}
    with tempfile.TemporaryDirectory(prefix="quantgate-proxy-") as tmp:
        work = Path(tmp)
        for name in ("baseline", "gated"):
            f32 = work / f"{name}-F32.gguf"
            cli("export", "gguf", run / name, "--out", f32, "--outtype", "f32")
            units = units_of(f32)
            t0 = time.perf_counter()
            found = measured_from(cache, f32, units)
            meas = found[0] if found else measure_sensitivity(f32, units, "embedded", CALIB["windows"], CALIB["ctx"],
                                                              0, None, work)
            t_meas = time.perf_counter() - t0
            t0 = time.perf_counter()
            prox = proxy_sensitivity(f32, units)
            t_prox = time.perf_counter() - t0
            kept = {n: d for n, d in prox.delta.items() if n in meas.delta}
            tw = {"twin": name, "tensors": len(meas.delta), "base_type": BASE,
                  "measured_from": found[1] if found else "measured now",
                  "measured_seconds_or_cached": round(t_meas, 1), "proxy_seconds": round(t_prox, 1),
                  "all_types": rank_agreement(meas.delta, kept),
                  "one_type": {"type": ONE_TYPE, **rank_agreement(meas.delta, kept, [ONE_TYPE])}, "budgets": []}
            print(json.dumps({k: v for k, v in tw.items() if k != "budgets"}), flush=True)
            env = {"QUANTGATE_CACHE": str(cache)}
            calib = ["--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"]]
            std = {}
            for t in STANDARD:
                p = work / f"{name}-{t}.gguf"
                cli("quantize", f32, "--type", t, "--out", p, env=env)
                std[t] = p
            for b in BUDGETS:
                files, row = {}, {"budget_bpw": b}
                for kind in ("measured", "proxy"):
                    p = work / f"{name}-{b}-{kind}.gguf"
                    cli("quantize", f32, "--target-bpw", b, "--sensitivity", kind, *calib, "--out", p, env=env)
                    files[kind] = (p, evaluate(p, run / name, cache))
                    row[kind] = {k: v for k, v in files[kind][1].items() if k != "per_window"}
                    row[kind]["types"] = json.loads(Path(str(p) + ".allocation.json").read_text())["types"]
                pbytes = files["proxy"][1]["bytes"]
                fits = [t for t in STANDARD if std[t].stat().st_size <= pbytes]
                row["proxy_vs_measured"] = paired_ratio(files["proxy"][1]["per_window"],
                                                        files["measured"][1]["per_window"])
                if fits:
                    evs = {t: evaluate(std[t], run / name, cache) for t in fits}
                    best = min(fits, key=lambda t: evs[t]["kld_mean"])
                    row["best_standard"] = best
                    row["standard"] = {k: v for k, v in evs[best].items() if k != "per_window"}
                    row["proxy_vs_best_standard"] = paired_ratio(files["proxy"][1]["per_window"],
                                                                 evs[best]["per_window"])
                    row["measured_vs_best_standard"] = paired_ratio(files["measured"][1]["per_window"],
                                                                    evs[best]["per_window"])
                for p, _ in files.values():
                    p.unlink()
                    Path(str(p) + ".allocation.json").unlink()
                tw["budgets"].append(row)
                print(json.dumps({"twin": name, "budget": b, "proxy_vs_measured": row["proxy_vs_measured"],
                                  "proxy_vs_best_standard": row.get("proxy_vs_best_standard")}), flush=True)
            for p in std.values():
                p.unlink()
            f32.unlink()
            out["twins"].append(tw)
    return out


ROWS_TRIED = (256, 128, 64)
SEEDS = (0, 1, 2)


def part_rows(run: Path, cache: Path) -> dict:
    """How many sampled rows the proxy needs: for each twin of the trained pair, the proxy at each of ROWS_TRIED rows
    per tensor and SEEDS row draws, its seconds, its rank agreement with the measured sensitivity, and at each
    budget the KLD its allocation is predicted to carry by the measured deltas (the model the measured allocator
    minimises; no file written) over the measured allocation's, so that a sample smaller than 256 rows is chosen
    only where it loses nothing beyond the spread between draws."""
    from quantgate.formats.gguf import open_reader
    from quantgate.quant.allocate import BASE, allocate, proxy_sensitivity, units_of
    os.environ["QUANTGATE_CACHE"] = str(cache)
    out = {"run": str(run), "rows": list(ROWS_TRIED), "seeds": list(SEEDS), "budgets": list(BUDGETS), "twins": []}
    with tempfile.TemporaryDirectory(prefix="quantgate-proxy-rows-") as tmp:
        for name in ("baseline", "gated"):
            f32 = Path(tmp) / f"{name}-F32.gguf"
            cli("export", "gguf", run / name, "--out", f32, "--outtype", "f32")
            found = measured_from(cache, f32, units_of(f32))
            if not found:
                raise RuntimeError(f"no measured sensitivity of {run / name} in {cache}: run benchmarks/allocator.py "
                                   f"--arch medium --keep-run {run} first")
            meas = found[0]
            units = [u for u in units_of(f32) if u.name in meas.delta]
            tensors = open_reader(f32).tensors
            total = sum(int(np.prod([int(d) for d in t.shape])) for t in tensors)
            other = sum(int(t.n_bytes) for t in tensors if t.name not in meas.delta)
            budgets = {b: int(b * total / 8) - other for b in BUDGETS}
            best = {b: allocate(units, meas, n).predicted_kld for b, n in budgets.items()}

            def predicted(types: dict) -> float:
                return meas.base_kld + sum(meas.delta[u.name][types[u.name]] for u in units)
            tw = {"twin": name, "tensors": len(units), "draws": [],
                  "measured_predicted_kld": {str(b): k for b, k in best.items()}}
            for rows in ROWS_TRIED:
                for seed in SEEDS:
                    t0 = time.perf_counter()
                    prox = proxy_sensitivity(f32, units, rows=rows, seed=seed)
                    d = {"rows": rows, "seed": seed, "seconds": round(time.perf_counter() - t0, 2),
                         "rho_all": rank_agreement(meas.delta, prox.delta, base=BASE)["rho"],
                         "rho_one_type": rank_agreement(meas.delta, prox.delta, [ONE_TYPE], base=BASE)["rho"],
                         "predicted_over_measured": {str(b): predicted(allocate(units, prox, n).types) / best[b]
                                                     for b, n in budgets.items()}}
                    tw["draws"].append(d)
                    print(json.dumps({"twin": name, **d}), flush=True)
            f32.unlink()
            out["twins"].append(tw)
    return out


def part_scale(shape: str, work: Path, arms: tuple[str, ...] = ()) -> dict:
    import scale
    cfg = scale.SHAPES[shape]()
    d = scale.claim(work / shape)
    res: dict = {"shape": shape}
    try:
        ckpt, f16 = d / "ckpt", d / "model-BF16.gguf"
        res["checkpoint"] = scale.write_checkpoint(cfg, ckpt)
        res["export"] = _brief(scale.measured(scale.qg("export", "gguf", str(ckpt), "--out", str(f16), "--outtype",
                                                       "bf16")))
        shutil.rmtree(ckpt)
        plain = d / "Q4_K_M.gguf"
        res["quantize Q4_K_M"] = _brief(scale.measured(scale.qg("quantize", str(f16), "--type", "Q4_K_M", "--out",
                                                                str(plain))))
        size = plain.stat().st_size
        res["q4_k_m_bytes"] = size
        plain.unlink()
        for key, extra in ARMS.items():
            if arms and key not in arms:
                continue
            alloc = d / "auto.gguf"
            r = scale.measured(scale.qg("quantize", str(f16), "--target-size", str(size), "--sensitivity", "proxy",
                                        *extra, "--out", str(alloc), "--json"))
            arm = res if key == "all" else res.setdefault("arms", {}).setdefault(key, {"flags": extra})
            arm["quantize --target-size (proxy)"] = _brief(r)
            if r["rc"] == 0:
                side = Path(str(alloc) + ".allocation.json")
                s = json.loads(side.read_text())  # stdout's tail is cut at 3000 chars
                arm["allocated_bytes"] = alloc.stat().st_size
                arm["allocated_bits_per_weight"] = s.get("bits_per_weight")
                counts: dict = {}
                for t in s.get("types", {}).values():
                    counts[t] = counts.get(t, 0) + 1
                arm["allocated_type_counts"] = counts
                arm["allocation_phase_seconds"] = s.get("seconds")
                arm["quantize_time"] = s.get("quantize_time")  # the limit on llama.cpp's quantizer, and its price
                alloc.unlink()
                side.unlink()
            q, a = res["quantize Q4_K_M"], arm["quantize --target-size (proxy)"]
            arm["time_ratio"] = a["seconds"] / q["seconds"]
            arm["peak_ratio"] = a["peak_rss"] / q["peak_rss"]
        res["quantize_throughput_m_elements_per_s"] = quantize_throughput()
    finally:
        scale.remove_own(d)
    return res


# The allocations timed at 9B: every candidate type (under the default quantize-time limit, which keeps llama.cpp's
# quantizer within 1.5x its Q4_K time), and without IQ4_XS (whose quantizer is the slowest: see quantize_throughput),
# the choice `--types` gives a user who cannot wait for it.
ARMS = {"all": [], "without IQ4_XS": ["--types", "Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0"]}


def quantize_throughput(rows: int = 256, row: int = 4096) -> dict:
    """ggml's own quantizer (ggml_quantize_chunk, one thread, no importance matrix) on random rows: million
    elements per second per candidate type, the median of 3 runs."""
    import ctypes
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from llama_cpp._ggml import libggml as lib
    from quantgate.quant.allocate import CANDIDATES
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    x = np.random.default_rng(0).standard_normal((rows, row)).astype(np.float32)
    out = {}
    for t in CANDIDATES:
        q = GGMLQuantizationType[t]
        block, size = GGML_QUANT_SIZES[q]
        dst = np.zeros(x.size // block * size, dtype=np.uint8)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            lib.ggml_quantize_chunk(int(q), x.ctypes.data, dst.ctypes.data, 0, rows, row, None)
            runs.append(time.perf_counter() - t0)
        out[t] = round(x.size / float(np.median(runs)) / 1e6, 1)
    return out


def _brief(r: dict) -> dict:
    return {"rc": r["rc"], "seconds": round(r["seconds"], 1), "peak_rss": r["peak_rss"],
            "own_peak_line": r.get("own_peak_line"), "error_line": r.get("error_line")}


def rows_table(e: dict) -> list[str]:
    """Per twin and rows per tensor: seconds, rho (mean and range over the draws), and per budget the allocation's
    predicted KLD over the measured allocation's (mean and range over the draws)."""
    lines = ["## How many rows the proxy samples", "",
             f"`{e['command']}` at {e['commit']} ({e['seconds'] / 60:.0f} min). For each rows per tensor, {len(e['seeds'])} "
             "row draws (seeds): the proxy's seconds, Spearman's rho with the measured sensitivity (all pairs; across "
             f"tensors at {ONE_TYPE}), and the KLD of its allocation at each budget as the measured per-tensor deltas "
             "predict it (additive, no file written), over the measured allocation's: mean [min, max] over the "
             "draws.", "",
             "| twin | rows | seconds | rho all | rho at " + ONE_TYPE + " | "
             + " | ".join(f"predicted KLD / measured alloc's at {b}" for b in e["budgets"]) + " |",
             "|---|---|---|---|---|" + "---|" * len(e["budgets"])]

    def span(xs: list[float]) -> str:
        return f"{np.mean(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"
    for tw in e["twins"]:
        for rows in e["rows"]:
            ds = [d for d in tw["draws"] if d["rows"] == rows]
            lines.append(f"| {tw['twin']} | {rows} | {np.median([d['seconds'] for d in ds]):.2f} | "
                         f"{span([d['rho_all'] for d in ds])} | {span([d['rho_one_type'] for d in ds])} | "
                         + " | ".join(span([d["predicted_over_measured"][str(b)] for d in ds]) for b in e["budgets"])
                         + " |")
    return lines + [""]


def write_tables(result: dict) -> None:
    lines = ["# The allocator's weight-error proxy", ""]
    if "rank" in result:
        e = result["rank"]
        lines += ["## Proxy vs measured sensitivity (CPU-trained medium pair)", "",
                  f"`{e['command']}` at {e['commit']} ({e['seconds'] / 60:.0f} min). Measured: each tensor alone at "
                  f"each type, KLD on {CALIB['windows']} calibration windows of {CALIB['ctx']} tokens (valid split). "
                  "Proxy: importance-weighted weight error (importance 1), 256 sampled rows per tensor, ggml's own "
                  "quantizers. Spearman's rho with a 95% bootstrap interval over tensors. The measured sensitivity was "
                  "read from benchmarks/allocator.py's cache of the same pair (identified by its base KLD, recomputed "
                  "here), so its seconds are a cache read. The proxy's formula (no rescaling of the embedding) was "
                  "chosen after a first version that treated the embedding as a lookup was seen to fail on these same "
                  "twins (77-1132x the measured allocation's KLD): these numbers are the proxy at its best here.", "",
                  "| twin | tensors | rho, all (tensor, type) pairs | rho across tensors at Q4_K | proxy s | measured s (cached) |",
                  "|---|---|---|---|---|---|"]
        for tw in e["twins"]:
            a, o = tw["all_types"], tw["one_type"]
            lines.append(f"| {tw['twin']} | {tw['tensors']} | {a['rho']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] "
                         f"| {o['rho']:.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}] | {tw['proxy_seconds']} | "
                         f"{tw['measured_seconds_or_cached']} |")
        lines += ["", f"Files at the same budget: mean KLD against the float twin on {EVAL['windows']} test windows of "
                  f"{EVAL['ctx']} tokens; paired window-bootstrap ratios [95%].", "",
                  "| twin | budget | KLD measured alloc | KLD proxy alloc | proxy / measured | best standard <= proxy "
                  "size | proxy / standard | measured / standard |", "|---|---|---|---|---|---|---|---|"]
        for tw in e["twins"]:
            for r in tw["budgets"]:
                pm = r["proxy_vs_measured"]
                cells = [f"{r['measured']['kld_mean']:.4g}", f"{r['proxy']['kld_mean']:.4g}",
                         f"{pm['ratio']:.3f} [{pm['ci95'][0]:.3f}, {pm['ci95'][1]:.3f}]"]
                if "best_standard" in r:
                    ps, ms = r["proxy_vs_best_standard"], r["measured_vs_best_standard"]
                    cells += [r["best_standard"], f"{ps['ratio']:.3f} [{ps['ci95'][0]:.3f}, {ps['ci95'][1]:.3f}]",
                              f"{ms['ratio']:.3f} [{ms['ci95'][0]:.3f}, {ms['ci95'][1]:.3f}]"]
                else:
                    cells += ["none this small", "-", "-"]
                lines.append(f"| {tw['twin']} | {r['budget_bpw']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "rows" in result:
        lines += rows_table(result["rows"])
    if "scale" in result:
        e = result["scale"]
        s = e["result"]
        q, a = s["quantize Q4_K_M"], s["quantize --target-size (proxy)"]
        lines += [f"## Allocation at a {s['shape']} shape (random bf16 weights)", "",
                  f"`{e['command']}` at {e['commit']}; each command in its own process, wall time and peak RSS of its "
                  "largest process.", "",
                  "| command | rc | seconds | peak RSS GB |", "|---|---|---|---|",
                  f"| quantize --type Q4_K_M | {q['rc']} | {q['seconds']} | {q['peak_rss'] / 1e9:.2f} |",
                  f"| quantize --target-size {s['q4_k_m_bytes']} --sensitivity proxy | {a['rc']} | {a['seconds']} | "
                  f"{a['peak_rss'] / 1e9:.2f} |", "",
                  f"Allocation / plain: time {s['time_ratio']:.2f}x, peak memory {s['peak_ratio']:.2f}x (goal: <= 2x "
                  f"both). Allocated file: {s.get('allocated_bytes', 0):,} bytes vs Q4_K_M's {s['q4_k_m_bytes']:,}; "
                  f"types: {s.get('allocated_type_counts')}."
                  + (f" Allocation phases (s): {s['allocation_phase_seconds']}." if s.get("allocation_phase_seconds")
                     else " Its phases were not timed in this run."), ""]
        if s.get("quantize_time"):
            qt = s["quantize_time"]
            lines += [f"Quantize-time limit (default `--quantize-time {qt['factor']:g}`): llama.cpp's quantizer predicted at "
                      f"{qt['predicted_s']:.0f} s against a limit of {qt['limit_s']:.0f} s (every tensor at Q4_K: "
                      f"{qt['reference_s']:.0f} s predicted, on {qt['threads']} threads); the limit "
                      + ("bound: without it the allocation was predicted at "
                         f"{qt['unlimited_predicted_s']:.0f} s with predicted proxy error "
                         f"{qt['unlimited_predicted_proxy_error']:.4g} against this file's "
                         f"{qt['predicted_proxy_error']:.4g} ({qt['predicted_proxy_error'] / qt['unlimited_predicted_proxy_error']:.3f}x; "
                         "the proxy's unit, not KLD)." if qt.get("binds") else "did not bind."), ""]
        for name, arm in s.get("arms", {}).items():
            b = arm["quantize --target-size (proxy)"]
            lines += [f"The same allocation {name} (`{' '.join(arm['flags'])}`): rc {b['rc']}, {b['seconds']} s, "
                      f"{b['peak_rss'] / 1e9:.2f} GB: time {arm['time_ratio']:.2f}x, peak memory {arm['peak_ratio']:.2f}x "
                      f"plain; {arm.get('allocated_bytes', 0):,} bytes; types {arm.get('allocated_type_counts')}; "
                      f"phases (s) {arm.get('allocation_phase_seconds')}.", ""]
        if s.get("quantize_throughput_m_elements_per_s"):
            lines += ["ggml's quantizer, one thread, no importance matrix, million elements per second (random rows "
                      f"of 4096): {s['quantize_throughput_m_elements_per_s']}.", ""]
        for e in result.get("scale_earlier_runs", []):
            s = e["result"]
            q, a = s["quantize Q4_K_M"], s["quantize --target-size (proxy)"]
            lines += [f"An earlier run of the same command at {e['commit']} ({e.get('note', '')}): plain {q['seconds']} s, "
                      f"{q['peak_rss'] / 1e9:.2f} GB; allocation {a['seconds']} s, {a['peak_rss'] / 1e9:.2f} GB; "
                      f"time {s['time_ratio']:.2f}x, memory {s['peak_ratio']:.2f}x.", ""]
    (RESULTS / "allocator_proxy.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("rank", "rows", "scale"), required=False)
    ap.add_argument("--run", default=None, help="rank: the trained pair (train --twins --preset medium)")
    ap.add_argument("--steps", type=int, default=300, help="rank without --run: train the medium pair this long")
    ap.add_argument("--shape", default="qwen35-9b")
    ap.add_argument("--work", default=None, help="scale: folder for the checkpoint and files (~45 GB at 9B)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"scale: the allocations to time, of {', '.join(ARMS)} "
                    "(comma-separated; default: every one)")
    ap.add_argument("--tables-only", action="store_true")
    args = ap.parse_args()
    path = RESULTS / "allocator_proxy.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    t0 = time.perf_counter()
    if args.part == "rank":
        with tempfile.TemporaryDirectory(prefix="quantgate-proxy-run-") as tmp:
            run = Path(args.run) if args.run else Path(tmp) / "run"
            if not (run / "gated").is_dir():
                cli("train", "--twins", "--preset", "medium", "--batch-size", 8, "--ctx", 128, "--steps", args.steps,
                    "--out", run)
            cache = run.parent / f"{run.name}-cache"
            r = part_rank(run, cache)
        result["rank"] = {"command": "python benchmarks/allocator_proxy.py --part rank"
                                     + (f" --run {args.run}" if args.run else f" --steps {args.steps}"),
                          "commit": commit, "machine": machine, "seconds": round(time.perf_counter() - t0, 1), **r}
    elif args.part == "rows":
        if not args.run:
            raise SystemExit("--part rows needs --run DIR (benchmarks/allocator.py --arch medium --keep-run DIR)")
        run = Path(args.run)
        r = part_rows(run, run.parent / f"{run.name}-cache")
        result["rows"] = {"command": f"python benchmarks/allocator_proxy.py --part rows --run {args.run}",
                          "commit": commit, "machine": machine, "seconds": round(time.perf_counter() - t0, 1), **r}
    elif args.part == "scale":
        work = Path(args.work or tempfile.gettempdir()) / "qg-alloc-scale"
        arms = tuple(a.strip() for a in args.arms.split(","))
        if not set(arms) <= set(ARMS) or "all" not in arms:
            raise SystemExit(f"--arms: 'all' and any of {', '.join(ARMS)}")
        r = part_scale(args.shape, work, arms)
        if work.is_dir() and not any(work.iterdir()):
            work.rmdir()
        if "scale" in result:  # the run it replaces stays, with its commit (these ratios vary between runs)
            result.setdefault("scale_earlier_runs", []).insert(0, result["scale"])
        result["scale"] = {"command": f"python benchmarks/allocator_proxy.py --part scale --shape {args.shape}"
                                      + ("" if set(arms) == set(ARMS) else f" --arms {args.arms}"),
                           "commit": commit, "machine": machine, "seconds": round(time.perf_counter() - t0, 1),
                           "result": r}
    if args.part:
        path.write_text(json.dumps(result, indent=1) + "\n")
    write_tables(result)


if __name__ == "__main__":
    main()
