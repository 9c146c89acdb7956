"""`run_report(settings)`: every cell run (or read back from a previous run), then report.json, .md and .html."""
from __future__ import annotations

import os

from ..analyze import analyze, plot_reports
from ..calib_data import check_ctx, default_split, eval_windows, load_corpus, tokenize_corpus
from ..errors import QuantgateError
from ..formats import load_checkpoint
from ..fsio import atomic_file, claim_folder, write_json
from ..identity import code_id, content_id
from ..info import cache_bytes
from ..progress import console
from .cells import Artifacts, cached, score_cell, torch_fp32_cell
from .conclusion import build_report, training
from .render import render_html, render_markdown, report_plots
from .settings import BENCH_TOKENS, DEFAULT_SCHEMES, TWINS, Identity, ReportSettings, check_settings, gated_only


def _check_twins(s: ReportSettings) -> dict:
    """Both twins loaded, in the right order, with tokenizers and enough context for every window and speed run."""
    loaded = {t: load_checkpoint(getattr(s, t)) for t in TWINS}
    if loaded["baseline"].model.cfg.gate != "none" or loaded["gated"].model.cfg.gate == "none":
        raise QuantgateError("--models takes the baseline (no gate) first, then the gated twin")
    types = [loaded[t].model.cfg.layer_types or ("full_attention",) * loaded[t].model.cfg.n_layers for t in TWINS]
    if types[0] != types[1] and not s.unpaired:
        raise QuantgateError("the twins must have the same layers (a hybrid baseline beside a hybrid gated twin, or two "
                             "all-attention twins); these differ in layer_types (pass --unpaired to compare two models "
                             "that are not twins, such as Qwen3 beside Qwen3.5)")
    if loaded["baseline"].tokenizer is None or loaded["gated"].tokenizer is None:
        raise QuantgateError("both twins need a tokenizer.json")
    a, b = (loaded[t].tokenizer for t in TWINS)
    if a.tok.to_str() != b.tok.to_str() and not s.unpaired:
        raise QuantgateError("the twins use different tokenizers, so their windows do not pair (pass --unpaired to "
                             "compare two models that are not twins, such as Qwen3 beside Qwen3.5)")
    for t in TWINS:
        context = loaded[t].model.cfg.max_seq_len
        check_ctx(s.ctx, context, getattr(s, t))
        if context < BENCH_TOKENS:
            raise QuantgateError(f"{getattr(s, t)}: the report's speed runs need {BENCH_TOKENS} tokens of context, "
                                 f"the model has {context}")
    return loaded


def run_report(s: ReportSettings) -> dict:
    """Run (or resume) every cell, then write report.json, report.md and report.html into s.out."""
    check_settings(s)
    loaded = _check_twins(s)
    tok = loaded["baseline"].tokenizer
    corpus = load_corpus(s.data)
    ids = [int(t) for t in eval_windows(tokenize_corpus(corpus.split(default_split(s.data)), tok).ids, BENCH_TOKENS + 1,
                                        tok.bos_id, 1)[0]]
    ident = Identity({t: content_id(getattr(s, t)) for t in TWINS}, corpus.fingerprint, code_id())
    out = claim_folder(s.out, "report")
    cells_dir, plots_dir = out / "cells", out / "plots"
    arts = Artifacts(out / "artifacts")
    timings: dict[str, float] = {}

    analysis = {t: cached(cells_dir / f"analysis-{t}.json", ident.cell_key(s, "analysis", t),
                          lambda t=t: analyze(getattr(s, t), s.data, s.ctx, s.analysis_windows),
                          f"analyse {t}", timings) for t in TWINS}
    plot_files = [str(p) for p in plot_reports(analysis, plots_dir)]

    cells: dict[str, dict] = {}
    for backend in s.backends:
        for twin in TWINS:
            if backend == "torch":
                cells[f"torch/{twin}/fp32"] = cached(
                    cells_dir / f"torch-{twin}-fp32.json", ident.cell_key(s, "torch", twin, "fp32"),
                    lambda twin=twin: torch_fp32_cell(loaded[twin].model, ids), f"torch {twin} fp32 speed", timings)
            for scheme in s.schemes.get(backend, DEFAULT_SCHEMES[backend]):
                if twin == "baseline" and gated_only(backend, scheme):
                    continue
                # llama.cpp's KV rotation follows this variable (runners.llama.attn_rotation): part of what a cell is
                env = ("LLAMA_ATTN_ROT_DISABLE", os.environ.get("LLAMA_ATTN_ROT_DISABLE")) if backend == "gguf" else ()
                cell = cached(cells_dir / f"{backend}-{twin}-{scheme}.json",
                              ident.cell_key(s, backend, twin, scheme, *env),
                              lambda b=backend, t=twin, sc=scheme: score_cell(s, ident, arts, b, t, sc, ids),
                              f"{backend} {twin} {scheme}", timings)
                if "error" in cell:
                    console.print(f"  skipped: {cell['error']}", markup=False, highlight=False)
                cells[f"{backend}/{twin}/{scheme}"] = cell

    report = build_report(s, analysis, cells, timings, plot_files,
                          memory={t: cache_bytes(loaded[t].model.cfg) for t in TWINS})
    report["identity"] = {"models": ident.models, "data": ident.data, "code": ident.code}
    report["artifacts"] = arts.log
    report["training"] = {t: training(loaded[t].model.cfg.extra) for t in TWINS}
    plots = report_plots(report, plots_dir)
    report["plots"] = plot_files + [str(p) for p in plots]
    write_json(out / "report.json", report)
    with atomic_file(out / "report.md", "w") as f:
        f.write(render_markdown(report))
    with atomic_file(out / "report.html", "w") as f:
        f.write(render_html(report))
    return report
