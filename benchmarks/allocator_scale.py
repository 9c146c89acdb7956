"""The allocator's sensitivities against llama.cpp's standard types on CPU-trained pairs, as a user gets them (issue 50).

For each twin of one pair (`--pair attention|medium|hybrid|large`, recipes in PAIRS, weights kept outside the repo
with `--keep-run DIR`), from its F32 GGUF, with the CLI's default calibration (32 windows of 256 tokens of the
embedded corpus's valid split) and no other option than the one a method names:

1. llama.cpp's standard types Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K (`quantize --type`);
2. per method (METHODS: gradient, calibrated, auto = the default, auto at the time budget a 9B model gets (0.5x a
   plain quantize, no two-minute floor), proxy, measured) and budget (BUDGETS): `quantize --target-bpw B`, and the
   same method at exactly the size of the best standard type at <= that file (`--target-size`);
3. mean KLD of every file against the float twin on 64 windows of 128 tokens of the test split, and per file the
   ratio to its standard type (mean KLD over mean KLD, paired by window) with a 95% interval from the document
   bootstrap the report uses (quantgate.stats, documents resampled, 2,000 resamples) and its p-value; Holm's
   correction over every ratio of the pair's entry;
4. the budget file's prefill and decode against the standard file in alternated rounds (the runners' bench protocol
   as benchmarks/allocator.py runs it: 128 + 128 tokens, 9 rounds, one thread, F16 KV cache): median per-round ratio;
5. each method's seconds (the sensitivity's, from the allocation's own phases, the first budget; each file's total)
   and, where measured ran, each cheaper sensitivity's rank agreement with it (Spearman over (tensor, type) pairs and
   across tensors at Q4_K, intervals over tensors).

A row meets the issue's goal where the KLD ratio is <= 0.85 with its interval below 1 and kept by Holm, and the
decode ratio >= 0.95.

    python benchmarks/allocator_scale.py --pair medium --keep-run /tmp/qg/medium [--methods gradient,auto]

Each run replaces (or, with --methods, merges into) its pair's entry in results/allocator_scale.json and rewrites
allocator_scale.md and allocator_scale.png from every entry.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from allocator import EVAL, SPEED, STANDARD, cli, speed_pair  # noqa: E402  (the same protocol)
from allocator_proxy import rank_agreement  # noqa: E402
from provenance import provenance  # noqa: E402

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "allocator_scale.json"
COST_OUT = RESULTS / "allocator_scale_cost.json"  # apart: a cost run and a pair's run may write at the same time
BUDGETS = (4.25, 4.5, 5.0, 5.5, 6.5)
METHODS = {"gradient": ["--sensitivity", "gradient"], "auto": [], "auto@9B-budget": ["--sensitivity-time", "0.5x"],
           "calibrated": ["--sensitivity", "calibrated"], "proxy": ["--sensitivity", "proxy"],
           "measured": ["--sensitivity", "measured"]}
PAIRS = {"attention": ["--twins", "--preset", "small", "--batch-size", 8, "--ctx", 128, "--steps", 300],
         "medium": ["--twins", "--preset", "medium", "--batch-size", 8, "--ctx", 128, "--steps", 300],
         "hybrid": ["--twins", "--arch", "hybrid", "--preset", "small", "--batch-size", 8, "--ctx", 128, "--steps", 300],
         "large": ["--twins", "--preset", "large", "--batch-size", 8, "--ctx", 128, "--steps", 600]}
GOAL_KLD, GOAL_DECODE = 0.85, 0.95


def evaluate(path: Path, ref: Path, cache: Path) -> dict:
    out = json.loads(cli("eval", path, "--reference", ref, "--data", EVAL["data"], "--ctx", EVAL["ctx"],
                         "--max-windows", EVAL["windows"], "--json", env={"QUANTGATE_CACHE": str(cache)}))
    return {"kld_mean": out["kld_mean"], "kld": out["per_window"]["kld"], "doc": out["per_window"].get("doc"),
            "bytes": path.stat().st_size}


def ratio_test(a: dict, b: dict) -> dict:
    """mean KLD of `a` over `b`'s on the same windows, interval and p-value (against 1) by the document bootstrap."""
    from quantgate.stats import bootstrap_test, unit_name
    x, y = np.asarray(a["kld"]), np.asarray(b["kld"])
    ci, p = bootstrap_test(lambda u, v: u.mean(axis=1) / v.mean(axis=1), x, y, null=1.0, groups=a["doc"])
    return {"ratio": float(x.mean() / y.mean()), "ci95": ci, "p": p, "unit": unit_name(a["doc"], len(x))}


