"""The search for a CPU recipe on which the baseline twin grows an attention sink (BOS share > 0.3), measured.

Outcome of the committed run (results/sink_lab_recipe.json): none of the three recipes below sinks within 1000
steps (120-150 s per twin pair on one thread): the baseline's worst head reaches 0.11-0.18 BOS share (2-4x
uniform), always in layer 0, the gated twin's 0.03-0.12. Probes outside this script at higher lr (1e-2) and weight
decay (0.5-1.0), one layer, three layers or d 128 did no better within ~3 minutes per pair. `lab-sinks` is the
recipe `demo --lab sinks` trained then (its gated twin stays nearest uniform).

Superseded (issue 26): those rows were measured on the corpus before it took Guo et al.'s triggers (the most
frequent symbols; the old ones fell on ~6% of positions) and with the model's rope. benchmarks/sink_lab_search.py
found what makes the lab sink and `demo --lab sinks` now trains that; this script's recipes and results are kept as
the record of what did not.

The `small` twins trained on the embedded corpus have no attention sink at the demo's budget (BOS share 0.06 in
layer 0, README findings), so the gate's main claimed effect cannot be shown there. Guo et al. 2024
(arXiv:2410.13835) grow sinks in 1-3 layer transformers on their Bigram-Backcopy task; quantgate has it as
`--data synthetic:bigram-backcopy` (calib_data.synthetic). This script trains lockstep baseline/gated twins
on it, byte tokenizer, `tiny` preset plus overrides, one thread, and measures each twin at several step counts:
per layer and head the mean attention share on BOS (position 0) over queries >= 1 (`quantgate analyze`), the
worst head against Gu et al.'s sink threshold 0.3 and against the share uniform attention would give, the
largest residual |h| (and its position), max/median, the held-out test loss, and the training time.

A sweep over step counts is one run: the learning rate is held constant after warmup (min_lr_frac=1), so
training to N steps and resuming to M > N steps is the same trajectory as training to M directly (the batches
depend only on the seed and step); the models are analyzed at each stage.

    python benchmarks/sink_lab_recipe.py                 # the recipes below, all their stages
    python benchmarks/sink_lab_recipe.py --quick         # the first recipe, its first stage only (a smoke test)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DATA = "synthetic:bigram-backcopy"
SINK_THRESHOLD = 0.3  # Gu et al. 2024: a head is a sink head when its BOS share exceeds epsilon = 0.3
# name -> (TrainConfig fields beyond the common ones, step counts at which both twins are measured)
COMMON = dict(preset="tiny", twins=True, gate="elementwise", data=DATA, byte_tokenizer=True, min_lr_frac=1.0,
              threads=1, ckpt_every=10**9, log_every=50)
STAGES = [300, 600, 1000]
RECIPES: dict[str, tuple[dict, list[int]]] = {
    # the tiny preset as is: 2 layers, d 64, 4 query / 2 KV heads of 16
    "tiny-h4-ctx64": (dict(batch_size=16, ctx=64, lr=3e-3, warmup=30, weight_decay=0.1, seed=0), STAGES),
    # two wider heads per layer (1 KV head): the back-copy can live in one head that must idle elsewhere
    "tiny-h2-ctx64": (dict(batch_size=16, ctx=64, lr=3e-3, warmup=30, weight_decay=0.1, seed=0,
                           model_overrides=dict(n_heads=2, n_kv_heads=1, head_dim=32)), STAGES),
    # the same model at ctx 128, batch 8: the recipe `quantgate demo --lab sinks` trains (quantgate.demo.LAB_RECIPES)
    "lab-sinks": (dict(batch_size=8, ctx=128, lr=3e-3, warmup=30, weight_decay=0.1, seed=0,
                       model_overrides=dict(n_heads=2, n_kv_heads=1, head_dim=32)), STAGES),
}


def twin_row(model_dir: str, ctx: int, n_windows: int) -> dict:
    """What `quantgate analyze` and `quantgate eval` say about one twin, condensed."""
    from quantgate.analyze import analyze
    from quantgate.evaluate import evaluate_model

    rep = analyze(model_dir, DATA, ctx, n_windows)
    layers = rep["layers"]
    heads = [(share, l["layer"], h) for l in layers for h, share in enumerate(l["bos_attention"])]
    share, layer, head = max(heads)
    peak = max(layers, key=lambda l: l["max_abs"])
    ev = evaluate_model(model_dir, DATA, ctx, max_windows=64, threads=1)
    return {"worst_head_bos_share": round(share, 4), "worst_head": [layer, head],
            "sink": share > SINK_THRESHOLD,
            "mean_bos_share": round(sum(s for s, _, _ in heads) / len(heads), 4),
            "uniform_bos_share": round(rep["uniform_bos_share"], 4),
            "bos_share_per_layer_head": [[round(s, 3) for s in l["bos_attention"]] for l in layers],
            "max_abs": round(peak["max_abs"], 2), "max_abs_layer": peak["layer"],
            "max_abs_position": peak["max_position"], "max_over_median": round(peak["max_over_median"], 1),
            "max_abs_per_layer": [round(l["max_abs"], 2) for l in layers],
            "test_loss": round(ev["mean_nll"], 4),
            "test_ppl": round(ev["ppl"], 4)}


def run_recipe(name: str, settings: dict, stages: list[int], work: Path, n_windows: int) -> dict:
    import torch

    from quantgate.train import TrainConfig, train

    torch.set_num_threads(1)
    fields = {**COMMON, **settings}
    out, train_s, rows = work / name, 0.0, []
    for i, steps in enumerate(stages):
        tc = TrainConfig(**fields, steps=steps)
        t = time.time()
        train(tc, out, resume=i > 0)
        train_s += time.time() - t
        log = json.loads((out / "state" / "train_log.json").read_text())
        row = {"steps": steps, "train_s": round(train_s, 1), "tokens": steps * tc.batch_size * (tc.ctx - 1),
               "train_loss": {k: round(v, 4) for k, v in log[-1]["loss"].items()},
               "twins": {k: twin_row(str(out / k), tc.ctx, n_windows) for k in ("baseline", "gated")}}
        rows.append(row)
        b, g = row["twins"]["baseline"], row["twins"]["gated"]
        print(f"{name} step {steps} ({train_s:.0f} s): worst BOS share baseline {b['worst_head_bos_share']:.3f} "
              f"{b['worst_head']}, gated {g['worst_head_bos_share']:.3f} {g['worst_head']} (uniform "
              f"{b['uniform_bos_share']:.3f}); max|h| {b['max_abs']:.1f} / {g['max_abs']:.1f}", flush=True)
    return {"recipe": name, "train_config": fields, "stages": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"from {', '.join(RECIPES)}")
    ap.add_argument("--quick", action="store_true", help="first recipe, first stage only")
    ap.add_argument("--windows", type=int, default=32, help="analysis windows per twin")
    ap.add_argument("--out", default=str(RESULTS / "sink_lab_recipe.json"))
    args = ap.parse_args()
    os.environ.setdefault("QUANTGATE_PROGRESS", "0")
    names = args.recipes.split(",")[:1] if args.quick else args.recipes.split(",")
    for n in names:
        if n not in RECIPES:
            sys.exit(f"unknown recipe {n!r}; choose from {', '.join(RECIPES)}")
    import torch
    runs = []
    with tempfile.TemporaryDirectory(prefix="sink-lab-") as tmp:
        for n in names:
            settings, stages = RECIPES[n]
            runs.append(run_recipe(n, settings, stages[:1] if args.quick else stages, Path(tmp), args.windows))
    payload = {"what": "attention sinks of lockstep baseline/gated twins on synthetic:bigram-backcopy "
                       "(Guo et al. 2024), measured at several step counts on one CPU thread",
               "command": "python benchmarks/sink_lab_recipe.py " + " ".join(sys.argv[1:]),
               "sink_threshold": SINK_THRESHOLD,
               "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": 1,
                           "torch": torch.__version__, "python": platform.python_version()},
               "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
