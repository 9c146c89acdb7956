"""`quantgate demo`: the main job, end to end on the embedded corpus.

Train baseline/gated twins, evaluate both on held-out text, analyse their outliers side by side (JSON and
plots), then the report: both twins exported to ONNX and GGUF, quantized at 8 and 4 bits on every backend,
scored against their float selves (report.html/.md/.json), and a short generation streamed from the 4-bit
GGUF. Finished stages are reused on a re-run and an interrupted training resumes from its last checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.table import Table

from .analyze import run_analyze
from .errors import QuantgateError
from .evaluate import evaluate_model
from .fsio import check_output, claim_folder, proven_ours, signals_held, write_json
from .generate import generate
from .progress import console
from .report import ReportSettings, run_report, run_seeds_report
from .train import TrainConfig, recorded, train, trajectory

DEMO_RECIPES = {
    # 600 steps x 8 x 256 (1.2M tokens per twin): what fits a 20-minute demo on 2 cores beside the report
    # (benchmarks/results/small_twins_run.json times the whole command; 800 steps with 64 report windows took
    # 1357 s in the run before it, git history of that file). lr 6e-3 and weight decay 0.5 come from
    # benchmarks/demo_recipe.py, a search of four recipes at 1200 steps, one run each: they are that search's pick,
    # not a tuned optimum, and the demo's shorter run is not the run that was searched.
    "full": dict(preset="small", steps=600, batch_size=8, ctx=256, lr=6e-3, warmup=100, weight_decay=0.5),
    "fast": dict(preset="tiny", steps=150, batch_size=8, ctx=128, lr=3e-3, warmup=20, weight_decay=0.1,
                 vocab_size=512, max_chars=2_000_000),
}


def recipe_note(name: str, recipe: dict) -> str:
    """Printed in the report: how and why the twins were trained so, from the recipe itself (no numbers that a
    later run could contradict)."""
    tokens = recipe["steps"] * recipe["batch_size"] * (recipe["ctx"] - 1)
    head = (f"Recipe `{name}`: {recipe['preset']} twins, {recipe['steps']} steps x {recipe['batch_size']} x "
            f"{recipe['ctx']} tokens ({tokens / 1e6:.1f}M per twin), lr {recipe['lr']:g}, weight decay "
            f"{recipe['weight_decay']:g}. ")
    if name == "fast":
        return head + ("Made to check the whole pipeline in a few minutes; at this size no outlier structure is "
                       "expected, so its numbers say nothing about the gate.")
    return head + ("The step count is what fits a 20-minute demo on a 2-core CPU "
                   "(benchmarks/results/small_twins_run.json); learning rate and weight decay were picked among four "
                   "recipes at 1200 steps, one run each (benchmarks/results/demo_recipe.md). At this scale natural "
                   "text grows no attention sink (`quantgate demo --lab sinks` trains on a task that does), and one "
                   "training run is one seed: read twin differences through their intervals, and across seeds with "
                   "`train --twins --seeds N`.")


# the report's cells in the demo (registry names, quantgate.quant): fewer than `quantgate report`'s defaults to
# fit its time; each backend's gate-aware cell keeps the whole q|gate projection at 8 bits, beside its plain partner
DEMO_SCHEMES = {
    "torch": ["w8a8-static", "w8a8-static-sink", "w4a16-g32", "w4a16-g32-qgate8"],
    "onnx": ["fp32", "int8-dynamic", "int4", "int4+gate8"],
    "gguf": ["F16", "Q8_0", "Q4_K_M", "Q4_K_M+gate8", "kv-q4_0"],
}
TRAINED = ("state", "baseline", "gated")  # what the train stage writes into the demo folder
# held-out windows per report cell: half the report's default, to fit 20 minutes (benchmarks/results/
# interval_width.json: the twins' KLD-ratio interval is 1.3-1.6x wider at 32 windows than at 64)
DEMO_WINDOWS = 32
DEMO_EVAL_WINDOWS = 64  # held-out windows of the demo's perplexity table (per twin)
DEMO_PROMPT = "def "   # the generated sample's prompt: the embedded corpus is Python code
FAST_WINDOWS = 16       # both, under --fast (the fewest that give an interval: quantgate.stats.MIN_UNITS)

# The sink lab (`quantgate demo --lab sinks`): twins trained on Guo et al.'s Bigram-Backcopy task
# (calib_data.synthetic), whose small transformers grow attention sinks; recipe from benchmarks/sink_lab_recipe.py.
LAB_RECIPES = {
    # Guo et al.'s setting (one layer, one head; their data: triggers the most frequent symbols; their vocabulary:
    # the task's symbols) with quantgate's model and one lab-only switch, learned absolute positions in place of
    # rope (ModelConfig.positions). benchmarks/sink_lab_search.py measured, baseline only, the non-trigger BOS share
    # in seeds 0/1/2 (results/sink_lab_search.jsonl): rope 0.62/0.37/0.89 after 4000 steps, learned positions
    # 1.00/1.00/1.00, both with the task's 64-token vocabulary. With quantgate's 259-token byte vocabulary the same
    # model learned the copy without a sink (runs vocab259), so the lab tokenizes with the corpus's own alphabet.
    "sinks": dict(preset="tiny", data="synthetic:bigram-backcopy", symbol_tokenizer=True, steps=4000, batch_size=8,
                  ctx=64, lr=3e-3, min_lr_frac=1.0, warmup=30, weight_decay=0.1,
                  model_overrides=dict(dim=128, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64, ffn_dim=512,
                                       positions="learned")),
}
LAB_SCHEMES = {"torch": ["w8a8-static", "w8a8-static-sink", "w4a16-g32", "kv-int4"]}  # W8A8 per-tensor static,
# its sink-aware variant, INT4 weight-only and a 4-bit KV cache
LAB_SEEDS = 3
LAB_WINDOWS = 64  # held-out windows per cell and analysis windows per twin (benchmarks/results/interval_width.json)


def _recorded(path: Path) -> dict | None:
    """The training settings a demo model or training state records (None when it records none)."""
    try:
        if path.name == "state":
            return json.loads((path / "run.json").read_text()).get("train_config")
        return json.loads((path / "config.json").read_text()).get("quantgate", {}).get("train_config")
    except (OSError, ValueError, AttributeError):
        return None


def _trained_by(out: Path, tc: TrainConfig) -> str:
    """'models' when the twins in `out` were trained by exactly these settings (gate included), 'state' when
    only a matching interrupted run is there, 'other' when something else is, 'none' when nothing is."""
    want = trajectory(tc)
    present = [n for n in TRAINED if os.path.lexists(out / n)]
    if not present:
        return "none"
    got = {n: _recorded(out / n) for n in present}
    strip = lambda d: {k: v for k, v in recorded(d).items() if k in want}  # noqa: E731
    if any(strip(d) != want for d in got.values()):
        return "other"
    return "models" if {"baseline", "gated"} <= set(present) else "state"


def _retire(out: Path) -> None:
    """Remove the train stage's earlier outputs (quantgate's own, checked) before training other settings."""
    for n in TRAINED:
        p = out / n
        why = proven_ours(p) if os.path.lexists(p) else None
        if why:
            raise QuantgateError(f"{p} was not written by quantgate's train stage ({why}); move it away or choose "
                                 f"another --out")
    trash = Path(tempfile.mkdtemp(prefix=".retired.", suffix=".tmp", dir=out))
    with signals_held():
        for n in TRAINED:
            if os.path.lexists(out / n):
                os.replace(out / n, trash / n)
        shutil.rmtree(trash, ignore_errors=True)


def train_stage(out: Path, tc: TrainConfig, gate: str) -> dict[str, Path]:
    """The twins `tc` trains in `out`: reused when `out` holds exactly them, resumed from an interrupted run of the
    same settings, else (after retiring what other settings left there) trained."""
    models = {k: out / k for k in ("baseline", "gated")}
    found = _trained_by(out, tc)
    if found == "models":
        console.print(f"[green]train[/]: reusing {out}/baseline and {out}/gated (trained by this recipe, gate {gate})")
        return models
    if found == "other":
        console.print(f"train: {out} holds twins or a run trained by other settings (another recipe or gate); "
                      "training again", markup=False, highlight=False)
        _retire(out)
    resume = found == "state" and (out / "state" / "train_state.pt").is_file()
    console.print(f"[bold]train[/]: {tc.preset} twins, {tc.steps} steps, seed {tc.seed}"
                  + (" (resuming)" if resume else ""))
    return train(tc, out, resume=resume)


def run_demo(out: str | Path, fast: bool = False, gate: str = "elementwise", threads: int | None = None,
             eval_windows: int | None = None, seeds: int = 1) -> dict:
    """The demo (see `quantgate demo --help`). With `seeds` > 1, that many twin pairs are trained (OUT/seed-K/, seed
    K) and the report states its verdicts across them (quantgate.report.seeds), so they carry the variation between
    training runs; the perplexity table, the analysis and the generated sample are of the seed-0 pair."""
    out = Path(out)
    check_output(out, "demo")
    recipe = dict(DEMO_RECIPES["fast" if fast else "full"])
    # Eager training: torch.compile's gain (benchmarks/results/train_throughput.json, ratio_ours_compiled_over_ours)
    # does not pay for its compiling time and its C-compiler requirement at this size.
    stages = {}
    t = time.time()
    claim_folder(out, "demo")
    pairs = []
    for k in range(seeds):
        tc = TrainConfig(twins=True, gate=gate, data="embedded", threads=threads, seed=k,
                         ckpt_every=50 if fast else 200, **recipe)
        pairs.append(train_stage(out if seeds == 1 else out / f"seed-{k}", tc, gate))
    models = pairs[0]
    stages["train_s"] = round(time.time() - t, 1)
    console.print(f"train: {stages['train_s']:.0f} s" + (f" for {seeds} twin pairs" if seeds > 1 else ""))

    t = time.time()
    n_windows = eval_windows or (FAST_WINDOWS if fast else DEMO_EVAL_WINDOWS)
    evals = {k: evaluate_model(str(p), "embedded", ctx=tc.ctx, split="test", max_windows=n_windows)
             for k, p in models.items()}
    stages["eval_s"] = round(time.time() - t, 1)
    console.print(f"eval: {stages['eval_s']:.0f} s")

    table = Table(title="held-out perplexity (embedded corpus, test split)")
    for col in ("model", "ppl", "tokens"):
        table.add_column(col)
    for k, e in evals.items():
        table.add_row(k, f"{e['ppl']:.3f}", str(e["n_tokens"]))
    console.print(table)
    t = time.time()
    result = run_analyze(str(models["baseline"]), "embedded", tc.ctx, 8 if fast else 32, "test", 0,
                         compare=str(models["gated"]), json_out=str(out / "analysis.json"), plots=str(out / "plots"))
    stages["analyze_s"] = round(time.time() - t, 1)
    reps = result["reports"]
    for name, rep in reps.items():
        L = rep["layers"]
        worst = max(L, key=lambda l: l["max_abs"])
        console.print(f"{name}: largest |h| {worst['max_abs']:.1f} (layer {worst['layer']}, position "
                      f"{worst['max_position']}), max BOS attention {max(max(l['bos_attention']) for l in L):.3f} "
                      f"(uniform {rep['uniform_bos_share']:.3f})")
    console.print(f"analyze: {stages['analyze_s']:.0f} s, plots in {out / 'plots'}")
    t = time.time()
    note = recipe_note("fast" if fast else "full", recipe)
    settings = ReportSettings(str(models["baseline"]), str(models["gated"]), str(out / "report"),
                              schemes={k: list(v) for k, v in DEMO_SCHEMES.items()},
                              windows=FAST_WINDOWS if fast else DEMO_WINDOWS, ctx=tc.ctx, calib_windows=8 if fast else 16,
                              analysis_windows=16 if fast else 32, threads=threads, recipe_note=note)
    if seeds == 1:
        rep = run_report(settings)
        cells = rep["cells"]
    else:
        rep = run_seeds_report([(str(m["baseline"]), str(m["gated"])) for m in pairs], settings)
        cells = json.loads((out / "report" / "seed-0" / "report.json").read_text())["cells"]
    stages["report_s"] = round(time.time() - t, 1)
    for line in rep["conclusion"]:
        console.print(f"- {line}", markup=False, highlight=False)
    console.print(f"report: {stages['report_s']:.0f} s, {out / 'report' / 'report.html'}")

    t = time.time()
    gguf = Path(cells.get("gguf/gated/Q4_K_M", {}).get("artifact", ""))
    sample = None
    if gguf.is_file():
        console.print(f"[bold]generate[/] from {gguf.name}, prompt {DEMO_PROMPT!r}:")
        console.out(DEMO_PROMPT, end="", highlight=False)  # the sample continues the prompt: shown together
        res = generate(str(gguf), DEMO_PROMPT, max_tokens=48, threads=threads,
                       on_text=lambda piece: console.out(piece, end="", highlight=False))
        console.print("")
        console.print(f"prefill {res.prefill_tps:.0f} tok/s, decode {res.decode_tps:.0f} tok/s", markup=False)
        sample = res.to_dict()
    stages["generate_s"] = round(time.time() - t, 1)
    summary = {"recipe": recipe, "recipe_note": note, "gate": gate, "seeds": seeds, "eval": evals,
               "stage_seconds": stages,
               "analysis": str(out / "analysis.json"), "plots": result["plots"],
               "report": str(out / "report" / "report.html"), "generation": sample}
    write_json(out / "summary.json", summary)
    console.print(f"summary: {out / 'summary.json'}")
    return summary


def lab_note(lab: str, recipe: dict, seeds: int) -> str:
    o = recipe.get("model_overrides") or {}
    size = ", ".join(f"{k} {v}" for k, v in o.items())
    return (f"Sink lab `{lab}`: {seeds} seeds of {recipe['preset']} twins{f' ({size})' if size else ''} on "
            f"{recipe['data']} (Guo et al. 2024, arXiv 2410.13835), {recipe['steps']} steps x {recipe['batch_size']} "
            f"x {recipe['ctx']} tokens, lr {recipe['lr']:g}{' constant' if recipe.get('min_lr_frac') == 1.0 else ''}, weight "
            f"decay {recipe['weight_decay']:g}"
            f"{', one token per symbol' if recipe.get('symbol_tokenizer') else ''}; recipe from "
            f"benchmarks/sink_lab_search.py (benchmarks/results/sink_lab_search.jsonl: each switch, three seeds).")


def run_lab(out: str | Path, lab: str = "sinks", gate: str = "elementwise", threads: int | None = None,
            seeds: int = LAB_SEEDS) -> dict:
    """Twins on a synthetic task that makes small models sink, `seeds` pairs (OUT/seed-K/), then the report across
    seeds (OUT/report/): the same analysis and report as the demo, torch schemes only to fit 20 minutes."""
    if lab not in LAB_RECIPES:
        raise QuantgateError(f"unknown lab {lab!r}; choose from {', '.join(LAB_RECIPES)}")
    out = Path(out)
    check_output(out, "demo")
    recipe = dict(LAB_RECIPES[lab])
    claim_folder(out, "demo")
    stages, t = {}, time.time()
    pairs = []
    for k in range(seeds):
        tc = TrainConfig(twins=True, gate=gate, threads=threads, seed=k, ckpt_every=recipe["steps"], **recipe)
        m = train_stage(out / f"seed-{k}", tc, gate)
        pairs.append((str(m["baseline"]), str(m["gated"])))
    stages["train_s"] = round(time.time() - t, 1)
    console.print(f"train: {stages['train_s']:.0f} s for {seeds} twin pairs")
    t = time.time()
    note = lab_note(lab, recipe, seeds)
    rep = run_seeds_report(pairs, ReportSettings(pairs[0][0], pairs[0][1], str(out / "report"), data=recipe["data"],
                                                 backends=("torch",), schemes={k: list(v) for k, v in LAB_SCHEMES.items()},
                                                 windows=LAB_WINDOWS, ctx=recipe["ctx"], calib_windows=16,
                                                 analysis_windows=LAB_WINDOWS, threads=threads, recipe_note=note))
    stages["report_s"] = round(time.time() - t, 1)
    for line in rep["conclusion"]:
        console.print(f"- {line}", markup=False, highlight=False)
    summary = {"lab": lab, "recipe": recipe, "recipe_note": note, "gate": gate, "seeds": seeds,
               "stage_seconds": stages, "report": str(out / "report" / "report.html"),
               "conclusion": rep["conclusion"]}
    write_json(out / "summary.json", summary)
    console.print(f"report: {stages['report_s']:.0f} s, {out / 'report' / 'report.html'}")
    return summary
