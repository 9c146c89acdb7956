"""`quantgate report`: the twins side by side, model x backend x scheme, with outliers and the link between them.

Every cell (one twin, one backend, one scheme) builds its artifact once under `OUT/artifacts/`, scores it
against the twin's float PyTorch logits on the same held-out windows, and stores its numbers with the
settings that produced them in `OUT/cells/*.json`. A re-run (or a run after an interruption) reuses every
cell whose settings match, so only missing cells are computed. The report itself is written from the cells:
`report.json` (every number, settings, versions, machine), `report.md`, and `report.html` (self-contained:
plots embedded as data URIs, opens offline). The conclusion is generated from the numbers.
"""
from __future__ import annotations

import base64
import contextlib
import html
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .analyze import analyze, plot_reports, save_figure
from .calib_data import check_ctx, data_paths, default_split, eval_windows, load_corpus, tokenize_corpus
from .errors import DiskFull, QuantgateError
from .evaluate import evaluate_model
from .export.gguf import export_checkpoint as export_gguf
from .export.onnx import export_checkpoint as export_onnx
from .formats import inspect_gguf, load_checkpoint
from .fsio import atomic_file, check_output, claim_folder, interrupts, write_json
from .gate_survival import check_gate_survival
from .identity import code_id, content_id
from .identity import key as ident_key
from .info import model_info
from .progress import console
from .quant import SCHEMES, SCOPES, plain_of
from .quant import get as registry_get
from .quant.build import CalibSettings, quantize
from .runners import LlamaRunner, OrtRunner

TWINS = ("baseline", "gated")
DEFAULT_SCHEMES = {
    "torch": ["w8a8-static", "w8a8-static-sink", "w8a8-dynamic", "w4a16-g32", "w4a16-g32-qgate8"],
    "onnx": ["fp32", "int8-dynamic", "int8-static", "int4", "int4+gate8"],
    "gguf": ["F16", "Q8_0", "Q4_K_M", "Q4_K_M+gate8", "Q2_K", "kv-q8_0", "kv-q4_0"],
}  # names from the registry (quantgate.quant); the gate-aware ones all keep the whole q|gate projection at 8 bits
# KLDs within 2% of each other are called a tie, not a win: the twins' KLD ratios that separate demo training
# runs produced ranged 1.03x-1.45x, and which configurations one twin won changed between runs.
TIE_RATIO = 1.02
BENCH_TOKENS = 192  # the speed runs prefill 128 tokens, then decode 64
GATE_SURVIVAL_WINDOWS = 4  # calibration windows the gate-survival check of each gated artifact runs


def gated_only(backend: str, scheme: str) -> bool:
    """Gate-aware schemes (a KeepAt override on gate rows) have nothing to keep in the baseline. The float
    reference cells (torch fp32 speed) are not registry schemes."""
    sch = SCHEMES.get(f"{backend}:{scheme}")
    return sch is not None and sch.keep is not None


@dataclass
class ReportSettings:
    baseline: str
    gated: str
    out: str
    data: str = "embedded"
    backends: tuple = ("torch", "onnx", "gguf")
    schemes: dict = field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_SCHEMES.items()})
    windows: int = 16
    ctx: int = 256
    calib_windows: int = 16
    analysis_windows: int = 16
    threads: int | None = None
    recipe_note: str | None = None      # why the twins were trained as they were (the demo says so here)


@dataclass
class Identity:
    """What every cached result of one report run is keyed by: the twins' contents, the data's contents,
    the measurement settings and the code (never paths, modification times or the version string)."""
    models: dict          # twin -> content id
    data: str             # corpus fingerprint
    code: str

    def cell_key(self, s: ReportSettings, *cell) -> str:
        return ident_key("cell", self.code, self.models, self.data, s.windows, s.ctx, s.calib_windows,
                         s.analysis_windows, *cell)

    def calibration(self, s: ReportSettings) -> list:
        return [self.data, s.calib_windows, s.ctx, 0]  # data content, windows, window length, sampler seed


