"""The ONNX allocator against ONNX Runtime's uniform weight-only recipes, 4.5 to 8 bits per weight (issue 36).

For the twins of one CPU-trained pair (`--arch attention`: the demo's `small` twins; `--arch medium`; recipes in
benchmarks/allocator.py, the weights are not committed), in a fresh folder removed afterwards, each twin:

1. the fp32 ONNX export, and ORT's uniform MatMulNBits recipes from it (`quantize --scheme int4|int8-weight
   --block-size B`): int4 in blocks of 128, 64 and 32, int8 in blocks of 128 and 32 (the embedding table in the
   same bits and blocks);
2. `quantize EXPORT --target-bpw B` for B in BUDGETS (each node's KLD measured alone by ONNX Runtime on calibration
   windows of the valid split), and the gate A/B's held arm (`--hold-gates`) at the same budget;
3. KLD of every graph against the float twin (PyTorch fp32) on evaluation windows of the test split, mean and p99
   with the 95% window-bootstrap interval; per budget, the paired ratio allocator / the best uniform recipe at <=
   the allocator's size, and held / free gates;
4. prefill and decode tok/s of the allocated graph and that recipe in ONNX Runtime (one thread, alternated rounds,
   the runners' bench protocol): median per-round ratio and its range;
5. the decode floor's arm (on by default, `--no-floor` skips it): `--decode-floor RECIPE --threads 1`, RECIPE that
   best uniform recipe, scored and timed against it; and the weight-error proxy's arm (`--sensitivity proxy`).

    python benchmarks/allocator_onnx.py --arch attention [--steps 300] [--keep-run DIR]
    python benchmarks/allocator_onnx.py --arch attention --floor-only --floor-fraction 0.97 [--budgets 4.5,5]

Each run replaces its arch's entry in benchmarks/results/allocator_onnx.json, then writes allocator_onnx.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from allocator import (CALIB, EVAL, RESULTS, SPEED, add_floor_run, checked_cell, cli, compare_cells, floor_key,
                       floor_run_words, fraction_words, goals_section, paired_ratio, parse_budgets, protocol_words,
                       run_words, speed_pair, train_and_run)
from allocator_proxy import rank_agreement

UNIFORM = {"int4/128": ("int4", 128), "int4/64": ("int4", 64), "int4/32": ("int4", 32),
           "int8/128": ("int8-weight", 128), "int8/32": ("int8-weight", 32)}
BUDGETS = (4.5, 5.0, 5.5, 6.5, 8.0)


def folder_bytes(d: Path) -> int:
    from quantgate.formats.onnx_io import onnx_bytes
    return onnx_bytes(d)


def evaluate(d: Path, ref: Path, cache: Path) -> dict:
    out = json.loads(cli("eval", d, "--reference", ref, "--data", EVAL["data"], "--ctx", EVAL["ctx"],
                         "--max-windows", EVAL["windows"], "--json", env={"QUANTGATE_CACHE": str(cache)}))
    return {"kld_mean": out["kld_mean"], "kld_mean_ci95": out.get("kld_mean_ci95"), "kld_p99": out["kld_p99"],
            "kld_p99_ci95": out.get("kld_p99_ci95"), "per_window": out["per_window"]["kld"], "bytes": folder_bytes(d)}


def run_twin(work: Path, name: str, model: Path, cache: Path, floor: bool = True, fraction: float = 1.0,
             floors: dict | None = None, budgets: tuple = BUDGETS) -> dict:
    """One twin's rows; `floors` (`--floor-only`: budget -> the best uniform recipe the entry's free arm found) runs
    only the floored arm against that recipe, at `fraction` of its speed."""
    import shutil
    fp32 = work / f"{name}-onnx"
    cli("export", "onnx", model, "--out", fp32)
    weights = _weights(fp32)
    calib = ["--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"]]
    env = {"QUANTGATE_CACHE": str(cache)}
    std = {}
    for label, (scheme, block) in UNIFORM.items():
        d = work / f"{name}-{label.replace('/', '-')}"
        cli("quantize", fp32, "--scheme", scheme, "--block-size", block, "--out", d)
        std[label] = {"path": d, **evaluate(d, model, cache)}
        std[label]["bits_per_weight"] = 8 * std[label]["bytes"] / weights
    rows = []
    delta: dict = {}
    for b in budgets:
        if floors is not None:
            best = floors.get(b)
            rows.append({"budget_bpw": b, "best_standard": best, **({floor_key(fraction): floored_arm(
                fp32, work / f"{name}-auto{b}-floor", b, best, std[best], model, cache, calib, fraction)}
                if best else {})})
            print(json.dumps({"twin": name, "budget": b, "floor_only": True, "fraction": fraction,
                              **({k: rows[-1][floor_key(fraction)].get(k) for k in ("vs_best_standard", "unreachable")}
                                 if best else {})}), flush=True)
            continue
        arms = {}
        for arm, extra in (("allocator", []), ("gates_held", ["--hold-gates"]), ("proxy", ["--sensitivity", "proxy"])):
            d = work / f"{name}-auto{b}-{arm}"
            t0 = time.perf_counter()
            s = json.loads(cli("quantize", fp32, "--target-bpw", b, *calib, *extra, "--out", d, "--json", env=env))
            arms[arm] = {"path": d, "seconds": round(time.perf_counter() - t0, 1), "bits_per_weight": s["bits_per_weight"],
                         "types": s["types"], "gate_types": s["gate_types"], "predicted_kld": s["predicted_kld"],
                         **evaluate(d, model, cache)}
            delta[arm] = s["sensitivity"]["delta"]
        a = arms["allocator"]
        fits = [t for t in UNIFORM if std[t]["bytes"] <= a["bytes"]]
        best = min(fits, key=lambda t: std[t]["kld_mean"]) if fits else None
        row = {"budget_bpw": b, "bits_per_weight": a["bits_per_weight"], "file_bits_per_weight": 8 * a["bytes"] / weights,
               **{arm: {k: v for k, v in d.items() if k not in ("path", "per_window")} for arm, d in arms.items()},
               "held_vs_free_gates": paired_ratio(arms["gates_held"]["per_window"], a["per_window"]),
               "proxy_vs_measured": paired_ratio(arms["proxy"]["per_window"], a["per_window"]),
               "best_standard": best}
        if best:
            row["allocator_vs_best_standard"] = paired_ratio(a["per_window"], std[best]["per_window"])
            p_fits = [t for t in UNIFORM if std[t]["bytes"] <= arms["proxy"]["bytes"]]
            if p_fits:
                p_best = min(p_fits, key=lambda t: std[t]["kld_mean"])
                row["proxy_vs_best_standard"] = {"standard": p_best, **paired_ratio(arms["proxy"]["per_window"],
                                                                                    std[p_best]["per_window"])}
            row["speed_vs_best_standard"] = speed_pair(a["path"], std[best]["path"], kv="f32")
            if floor:
                row[floor_key(fraction)] = floored_arm(fp32, work / f"{name}-auto{b}-floor", b, best, std[best], model,
                                                       cache, calib, fraction)
        rows.append(row)
        for d in arms.values():
            shutil.rmtree(d["path"])
        print(json.dumps({"twin": name, "budget": b, "best_standard": best,
                          **({"ratio": row["allocator_vs_best_standard"],
                              "decode": row["speed_vs_best_standard"]["decode"]["ratio_median"]} if best else {}),
                          "held_vs_free": row["held_vs_free_gates"]}), flush=True)
    for d in std.values():
        shutil.rmtree(d["path"])
    shutil.rmtree(fp32)
    if floors is not None:
        return {"twin": name, "weights": weights, "budgets": rows,
                "standard": {t: {k: v for k, v in d.items() if k not in ("path", "per_window")} for t, d in std.items()}}
    from quantgate.quant.allocate_onnx import BASE
    rank = {"all_options": rank_agreement(delta["allocator"], delta["proxy"], base=BASE),
            "int4/32": rank_agreement(delta["allocator"], delta["proxy"], ["int4/32"], base=BASE)}
    return {"twin": name, "weights": weights, "proxy_rank_agreement": rank,
            "standard": {t: {k: v for k, v in d.items() if k not in ("path", "per_window")} for t, d in std.items()},
            "budgets": rows}


def floored_arm(fp32: Path, d: Path, budget: float, best: str, std: dict, model: Path, cache: Path, calib: list,
                fraction: float = 1.0) -> dict:
    """The allocation at the same budget with `--decode-floor best` (or FRACTION*best; one thread, as the speed pair
    runs), scored and timed against the same uniform recipe; a floor the budget cannot meet is recorded as such."""
    import shutil
    t0 = time.perf_counter()
    floor = best if fraction == 1 else f"{fraction:g}*{best}"
    try:
        s = json.loads(cli("quantize", fp32, "--target-bpw", budget, *calib, "--decode-floor", floor, "--threads",
                           SPEED["threads"], "--out", d, "--json", env={"QUANTGATE_CACHE": str(cache)}))
    except RuntimeError as e:
        if "decode floor out of reach" not in str(e) and "decode floor not met" not in str(e):
            raise
        return {"floor": best, "fraction": fraction, "unreachable": str(e).partition("error: ")[2].strip()}
    ev = evaluate(d, model, cache)
    out = {"floor": best, "fraction": fraction, "seconds": round(time.perf_counter() - t0, 1), "bits_per_weight": s["bits_per_weight"],
           "predicted_decode_tps": s["predicted_decode_tps"], "floor_tps": s["floor_tps"],
           "floor_checks": s.get("floor_checks"), "floor_recipe": s.get("floor_recipe"), "types": s["types"],
           **{k: v for k, v in ev.items() if k != "per_window"},
           "vs_best_standard": paired_ratio(ev["per_window"], std["per_window"]),
           "speed_vs_best_standard": speed_pair(d, std["path"], kv="f32")}
    shutil.rmtree(d)
    return out


def _weights(fp32: Path) -> int:
    """fp32 initializer elements: the bits-per-weight denominator the allocator's --target-bpw uses."""
    from quantgate.quant.allocate_onnx import units_of
    return units_of(fp32 / "model.onnx").total_elements


