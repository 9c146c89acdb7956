"""`quantgate analyze`: outlier report of one model, or of twins side by side, with plots.

Windows are drawn with the seeded calibration sampler from the evaluation split of the text, so two
models analysed with the same arguments see exactly the same tokens.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .calib_data import (check_ctx, data_paths, default_split, load_corpus, sample_windows, sampled_documents,
                         tokenize_corpus)
from .calib_data.synthetic import BIGRAM_BACKCOPY, TRIGGERS
from .errors import QuantgateError
from .formats import artifact_kind, load_checkpoint
from .formats.hf import open_hf
from .layerwise import LayerwiseModel, check_layerwise_applies, needs_layerwise
from .fsio import atomic_file, check_output, staged_into, write_json
from .gate_survival import check_gate_survival
from .info import param_count
from .outliers import analyze_layerwise, analyze_model


def nontrigger_queries(data: str, tok, windows: np.ndarray) -> np.ndarray | None:
    """On Bigram-Backcopy, [N, T] True where the token is not a trigger (the queries Guo et al. read a sink over);
    None for other text, which has no triggers."""
    if str(data) != BIGRAM_BACKCOPY:
        return None
    ids = [i for t in TRIGGERS for i in tok.encode(t)]
    return ~np.isin(windows, ids)


def analyze(model_path: str, data: str = "embedded", ctx: int = 256, n_windows: int = 32, split: str = "auto",
            seed: int = 0, tokenizer_from: str | None = None, layerwise: bool | None = None) -> dict:
    """The outlier report of one model. A model directory whose fp32 weights do not fit in memory is run block by
    block (quantgate.layerwise; `layerwise=True` forces it, False forbids it): the same report."""
    lw = None
    check_layerwise_applies(layerwise, artifact_kind(model_path), model_path)
    if artifact_kind(model_path) == "hf" and layerwise is not False:
        ckpt = open_hf(model_path, must_fit_block_by_block=True)
        if layerwise or needs_layerwise(ckpt.cfg):
            lw = LayerwiseModel(ckpt)
    if lw is not None:
        cfg, tok, layout = lw.cfg, lw.ckpt.tokenizer, lw.ckpt.layout.name
    else:
        loaded = load_checkpoint(model_path)
        cfg, tok, layout = loaded.model.cfg, loaded.tokenizer, loaded.layout
    if tok is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot tokenize the analysis text")
    check_ctx(ctx, cfg.max_seq_len, model_path)
    split = default_split(data) if split == "auto" else split
    corpus = load_corpus(data).split(split)
    if not corpus.documents:
        raise QuantgateError(f"{data}: the {split} split is empty")
    stream = tokenize_corpus(corpus, tok)
    windows = sample_windows(stream, n_windows, ctx, seed)
    mask = nontrigger_queries(data, tok, windows)
    rep = (analyze_layerwise(lw, windows, query_mask=mask) if lw is not None
           else analyze_model(loaded.model, windows, query_mask=mask))
    if mask is not None:
        rep["nontrigger_query_share"] = float(mask[:, 1:].mean())
    rep.update(model=str(model_path), gate=cfg.gate, layout=layout, data=str(data), layerwise=lw is not None,
               split=split, seed=seed, corpus_fingerprint=corpus.fingerprint,
               window_docs=sampled_documents(stream, n_windows, ctx, seed).tolist(),  # the bootstrap's units
               windows_id=hashlib.sha256(windows.tobytes()).hexdigest()[:16])  # two twins' windows pair when equal
    return rep


def save_figure(fig, path: Path) -> Path:
    """A PNG written atomically (the report's plots use it too)."""
    with atomic_file(path) as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    return path


def plot_reports(reports: dict[str, dict], out_dir: str | Path) -> list[Path]:
    """The plots of render_plots in `out_dir`, written whole or not at all (fsio.staged_into)."""
    with staged_into(out_dir, "plots") as stage:
        names = [p.name for p in render_plots(reports, stage)]
    return [Path(out_dir) / n for n in names]


def render_plots(reports: dict[str, dict], out_dir: Path) -> list[Path]:
    """max |h| per layer (log axis), BOS-attention heatmaps (layer x head), gate histograms, into `out_dir`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, rep in reports.items():
        layers = [l["layer"] for l in rep["layers"]]
        ax.plot(layers, [l["max_abs"] for l in rep["layers"]], marker="o", label=f"{name}: max |h|")
        ax.plot(layers, [l["median_abs"] for l in rep["layers"]], ls="--", marker=".", label=f"{name}: median |h|")
    ax.set(yscale="log", xlabel="layer", ylabel="|h| of the residual stream after the block",
           title="massive activations")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "max_activation.png"))
    plt.close(fig)

    fig, axes = plt.subplots(1, len(reports), figsize=(4.5 * len(reports), 3.8), squeeze=False)
    vmax = max(max(l["bos_attention"]) for r in reports.values() for l in r["layers"] if l["bos_attention"])
    for ax, (name, rep) in zip(axes[0], reports.items()):
        H = next(len(l["bos_attention"]) for l in rep["layers"] if l["bos_attention"])
        grid = np.array([l["bos_attention"] or [np.nan] * H for l in rep["layers"]])  # GDN layers: blank rows
        im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set_title(f"{name}: attention on BOS\n(uniform would be {rep['uniform_bos_share']:.3f})", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    paths.append(save_figure(fig, out_dir / "bos_attention.png"))
    plt.close(fig)

    gated = {n: [l for l in r["layers"] if "gate_histogram" in l] for n, r in reports.items()}
    gated = {n: L for n, L in gated.items() if L}
    if gated:
        n_layers = max(len(L) for L in gated.values())
        fig, axes = plt.subplots(len(gated), n_layers, figsize=(2.2 * n_layers, 2.2 * len(gated)), squeeze=False)
        for row, (name, layers) in zip(axes, gated.items()):
            for ax, l in zip(row, layers):
                bins, counts = np.array(l["gate_histogram"]["bins"]), np.array(l["gate_histogram"]["counts"])
                ax.bar(bins[:-1], counts / counts.sum(), width=np.diff(bins), align="edge")
                ax.set_title(f"{name} L{l['layer']}: <0.1 {np.mean(l['gate_frac_below_0.1']):.0%}", fontsize=8)
                ax.set_yticks([])
        fig.suptitle("gate values sigmoid(X W_g)")
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / "gate_histograms.png"))
        plt.close(fig)
    return paths


def run_analyze(model: str, data: str, ctx: int, n_windows: int, split: str, seed: int,
                compare: str | None = None, json_out: str | None = None, plots: str | None = None,
                reference: str | None = None, layerwise: bool | None = None) -> dict:
    """Outlier reports (MODEL may be a .gguf: it is dequantized); with `reference`, the gate-survival check
    of MODEL's gate rows against the reference's (quantgate.gate_survival)."""
    inputs = (model, compare, reference, *data_paths(data))
    if json_out:
        check_output(json_out, "analysis", inputs, flag="--json")
    if plots:
        check_output(plots, "plots", inputs, flag="--plots")
    for other in (compare, reference):  # headers only: a missing or unreadable model fails before any analysis
        if other:
            param_count(other)
    gate_survival = None
    if reference:  # before the analysis too: it refuses a pair whose gate is lost or absent, and is the cheaper pass
        gate_survival = check_gate_survival(model, reference, data, min(n_windows, 8), ctx, seed)
    reports = {Path(model).name or model: analyze(model, data, ctx, n_windows, split, seed, layerwise=layerwise)}
    if compare:
        name = Path(compare).name or compare
        if name in reports:
            name = f"{name} (compare)"
        reports[name] = analyze(compare, data, ctx, n_windows, split, seed, layerwise=layerwise)
    result = {"reports": reports}
    if gate_survival is not None:
        result["gate_survival"] = gate_survival
    if not plots:
        if json_out:
            write_json(json_out, result, kind="analysis")
        return result
    # the JSON is written while the plots wait in their staging folder: a failure of either keeps neither
    json_new = bool(json_out) and not Path(json_out).exists()
    try:
        with staged_into(plots, "plots") as stage:
            names = [p.name for p in render_plots(reports, stage)]
            if json_out:
                write_json(json_out, result, kind="analysis")
    except BaseException:
        if json_new and Path(json_out).is_file():
            Path(json_out).unlink()  # written by this run a moment ago
        raise
    result["plots"] = [str(Path(plots) / n) for n in names]
    return result