class Artifacts:
    """Exported and quantized files under OUT/artifacts, each reused only while the key of what produced it
    (recorded in artifacts/keys.json once it is complete) still matches; otherwise it is built again."""

    def __init__(self, root: Path):
        self.root, self.file = root, root / "keys.json"
        self.keys: dict = {}
        if self.file.is_file():
            with contextlib.suppress(ValueError, OSError):
                d = json.loads(self.file.read_text())
                self.keys = d if isinstance(d, dict) else {}
        self.log: dict[str, dict] = {}

    def get(self, path: Path, k: str, build) -> Path:
        rel = path.relative_to(self.root).as_posix()
        if self.keys.get(rel) == k and path.exists():
            self.log.setdefault(rel, {"key": k, "built": False})  # built earlier in this run stays "built"
            return path
        build(path)
        self.keys[rel] = k
        self.log[rel] = {"key": k, "built": True}
        write_json(self.file, self.keys)
        return path


# --- cells -------------------------------------------------------------------------------------------

def _bench_torch(model, ids: list[int]) -> dict:
    import torch
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids[:128]]), past=[None] * model.cfg.n_layers)
        t1 = time.perf_counter()
        past, pos = out["past"], 128
        for t in ids[128:192]:
            out = model(torch.tensor([[t]]), past=past, start_pos=pos)
            past, pos = out["past"], pos + 1
        t2 = time.perf_counter()
    return {"prefill_tps": 128 / (t1 - t0), "decode_tps": 64 / (t2 - t1)}


def _torch_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str) -> dict:
    src, sch = getattr(s, twin), registry_get("torch", scheme)
    k = ident_key("torch", ident.code, ident.models[twin], scheme,
                  ident.calibration(s) if sch.needs_calibration else None)
    art = arts.get(arts.root / "torch" / f"{twin}-{scheme}", k, lambda p: quantize(src, sch, p, _calib(s)))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src)
    bits = model_info(str(art))["quantization"]["block_bits_per_weight"]  # the bits each stored Linear holds
    return {**_metrics(ev), "bits_per_weight": bits, "bytes": None, "layer_sqnr_db": ev.get("layer_sqnr_db"),
            "artifact": str(art)}


def _onnx_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str, ids: list[int]) -> dict:
    src, sch = getattr(s, twin), registry_get("onnx", scheme)
    k32 = ident_key("onnx-fp32", ident.code, ident.models[twin])
    art = fp32 = arts.get(arts.root / "onnx" / f"{twin}-fp32", k32, lambda p: export_onnx(src, p))
    if sch.tool != "export":
        k = ident_key("onnx", k32, scheme, ident.calibration(s) if sch.needs_calibration else None)
        art = arts.get(arts.root / "onnx" / f"{twin}-{scheme}", k, lambda p: quantize(fp32, sch, p, _calib(s)))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src, threads=s.threads)
    with OrtRunner(art, threads=s.threads) as r:
        speed = r.bench(ids[:128], ids[128:192], repeats=3)
    n = _n_params(src)
    size = (art / "model.onnx").stat().st_size
    return {**_metrics(ev), "bytes": size, "bits_per_weight": 8 * size / n, **_speed(speed), "artifact": str(art)}


def _gguf_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str, ids: list[int]) -> dict:
    src, root, sch = getattr(s, twin), arts.root / "gguf", registry_get("gguf", scheme)
    kv = sch.kv_type or "f32"  # kv-*: F16 weights, quantized KV cache: what a laptop would run
    scheme_file = "F16" if sch.kv_type else scheme
    if scheme_file == "F16":
        art = arts.get(root / f"{twin}-F16.gguf", ident_key("gguf-F16", ident.code, ident.models[twin]),
                       lambda p: export_gguf(src, p, "f16"))
    else:
        k32 = ident_key("gguf-F32", ident.code, ident.models[twin])
        f32 = arts.get(root / f"{twin}-F32.gguf", k32, lambda p: export_gguf(src, p, "f32"))
        art = arts.get(root / f"{twin}-{scheme_file}.gguf", ident_key("gguf", k32, scheme_file),
                       lambda p: quantize(f32, sch, p, _calib(s), threads=s.threads))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src, kv_type=kv, threads=s.threads)
    with LlamaRunner(art, n_ctx=max(s.ctx, BENCH_TOKENS), kv_type=kv if kv != "f32" else "f16", threads=s.threads,
                     logits_all=False) as r:
        speed = r.bench(ids[:128], ids[128:192], repeats=3)
    info = inspect_gguf(art)
    return {**_metrics(ev), "bytes": info.n_bytes, "bits_per_weight": info.bits_per_weight, "kv_type": kv,
            **_speed(speed), "artifact": str(art)}


