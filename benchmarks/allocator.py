"""The bit allocator against llama.cpp's standard types at the same file size, on trained twins (issue 36).

For each twin of a CPU-trained `small` pair (the recipe below; weights are not committed), in a fresh folder
removed afterwards:

1. the F32 GGUF, and llama.cpp's standard types from it (no importance matrix): Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M,
   Q6_K;
2. for each standard file, `quantize --target-size` at that file's exact size (the allocator, measured sensitivity
   on calibration windows of the calibration split), and the gate A/B's held arm at the same size (gate units at
   the allocation's base type);
3. KLD of every file against the float model on evaluation windows of the test split (disjoint from calibration),
   with the 95% window-bootstrap interval of the mean, and the paired ratio allocator/standard with its interval
   (windows resampled together), and the same for held/free gates.

    python benchmarks/allocator.py [--steps 300] [--work DIR]

Writes benchmarks/results/allocator.json and allocator.md. Not measured here (left, see the issue note): decode
speed, the importance-matrix variants, hybrid twins, a larger pair, a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STANDARD = ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K")
RESULTS = Path(__file__).parent / "results"
EVAL = dict(data="embedded", ctx=128, windows=64)
CALIB = dict(windows=8, ctx=128)


def cli(*args: str, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env={**os.environ, "QUANTGATE_PROGRESS": "0", **(env or {})})
    if r.returncode:
        raise RuntimeError(f"quantgate {' '.join(map(str, args[:3]))}: {r.stderr[-1500:]}")
    return r.stdout


def evaluate(path: Path, ref: Path, cache: Path) -> dict:
    out = json.loads(cli("eval", path, "--reference", ref, "--data", EVAL["data"], "--ctx", EVAL["ctx"],
                         "--max-windows", EVAL["windows"], "--json", env={"QUANTGATE_CACHE": str(cache)}))
    return {"kld_mean": out["kld_mean"], "kld_mean_ci95": out.get("kld_mean_ci95"), "kld_p99": out["kld_p99"],
            "per_window": out["per_window"]["kld"]}


def paired_ratio(a: list[float], b: list[float], n: int = 4000, seed: int = 0) -> dict:
    """mean(a)/mean(b) over the same windows, with its 95% bootstrap interval (windows resampled together)."""
    a, b = np.asarray(a), np.asarray(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n, len(a)))
    r = a[idx].mean(1) / b[idx].mean(1)
    lo, hi = np.percentile(r, [2.5, 97.5])
    return {"ratio": float(a.mean() / b.mean()), "ci95": [float(lo), float(hi)]}


def run_twin(work: Path, name: str, model: Path, cache: Path) -> dict:
    f32 = work / f"{name}-F32.gguf"
    cli("export", "gguf", model, "--out", f32, "--outtype", "f32")
    rows = []
    for t in STANDARD:
        std = work / f"{name}-{t}.gguf"
        cli("quantize", f32, "--type", t, "--out", std)
        size = std.stat().st_size
        arms = {"standard": std}
        for arm, extra in (("allocator", []), ("gates_held", ["--hold-gates"])):
            p = work / f"{name}-auto-{t}-{arm}.gguf"
            t0 = time.perf_counter()
            cli("quantize", f32, "--target-size", size, "--calib-windows", CALIB["windows"], "--ctx", CALIB["ctx"],
                "--out", p, *extra, env={"QUANTGATE_CACHE": str(cache)})
            arms[arm] = p
            if arm == "allocator":
                alloc_s = time.perf_counter() - t0
        ev = {arm: evaluate(p, model, cache) for arm, p in arms.items()}
        row = {"type": t, "standard_bytes": size,
               **{f"{arm}_bytes": p.stat().st_size for arm, p in arms.items()},
               **{arm: {k: v for k, v in e.items() if k != "per_window"} for arm, e in ev.items()},
               "allocator_vs_standard": paired_ratio(ev["allocator"]["per_window"], ev["standard"]["per_window"]),
               "held_vs_free_gates": paired_ratio(ev["gates_held"]["per_window"], ev["allocator"]["per_window"]),
               "allocation_seconds_incl_cached_sensitivity": round(alloc_s, 1),
               "allocator_types": json.loads((work / f"{name}-auto-{t}-allocator.gguf.allocation.json")
                                             .read_text())["types"]}
        rows.append(row)
        for p in arms.values():
            if p != std:
                p.unlink()
                p.with_name(p.name + ".allocation.json").unlink(missing_ok=True)
        std.unlink()
        print(json.dumps({k: row[k] for k in ("type", "standard_bytes", "allocator_vs_standard",
                                              "held_vs_free_gates")}), flush=True)
    f32.unlink()
    return {"twin": name, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    recipe = ["--twins", "--preset", "small", "--steps", args.steps, "--batch-size", 8, "--ctx", 128]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quantgate-allocator-", dir=args.work) as tmp:
        work = Path(tmp)
        cli("train", *recipe, "--out", work / "run")
        twins = [run_twin(work, name, work / "run" / name, work / "cache") for name in ("baseline", "gated")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"command": f"python benchmarks/allocator.py --steps {args.steps}", "commit": commit,
              "train": "quantgate train " + " ".join(map(str, recipe)),
              "eval": {**EVAL, "split": "test", "reference": "the float twin (PyTorch, fp32)"},
              "calibration": {**CALIB, "data": "embedded", "split": "valid"},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "seconds": round(time.perf_counter() - t0, 1), "twins": twins}
    (RESULTS / "allocator.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Allocator vs llama.cpp's standard types at the same file size", "",
             f"`{result['command']}` at {commit}; twins: `{result['train']}`; KLD against the float twin on "
             f"{EVAL['windows']} windows of {EVAL['ctx']} tokens of the embedded corpus's test split; sensitivity "
             f"on {CALIB['windows']} calibration windows (valid split). Ratios: mean KLD, paired window bootstrap, "
             f"95% interval.", "",
             "| twin | type | bytes (standard / allocator) | KLD standard | KLD allocator | allocator/standard | "
             "gates held/free |", "|---|---|---|---|---|---|---|"]
    for tw in twins:
        for r in tw["rows"]:
            a, h = r["allocator_vs_standard"], r["held_vs_free_gates"]
            lines.append(f"| {tw['twin']} | {r['type']} | {r['standard_bytes']:,} / {r['allocator_bytes']:,} | "
                         f"{r['standard']['kld_mean']:.4g} | {r['allocator']['kld_mean']:.4g} | {a['ratio']:.3f} "
                         f"[{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] | {h['ratio']:.3f} [{h['ci95'][0]:.3f}, "
                         f"{h['ci95'][1]:.3f}] |")
    (RESULTS / "allocator.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
