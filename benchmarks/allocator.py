"""The bit allocator against llama.cpp's standard types, at budgets from 3.5 to 6.5 bits per weight (issue 36).

For the twins of one CPU-trained pair (`--arch attention`: the demo's `small` twins, whose d=128 rows take only
llama.cpp's 32-blocks; `--arch medium`: a larger pair whose every row takes k-quants; `--arch hybrid`: Qwen3.5-style
hybrid twins, three of four layers Gated DeltaNet; the recipes are below, the weights are not committed), in a
fresh folder removed afterwards, each twin, without and with an importance matrix:

1. the F32 GGUF, and llama.cpp's standard types from it: Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K;
2. `quantize --target-bpw B` for B in BUDGETS (sensitivity measured on calibration windows of the valid split), and
   the gate A/B's held arm at the same budget (`--hold-gates`: gate units at the allocation's base type);
3. KLD of every file against the float twin on evaluation windows of the test split (disjoint from calibration),
   mean and p99 with the 95% window-bootstrap interval; per budget, the paired ratio allocator / the best standard
   type at <= the allocator's file size (lowest KLD among those), and held / free gates (windows resampled
   together);
4. prefill and decode tok/s of the allocated file and that standard type, timed in alternated rounds by the
   runners' bench protocol (llama.cpp, F16 KV cache, one thread), with the median per-round ratio and its range;
5. the decode floor's arm (`--floor`, on by default): `quantize --target-bpw B --decode-floor TYPE --threads 1`,
   TYPE that best standard type (the file predicted at least as fast as it, from per-type decode timings taken by
   the allocator), with its KLD and speed against the same standard file, and its predicted tok/s beside the
   measured ones.

    python benchmarks/allocator.py --arch attention [--steps 300] [--keep-run DIR]
    python benchmarks/allocator.py --arch medium   # the larger pair: d=256, every row takes k-quants
    python benchmarks/allocator.py --arch hybrid
    python benchmarks/allocator.py --arch medium --floor-only   # the floored arms again, into the entry
    python benchmarks/allocator.py --arch attention --floor-only --floor-fraction 0.97   # an arm at 0.97*TYPE

Each run replaces its arch's entry in benchmarks/results/allocator.json, then writes allocator.md and allocator.png
from every entry there. Each model's tables end with the goals table (goals_section): per budget and arm, whether
one file meets both goals of the issue's must-show (KLD <= 0.85x, decode >= 0.95x the standard type's), or what it
misses.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STANDARD = ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K")
BUDGETS = (3.5, 4.25, 4.75, 5.25, 5.75, 6.5)  # a budget a model cannot reach is recorded as such
RESULTS = Path(__file__).parent / "results"
EVAL = dict(data="embedded", ctx=128, windows=64)
CALIB = dict(windows=8, ctx=128)
SPEED = dict(prefill=128, decode=128, rounds=9, threads=1, kv="f16")
RECIPES = {"attention": ["--twins", "--preset", "small", "--batch-size", 8, "--ctx", 128],
           "medium": ["--twins", "--preset", "medium", "--batch-size", 8, "--ctx", 128],
           "hybrid": ["--twins", "--arch", "hybrid", "--preset", "small", "--batch-size", 8, "--ctx", 128]}


def cli(*args, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env={**os.environ, "QUANTGATE_PROGRESS": "0", **(env or {})})
    if r.returncode:
        raise RuntimeError(f"quantgate {' '.join(map(str, args[:3]))}: {r.stderr[-1500:]}")
    return r.stdout


def evaluate(path: Path, ref: Path, cache: Path) -> dict:
    out = json.loads(cli("eval", path, "--reference", ref, "--data", EVAL["data"], "--ctx", EVAL["ctx"],
                         "--max-windows", EVAL["windows"], "--json", env={"QUANTGATE_CACHE": str(cache)}))
    return {"kld_mean": out["kld_mean"], "kld_mean_ci95": out.get("kld_mean_ci95"), "kld_p99": out["kld_p99"],
            "kld_p99_ci95": out.get("kld_p99_ci95"),
            "per_window": out["per_window"]["kld"], "bytes": path.stat().st_size}


def paired_ratio(a: list[float], b: list[float], n: int = 4000, seed: int = 0) -> dict:
    """mean(a)/mean(b) over the same windows, with its 95% bootstrap interval (windows resampled together)."""
    a, b = np.asarray(a), np.asarray(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n, len(a)))
    r = a[idx].mean(1) / b[idx].mean(1)
    lo, hi = np.percentile(r, [2.5, 97.5])
    return {"ratio": float(a.mean() / b.mean()), "ci95": [float(lo), float(hi)]}


def speed_pair(alloc: Path, std: Path, kv: str = SPEED["kv"]) -> dict:
    """Prefill and decode tok/s of both files (or ONNX folders: `kv` "f32", the cache as exported), rounds
    alternated (the runners' bench protocol), and the per-round ratios allocator / standard: median, min and max."""
    from quantgate.runners.bench import bench
    from quantgate.runners.open import fixed_ctx, open_runner
    ids = list(np.random.default_rng(0).integers(3, 200, size=SPEED["prefill"] + SPEED["decode"]))
    n = SPEED["prefill"] + SPEED["decode"]
    a = open_runner(str(alloc), fixed_ctx(n, alloc), kv_type=kv, threads=SPEED["threads"], logits_all=False)
    s = open_runner(str(std), fixed_ctx(n, std), kv_type=kv, threads=SPEED["threads"], logits_all=False)
    with a.runner as ra, s.runner as rs:
        ba, bs = bench([ra, rs], ids[:SPEED["prefill"]], ids[SPEED["prefill"]:], rounds=SPEED["rounds"], warmup=1)
    out = {}
    for phase in ("prefill", "decode"):
        r = np.asarray(bs[f"{phase}_rounds_s"]) / np.asarray(ba[f"{phase}_rounds_s"])  # tok/s ratio, per round
        out[phase] = {"allocator_tps": ba[f"{phase}_tps"], "standard_tps": bs[f"{phase}_tps"],
                      "ratio_median": float(np.median(r)), "ratio_range": [float(r.min()), float(r.max())]}
    return out


def floor_key(fraction: float) -> str:
    """A budget row's key for its floored arm: `floored` at the standard type's own speed, `floored@0.97` at a
    fraction of it (`--floor-fraction`, a separate arm: the must-show asks decode >= 0.95x)."""
    return "floored" if fraction == 1 else f"floored@{fraction:g}"


def floored_arm(f32: Path, p: Path, budget: float, best: str, std: dict, model: Path, cache: Path,
                extra: list, fraction: float = 1.0) -> dict:
    """The allocation at the same budget with `--decode-floor best` (or FRACTION*best; one thread, as the speed pair
    runs), scored and timed against the same standard file; a floor the budget cannot meet is recorded as such."""
    t0 = time.perf_counter()
    floor = best if fraction == 1 else f"{fraction:g}*{best}"
    try:
        cli("quantize", f32, "--target-bpw", budget, *extra, "--decode-floor", floor, "--threads", SPEED["threads"],
            "--out", p, env={"QUANTGATE_CACHE": str(cache)})
    except RuntimeError as e:
        if "decode floor out of reach" not in str(e) and "decode floor not met" not in str(e):
            raise
        return {"floor": best, "fraction": fraction, "unreachable": str(e).partition("error: ")[2].strip()}
    side = Path(str(p) + ".allocation.json")
    info = json.loads(side.read_text())
    ev = evaluate(p, model, cache)
    out = {"floor": best, "fraction": fraction, "seconds": round(time.perf_counter() - t0, 1), "bits_per_weight": info["bits_per_weight"],
           "predicted_decode_tps": info["predicted_decode_tps"], "floor_tps": info["floor_tps"],
           "floor_checks": info.get("floor_checks"), "floor_recipe": info.get("floor_recipe"),
           "decode_cost_measured_tps": {k: 1 / v for k, v in info["decode_cost"]["measured_s"].items()},
           "types": info["types"], **{k: v for k, v in ev.items() if k != "per_window"},
           "vs_best_standard": paired_ratio(ev["per_window"], std["per_window"]),
           "speed_vs_best_standard": speed_pair(p, std["path"])}
    p.unlink()
    side.unlink()
    return out


def run_twin(work: Path, name: str, model: Path, cache: Path, which: tuple = ("plain", "imatrix"),
             floor: bool = True, floor_only: bool = False, fraction: float = 1.0,
             budgets: tuple = BUDGETS) -> dict:
    f32 = work / f"{name}-F32.gguf"
    cli("export", "gguf", model, "--out", f32, "--outtype", "f32")
    calib = ["--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"]]
    env = {"QUANTGATE_CACHE": str(cache)}
    variants = {}
    for im in [v == "imatrix" for v in which]:
        imx = ["--imatrix", "auto"] if im else []
        std = {}
        for t in STANDARD:
            p = work / f"{name}-{t}{'-im' if im else ''}.gguf"
            cli("quantize", f32, "--type", t, "--out", p, *imx, *(calib if im else []), env=env)
            std[t] = {"path": p, "tensor_bpw": tensor_bpw(p), **evaluate(p, model, cache)}
        rows = []
        for b in budgets:
            if floor_only:
                rows.append(floor_row(f32, work / f"{name}-auto{b}", b, std, model, cache, calib + imx, env, fraction))
                continue
            arms = {}
            for arm, extra in (("allocator", []), ("gates_held", ["--hold-gates"])):
                p = work / f"{name}-auto{b}-{arm}{'-im' if im else ''}.gguf"
                t0 = time.perf_counter()
                try:
                    cli("quantize", f32, "--target-bpw", b, *calib, *imx, *extra, "--out", p, env=env)
                except RuntimeError as e:
                    if "below the smallest file" not in str(e):
                        raise
                    arms = {"unreachable": str(e).partition("error: ")[2].strip()}
                    break
                arms[arm] = {"path": p, "seconds": round(time.perf_counter() - t0, 1), **evaluate(p, model, cache)}
            if "unreachable" in arms:
                rows.append({"budget_bpw": b, **arms})
                print(json.dumps({"twin": name, "imatrix": im, "budget": b, **arms}), flush=True)
                continue
            a = arms["allocator"]
            fits = [t for t in STANDARD if std[t]["bytes"] <= a["bytes"]]
            best = min(fits, key=lambda t: std[t]["kld_mean"]) if fits else None
            row = {"budget_bpw": b,
                   "bits_per_weight": json.loads(Path(str(a["path"]) + ".allocation.json").read_text())["bits_per_weight"],
                   **{arm: {k: v for k, v in d.items() if k not in ("path", "per_window")} for arm, d in arms.items()},
                   "held_vs_free_gates": paired_ratio(arms["gates_held"]["per_window"], a["per_window"]),
                   "types": json.loads(Path(str(a["path"]) + ".allocation.json").read_text())["types"],
                   "best_standard": best}
            if best:
                row["allocator_vs_best_standard"] = paired_ratio(a["per_window"], std[best]["per_window"])
                row["speed_vs_best_standard"] = speed_pair(a["path"], std[best]["path"])
                if floor:
                    row[floor_key(fraction)] = floored_arm(f32, work / f"{name}-auto{b}-floor.gguf", b, best,
                                                           std[best], model, cache, calib + imx, fraction)
            rows.append(row)
            for d in arms.values():
                d["path"].unlink()
                Path(str(d["path"]) + ".allocation.json").unlink(missing_ok=True)
            fl = row.get(floor_key(fraction), {})
            print(json.dumps({"twin": name, "imatrix": im, "budget": b, "best_standard": best,
                              **({"ratio": row["allocator_vs_best_standard"],
                                  "decode": row["speed_vs_best_standard"]["decode"]["ratio_median"]} if best else {}),
                              **({"floored_ratio": fl["vs_best_standard"]["ratio"],
                                  "floored_decode": fl["speed_vs_best_standard"]["decode"]["ratio_median"]}
                                 if "vs_best_standard" in fl else {}),
                              "held_vs_free": row["held_vs_free_gates"]}), flush=True)
        for d in std.values():
            d["path"].unlink()
        variants["imatrix" if im else "plain"] = {
            "standard": {t: {"bits_per_weight": d["tensor_bpw"], "file_bits_per_weight": 8 * d["bytes"] / _weights(f32),
                             **{k: v for k, v in d.items() if k not in ("path", "per_window", "tensor_bpw")}}
                         for t, d in std.items()},
            "budgets": rows}
    f32.unlink()
    return {"twin": name, **variants}