def quantize(f32: Path, out: Path, extra: list, cache: Path) -> dict:
    t0 = time.perf_counter()
    cli("quantize", f32, *extra, "--out", out, env={"QUANTGATE_CACHE": str(cache)})
    side = Path(str(out) + ".allocation.json")
    info = json.loads(side.read_text())
    side.unlink()
    return {"seconds": round(time.perf_counter() - t0, 1), "phases": info["seconds"], "bits_per_weight":
            info["bits_per_weight"], "sensitivity_kind": info["sensitivity_kind"],
            "sensitivity_auto": info.get("sensitivity_auto"), "sensitivity": info["sensitivity"],
            "types": info["types"]}


def run_method(work: Path, f32: Path, model: Path, cache: Path, std: dict, method: str, budgets: tuple) -> dict:
    rows, sens = [], None
    for b in budgets:
        p = work / f"{method}-{b}.gguf"
        try:
            q = quantize(f32, p, ["--target-bpw", b, *METHODS[method]], cache)
        except RuntimeError as e:
            if "below the smallest file" not in str(e):
                raise
            rows.append({"budget_bpw": b, "unreachable": str(e).partition("error: ")[2].strip()})
            continue
        sens = sens or q["sensitivity"]
        ev = evaluate(p, model, cache)
        fits = [t for t in STANDARD if std[t]["bytes"] <= ev["bytes"]]
        best = min(fits, key=lambda t: std[t]["kld_mean"]) if fits else None
        row = {"budget_bpw": b, "bits_per_weight": q["bits_per_weight"], "bytes": ev["bytes"],
               "kld_mean": ev["kld_mean"], "seconds": q["seconds"], "sensitivity_kind": q["sensitivity_kind"],
               "sensitivity_auto": q["sensitivity_auto"], "sensitivity_s": q["phases"].get("sensitivity"),
               "best_standard": best}
        if best:
            row["kld_ratio_vs_standard"] = ratio_test(ev, std[best])
            row["speed_vs_standard"] = speed_pair(p, std[best]["path"])
            at = work / f"{method}-{best}-size.gguf"
            qa = quantize(f32, at, ["--target-size", std[best]["bytes"], *METHODS[method]], cache)
            ea = evaluate(at, model, cache)
            row["at_standard_size"] = {"standard": best, "bytes": ea["bytes"], "standard_bytes": std[best]["bytes"],
                                       "kld_mean": ea["kld_mean"], "seconds": qa["seconds"],
                                       "kld_ratio_vs_standard": ratio_test(ea, std[best])}
            at.unlink()
        p.unlink()
        rows.append(row)
        print(json.dumps({"method": method, "budget": b, "best": best, "kind": row["sensitivity_kind"],
                          **({"ratio": row["kld_ratio_vs_standard"]["ratio"], "ci": row["kld_ratio_vs_standard"]["ci95"],
                              "decode": row["speed_vs_standard"]["decode"]["ratio_median"],
                              "at_size": row["at_standard_size"]["kld_ratio_vs_standard"]["ratio"]} if best else {}),
                          "s": row["seconds"]}), flush=True)
    return {"rows": rows, "sensitivity": sens}