def _calib(s: ReportSettings) -> CalibSettings:
    return CalibSettings(s.data, s.calib_windows, s.ctx)


def _metrics(ev: dict) -> dict:
    keys = ("ppl", "reference_ppl", "delta_ppl_pct", "kld_mean", "kld_p99", "top1_agreement", "n_tokens")
    return {k: ev[k] for k in keys}


def _speed(b: dict) -> dict:
    return {"prefill_tps": b["prefill_tps"], "decode_tps": b["decode_tps"]}


def _n_params(path: str) -> int:
    return load_checkpoint(path).model.num_params()


# --- the run -----------------------------------------------------------------------------------------

def check_settings(s: ReportSettings) -> None:
    """Checked before any work, so a typo is one error line and not a report whose cells were all skipped."""
    unknown = [b for b in s.backends if b not in DEFAULT_SCHEMES]
    if unknown:
        raise QuantgateError(f"unknown backend {unknown[0]!r}; choose from {', '.join(DEFAULT_SCHEMES)}")
    for backend in s.backends:
        for scheme in s.schemes.get(backend, DEFAULT_SCHEMES[backend]):
            registry_get(backend, scheme)  # an unknown name: one line listing the choices
    check_output(s.out, "report", (s.baseline, s.gated, *data_paths(s.data)))


def _cached(path: Path, k: str, compute, label: str, timings: dict) -> dict:
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if isinstance(d, dict) and d.get("_key") == k:
                timings[label] = 0.0
                return d
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    t0 = time.time()
    console.print(f"[bold]{label}[/bold] ...")
    d = compute()
    d["_key"], d["_seconds"] = k, round(time.time() - t0, 2)
    timings[label] = d["_seconds"]
    write_json(path, d)
    return d


def run_report(s: ReportSettings) -> dict:
    """Run (or resume) every cell, then write report.json, report.md and report.html into s.out."""
    check_settings(s)
    loaded = {t: load_checkpoint(getattr(s, t)) for t in TWINS}
    if loaded["baseline"].model.cfg.gate != "none" or loaded["gated"].model.cfg.gate == "none":
        raise QuantgateError("--models takes the baseline (no gate) first, then the gated twin")
    tok = loaded["baseline"].tokenizer
    if tok is None or loaded["gated"].tokenizer is None:
        raise QuantgateError("both twins need a tokenizer.json")
    for t in TWINS:
        context = loaded[t].model.cfg.max_seq_len
        check_ctx(s.ctx, context, getattr(s, t))
        if context < BENCH_TOKENS:
            raise QuantgateError(f"{getattr(s, t)}: the report's speed runs need {BENCH_TOKENS} tokens of context, "
                                 f"the model has {context}")
    corpus = load_corpus(s.data)
    ids = [int(t) for t in eval_windows(tokenize_corpus(corpus.split(default_split(s.data)), tok).ids, BENCH_TOKENS + 1,
                                        tok.bos_id, 1)[0]]
    ident = Identity({t: content_id(getattr(s, t)) for t in TWINS}, corpus.fingerprint, code_id())
    out = claim_folder(s.out, "report")
    cells_dir, plots_dir = out / "cells", out / "plots"
    arts = Artifacts(out / "artifacts")
    timings: dict[str, float] = {}

    analysis = {t: _cached(cells_dir / f"analysis-{t}.json", ident.cell_key(s, "analysis", t),
                           lambda t=t: analyze(getattr(s, t), s.data, s.ctx, s.analysis_windows),
                           f"analyse {t}", timings) for t in TWINS}
    plot_files = [str(p) for p in plot_reports(analysis, plots_dir)]

    cells: dict[str, dict] = {}
    for backend in s.backends:
        for twin in TWINS:
            if backend == "torch":
                cells[f"torch/{twin}/fp32"] = _cached(
                    cells_dir / f"torch-{twin}-fp32.json", ident.cell_key(s, "torch", twin, "fp32"),
                    lambda twin=twin: {"bits_per_weight": 32.0, "kld_mean": 0.0, "top1_agreement": 1.0,
                                       "delta_ppl_pct": 0.0, **_bench_torch(loaded[twin].model, ids)},
                    f"torch {twin} fp32 speed", timings)
            for scheme in s.schemes.get(backend, DEFAULT_SCHEMES[backend]):
                if twin == "baseline" and gated_only(backend, scheme):
                    continue
                label = f"{backend} {twin} {scheme}"

                def compute(backend=backend, twin=twin, scheme=scheme):
                    try:
                        if backend == "torch":
                            cell = _torch_cell(s, ident, arts, twin, scheme)
                        elif backend == "onnx":
                            cell = _onnx_cell(s, ident, arts, twin, scheme, ids)
                        else:
                            cell = _gguf_cell(s, ident, arts, twin, scheme, ids)
                    except DiskFull:
                        raise
                    except QuantgateError as e:  # a configuration this model cannot take: recorded, not fatal
                        if interrupts:
                            raise
                        return {"error": str(e)}
                    if twin == "gated" and not scheme.startswith("kv-"):
                        gs = check_gate_survival(cell["artifact"], s.gated, s.data, GATE_SURVIVAL_WINDOWS, s.ctx)
                        cell["gate_survival"] = {k: gs[k] for k in ("worst_layer", "worst_mean_abs_diff",
                                                                    "max_frac_crossed_0.5")}
                    return cell

                cell = _cached(cells_dir / f"{backend}-{twin}-{scheme}.json", ident.cell_key(s, backend, twin, scheme),
                               compute, label, timings)
                if "error" in cell:
                    console.print(f"  skipped: {cell['error']}", markup=False, highlight=False)
                cells[f"{backend}/{twin}/{scheme}"] = cell

    report = build_report(s, analysis, cells, timings, plot_files)
    report["identity"] = {"models": ident.models, "data": ident.data, "code": ident.code}
    report["artifacts"] = arts.log
    report["training"] = {t: _training(loaded[t].model.cfg.extra) for t in TWINS}
    plots = report_plots(report, plots_dir)
    report["plots"] = plot_files + [str(p) for p in plots]
    write_json(out / "report.json", report)
    with atomic_file(out / "report.md", "w") as f:
        f.write(render_markdown(report))
    with atomic_file(out / "report.html", "w") as f:
        f.write(render_html(report))
    return report