def floor_row(f32: Path, p: Path, budget: float, std: dict, model: Path, cache: Path, extra: list, env: dict,
              fraction: float = 1.0) -> dict:
    """`--floor-only`: a budget's floored arm alone. The free allocation is written only to find the best standard
    type at <= its size (the floor, as a full run picks it); it is neither scored nor timed."""
    try:
        cli("quantize", f32, "--target-bpw", budget, *extra, "--out", p, env=env)
    except RuntimeError as e:
        if "below the smallest file" not in str(e):
            raise
        return {"budget_bpw": budget, "unreachable": str(e).partition("error: ")[2].strip()}
    size = p.stat().st_size
    p.unlink()
    Path(str(p) + ".allocation.json").unlink(missing_ok=True)
    fits = [t for t in STANDARD if std[t]["bytes"] <= size]
    best = min(fits, key=lambda t: std[t]["kld_mean"]) if fits else None
    row = {"budget_bpw": budget, "best_standard": best, "free_bytes": size}
    key = floor_key(fraction)
    if best:
        row[key] = floored_arm(f32, p.with_name(p.name + "-floor.gguf"), budget, best, std[best], model, cache,
                               extra, fraction)
    print(json.dumps({"floor_only": True, "budget": budget, "best_standard": best, "fraction": fraction,
                      **({k: row[key].get(k) for k in ("vs_best_standard", "unreachable")} if best else {}),
                      **({"decode": row[key]["speed_vs_best_standard"]["decode"]["ratio_median"]}
                         if best and "speed_vs_best_standard" in row[key] else {})}), flush=True)
    return row