def run_twin(work: Path, name: str, model: Path, cache: Path, methods: list[str], budgets: tuple, save) -> dict:
    f32 = work / f"{name}-F32.gguf"
    cli("export", "gguf", model, "--out", f32, "--outtype", "f32")
    std = {}
    for t in STANDARD:
        p = work / f"{name}-{t}.gguf"
        cli("quantize", f32, "--type", t, "--out", p)
        std[t] = {"path": p, **evaluate(p, model, cache)}
    twin = {"twin": name, "standard": {t: {"bytes": d["bytes"], "kld_mean": d["kld_mean"]} for t, d in std.items()},
            "methods": {}}
    sens = {}
    for m in methods:
        r = run_method(work, f32, model, cache, std, m, budgets)
        sens[m] = r.pop("sensitivity")
        twin["methods"][m] = r
        save(twin)
    if sens.get("measured"):
        meas = sens["measured"]["delta"]
        twin["rank_vs_measured"] = {m: {"all_types": rank_agreement(meas, kept := {n: d for n, d in s["delta"].items()
                                                                                    if n in meas}),
                                        "at_Q4_K": rank_agreement(meas, kept, ["Q4_K"])}
                                    for m, s in sens.items() if s and m != "measured" and s["kind"] != "measured"}
    for d in std.values():
        d["path"].unlink()
    f32.unlink()
    save(twin)
    return twin


def apply_holm(entry: dict) -> None:
    """Holm over every ratio of the entry (each file against its standard type); each ratio says whether it is kept,
    and each budget row whether it meets the goal."""
    from quantgate.stats import holm
    tests = {}
    for tw in entry["twins"]:
        for m, r in tw["methods"].items():
            for row in r["rows"]:
                for k, c in (("budget", row.get("kld_ratio_vs_standard")),
                             ("size", row.get("at_standard_size", {}).get("kld_ratio_vs_standard"))):
                    if c:
                        tests[(tw["twin"], m, row["budget_bpw"], k)] = c
    kept = holm({k: c["p"] for k, c in tests.items()})
    for k, c in tests.items():
        c["holm_kept"] = bool(kept[k])
    for tw in entry["twins"]:
        for r in tw["methods"].values():
            for row in r["rows"]:
                c = row.get("kld_ratio_vs_standard")
                if c:
                    d = row["speed_vs_standard"]["decode"]["ratio_median"]
                    row["meets_goal"] = bool(c["ratio"] <= GOAL_KLD and c["ci95"] and c["ci95"][1] < 1
                                             and c["holm_kept"] and d >= GOAL_DECODE)