# --- numbers -> report ---------------------------------------------------------------------------------

def _link(analysis: dict, cells: dict, twin: str) -> dict | None:
    """Per Linear: W8A8-static output SQNR against that layer's input inf-norm, with their correlation."""
    cell = cells.get(f"torch/{twin}/w8a8-static")
    if not cell or not cell.get("layer_sqnr_db"):
        return None
    pts = []
    for name, v in cell["layer_sqnr_db"].items():
        li = analysis[twin]["linear_inputs"].get(name)
        if li and v.get("output_db") is not None:
            pts.append((name, li["max_abs"], v["output_db"]))
    if len(pts) < 3:
        return None
    x, y = np.log10([p[1] for p in pts]), np.array([p[2] for p in pts])
    return {"points": [{"linear": n, "inf_norm": a, "sqnr_db": b} for n, a, b in pts],
            "pearson_log_infnorm_vs_sqnr": float(np.corrcoef(x, y)[0, 1])}


def _layer_inputs(linear_inputs: dict, layer: int) -> dict:
    """The layer's o_proj and down_proj inputs: inf-norm and kurtosis (where outliers hurt W8A8)."""
    out = {}
    for short, name in (("o_proj", f"layers.{layer}.self_attn.o_proj"), ("down_proj", f"layers.{layer}.mlp.down_proj")):
        v = linear_inputs.get(name)
        if v:
            out[f"{short}_inf_norm"], out[f"{short}_kurtosis"] = v["max_abs"], v["kurtosis"]
    return out


def _training(extra: dict) -> dict | None:
    """What a checkpoint says of its own training (quantgate train records it; other checkpoints: None)."""
    if extra.get("trained_by") != "quantgate train":
        return None
    return {"steps": extra.get("steps"), "corpus": extra.get("corpus"), **(extra.get("recipe") or {})}


def _training_lines(rep: dict) -> list[str]:
    tr = rep.get("training") or {}
    lines = []
    for t, r in tr.items():
        if not r:
            lines.append(f"{t}: not trained by quantgate (no recipe recorded).")
            continue
        tokens = f", {r['tokens'] / 1e6:.2f}M tokens" if r.get("tokens") else ""
        extra = ", ".join(f"{k} {r[k]}" for k in ("batch_size", "ctx", "lr", "warmup", "weight_decay") if k in r)
        lines.append(f"{t}: {r.get('steps')} steps{tokens} on {r.get('corpus')}" + (f" ({extra})" if extra else "") + ".")
    if rep["settings"].get("recipe_note"):
        lines.append(rep["settings"]["recipe_note"])
    return lines