def merge_floors(old: dict, new: dict, variants: tuple, key: str = "floored") -> dict:
    """`--floor-only`: this run's floored arms put into the arch's earlier rows, once the run shows it trained the
    same twins (each standard file the same size and KLD: training, llama.cpp's quantizer and the importance matrix
    are deterministic); each variant names the run that measured its floors. A floor type other than the row's best
    standard (this run's free allocation, by newer code, ended on the other side of a standard file's size) is
    kept and said."""
    for tw_old, tw_new in zip(old["twins"], new["twins"]):
        for v in variants:
            for t, cell in tw_old[v]["standard"].items():
                now = tw_new[v]["standard"][t]
                if now["bytes"] != cell["bytes"] or abs(now["kld_mean"] - cell["kld_mean"]) > 1e-6 * cell["kld_mean"]:
                    raise RuntimeError(f"{tw_old['twin']} {v} {t}: {now['bytes']} bytes, KLD {now['kld_mean']} now; "
                                       f"{cell['bytes']}, {cell['kld_mean']} in the entry: not the same twins")
            rows = {r["budget_bpw"]: r for r in tw_new[v]["budgets"]}
            for r in tw_old[v]["budgets"]:
                n = rows.get(r["budget_bpw"])
                if "unreachable" in r or not r.get("best_standard") or not n or key not in n:
                    continue
                r[key] = n[key]  # its own floor type: the best standard at <= this run's free file
                if n["best_standard"] != r["best_standard"]:  # the free allocation's size moved across a type's
                    r[key]["free_arm_best_standard_then"] = r["best_standard"]
    runs = old.get("floor_runs", {})
    for v in variants:
        add_floor_run(runs, v if key == "floored" else f"{v} {key}",
                      {k: new[k] for k in ("command", "commit", "seconds", "machine")})
    return {**old, "floor_runs": runs}


