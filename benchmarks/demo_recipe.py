"""Which training recipe for `quantgate demo` makes outliers and sinks most visible within its time budget.

Trains one `small` twin pair per recipe on the embedded corpus (the demo's corpus and shape), then measures
what the report will show: held-out perplexity, the largest residual |h| per twin and where it sits, its
ratio to the median, the largest BOS attention share, and what W8A8-static and INT4 cost each twin (KLD
against its own float logits). Recipes run as separate processes, `--parallel` at a time, each with
`--threads` threads; training time is measured per run (runs side by side slow each other: compare the
`train_s` of runs that ran alone, or all in parallel, not across).

    python benchmarks/demo_recipe.py --steps 1200 --recipes lr3e-3,lr6e-3,wd0.5 --parallel 2 --threads 1
    python benchmarks/demo_recipe.py --collect   # rewrite results/demo_recipe.{json,md} from finished runs
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# name -> overrides of the demo's full recipe (quantgate.demo.DEMO_RECIPES["full"])
RECIPES = {
    "lr3e-3": dict(lr=3e-3, weight_decay=0.1),
    "lr6e-3": dict(lr=6e-3, weight_decay=0.1),
    "wd0.5": dict(lr=3e-3, weight_decay=0.5),
    "lr6e-3-wd0.5": dict(lr=6e-3, weight_decay=0.5),
    "lr1e-2": dict(lr=1e-2, weight_decay=0.1),
}


def run_one(name: str, steps: int, threads: int, work: Path) -> dict:
    """Train one recipe's twins and measure them; writes work/NAME/result.json."""
    import torch

    from quantgate.analyze import run_analyze
    from quantgate.demo import DEMO_RECIPES
    from quantgate.evaluate import evaluate_model
    from quantgate.quant.torch_backend import quantize_checkpoint
    from quantgate.train import TrainConfig, train

    torch.set_num_threads(threads)
    recipe = {**DEMO_RECIPES["full"], **RECIPES[name], "steps": steps}
    out = work / name
    tc = TrainConfig(twins=True, gate="elementwise", data="embedded", threads=threads, ckpt_every=200,
                     compile=True, **recipe)
    t = time.time()
    if not all((out / k / "config.json").is_file() for k in ("baseline", "gated")):
        train(tc, out, resume=(out / "state" / "train_state.pt").is_file())
    train_s = time.time() - t
    models = {k: str(out / k) for k in ("baseline", "gated")}
    res = run_analyze(models["baseline"], "embedded", tc.ctx, 32, "test", 0, compare=models["gated"])
    result = {"recipe": name, "settings": recipe, "train_s": round(train_s, 1), "threads": threads, "twins": {}}
    for twin, rep in res["reports"].items():
        layers = rep["layers"]
        worst = max(layers, key=lambda l: l["max_abs"])
        bos = [max(l["bos_attention"]) for l in layers]
        row = {"ppl": round(evaluate_model(models[twin], "embedded", tc.ctx, split="test",
                                           max_windows=64)["ppl"], 3),
               "max_abs": round(worst["max_abs"], 2), "max_layer": worst["layer"],
               "max_position": worst["max_position"], "max_over_median": round(worst["max_over_median"], 1),
               "layers_max_on_bos": sum(l["max_position"] == 0 for l in layers),
               "bos_share_max": round(max(bos), 4), "uniform_bos_share": round(rep["uniform_bos_share"], 4)}
        for scheme in ("w8a8-static", "w4a16-g32"):
            q = out / f"{twin}-{scheme}"
            if not (q / "config.json").is_file():
                quantize_checkpoint(models[twin], scheme, str(q), ctx=tc.ctx)
            ev = evaluate_model(str(q), "embedded", tc.ctx, split="test", max_windows=16, reference=models[twin])
            row[f"kld_{scheme}"] = round(ev["kld_mean"], 5)
        result["twins"][twin] = row
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def collect(work: Path, out_json: Path) -> None:
    runs = [json.loads(p.read_text()) for p in sorted(work.glob("*/result.json"))]
    payload = {"what": "demo recipe search: small twins on the embedded corpus, one run per recipe",
               "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
               "runs": runs}
    out_json.write_text(json.dumps(payload, indent=1))
    lines = ["| recipe | steps | train s (threads) | twin | ppl | max abs h (layer, pos) | max/median | layers max on BOS "
             "| max BOS share (uniform) | KLD w8a8-static | KLD w4a16-g32 |", "|" + "---|" * 11]
    for r in runs:
        for twin, t in r["twins"].items():
            lines.append(f"| {r['recipe']} | {r['settings']['steps']} | {r['train_s']:.0f} ({r['threads']}) | {twin} "
                         f"| {t['ppl']:.2f} | {t['max_abs']:.1f} ({t['max_layer']}, {t['max_position']}) "
                         f"| {t['max_over_median']:.1f} | {t['layers_max_on_bos']}/6 "
                         f"| {t['bos_share_max']:.3f} ({t['uniform_bos_share']:.3f}) "
                         f"| {t['kld_w8a8-static']:.4f} | {t['kld_w4a16-g32']:.4f} |")
    out_json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="lr3e-3,lr6e-3,wd0.5,lr6e-3-wd0.5", help=f"from {', '.join(RECIPES)}")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="demo-recipe-runs", help="run directories (reused: finished runs are kept)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--collect", action="store_true", help="only rewrite the results from finished runs")
    ap.add_argument("--out", default=str(RESULTS / "demo_recipe.json"))
    args = ap.parse_args()
    work = Path(args.work)
    if args.one:
        run_one(args.one, args.steps, args.threads, work)
        return
    if not args.collect:
        names = args.recipes.split(",")
        for n in names:
            if n not in RECIPES:
                sys.exit(f"unknown recipe {n!r}; choose from {', '.join(RECIPES)}")
        pending = list(names)
        running: list[subprocess.Popen] = []
        while pending or running:
            while pending and len(running) < args.parallel:
                n = pending.pop(0)
                work.mkdir(parents=True, exist_ok=True)
                log = open(work / f"{n}.log", "w")
                running.append(subprocess.Popen([sys.executable, __file__, "--one", n, "--steps", str(args.steps),
                                                 "--threads", str(args.threads), "--work", str(work)],
                                                stdout=log, stderr=subprocess.STDOUT))
            time.sleep(5)
            for p in [p for p in running if p.poll() is not None]:
                running.remove(p)
                if p.returncode:
                    print(f"a run failed (exit {p.returncode}); see {work}/*.log", file=sys.stderr)
    collect(work, Path(args.out))


if __name__ == "__main__":
    main()