def build_report(s: ReportSettings, analysis: dict, cells: dict, timings: dict, plot_files: list) -> dict:
    import onnxruntime
    import torch
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
    outliers = {}
    for t, rep in analysis.items():
        L = rep["layers"]
        outliers[t] = {"max_abs": max(l["max_abs"] for l in L), "max_over_median": max(l["max_over_median"] for l in L),
                       "bos_attention_max_layer_mean": max(l["bos_attention_mean"] for l in L),
                       "uniform_bos_share": rep["uniform_bos_share"],
                       "max_kurtosis": max(v["kurtosis"] for v in rep["linear_inputs"].values()),
                       "max_linear_inf_norm": max(v["max_abs"] for v in rep["linear_inputs"].values()),
                       "per_layer": [{k: l.get(k) for k in ("layer", "max_abs", "max_over_median", "bos_attention_mean")}
                                     | _layer_inputs(rep["linear_inputs"], l["layer"])
                                     | ({"gate_mean": float(np.mean(l["gate_mean"])),
                                         "gate_frac_below_0.1": float(np.mean(l["gate_frac_below_0.1"]))}
                                        if "gate_mean" in l else {}) for l in L]}
    rep = {"quantgate_version": __version__, "settings": asdict(s), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "python": platform.python_version()},
           "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                        "llama_cpp_python": llama_version},
           "cells": {k: {kk: vv for kk, vv in v.items() if kk != "layer_sqnr_db"} for k, v in cells.items()},
           "outliers": outliers, "link": {t: _link(analysis, cells, t) for t in TWINS}, "timings_s": timings}
    rep["conclusion"] = conclusion(rep)
    return rep


def conclusion(rep: dict) -> list[str]:
    """Sentences written from the numbers: nothing here is fixed wording that could contradict them."""
    lines = []
    o = rep["outliers"]
    b, g = o["baseline"], o["gated"]
    ratio = b["max_abs"] / g["max_abs"]
    lines.append(f"Largest residual activation: baseline {b['max_abs']:.1f} vs gated {g['max_abs']:.1f} "
                 f"({ratio:.2f}x); largest max/median ratio {b['max_over_median']:.1f} vs {g['max_over_median']:.1f}.")
    uni = b["uniform_bos_share"]
    sink = "none of either twin's layers is an attention sink" if max(b["bos_attention_max_layer_mean"],
                                                                    g["bos_attention_max_layer_mean"]) < 0.2 \
        else "at least one layer puts most of its attention on BOS"
    lines.append(f"Attention on BOS, worst layer (head mean): baseline {b['bos_attention_max_layer_mean']:.3f} vs gated "
                 f"{g['bos_attention_max_layer_mean']:.3f} (uniform {uni:.3f}): {sink}.")
    wins = {"baseline": 0, "gated": 0, "tie": 0}
    for key, cell in rep["cells"].items():
        backend, twin, scheme = key.split("/")
        if twin != "gated" or gated_only(backend, scheme) or scheme in ("fp32", "F16"):
            continue
        other = rep["cells"].get(f"{backend}/baseline/{scheme}")
        if not other or other.get("kld_mean") is None or cell.get("kld_mean") is None:
            continue
        kb, kg = other["kld_mean"], cell["kld_mean"]
        if kb <= 0 or kg <= 0:
            continue
        ratio = max(kb, kg) / min(kb, kg)
        better = "tie" if ratio < TIE_RATIO else "gated" if kg < kb else "baseline"
        wins[better] += 1
        verdict = (f"the twins lose the same within {TIE_RATIO - 1:.0%}" if better == "tie"
                   else f"the {better} twin loses less")
        lines.append(f"{backend} {scheme}: {verdict} (KLD {kb:.5f} baseline vs {kg:.5f} gated, "
                     f"{ratio:.2f}x; delta ppl {other['delta_ppl_pct']:+.2f}% vs {cell['delta_ppl_pct']:+.2f}%).")
    for key, a in rep["cells"].items():  # each gate-aware cell beside the same scheme without its override
        backend, twin, scheme = key.split("/")
        sch = SCHEMES.get(f"{backend}:{scheme}")
        aware = twin == "gated" and gated_only(backend, scheme)
        p = rep["cells"].get(f"{backend}/gated/{plain_of(sch)}") if aware else None
        if p:
            lines.append(f"{backend}: keeping {SCOPES[sch.keep.scope]} at {sch.keep.bits} bits under {plain_of(sch)} "
                         f"changes the gated twin's KLD from {p['kld_mean']:.5f} to {a['kld_mean']:.5f}.")
    total = sum(wins.values())
    if total:
        ties = f", {wins['tie']} within {TIE_RATIO - 1:.0%}" if wins["tie"] else ""
        lines.insert(2, f"Across {total} quantized configurations the gated twin loses less in {wins['gated']} and the "
                        f"baseline in {wins['baseline']}{ties} (KL divergence against each twin's own float model).")
    for t, link in rep["link"].items():
        if link:
            r = link["pearson_log_infnorm_vs_sqnr"]
            reading = ("layers with larger inputs lose more signal to W8A8" if r < -0.3 else
                       "layers with larger inputs keep more signal under W8A8, the opposite of the outlier story"
                       if r > 0.3 else "no clear relation between input size and W8A8 error across layers")
            lines.append(f"{t}: per-layer W8A8 output SQNR against the layer's input inf-norm: Pearson r = {r:+.2f} "
                         f"(log10 inf-norm, {len(link['points'])} layers): {reading}.")
    return lines