def tensor_bpw(path: Path) -> float:
    """Bits per weight as llama.cpp counts them (tensor bytes over weights; the allocator's budget is in these):
    the file's header (metadata, tokenizer) is not in it."""
    from quantgate.formats import inspect_gguf
    return inspect_gguf(path).bits_per_weight


def restate_standard_bpw(result: dict, arch: str, run: Path) -> None:
    """For an entry written before the standard types' bits per weight were counted as llama.cpp counts them
    (file bytes were), quantize the same twins to the same types again (llama.cpp's quantizer and the importance
    matrix are deterministic) and record their tensor bits per weight; nothing else changes."""
    calib = ["--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"]]
    with tempfile.TemporaryDirectory(prefix="quantgate-allocator-") as tmp:
        work = Path(tmp)
        for tw in result["archs"][arch]["twins"]:
            f32 = work / f"{tw['twin']}-F32.gguf"
            cli("export", "gguf", run / tw["twin"], "--out", f32, "--outtype", "f32")
            for var in [v for v in ("plain", "imatrix") if v in tw]:
                for t, cell in tw[var]["standard"].items():
                    p = work / f"{t}.gguf"
                    cli("quantize", f32, "--type", t, "--out", p,
                        *(["--imatrix", "auto", *calib] if var == "imatrix" else []), env={"QUANTGATE_CACHE": tmp})
                    if p.stat().st_size != cell["bytes"]:
                        raise RuntimeError(f"{tw['twin']} {t} {var}: {p.stat().st_size} bytes now, "
                                           f"{cell['bytes']} then: not the same file")
                    cell.setdefault("file_bits_per_weight", cell["bits_per_weight"])
                    cell["bits_per_weight_from"] = "--restate-standard-bpw (the same file quantized again)"
                    cell["bits_per_weight"] = tensor_bpw(p)
                    p.unlink()
            f32.unlink()


def _weights(f32: Path) -> int:
    from quantgate.formats.gguf import open_reader
    return sum(int(np.prod([int(d) for d in t.shape])) for t in open_reader(f32).tensors)


def run_words(entry: dict) -> str:
    """What ran and what the KLD is measured on, the opening of every entry's table (this one's and
    allocator_onnx's)."""
    runs = entry.get("variant_runs")
    ran = (f"`{entry['command']}` at {entry['commit']} ({entry['seconds'] / 60:.0f} min)" if not runs else
           "; ".join(f"{v} rows: `{r['command']}` at {r['commit']} ({r['seconds'] / 60:.0f} min)" for v, r in runs.items())
           + " (separate runs, each training the twins anew by the same recipe)")
    return (f"{ran}; twins: `{entry['train']}`; KLD against the float twin on {EVAL['windows']} windows of "
            f"{EVAL['ctx']} tokens of the embedded corpus's test split")


def merge_variants(old: dict, new: dict, variants: tuple) -> dict:
    """`--merge`: the arch's earlier entry with this run's variants put in (a variant measured again replaced), each
    variant naming the run that measured it (`variant_runs`: command, commit, minutes)."""
    runs = old.get("variant_runs") or {v: {k: old[k] for k in ("command", "commit", "seconds")}
                                        for v in ("plain", "imatrix") if v in old["twins"][0]}
    for v in variants:  # the machine's load too: the entry's own `machine` is the first run's
        runs[v] = {k: new[k] for k in ("command", "commit", "seconds", "machine")}
    for tw_old, tw_new in zip(old["twins"], new["twins"]):
        for v in variants:
            tw_old[v] = tw_new[v]
    return {**old, "variant_runs": runs}


def run_budgets(run: dict) -> set[float] | None:
    """The budgets a floor run measured: those its `--budgets` named, or None (every budget)."""
    m = re.search(r"--budgets (\S+)", run["command"])
    return {float(b) for b in m.group(1).split(",")} if m else None


def add_floor_run(runs: dict, name: str, run: dict) -> None:
    """Name `run` as a measurer of arm `name`'s rows (floor_runs). A run over some budgets (`--budgets`) joins the
    runs that measured the others; a run over every budget, or over all of an earlier run's, replaces that run."""
    new = run_budgets(run)
    before = runs.get(name, [])
    before = before if isinstance(before, list) else [before]
    kept = [r for r in before if new is not None and (run_budgets(r) is None or not run_budgets(r) <= new)]
    runs[name] = kept + [run] if kept else run