def write_markdown(result: dict) -> None:
    lines = ["# The allocator's sensitivities against llama.cpp's standard types", "",
             "`benchmarks/allocator_scale.py` (issue 50). CLI defaults: calibration 32 windows of 256 tokens (valid "
             "split); evaluation 64 windows of 128 tokens (test split), KLD against the float twin; ratio = mean KLD "
             "of the allocated file over the best standard type's at <= its size, 95% interval by the document "
             "bootstrap, Holm over the entry; `at size`: the same method at exactly that type's file size; decode: "
             "median per-round ratio in the speed pair (128 + 128 tokens, 9 rounds, 1 thread). Goal: ratio <= 0.85, "
             "interval below 1 and kept by Holm, decode >= 0.95.", ""]
    for pair, e in result["pairs"].items():
        pv = e["provenance"]
        lines += [f"## {pair} pair", "", f"`{pv['command']}` at {pv['commit']}{' (dirty)' if pv['dirty'] else ''}, "
                  f"{pv['date']}, {pv['machine']['cpus']} CPUs; twins: `quantgate train {' '.join(map(str, e['train']))}`"
                  + (" (partial: still running)" if e.get("partial") else ""), ""]
        for tw in e["twins"]:
            lines += [f"### {tw['twin']}", "", "| method (chose) | budget | bpw | vs | KLD ratio [95%] | Holm | at size "
                      "| decode | s (sensitivity s) | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
            for m, r in tw["methods"].items():
                for row in r["rows"]:
                    if "unreachable" in row:
                        lines.append(f"| {m} | {row['budget_bpw']} | - | - | unreachable | | | | | |")
                        continue
                    c = row.get("kld_ratio_vs_standard")
                    chose = row["sensitivity_kind"] + (f", {row['sensitivity_auto']['windows']} w"
                                                       if row.get("sensitivity_auto") else "")
                    if not c:
                        lines.append(f"| {m} ({chose}) | {row['budget_bpw']} | {row['bits_per_weight']:.3f} | none "
                                     f"this small | | | | | {row['seconds']} | - |")
                        continue
                    a = row["at_standard_size"]["kld_ratio_vs_standard"]
                    lines.append(
                        f"| {m} ({chose}) | {row['budget_bpw']} | {row['bits_per_weight']:.3f} | {row['best_standard']} "
                        f"| {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] | {'kept' if c.get('holm_kept') else 'no'} "
                        f"| {a['ratio']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] "
                        f"| {row['speed_vs_standard']['decode']['ratio_median']:.3f} | {row['seconds']} "
                        f"({row['sensitivity_s']}) | {'yes' if row.get('meets_goal') else 'no'} |")
            if tw.get("rank_vs_measured"):
                lines += ["", "| sensitivity | rho, all (tensor, type) pairs | rho across tensors at Q4_K |",
                          "|---|---|---|"]
                for m, rk in tw["rank_vs_measured"].items():
                    f = lambda x: f"{x['rho']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"  # noqa: E731
                    lines.append(f"| {m} | {f(rk['all_types'])} | {f(rk['at_Q4_K'])} |")
            lines.append("")
        met = [(tw["twin"], m, row["budget_bpw"]) for tw in e["twins"] for m, r in tw["methods"].items()
               for row in r["rows"] if "kld_ratio_vs_standard" in row]
        for m in dict.fromkeys(x[1] for x in met):
            rows = [row for tw in e["twins"] for row in tw["methods"].get(m, {}).get("rows", [])
                    if "kld_ratio_vs_standard" in row]
            lines.append(f"- {m}: {sum(r.get('meets_goal', False) for r in rows)} of {len(rows)} comparable rows meet "
                         f"both goals; KLD alone {sum(r['kld_ratio_vs_standard']['ratio'] <= GOAL_KLD and r['kld_ratio_vs_standard']['ci95'][1] < 1 and r['kld_ratio_vs_standard'].get('holm_kept', False) for r in rows)}; "
                         f"decode alone {sum(r['speed_vs_standard']['decode']['ratio_median'] >= GOAL_DECODE for r in rows)}")
        lines.append("")
    cost = json.loads(COST_OUT.read_text()) if COST_OUT.is_file() else {}
    if cost:
        lines += ["## Cost at Qwen3.5 shapes (random bf16 weights)", "",
                  "Each command in its own process; seconds and peak RSS of its largest process; the allocation at "
                  "the plain Q4_K_M file's size.", "",
                  "| shape | plain Q4_K_M s, GB | arm | chose | s | peak GB | time ratio | peak ratio | phases (s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        runs = []
        for shape, c in cost.items():
            pl = c["plain"]
            for arm, a in c.get("arms", {}).items():
                lines.append(f"| {shape} | {pl['seconds']:.0f}, {pl['peak_rss'] / 1e9:.2f} | {arm} | "
                             f"{a.get('sensitivity_kind', 'failed')} | {a['seconds']:.0f} | {a['peak_rss'] / 1e9:.2f} | "
                             f"{a['time_ratio']:.2f} | {a['peak_ratio']:.2f} | {a.get('phases')} |")
            pv = c["provenance"]
            runs.append(f"- {shape}: `{pv['command']}` at {pv['commit']}{' (dirty)' if pv['dirty'] else ''}, "
                        f"{pv['date']}" + (f"; {c['note']}" if c.get("note") else ""))
        lines += ["", *runs, ""]
    (RESULTS / "allocator_scale.md").write_text("\n".join(lines))


def plot(result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pairs = list(result["pairs"].items())
    fig, axes = plt.subplots(1, max(1, 2 * len(pairs)), figsize=(5 * max(1, 2 * len(pairs)), 4), squeeze=False)
    for k, (pair, e) in enumerate(pairs):
        for j, tw in enumerate(e["twins"]):
            ax = axes[0][2 * k + j]
            for m, r in tw["methods"].items():
                pts = [(row["bits_per_weight"], row["kld_ratio_vs_standard"]) for row in r["rows"]
                       if "kld_ratio_vs_standard" in row]
                if pts:
                    x = [p[0] for p in pts]
                    y = [p[1]["ratio"] for p in pts]
                    err = np.array([[p[1]["ratio"] - p[1]["ci95"][0] for p in pts],
                                    [p[1]["ci95"][1] - p[1]["ratio"] for p in pts]])
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.axhline(GOAL_KLD, color="red", lw=0.8, ls="--")
            ax.set_title(f"{pair}: {tw['twin']}")
            ax.set_xlabel("bits per weight")
            ax.set_ylabel("KLD / best standard type at <= size")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "allocator_scale.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=sorted(PAIRS))
    ap.add_argument("--keep-run", default=None, help="train the twins into this folder once and reuse them")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--twins", default="baseline,gated", help="the twins to run (the others keep their rows)")
    ap.add_argument("--tables-only", action="store_true", help="rewrite the .md and .png from the JSON")
    ap.add_argument("--cost", default=None, help="a Qwen3.5 shape (benchmarks/scale.py: qwen35-0.8b, qwen35-4b, "
                    "qwen35-9b): time and memory against plain quantize, instead of a pair")
    ap.add_argument("--work", default=tempfile.gettempdir(), help="with --cost: where the shape's files go")
    ap.add_argument("--cost-arms", default=",".join(COST_ARMS), help="with --cost: the arms to run")
    args = ap.parse_args()
    result = json.loads(OUT.read_text()) if OUT.is_file() else {"pairs": {}}
    if args.cost:
        cost = json.loads(COST_OUT.read_text()) if COST_OUT.is_file() else {}
        arms = [a for a in args.cost_arms.split(",") if a]
        if not arms or set(arms) - set(COST_ARMS):
            ap.error(f"--cost-arms: choose from {', '.join(COST_ARMS)}")

        def save_cost(res: dict) -> None:  # after each arm: a run cut short keeps what it measured
            cost[args.cost] = res
            COST_OUT.write_text(json.dumps(cost, indent=1))
        save_cost(part_cost(args.cost, Path(args.work), arms, save_cost))
        write_markdown(result)
        return
    if args.tables_only:
        write_markdown(result)
        plot(result)
        return
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: {bad} not in {list(METHODS)}")
    budgets = tuple(float(b) for b in args.budgets.split(","))
    entry = {"provenance": provenance(), "train": PAIRS[args.pair], "eval": {**EVAL, "split": "test"},
             "calibration": "the CLI's default: 32 windows of 256 tokens, embedded valid split", "speed": SPEED,
             "budgets": list(budgets), "twins": [], "partial": True}
    old = result["pairs"].get(args.pair)

    def save(twin: dict) -> None:
        names = [t["twin"] for t in entry["twins"]]
        if twin["twin"] in names:
            entry["twins"][names.index(twin["twin"])] = twin
        else:
            entry["twins"].append(twin)
        merged = merge(old, entry) if old and (set(methods) != set(METHODS) or args.twins != "baseline,gated") \
            else entry
        apply_holm(merged)
        result["pairs"][args.pair] = merged
        OUT.write_text(json.dumps(result, indent=1))
        write_markdown(result)

    with tempfile.TemporaryDirectory(prefix="quantgate-alloc-scale-") as tmp:
        work = Path(tmp)
        run = Path(args.keep_run) if args.keep_run else work / "run"
        if not (run / "gated").is_dir():
            cli("train", *PAIRS[args.pair], "--out", run)
        cache = run.parent / f"{run.name}-cache" if args.keep_run else work / "cache"
        for name in args.twins.split(","):
            run_twin(work, name, run / name, cache, methods, budgets, save)
    entry["partial"] = False
    save(entry["twins"][-1])
    plot(result)


# the cost arms at Qwen3.5 shapes: the default, and the gradient on one calibration window of 256 tokens (the
# default's 32 windows of a 9B shape take hours on two cores; auto cuts the windows itself where it takes it)
COST_ARMS = {"auto (default)": [], "gradient, 1 window": ["--sensitivity", "gradient", "--calib-windows", "1",
                                                           "--decode-floor", "none"]}


def part_cost(shape: str, work: Path, arms: list[str], save=lambda res: None) -> dict:
    """Seconds and peak RSS of plain `quantize --type Q4_K_M` and of each COST_ARMS allocation at that file's size, on
    a Qwen3.5 shape with random bf16 weights (benchmarks/scale.py's writer), each command in its own process (the
    wrapper's getrusage of its largest process); every file removed once its numbers are written."""
    import scale
    cfg = scale.SHAPES[shape]()
    d = scale.claim(work / shape)
    res: dict = {"shape": shape, "provenance": provenance()}
    try:
        ckpt, src = d / "ckpt", d / "model-BF16.gguf"
        res["checkpoint"] = scale.write_checkpoint(cfg, ckpt)
        r = scale.measured(scale.qg("export", "gguf", str(ckpt), "--out", str(src), "--outtype", "bf16"))
        res["export"] = {"rc": r["rc"], "seconds": r["seconds"], "peak_rss": r["peak_rss"]}
        shutil.rmtree(ckpt)
        plain = d / "Q4_K_M.gguf"
        r = scale.measured(scale.qg("quantize", str(src), "--type", "Q4_K_M", "--out", str(plain)))
        res["plain"] = {"rc": r["rc"], "seconds": r["seconds"], "peak_rss": r["peak_rss"]}
        size = plain.stat().st_size
        plain.unlink()
        save({**res, "partial": True})
        for arm in arms:
            extra = COST_ARMS[arm]
            out = d / "auto.gguf"
            r = scale.measured(scale.qg("quantize", str(src), "--target-size", str(size), *extra, "--out", str(out)))
            a = {"flags": extra, "rc": r["rc"], "seconds": r["seconds"], "peak_rss": r["peak_rss"],
                 "time_ratio": r["seconds"] / res["plain"]["seconds"], "peak_ratio": r["peak_rss"] / res["plain"]["peak_rss"]}
            side = Path(str(out) + ".allocation.json")
            if r["rc"] == 0 and side.is_file():
                info = json.loads(side.read_text())
                a.update(sensitivity_kind=info["sensitivity_kind"], sensitivity_auto=info.get("sensitivity_auto"),
                         decode_floor_auto=info.get("decode_floor_auto"), phases=info["seconds"],
                         bytes=out.stat().st_size)
            else:
                a["error_line"] = r.get("error_line")
            out.unlink(missing_ok=True)
            side.unlink(missing_ok=True)
            res.setdefault("arms", {})[arm] = a
            print(json.dumps({"shape": shape, "arm": arm, **{k: a.get(k) for k in ("rc", "seconds", "time_ratio",
                                                                                  "peak_ratio", "sensitivity_kind")}}),
                  flush=True)
            save({**res, "partial": True})
    finally:
        scale.remove_own(d)
    return res


def merge(old: dict, new: dict) -> dict:
    """A run of some methods put into the pair's earlier entry (the same twins: each standard file's bytes and KLD
    equal), each method's rows naming the run that measured them."""
    out = json.loads(json.dumps(old))
    for tw_new in new["twins"]:
        tw_old = next((t for t in out["twins"] if t["twin"] == tw_new["twin"]), None)
        if tw_old is None:
            out["twins"].append(tw_new)
            continue
        for t, c in tw_new["standard"].items():
            o = tw_old["standard"][t]
            if o["bytes"] != c["bytes"] or abs(o["kld_mean"] - c["kld_mean"]) > 1e-6 * o["kld_mean"]:
                raise RuntimeError(f"{tw_new['twin']} {t}: not the same twins as the entry's")
        for m, r in tw_new["methods"].items():
            tw_old["methods"][m] = {**r, "run": new["provenance"]}
        if "rank_vs_measured" in tw_new:
            tw_old["rank_vs_measured"] = tw_new["rank_vs_measured"]
    out["partial"] = new.get("partial", False)
    return out


if __name__ == "__main__":
    main()
