"""The torch allocator against the registry's uniform PyTorch weight-only schemes, 3.5 to 7 bits per weight (issue 36).

For the twins of one CPU-trained pair (`--arch attention`, `medium` or `hybrid`: the recipes of
benchmarks/allocator.py; the weights are not committed), in a fresh folder removed afterwards, each twin:

1. the uniform round-to-nearest schemes a user picks by name (`quantize --scheme w4a16-g128|w4a16-g64|w4a16-g32|
   w8a16`), their bits per weight as `quantgate info` counts them (block Linears, fp16 scales included);
2. `quantize MODEL --target-bpw B` for B in BUDGETS (each Linear's KLD measured alone on calibration windows of the
   valid split), the gate A/B's held arm (`--hold-gates`) and the weight-error proxy's arm (`--sensitivity proxy`)
   at the same budget;
3. KLD of every checkpoint against the float twin on evaluation windows of the test split, mean and p99 with the
   95% window-bootstrap interval; per budget, the paired ratio allocator / the best uniform scheme at <= the
   allocator's bits (lowest KLD among those), held / free gates and proxy / measured (windows resampled together).

No speed: the simulation stores rounded weights in float and runs float kernels, so every scheme runs at the float
model's speed; speed belongs to the GGUF and ONNX benchmarks.

    python benchmarks/allocator_torch.py --arch attention [--steps 300] [--keep-run DIR]

Each run replaces its arch's entry in benchmarks/results/allocator_torch.json, then writes allocator_torch.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from allocator import CALIB, EVAL, RECIPES, RESULTS, cli, paired_ratio, run_words, train_and_run

UNIFORM = ("w4a16-g128", "w4a16-g64", "w4a16-g32", "w8a16")
BUDGETS = (3.5, 4.25, 4.5, 5.0, 6.0, 7.0)


def evaluate(d: Path, ref: Path, cache: Path) -> dict:
    out = json.loads(cli("eval", d, "--reference", ref, "--data", EVAL["data"], "--ctx", EVAL["ctx"],
                         "--max-windows", EVAL["windows"], "--json", env={"QUANTGATE_CACHE": str(cache)}))
    info = json.loads(cli("info", d, "--json"))
    return {"kld_mean": out["kld_mean"], "kld_mean_ci95": out.get("kld_mean_ci95"), "kld_p99": out["kld_p99"],
            "kld_p99_ci95": out.get("kld_p99_ci95"), "per_window": out["per_window"]["kld"],
            "bits_per_weight": info["quantization"]["block_bits_per_weight"]}


def run_twin(work: Path, name: str, model: Path, cache: Path) -> dict:
    calib = ["--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"]]
    env = {"QUANTGATE_CACHE": str(cache)}
    std = {}
    for scheme in UNIFORM:
        d = work / f"{name}-{scheme}"
        cli("quantize", model, "--scheme", scheme, "--out", d)
        std[scheme] = evaluate(d, model, cache)
        shutil.rmtree(d)
    rows = []
    for b in BUDGETS:
        arms = {}
        try:
            for arm, extra in (("allocator", []), ("gates_held", ["--hold-gates"]),
                               ("proxy", ["--sensitivity", "proxy"])):
                d = work / f"{name}-auto{b}-{arm}"
                t0 = time.perf_counter()
                s = json.loads(cli("quantize", model, "--target-bpw", b, *calib, *extra, "--out", d, "--json", env=env))
                arms[arm] = {"seconds": round(time.perf_counter() - t0, 1), "types": s["types"],
                             "gate_types": s["gate_types"], "predicted_kld": s["predicted_kld"],
                             **evaluate(d, model, cache)}
                shutil.rmtree(d)
        except RuntimeError as e:
            if "below the smallest" not in str(e):
                raise
            rows.append({"budget_bpw": b, "unreachable": str(e).partition("error: ")[2].strip()})
            continue
        a = arms["allocator"]
        fits = [t for t in UNIFORM if std[t]["bits_per_weight"] <= a["bits_per_weight"] + 1e-9]
        best = min(fits, key=lambda t: std[t]["kld_mean"]) if fits else None
        row = {"budget_bpw": b, "bits_per_weight": a["bits_per_weight"],
               **{arm: {k: v for k, v in d.items() if k != "per_window"} for arm, d in arms.items()},
               "held_vs_free_gates": paired_ratio(arms["gates_held"]["per_window"], a["per_window"]),
               "proxy_vs_measured": paired_ratio(arms["proxy"]["per_window"], a["per_window"]),
               "best_standard": best}
        if best:
            row["allocator_vs_best_standard"] = paired_ratio(a["per_window"], std[best]["per_window"])
        rows.append(row)
        print(json.dumps({"twin": name, "budget": b, "best_standard": best,
                          "ratio": row.get("allocator_vs_best_standard"), "held_vs_free": row["held_vs_free_gates"]}),
              flush=True)
    return {"twin": name, "standard": {t: {k: v for k, v in d.items() if k != "per_window"} for t, d in std.items()},
            "budgets": rows}


def _ci(x: dict) -> str:
    return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"


def write_tables(result: dict) -> None:
    lines = ["# Torch allocator vs the registry's uniform PyTorch weight-only schemes", ""]
    for arch, e in result["archs"].items():
        lines += [f"## {arch} twins", "",
                  f"{run_words(e)} (PyTorch fp32); sensitivity on {CALIB['windows']} calibration windows of "
                  f"{CALIB['ctx']} tokens (valid split). bpw: the block Linears' bits per weight, fp16 group scales "
                  f"included (`quantgate info`'s block_bits_per_weight, what `--target-bpw` counts); the best uniform "
                  f"scheme is the one with the lowest KLD at no more bits (the registry's: int4 in groups of 128, 64, 32 "
                  f"and int8 per row, so from 4.5 to 8 bpw the comparison is against w4a16-g32). No speed columns: the "
                  f"simulation runs float kernels whatever the bits.", "",
                  "| twin | budget | bpw | KLD allocator [95%] | KLD p99 [95%] | best uniform <= bits | "
                  "alloc/uniform KLD | gates held/free | proxy/measured |", "|---|---|---|---|---|---|---|---|---|"]
        for tw in e["twins"]:
            for r in tw["budgets"]:
                if "unreachable" in r:
                    lines.append(f"| {tw['twin']} | {r['budget_bpw']} | unreachable: {r['unreachable']} |" + " |" * 6)
                    continue
                a = r["allocator"]
                ci, p99 = a["kld_mean_ci95"], a["kld_p99_ci95"]
                cmp = (f"{r['best_standard']} | {_ci(r['allocator_vs_best_standard'])}" if r["best_standard"]
                       else "none this small | -")
                held = _ci(r["held_vs_free_gates"]) if r["gates_held"]["gate_types"] else "no gate units"
                lines.append(f"| {tw['twin']} | {r['budget_bpw']} | {r['bits_per_weight']:.3f} | {a['kld_mean']:.4g} "
                             f"[{ci[0]:.4g}, {ci[1]:.4g}] | {a['kld_p99']:.4g} [{p99[0]:.4g}, {p99[1]:.4g}] | {cmp} | "
                             f"{held} | {_ci(r['proxy_vs_measured'])} |")
        lines += ["", "The uniform schemes (bits per weight: then mean KLD [95%]):", "",
                  "| twin | " + " | ".join(UNIFORM) + " |", "|---|" + "---|" * len(UNIFORM)]
        for tw in e["twins"]:
            lines.append(f"| {tw['twin']} | " + " | ".join(
                f"{tw['standard'][t]['bits_per_weight']:.3f}: {tw['standard'][t]['kld_mean']:.4g} "
                f"[{tw['standard'][t]['kld_mean_ci95'][0]:.4g}, {tw['standard'][t]['kld_mean_ci95'][1]:.4g}]"
                for t in UNIFORM) + " |")
        lines.append("")
    (RESULTS / "allocator_torch.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(RECIPES), default="attention")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-run", default=None, help="train the twins into this folder once and reuse them")
    ap.add_argument("--tables-only", action="store_true")
    args = ap.parse_args()
    path = RESULTS / "allocator_torch.json"
    result = json.loads(path.read_text()) if path.is_file() else {"archs": {}}
    if not args.tables_only:
        result["archs"][args.arch] = {
            "command": f"python benchmarks/allocator_torch.py --arch {args.arch} --steps {args.steps}",
            **train_and_run(args.arch, args.steps, args.keep_run, "allocator-torch", run_twin)}
        path.write_text(json.dumps(result, indent=1) + "\n")
    write_tables(result)


if __name__ == "__main__":
    main()