def floor_run_words(entry: dict, key: str = "floored") -> str:
    """Which runs measured the floor rows of `key`, where `--floor-only` put them in after the rest; a run over some
    budgets names them."""
    groups: dict = {}  # variants measured by one run are named together
    for v, rs in entry.get("floor_runs", {}).items():
        if (v.partition(" ")[2] or "floored") != key:  # "plain" or "plain floored@0.97"
            continue
        for r in rs if isinstance(rs, list) else [rs]:
            groups.setdefault((r["command"], r["commit"], r["seconds"]), []).append(v.partition(" ")[0])
    if not groups:
        return ""
    several = len(groups) > 1

    def which(c: str) -> str:
        b = run_budgets({"command": c})
        return (f", budgets {', '.join(f'{x:g}' for x in sorted(b))}" if b else
                ", the other budgets" if several else "")
    return (" Floor rows of " + "; ".join(f"{' and '.join(vs)}: `{c}` at {h} ({sec / 60:.0f} min{which(c)})"
                                          for (c, h, sec), vs in groups.items())
            + " (the twins trained again by the same recipe; every standard file's size and KLD equal the entry's).")


def checked_cell(f: dict) -> str:
    """The floor check's cell: the last timed file's tok/s / the floor's (files timed; met or not by the sign test),
    or the floor type's own recipe where that was written (not timed: it is the floor's file)."""
    checks = f.get("floor_checks") or []
    if f.get("floor_recipe"):
        return f"{f['floor_recipe']}'s recipe" + (f" after {len(checks)} short" if checks else "")
    if not checks:
        return "none"
    met = "" if "met" not in checks[-1] else (", met" if checks[-1]["met"] else ", short")
    return f"{checks[-1]['written_tps']:.0f} / {checks[-1]['floor_tps']:.0f} ({len(checks)}{met})"


def protocol_words(runtime: str, kv: str) -> str:
    return (f"Ratios: mean KLD, paired window bootstrap, 95% interval. Speed: {runtime}, {SPEED['threads']} thread, "
            f"{kv}, prefill {SPEED['prefill']} then decode {SPEED['decode']}, median per-round ratio of "
            f"{SPEED['rounds']} alternated rounds [min, max].")


def compare_cells(r: dict) -> str:
    """A budget row's cells against the best standard type (or uniform recipe) no larger: its name, the KLD ratio
    with its interval, decode and prefill ratios with their per-round ranges."""
    if not r["best_standard"]:
        return "none this small | - | - | -"
    c, sp = r["allocator_vs_best_standard"], r["speed_vs_best_standard"]
    return (f"{r['best_standard']} | {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] | "
            f"{sp['decode']['ratio_median']:.3f} [{sp['decode']['ratio_range'][0]:.2f}, "
            f"{sp['decode']['ratio_range'][1]:.2f}] | {sp['prefill']['ratio_median']:.3f} "
            f"[{sp['prefill']['ratio_range'][0]:.2f}, {sp['prefill']['ratio_range'][1]:.2f}]")


def floor_keys(entry: dict) -> list[str]:
    """The floored arms an entry holds: `floored` first, then each fraction's (floor_key)."""
    keys = {k for tw in entry["twins"] for var in ("plain", "imatrix") if var in tw for r in tw[var]["budgets"]
            for k in r if k.startswith("floored")}
    return sorted(keys, key=lambda k: (k != "floored", k))


def fraction_words(key: str, name: str) -> tuple[str, str]:
    """A floored arm's floor (floor_key) as `--decode-floor` spells it before NAME (`0.97*`) and in words
    (`0.97x NAME`)."""
    frac = key.partition("@")[2]
    return (f"{frac}*", f"{frac}x {name}") if frac else ("", name)