# --- plots and rendering ---------------------------------------------------------------------------------

def report_plots(rep: dict, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    backends = sorted({k.split("/")[0] for k in rep["cells"]})
    fig, axes = plt.subplots(1, len(backends), figsize=(4.8 * len(backends), 3.8), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        for twin, color in (("baseline", "tab:blue"), ("gated", "tab:orange")):
            pts = sorted((c["bits_per_weight"], c["kld_mean"], k.split("/")[2]) for k, c in rep["cells"].items()
                         if k.startswith(f"{backend}/{twin}/") and c.get("kld_mean") and c.get("bits_per_weight")
                         and not k.endswith(("/fp32", "/F16")) and not k.split("/")[2].startswith("kv-"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, label=twin)
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight" + (" (as stored, block Linears)" if backend == "torch"
                                           else " (whole file, embeddings included)"))
        ax.set_ylabel("KL divergence vs float")
        ax.set_title(backend)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(save_figure(fig, out_dir / "kld_vs_bits.png"))
    plt.close(fig)
    if any(rep["link"].values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for twin, color in (("baseline", "tab:blue"), ("gated", "tab:orange")):
            link = rep["link"].get(twin)
            if link:
                ax.scatter([p["inf_norm"] for p in link["points"]], [p["sqnr_db"] for p in link["points"]], c=color,
                           label=f"{twin} (r = {link['pearson_log_infnorm_vs_sqnr']:+.2f})", s=18)
        ax.set_xscale("log")
        ax.set_xlabel("linear-layer input inf-norm (max |x|)")
        ax.set_ylabel("W8A8-static output SQNR (dB)")
        ax.set_title("larger activations, larger quantization error?")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "sqnr_vs_infnorm.png"))
        plt.close(fig)
    return paths


def _rows(rep: dict) -> list[tuple]:
    rows = []
    for key in sorted(rep["cells"], key=lambda k: (k.split("/")[0], k.split("/")[2], k.split("/")[1])):
        backend, twin, scheme = key.split("/")
        c = rep["cells"][key]
        rows.append((backend, scheme, twin, c.get("bits_per_weight"), c.get("bytes"), c.get("ppl"),
                     c.get("delta_ppl_pct"), c.get("kld_mean"), c.get("top1_agreement"), c.get("prefill_tps"),
                     c.get("decode_tps"), (c.get("gate_survival") or {}).get("worst_mean_abs_diff")))
    return rows


HEADERS = ("backend", "scheme", "twin", "bits/weight", "bytes", "ppl", "delta ppl %", "KLD", "top-1", "prefill tok/s",
           "decode tok/s", "gate mean abs diff")


def _fmt(v, i: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if i == 4:
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.5f}" if i in (7, 11) else f"{v:.4f}" if i == 8 else f"{v:+.2f}" if i == 6 else f"{v:.2f}" \
            if i in (3, 5) else f"{v:.0f}"
    return str(v)