def floor_section(e: dict, key: str) -> list[str]:
    """The table of one floored arm (allocator.floor_key) with the words that say how it was measured."""
    frac, speed = fraction_words(key, "RECIPE")
    lines = ["", f"With a decode floor (`--decode-floor {frac}RECIPE --threads 1`, RECIPE the best uniform recipe no "
             "larger than the free allocation): predicted at least as fast as "
             f"{speed} from per-option decode "
             "timings, against the same recipe's graph (measured ratio: median per-round [min, max]). "
             "Checked: the written graph's tok/s against the floor's, timed by quantize in alternated rounds "
             "(graphs written; none: a run before the check, prediction only)." + floor_run_words(e, key), "",
             "| twin | budget | floor | bpw | KLD [95%] | alloc/uniform KLD | decode alloc/uniform | "
             "predicted / floor tok/s | checked tok/s (graphs) | free arm's KLD ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for tw, r in [(tw, r) for tw in e["twins"] for r in tw["budgets"] if key in r]:
        f = r[key]
        head = f"| {tw['twin']} | {r['budget_bpw']} | {frac}{f['floor']} |"
        if "unreachable" in f:
            lines.append(f"{head} unreachable: {f['unreachable']} |" + " |" * 6)
            continue
        c, sp, ci = f["vs_best_standard"], f["speed_vs_best_standard"]["decode"], f["kld_mean_ci95"]
        lines.append(f"{head} {f['bits_per_weight']:.3f} | {f['kld_mean']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}] | "
                     f"{c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] | {sp['ratio_median']:.3f} "
                     f"[{sp['ratio_range'][0]:.2f}, {sp['ratio_range'][1]:.2f}] | "
                     f"{f['predicted_decode_tps']:.0f} / {f['floor_tps']:.0f} | {checked_cell(f)} | "
                     f"{r['allocator_vs_best_standard']['ratio']:.3f} |")
    return lines


def merge_floors(old: dict, new: dict, key: str) -> dict:
    """`--floor-only`: this run's floored arms put into the arch's rows, once the run shows it trained the same twins
    (each uniform recipe's graph the same size and KLD); the run is named beside the rows (floor_runs)."""
    for tw_old, tw_new in zip(old["twins"], new["twins"]):
        for t, cell in tw_old["standard"].items():
            now = tw_new["standard"][t]
            if now["bytes"] != cell["bytes"] or abs(now["kld_mean"] - cell["kld_mean"]) > 1e-6 * cell["kld_mean"]:
                raise RuntimeError(f"{tw_old['twin']} {t}: {now['bytes']} bytes, KLD {now['kld_mean']} now; "
                                   f"{cell['bytes']}, {cell['kld_mean']} in the entry: not the same twins")
        rows = {r["budget_bpw"]: r for r in tw_new["budgets"]}
        for r in tw_old["budgets"]:
            n = rows.get(r["budget_bpw"])
            if n and key in n:
                r[key] = n[key]
    runs = old.get("floor_runs", {})
    add_floor_run(runs, "graphs" if key == "floored" else f"graphs {key}",
                  {k: new[k] for k in ("command", "commit", "seconds", "machine")})
    return {**old, "floor_runs": runs}


def write_tables(result: dict) -> None:
    lines = ["# ONNX allocator vs ONNX Runtime's uniform MatMulNBits recipes", ""]
    for arch, e in result["archs"].items():
        lines += [f"## {arch} twins", "",
                  f"{run_words(e)} (PyTorch fp32); sensitivity on {CALIB['windows']} calibration windows of "
                  f"{CALIB['ctx']} tokens (valid split). bpw: the allocation's weight bytes (packed blocks, scales, "
                  f"float norms) over every weight, as `--target-bpw` counts them; folder bpw: model.onnx and its data "
                  f"(the graph's nodes and names too) over every weight, as the uniform recipes are shown and "
                  f"compared (the best uniform recipe is the one with the lowest KLD whose folder is no larger). "
                  f"{protocol_words('ONNX Runtime', 'fp32 KV')}", "",
                  "| twin | budget | bpw (folder) | KLD allocator [95%] | KLD p99 [95%] | best uniform <= size | alloc/uniform KLD | "
                  "decode alloc/uniform | prefill alloc/uniform | gates held/free |", "|---|---|---|---|---|---|---|---|---|---|"]
        for tw in e["twins"]:
            for r in tw["budgets"]:
                a, h = r["allocator"], r["held_vs_free_gates"]
                ci, p99 = a["kld_mean_ci95"], a["kld_p99_ci95"]
                cmp = compare_cells(r)
                lines.append(f"| {tw['twin']} | {r['budget_bpw']} | {r['bits_per_weight']:.3f} "
                             f"({r['file_bits_per_weight']:.2f}) | {a['kld_mean']:.4g} "
                             f"[{ci[0]:.4g}, {ci[1]:.4g}] | {a['kld_p99']:.4g} [{p99[0]:.4g}, {p99[1]:.4g}] | {cmp} | "
                             f"{h['ratio']:.3f} [{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}] |")
        keys = sorted({k for tw in e["twins"] for r in tw["budgets"] for k in r if k.startswith("floored")},
                      key=lambda k: (k != "floored", k))
        for key in keys:
            lines += floor_section(e, key)
        lines += goals_section([([tw["twin"], r["budget_bpw"]], r) for tw in e["twins"] for r in tw["budgets"]
                                if r.get("best_standard")], ["twin", "budget"], keys, "uniform recipe",
                               "Issue 36's two goals (set against llama.cpp's types, held here against ORT's recipes)")
        if any("proxy_rank_agreement" in tw for tw in e["twins"]):
            lines += ["", "The weight-error proxy (`--sensitivity proxy`: ORT's block quantizer on 256 sampled columns "
                      "per node, no calibration) against the measured sensitivity: Spearman's rho over (node, option) "
                      "pairs and across nodes at int4/32 [95% bootstrap over nodes]; its allocation's KLD over the "
                      "measured allocation's at the same budget [95%], and over the best uniform recipe no larger.", "",
                      "| twin | rho, all pairs | rho at int4/32 | " + " | ".join(f"proxy/measured at {b}" for b in BUDGETS)
                      + " | " + " | ".join(f"proxy/uniform at {b}" for b in BUDGETS) + " |",
                      "|---|---|---|" + "---|" * (2 * len(BUDGETS))]
            for tw in e["twins"]:
                if "proxy_rank_agreement" not in tw:
                    continue
                ra, r1 = tw["proxy_rank_agreement"]["all_options"], tw["proxy_rank_agreement"]["int4/32"]

                def c(x):
                    return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]" if x else "-"
                lines.append(f"| {tw['twin']} | {ra['rho']:.3f} [{ra['ci95'][0]:.3f}, {ra['ci95'][1]:.3f}] | "
                             f"{r1['rho']:.3f} [{r1['ci95'][0]:.3f}, {r1['ci95'][1]:.3f}] | "
                             + " | ".join(c(r.get("proxy_vs_measured")) for r in tw["budgets"]) + " | "
                             + " | ".join((r["proxy_vs_best_standard"]["standard"] + " " + c(r["proxy_vs_best_standard"]))
                                          if r.get("proxy_vs_best_standard") else "-" for r in tw["budgets"]) + " |")
        lines += ["", "The uniform recipes (folder bits per weight: then mean KLD [95%]):", "",
                  "| twin | " + " | ".join(UNIFORM) + " |", "|---|" + "---|" * len(UNIFORM)]
        for tw in e["twins"]:
            lines.append(f"| {tw['twin']} | " + " | ".join(
                f"{tw['standard'][t]['bits_per_weight']:.2f}: {tw['standard'][t]['kld_mean']:.4g} "
                f"[{tw['standard'][t]['kld_mean_ci95'][0]:.4g}, {tw['standard'][t]['kld_mean_ci95'][1]:.4g}]"
                for t in UNIFORM) + " |")
        lines.append("")
    (RESULTS / "allocator_onnx.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("attention", "medium"), default="attention")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-run", default=None, help="train the twins into this folder once and reuse them")
    ap.add_argument("--no-floor", action="store_true", help="skip the decode floor's arm")
    ap.add_argument("--floor-fraction", type=float, default=1.0,
                    help="the floored arm's floor as this fraction of the uniform recipe's speed (`--decode-floor "
                         "F*RECIPE`); other than 1, a separate arm of its own rows")
    ap.add_argument("--floor-only", action="store_true",
                    help="measure only the floored arms, against the best uniform recipes --arch's entry found, and put "
                         "them into that entry; the twins are checked to be the same (each recipe's size and KLD)")
    ap.add_argument("--budgets", default=None, help="with --floor-only: these budgets alone (comma-separated, of "
                    f"{', '.join(map(str, BUDGETS))}); the entry's other rows stay as they are")
    ap.add_argument("--tables-only", action="store_true")
    args = ap.parse_args()
    budgets = parse_budgets(ap, args.budgets, args.floor_only, BUDGETS)
    path = RESULTS / "allocator_onnx.json"
    result = json.loads(path.read_text()) if path.is_file() else {"archs": {}}
    if not args.tables_only:
        old = result["archs"].get(args.arch)
        if args.floor_only and not old:
            raise SystemExit(f"--floor-only: no {args.arch} entry in {path} to take the best uniform recipes from")
        bests = ({tw["twin"]: {r["budget_bpw"]: r["best_standard"] for r in tw["budgets"]} for tw in old["twins"]}
                 if args.floor_only else {})
        entry = {
            "command": f"python benchmarks/allocator_onnx.py --arch {args.arch} --steps {args.steps}"
                       f"{' --no-floor' if args.no_floor else ''}{' --floor-only' if args.floor_only else ''}"
                       f"{f' --floor-fraction {args.floor_fraction:g}' if args.floor_fraction != 1 else ''}"
                       f"{f' --budgets {args.budgets}' if args.budgets else ''}",
            "speed": {**SPEED, "kv": "f32 (as exported)"},
            **train_and_run(args.arch, args.steps, args.keep_run, "allocator-onnx",
                            lambda work, name, model, cache: run_twin(
                                work, name, model, cache, not args.no_floor, args.floor_fraction,
                                bests[name] if args.floor_only else None, budgets))}
        result["archs"][args.arch] = (merge_floors(old, entry, floor_key(args.floor_fraction)) if args.floor_only
                                      else entry)
        path.write_text(json.dumps(result, indent=1) + "\n")
    write_tables(result)


if __name__ == "__main__":
    main()
