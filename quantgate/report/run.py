"""`run_report(settings)`: every cell run (or read back from a previous run), then report.json, .md and .html."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..analyze import analyze, plot_reports
from ..calib_data import check_ctx, default_split, eval_windows, load_corpus, tokenize_corpus
from ..errors import QuantgateError
from ..formats import load_checkpoint
from ..fsio import atomic_file, claim_folder, write_json
from ..identity import code_id, content_id
from ..info import cache_bytes
from ..progress import console
from ..executor import Needs, open_executor
from .cells import Artifacts, base_artifact, cached, cell_speed, score_cell, torch_fp32_cell
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

    plan = []  # (name, file, key, label, backend, twin, scheme): every cell in the report's order
    for backend in s.backends:
        for twin in TWINS:
            if backend == "torch":
                plan.append((f"torch/{twin}/fp32", cells_dir / f"torch-{twin}-fp32.json",
                             ident.cell_key(s, "torch", twin, "fp32"), f"torch {twin} fp32 speed", backend, twin, None))
            for scheme in s.schemes.get(backend, DEFAULT_SCHEMES[backend]):
                if twin == "baseline" and gated_only(backend, scheme):
                    continue
                # llama.cpp's KV rotation follows this variable (runners.llama.attn_rotation): part of what a cell is
                env = ("LLAMA_ATTN_ROT_DISABLE", os.environ.get("LLAMA_ATTN_ROT_DISABLE")) if backend == "gguf" else ()
                plan.append((f"{backend}/{twin}/{scheme}", cells_dir / f"{backend}-{twin}-{scheme}.json",
                             ident.cell_key(s, backend, twin, scheme, *env), f"{backend} {twin} {scheme}", backend, twin,
                             scheme))
    executor = open_executor(s.executor)
    if executor.name == "local":
        cells = {name: cached(path, k, (lambda b=b, t=t, sc=sc: torch_fp32_cell(loaded[t].model, ids) if sc is None
                                        else score_cell(s, ident, arts, b, t, sc, ids)), label, timings)
                 for name, path, k, label, b, t, sc in plan}
        where = None
    else:
        cells, where = cluster_cells(executor, s, ident, arts, plan, ids, timings)
    for name, c in cells.items():
        if "error" in c:
            console.print(f"  skipped {name}: {c['error']}", markup=False, highlight=False)
    arts.write_index()

    report = build_report(s, analysis, cells, timings, plot_files,
                          memory={t: cache_bytes(loaded[t].model.cfg) for t in TWINS})
    report["identity"] = {"models": ident.models, "data": ident.data, "code": ident.code}
    report["artifacts"] = arts.log
    report["executor"] = where or {"name": "local", "nodes": executor.nodes()}
    report["training"] = {t: training(loaded[t].model.cfg.extra) for t in TWINS}
    plots = report_plots(report, plots_dir)
    report["plots"] = plot_files + [str(p) for p in plots]
    write_json(out / "report.json", report)
    with atomic_file(out / "report.md", "w") as f:
        f.write(render_markdown(report))
    with atomic_file(out / "report.html", "w") as f:
        f.write(render_html(report))
    return report


def cluster_cells(executor, s: ReportSettings, ident: Identity, arts: Artifacts, plan: list, ids: list[int],
                  timings: dict) -> tuple[dict, dict]:
    """The cells on a Ray cluster: each cell not already stored under its key is scored as a task (its artifact
    built there; the exports the cells of one backend and twin share are built first, one task each, so that no two
    tasks build the same file), then every artifact is timed on this process's node, one task at a time, so the
    speed columns come from one machine with nothing else running on it. Cells are stored as they complete."""
    cells, todo, at_start = {}, [], executor.nodes()
    for name, path, k, label, b, t, sc in plan:
        d = _stored(path, k)
        if d is not None:
            cells[name], timings[label] = d, 0.0
        else:
            todo.append((name, path, k, label, b, t, sc))
    n = max(load_checkpoint(getattr(s, t)).model.num_params() for t in TWINS)
    needs = Needs(cpus=s.threads or 1, memory=int(16 * n + 2 * 2 ** 30))  # fp32 twin, reference, artifact, runtime
    bases = sorted({(b, t) for _n, _p, _k, _l, b, t, sc in todo if sc is not None and b in ("gguf", "onnx")})
    executor.map(_base_artifact, bases, needs, "report: exports on the cluster", shared=dict(s=s, ident=ident))
    scored = executor.map(_accuracy, [(b, t, sc) for *_x, b, t, sc in todo], needs, "report: cells on the cluster",
                          shared=dict(s=s, ident=ident, ids=ids))
    node = executor.this_node()
    for (name, path, k, label, b, t, sc), (cell, secs) in zip(todo, scored):
        t0 = time.time()
        if "error" not in cell:
            cell.update(executor.run_on(node, _timed, s, b, t, sc, cell, ids, needs=Needs(cpus=s.threads or 1)))
        cell["_key"], cell["_seconds"] = k, round(secs + time.time() - t0, 2)
        timings[label] = cell["_seconds"]
        write_json(path, cell)
        cells[name] = cell
    for rel in _artifact_keys(arts):
        arts.log.setdefault(rel, {"key": arts.key_of(rel), "built": True})
    return cells, {"name": "ray", "nodes": at_start, "nodes_at_end": executor.nodes(), "speed_node": node,
                   "speed": "every artifact timed on speed_node, one task at a time, after the cells were scored"}


def _stored(path, k: str) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("_key") == k else None


def _artifact_keys(arts: Artifacts) -> list[str]:
    return [f.name[:-4].replace("__", "/") for f in sorted(arts.dir.glob("*.key"))] if arts.dir.is_dir() else []


def _base_artifact(bt: tuple[str, str], s: ReportSettings, ident: Identity) -> None:
    """The export every cell of one backend and twin starts from (a task)."""
    base_artifact(s, ident, Artifacts(Path(s.out) / "artifacts"), *bt)


def _accuracy(cell: tuple, s: ReportSettings, ident: Identity, ids: list[int]) -> tuple[dict, float]:
    """One cell scored without its speed (a task): (numbers, seconds)."""
    backend, twin, scheme = cell
    t0 = time.time()
    if scheme is None:
        return {"bits_per_weight": 32.0, "kld_mean": 0.0, "top1_agreement": 1.0, "delta_ppl_pct": 0.0}, 0.0
    out = score_cell(s, ident, Artifacts(Path(s.out) / "artifacts"), backend, twin, scheme, ids, speed=False)
    return out, time.time() - t0


def _timed(s: ReportSettings, backend: str, twin: str, scheme: str | None, cell: dict, ids: list[int]) -> dict:
    """A cell's speed (a task pinned to the speed node): the torch rows time the float twin."""
    if scheme is None:
        return torch_fp32_cell(load_checkpoint(getattr(s, twin)).model, ids)
    return cell_speed(s, backend, cell, ids)