def render_markdown(rep: dict) -> str:
    s = rep["settings"]
    lines = [f"# quantgate report: {s['baseline']} vs {s['gated']}", "",
             f"quantgate {rep['quantgate_version']}, {rep['created']}, {rep['machine']['processor']}; data `{s['data']}`, "
             f"{s['windows']} held-out windows x {s['ctx']} tokens.", "", "## Conclusion", ""]
    lines += [f"- {c}" for c in rep["conclusion"]]
    lines += ["", "## How the twins were trained", ""] + [f"- {t}" for t in _training_lines(rep)]
    lines += ["", "## Accuracy, size and speed", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_fmt(v, i) for i, v in enumerate(r)) + " |" for r in _rows(rep)]
    lines += ["", "## Outliers per layer", ""]
    for t, o in rep["outliers"].items():
        lines += [f"**{t}**: max |h| {o['max_abs']:.1f}, max kurtosis {o['max_kurtosis']:.0f}, max linear inf-norm "
                  f"{o['max_linear_inf_norm']:.1f}", "",
                  "| layer | max abs h | max/median | BOS attention | o_proj inf-norm | o_proj kurtosis | down_proj inf-norm "
                  "| down_proj kurtosis | gate mean | gate < 0.1 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for l in o["per_layer"]:
            gm = f"{l['gate_mean']:.3f}" if "gate_mean" in l else "-"
            gf = f"{l['gate_frac_below_0.1']:.1%}" if "gate_frac_below_0.1" in l else "-"
            li = " | ".join(format(l[k], ".1f") if k in l else "-" for k in
                            ("o_proj_inf_norm", "o_proj_kurtosis", "down_proj_inf_norm", "down_proj_kurtosis"))
            lines.append(f"| {l['layer']} | {l['max_abs']:.1f} | {l['max_over_median']:.1f} | {l['bos_attention_mean']:.3f} | "
                         f"{li} | {gm} | {gf} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{Path(p).stem}](plots/{Path(p).name})" for p in rep.get("plots", [])]
    return "\n".join(lines) + "\n"


def _img(path: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<figure><img alt="{html.escape(Path(path).stem)}" src="data:image/png;base64,{data}"></figure>'


def render_html(rep: dict) -> str:
    s = rep["settings"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v, i))}</td>" for i, v in enumerate(r)) + "</tr>"
                   for r in _rows(rep))
    concl = "".join(f"<li>{html.escape(c)}</li>" for c in rep["conclusion"])
    trained = "".join(f"<li>{html.escape(t)}</li>" for t in _training_lines(rep))
    outl = ""
    for t, o in rep["outliers"].items():
        keys = ("o_proj_inf_norm", "o_proj_kurtosis", "down_proj_inf_norm", "down_proj_kurtosis")
        rows = "".join(f"<tr><td>{l['layer']}</td><td>{l['max_abs']:.1f}</td><td>{l['max_over_median']:.1f}</td>"
                       f"<td>{l['bos_attention_mean']:.3f}</td>"
                       + "".join(f"<td>{format(l[k], '.1f') if k in l else '-'}</td>" for k in keys)
                       + f"<td>{format(l['gate_mean'], '.3f') if 'gate_mean' in l else '-'}</td></tr>"
                       for l in o["per_layer"])
        outl += (f"<h3>{html.escape(t)}</h3><table><tr><th>layer</th><th>max |h|</th><th>max/median</th>"
                 f"<th>BOS attention</th><th>o_proj inf-norm</th><th>o_proj kurtosis</th><th>down_proj inf-norm</th>"
                 f"<th>down_proj kurtosis</th><th>gate mean</th></tr>{rows}</table>")
    imgs = "".join(_img(p) for p in rep.get("plots", []) if Path(p).is_file())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>quantgate report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}}table{{border-collapse:collapse;
font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style></head>
<body><h1>quantgate report</h1>
<p>{html.escape(s['baseline'])} vs {html.escape(s['gated'])}; quantgate {html.escape(rep['quantgate_version'])},
{html.escape(rep['created'])}, data <code>{html.escape(s['data'])}</code>, {s['windows']} windows x {s['ctx']} tokens.</p>
<h2>Conclusion</h2><ul>{concl}</ul>
<h2>How the twins were trained</h2><ul>{trained}</ul>
<h2>Accuracy, size and speed</h2><table><tr>{head}</tr>{body}</table>
<h2>Outliers per layer</h2>{outl}
<h2>Plots</h2>{imgs}
</body></html>
"""