def floor_section(entry: dict, key: str) -> list[str]:
    """The table of one floored arm (floor_key) with the words that say how it was measured."""
    floored = [(tw, var, r) for tw in entry["twins"] for var in ("plain", "imatrix") if var in tw
               for r in tw[var]["budgets"] if key in r]
    frac, speed = fraction_words(key, "TYPE")
    lines = ["", f"With a decode floor (`--decode-floor {frac}TYPE --threads 1`, TYPE the best standard type at <= "
             "the free allocation's size): the allocation predicted at least as fast as "
             f"{speed} from per-type "
             "decode timings, against the same standard file. Predicted tok/s is the allocator's model; "
             "the measured ratio is the speed pair's (median per-round ratio [min, max]). Checked: the "
             "written file's tok/s against the floor's, timed by quantize in alternated rounds (files "
             "written; met unless measurably slower by a sign test over the rounds, from 09758ec on; none: a "
             "run before the check, prediction only; TYPE's recipe: the floor type's own tensor types, written "
             "where predicted to lose less than any allocation as fast, or where none was)."
             + floor_run_words(entry, key), "",
             "| twin | imatrix | budget | floor | bpw | KLD [95%] | alloc/standard KLD | decode alloc/std | "
             "prefill alloc/std | predicted / floor tok/s | checked tok/s (files) | free arm's KLD ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for tw, var, r in floored:
        f = r[key]
        then = f" (free arm's: {f['free_arm_best_standard_then']})" if "free_arm_best_standard_then" in f else ""
        head = f"| {tw['twin']} | {'yes' if var == 'imatrix' else 'no'} | {r['budget_bpw']} | {frac}{f['floor']}{then} |"
        if "unreachable" in f:
            lines.append(f"{head} unreachable: {f['unreachable']} |" + " |" * 7)
            continue
        c, sp, ci = f["vs_best_standard"], f["speed_vs_best_standard"], f["kld_mean_ci95"]
        free = r["allocator_vs_best_standard"]
        lines.append(f"{head} {f['bits_per_weight']:.3f} | {f['kld_mean']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}] | "
                     f"{c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] | "
                     f"{sp['decode']['ratio_median']:.3f} [{sp['decode']['ratio_range'][0]:.2f}, "
                     f"{sp['decode']['ratio_range'][1]:.2f}] | {sp['prefill']['ratio_median']:.3f} | "
                     f"{f['predicted_decode_tps']:.0f} / {f['floor_tps']:.0f} | {checked_cell(f)} | "
                     f"{free['ratio']:.3f} |")
    return lines


KLD_GOAL, DECODE_GOAL = 0.85, 0.95  # issue 36's must-show: KLD <= 0.85x the type's (interval below 1), decode >= 0.95x


def goal_verdict(kld: dict, decode: dict) -> str:
    """`yes` where one file meets both goals of the must-show against its standard type (mean KLD ratio <= KLD_GOAL
    with the 95% interval below 1; median per-round decode ratio >= DECODE_GOAL), else what it misses."""
    miss = []
    if kld["ratio"] > KLD_GOAL or kld["ci95"][1] >= 1:
        miss.append(f"KLD {kld['ratio']:.3f}")
    if decode["ratio_median"] < DECODE_GOAL:
        miss.append(f"decode {decode['ratio_median']:.3f}")
    return "yes" if not miss else "no: " + ", ".join(miss)


def arm_verdict(r: dict, key: str | None) -> str | None:
    """A budget row's verdict for its free arm (`key` None) or a floored arm (floor_key); None: not measured."""
    if key is None:
        return goal_verdict(r["allocator_vs_best_standard"], r["speed_vs_best_standard"]["decode"])
    f = r.get(key)
    if f is None:
        return None
    if "unreachable" in f:
        return "no: floor unreachable"
    if f.get("floor_recipe"):
        return f"no: {f['floor_recipe']}'s recipe"
    return goal_verdict(f["vs_best_standard"], f["speed_vs_best_standard"]["decode"])


def goals_section(rows: list[tuple[list, dict]], heads: list[str], keys: list[str], standard: str,
                  goals: str = "The must-show's two goals") -> list[str]:
    """The must-show's two goals per budget row and arm, and how many rows have a file that meets both. `rows`: the
    leading cells (`heads`) and the row, for rows with a standard type no larger; `keys`: the floored arms; `goals`:
    the words that open the section."""
    arms = [None, *keys]
    names = ["free"] + [f"floor {k.partition('@')[2] or '1'}x" for k in keys]
    lines = ["", f"{goals} in one file: mean KLD <= {KLD_GOAL}x the best {standard}'s at <= its size "
             f"with the 95% interval below 1, and decode >= {DECODE_GOAL}x that {standard}'s (median per-round ratio "
             "of the speed pair), per arm (free: no floor; - : that arm not measured at that budget).", "",
             "| " + " | ".join(heads) + f" | {standard} | " + " | ".join(names) + " | any arm |",
             "|---" * (len(heads) + len(names) + 2) + "|"]
    met = {n: [0, 0] for n in names}
    anywhere = 0
    for lead, r in rows:
        cells = [arm_verdict(r, k) for k in arms]
        for n, c in zip(names, cells):
            met[n][0] += c == "yes"
            met[n][1] += c is not None
        anywhere += "yes" in cells
        lines.append("| " + " | ".join(map(str, lead)) + f" | {r['best_standard']} | "
                     + " | ".join(c or "-" for c in cells) + f" | {'yes' if 'yes' in cells else 'no'} |")
    lines += ["", f"Rows with a file meeting both: {anywhere} of {len(rows)} ("
              + ", ".join(f"{n} {a} of {b}" for n, (a, b) in met.items()) + ")."]
    return lines


def write_tables(result: dict) -> None:
    lines = ["# Allocator vs llama.cpp's standard types, 3.5 to 6.5 bits per weight", ""]
    for arch, entry in result["archs"].items():
        lines += [f"## {arch} twins", "",
                  f"{run_words(entry)}; sensitivity and importance matrix on "
                  f"{CALIB['windows']} calibration windows of {CALIB['ctx']} tokens (valid split). "
                  f"{protocol_words('llama.cpp', 'F16 KV')}", "",
                  "| twin | imatrix | budget | bpw | KLD allocator [95%] | KLD p99 [95%] | best standard <= size | alloc/standard "
                  "KLD | decode alloc/std | prefill alloc/std | gates held/free |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for tw in entry["twins"]:
            for var in [v for v in ("plain", "imatrix") if v in tw]:
                for r in tw[var]["budgets"]:
                    if "unreachable" in r:
                        lines.append(f"| {tw['twin']} | {'yes' if var == 'imatrix' else 'no'} | {r['budget_bpw']} | "
                                     f"unreachable: {r['unreachable']} |" + " |" * 7)
                        continue
                    a, h = r["allocator"], r["held_vs_free_gates"]
                    ci = a["kld_mean_ci95"] or [float("nan")] * 2
                    p99 = a["kld_p99_ci95"] or [float("nan")] * 2
                    cmp = compare_cells(r)
                    lines.append(f"| {tw['twin']} | {'yes' if var == 'imatrix' else 'no'} | {r['budget_bpw']} | "
                                 f"{r['bits_per_weight']:.3f} | {a['kld_mean']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}] | "
                                 f"{a['kld_p99']:.4g} [{p99[0]:.4g}, {p99[1]:.4g}] | "
                                 f"{cmp} | {h['ratio']:.3f} [{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}] |")
        for key in floor_keys(entry):
            lines += floor_section(entry, key)
        lines += goals_section([([tw["twin"], "yes" if var == "imatrix" else "no", r["budget_bpw"]], r)
                                for tw in entry["twins"] for var in ("plain", "imatrix") if var in tw
                                for r in tw[var]["budgets"] if r.get("best_standard")],
                               ["twin", "imatrix", "budget"], floor_keys(entry), "standard type")
        lines += ["", "llama.cpp's standard types on the same twins (bits per weight as llama.cpp counts them: tensor "
                  "bytes; the file adds its header; then mean KLD):", "",
                  "| twin | imatrix | " + " | ".join(STANDARD) + " |", "|---|---|" + "---|" * len(STANDARD)]
        for tw in entry["twins"]:
            for var in [v for v in ("plain", "imatrix") if v in tw]:
                cells = [f"{tw[var]['standard'][t]['bits_per_weight']:.2f}: {tw[var]['standard'][t]['kld_mean']:.4g}"
                         for t in STANDARD]
                lines.append(f"| {tw['twin']} | {'yes' if var == 'imatrix' else 'no'} | " + " | ".join(cells) + " |")
        lines.append("")
    (RESULTS / "allocator.md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot(result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(arch, tw) for arch, e in result["archs"].items() for tw in e["twins"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (arch, tw) in zip(axes[0], panels):
        for var, color in (("plain", "tab:blue"), ("imatrix", "tab:orange")):
            if var not in tw:
                continue
            st = tw[var]["standard"]
            x = [st[t]["bits_per_weight"] for t in STANDARD]
            ax.errorbar(x, [st[t]["kld_mean"] for t in STANDARD], yerr=_err(st[t] for t in STANDARD), fmt="s",
                        color=color, mfc="none", label=f"llama.cpp types{' + imatrix' if var == 'imatrix' else ''}")
            for t, xi in zip(STANDARD, x):
                if var == "plain":
                    ax.annotate(t, (xi, st[t]["kld_mean"]), fontsize=6, xytext=(2, 4), textcoords="offset points")
            rows = [r for r in tw[var]["budgets"] if "unreachable" not in r]
            for arm, fmt in (("allocator", "-o"), ("gates_held", ":^")):
                ax.errorbar([r["bits_per_weight"] for r in rows], [r[arm]["kld_mean"] for r in rows],
                            yerr=_err(r[arm] for r in rows), fmt=fmt, color=color, ms=4,
                            label=f"allocator{' gates held' if arm == 'gates_held' else ''}"
                                  f"{' + imatrix' if var == 'imatrix' else ''}")
            fl = [r["floored"] for r in rows if "floored" in r and "unreachable" not in r["floored"]]
            if fl:
                ax.errorbar([f["bits_per_weight"] for f in fl], [f["kld_mean"] for f in fl], yerr=_err(fl), fmt="x",
                            color=color, ms=6, label="allocator, decode >= the standard type's"
                                                     f"{' + imatrix' if var == 'imatrix' else ''}")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight")
        ax.set_title(f"{arch}: {tw['twin']}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean KLD vs float (64 test windows)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "allocator.png", dpi=120)


def _err(cells) -> np.ndarray:
    lo, hi = [], []
    for c in cells:
        ci = c["kld_mean_ci95"] or [c["kld_mean"]] * 2
        lo.append(c["kld_mean"] - ci[0])
        hi.append(ci[1] - c["kld_mean"])
    return np.array([lo, hi])


def train_and_run(arch: str, steps: int, keep_run: str | None, name: str, run_twin) -> dict:
    """The twins of RECIPES[arch] trained (or `keep_run`'s, trained there once and reused with their cache), then
    `run_twin(work, twin, model dir, cache)` for each in a fresh temporary folder removed afterwards: the fields every
    benchmark entry of this family shares (commit at the start, recipe, eval and calibration text, machine, seconds,
    twins). `name`: the temporary folder's prefix (quantgate-NAME-)."""
    recipe = [*RECIPES[arch], "--steps", steps]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # at the start: the code that runs
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"quantgate-{name}-") as tmp:
        work = Path(tmp)
        run = Path(keep_run) if keep_run else work / "run"
        if not (run / "gated").is_dir():  # --keep-run: trained once, reused by a rerun
            cli("train", *recipe, "--out", run)
        cache = run.parent / f"{run.name}-cache" if keep_run else work / "cache"  # a rerun reuses it
        twins = [run_twin(work, twin, run / twin, cache) for twin in ("baseline", "gated")]
    return {"commit": commit, "train": "quantgate train " + " ".join(map(str, recipe)),
            "eval": {**EVAL, "split": "test", "reference": "the float twin (PyTorch, fp32)"},
            "calibration": {**CALIB, "data": "embedded", "split": "valid"},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_end": os.getloadavg()},
            "seconds": round(time.perf_counter() - t0, 1), "twins": twins}


def parse_budgets(ap: argparse.ArgumentParser, text: str | None, floor_only: bool, allowed: tuple) -> tuple:
    """`--budgets`: a subset of the script's budgets, for a `--floor-only` run (a full entry has every budget)."""
    if text is None:
        return allowed
    if not floor_only:
        ap.error("--budgets goes with --floor-only (a full run measures every budget)")
    try:
        chosen = tuple(float(b) for b in text.split(","))
    except ValueError:
        ap.error(f"--budgets {text}: not numbers")
    if not chosen or any(b not in allowed for b in chosen):
        ap.error(f"--budgets {text}: each one of {', '.join(map(str, allowed))}")
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(RECIPES), default="attention")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-run", default=None, help="train the twins into this folder once and reuse them")
    ap.add_argument("--variants", default="plain,imatrix", help="plain, imatrix or both (comma-separated)")
    ap.add_argument("--no-floor", action="store_true", help="skip the decode floor's arm")
    ap.add_argument("--floor-only", action="store_true",
                    help="measure only the decode floor's arms (with the standard types they are compared with) and "
                         "put them into --arch's entry, which must hold --variants already; the twins are checked to "
                         "be the same ones (each standard file's size and KLD)")
    ap.add_argument("--floor-fraction", type=float, default=1.0,
                    help="the floored arm's floor as this fraction of the standard type's speed (`--decode-floor "
                         "F*TYPE`); other than 1, a separate arm of its own rows (with --floor-only: put beside the "
                         "entry's rows)")
    ap.add_argument("--budgets", default=None, help="with --floor-only: these budgets alone (comma-separated, of "
                    f"{', '.join(map(str, BUDGETS))}); the entry's other rows stay as they are")
    ap.add_argument("--tables-only", action="store_true", help="rewrite allocator.md and .png from the JSON")
    ap.add_argument("--merge", action="store_true", help="keep --arch's entry and add this run's --variants to it (e.g. "
                    "the imatrix rows of a pair measured plain before); each variant names the run that measured it")
    ap.add_argument("--restate-standard-bpw", action="store_true",
                    help="with --keep-run: count the standard types' bits per weight as llama.cpp does (see "
                         "restate_standard_bpw) in --arch's entry, then rewrite the tables")
    args = ap.parse_args()
    budgets = parse_budgets(ap, args.budgets, args.floor_only, BUDGETS)
    path = RESULTS / "allocator.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    if "archs" not in result:
        result = {"archs": {}}  # an earlier layout (one arch, standard sizes only) is replaced
    if args.restate_standard_bpw:
        restate_standard_bpw(result, args.arch, Path(args.keep_run))
        path.write_text(json.dumps(result, indent=1) + "\n")
    elif not args.tables_only:
        variants = tuple(args.variants.split(","))
        entry = {
            "command": f"python benchmarks/allocator.py --arch {args.arch} --steps {args.steps} --variants "
                       f"{args.variants}{' --no-floor' if args.no_floor else ''}{' --merge' if args.merge else ''}"
                       f"{' --floor-only' if args.floor_only else ''}"
                       f"{f' --floor-fraction {args.floor_fraction:g}' if args.floor_fraction != 1 else ''}"
                       f"{f' --budgets {args.budgets}' if args.budgets else ''}",
            "speed": SPEED,
            **train_and_run(args.arch, args.steps, args.keep_run, "allocator",
                            lambda work, name, model, cache: run_twin(work, name, model, cache, variants,
                                                                      not args.no_floor, args.floor_only,
                                                                      args.floor_fraction, budgets))}
        old = result["archs"].get(args.arch)
        if args.floor_only:
            result["archs"][args.arch] = merge_floors(old, entry, variants, floor_key(args.floor_fraction))
        else:
            result["archs"][args.arch] = merge_variants(old, entry, variants) if args.merge and old else entry
        path.write_text(json.dumps(result, indent=1) + "\n")
    write_tables(result)
    plot(result)


if __name__ == "__main__":
    main()
