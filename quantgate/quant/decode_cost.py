"""What each llama.cpp type costs in decode time, measured here, for the allocator's decode floor (issue 36).

On a CPU, a type's decode cost is not its bytes: measured here, IQ4_XS, Q3_K and Q5_K files decode slower than
Q8_0 ones while Q2_K and Q4_K decode faster, so a file that spends fewer bits on most tensors can decode slower
than a bigger one (allocated files without a floor: 0.71-0.94x the tok/s of llama.cpp's standard type at the same
size, benchmarks/results/allocator.md). The
allocator therefore needs a speed model, and only a measured one is worth anything:

1. one file per candidate type, every unit that takes the type at it and the others at the base type, plus the
   base file (every unit at the base type), each written by llama.cpp's quantizer;
2. decode seconds per token of every file, timed by the runners' bench protocol (alternated rounds, medians) with
   the threads and KV cache the user will run;
3. per unit element, the extra seconds a type costs over the base type: (t_type - t_base) / elements at the type.
   The predicted decode time of an assignment is t_base plus its units' extra seconds (linear in the elements;
   exact for the files it was measured on, only roughly right for a mixture);
4. the written file is timed against the floor (floor_check), in alternated rounds; it meets the floor where its
   median per-round ratio is at least CHECK_MEDIAN and it is not measurably slower (a sign test over the rounds: at
   most sign_k(rounds) of them as fast as the floor); a check that is neither (a median under CHECK_MEDIAN the
   signs do not back) is timed again, up to CHECK_EXTENSIONS more sets of rounds. Where it falls
   short, the allocation asks its model for the median per-round shortfall and writes again
   (quant.allocate.FLOOR_TRIES files at most). A small model decodes a token in a third of a millisecond, and its
   speed there moves by 30% between two timings on a shared machine: a check on medians alone replanned a file measured 29% short
   beside a floor file that itself measured 2863 tok/s and then 1987, and the allocation planned for that
   shortfall carried 7.6x the KLD (benchmarks/results/logs/allocator_attention_imatrix_floors_e66a62f.json);
5. a floor named by a llama.cpp type at most 1x is met by that type's own recipe (its per-tensor types, read from
   the reference file here), so an allocation is never written where that recipe is predicted to lose less: the
   recipe is written instead (quant.allocate.floor_plan).

A decode floor is given in tok/s (`40`), or as llama.cpp's own type (`Q4_K_M`: as fast as that file, measured in
the same rounds), or a fraction of it (`0.95xQ4_K_M`); quant.targets parses it.

Written by hand: no library models llama.cpp's per-type decode cost.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QuantgateError
from ..formats.kind import GGUF_SUFFIX
from ..fsio import write_json
from ..identity import code_id, content_id, key
from ..progress import stage
from ..reference import cache_dir
from ..runners.bench import bench
from ..runners.open import fixed_ctx, open_runner
from .llama_cpp import exact_overrides as overrides, run_quantizer
from .targets import DecodeFloor

# the benchmarks' speed pair's protocol (benchmarks/allocator.py): a check timed otherwise (16 + 256 tokens) passed
# five files that the speed pair then timed at 0.916-0.948x their floor (benchmarks/results/allocator.md)
SPEED = dict(prefill=128, decode=128, rounds=9, kv="f16")
# a written file meets its floor only with its median per-round ratio at least this: 2% of room for the noise between
# the check and a later timing, inside the 5% the goal allows (decode >= 0.95x the standard type)
CHECK_MEDIAN = 0.98
# The sign test's bound: with 9 rounds a file no slower than the floor has every round at least as fast as it with
# probability 1/2 each, so one round or none in 9 happens by chance 2% of the time (10/512); more rounds, more kept.
SIGN_ALPHA = 0.05
CHECK_EXTENSIONS = 2  # more sets of SPEED["rounds"] rounds an inconclusive check is timed for (check_against)


def sign_k(n: int, alpha: float = SIGN_ALPHA) -> int:
    """The most rounds as fast as the floor that still make a file measurably slower: the largest k with
    P(Binomial(n, 1/2) <= k) <= alpha (-1: none, too few rounds to tell)."""
    from math import comb
    total, k = 0, -1
    for i in range(n + 1):
        total += comb(n, i)
        if total / 2 ** n > alpha:
            return k
        k = i
    return k


@dataclass
class FloorCheck:
    """A written file against its floor: medians of each (tok/s), the per-round ratios file/floor, and whether the
    floor is met: its median per-round ratio at least CHECK_MEDIAN and the file not measurably slower (more than
    sign_k(rounds) rounds at least as fast)."""
    written_tps: float
    floor_tps: float
    ratios: list[float]

    @property
    def ratio(self) -> float:
        return float(np.median(self.ratios))

    @property
    def slower(self) -> bool:
        """Measurably slower than the floor: at most sign_k(rounds) rounds as fast as it."""
        return sum(r >= 1.0 for r in self.ratios) <= sign_k(len(self.ratios))

    @property
    def met(self) -> bool:
        return self.ratio >= CHECK_MEDIAN and not self.slower

    @property
    def inconclusive(self) -> bool:
        """Neither met nor measurably slower: a median under CHECK_MEDIAN that the rounds' signs do not back."""
        return not self.met and not self.slower

    def to_dict(self) -> dict:
        return {"written_tps": self.written_tps, "floor_tps": self.floor_tps, "ratio_median": self.ratio,
                "ratio_range": [min(self.ratios), max(self.ratios)], "rounds": len(self.ratios), "met": self.met}


@dataclass
class DecodeCost:
    """Measured decode seconds per token: `base_s` with every unit at the base type, `extra[type]` the seconds one
    unit element at that type adds (negative where the type decodes faster than the base), and the reference
    type's seconds where a floor names one."""
    base_s: float
    extra: dict[str, float]
    reference_s: dict[str, float]
    threads: int | None
    measured: dict[str, float]
    kv: str = SPEED["kv"]  # the KV cache the timings ran with (an ONNX graph's: f32, as exported)
    reference_types: dict[str, str] = field(default_factory=dict)  # unit -> the type the reference file gave it

    def predict(self, units, types: dict[str, str]) -> float:
        """Predicted decode seconds per token of the assignment `types` (unit name -> type)."""
        return self.base_s + sum(u.n_elements * self.extra.get(types[u.name], 0.0) for u in units)

    def limit_s(self, floor: DecodeFloor) -> float:
        """The most seconds per token the floor allows."""
        if floor.reference is None:
            return 1.0 / floor.tps
        return self.reference_s[floor.reference] / floor.fraction

    def plan_limit_s(self, floor: DecodeFloor, units) -> float:
        """The limit an allocation is planned against. A floor named by a type is that type's file, and the model
        predicts a mixture of types only roughly (on the medium baseline it put Q4_K_S's own recipe at 1958 tok/s,
        measured 2096): so the floor is taken as the model predicts the type's own recipe (reference_types), and an
        allocation predicted as fast as that recipe is planned as as fast as its file. The written file is then
        timed against the measured floor (floor_check). Where the recipe holds a type the model did not time, or
        the floor is in tok/s, the measured limit."""
        if floor.reference is None or not self.reference_types or not units:
            return self.limit_s(floor)
        types = {u.name: self.reference_types.get(u.name) for u in units}
        if any(t not in self.extra for t in types.values()):  # extra holds the base type too (0 s)
            return self.limit_s(floor)
        return self.predict(units, types) / floor.fraction

    def to_dict(self) -> dict:
        return {"base_s": self.base_s, "extra_s_per_element": self.extra, "reference_s": self.reference_s,
                "threads": self.threads, "measured_s": self.measured, "protocol": {**SPEED, "kv": self.kv},
                "reference_types": self.reference_types}


def measure_decode_cost(src: Path, units, base: str, types: tuple[str, ...], reference: str | None,
                        threads: int | None, work: Path, im: dict | None = None) -> DecodeCost:
    """Decode seconds per token of the base file, one file per type in `types` and llama.cpp's `reference` type
    (see the module docstring), cached by the source's content, the types, the threads and this machine (a timing
    holds for the machine it was taken on)."""
    k = key("decode-cost", content_id(src), code_id(), base, sorted(types), reference, threads, SPEED,
            [(u.name, u.candidates()) for u in units], platform.node(), os.cpu_count(), im is not None)
    cached = cache_dir() / f"decode-{k}.json"
    if cached.is_file():
        d = json.loads(cached.read_text())
        return DecodeCost(d["base_s"], d["extra_s_per_element"], d["reference_s"], d["threads"], d["measured_s"],
                          reference_types=d.get("reference_types", {}))
    files: dict[str, tuple[Path, dict[str, str]]] = {}
    paths: list[Path] = []
    try:
        plans = {base: {u.name: base for u in units}}
        for t in types:
            if t != base:
                plans[t] = {u.name: (t if t in u.candidates() else base) for u in units}
        for label, assign in plans.items():
            p = _tmp(work, paths)
            written = run_quantizer(src, p, base, overrides(assign), im, threads=threads)
            files[label] = (p, {n: written.tensor_types.get(n) for n in assign})
        if reference is not None:
            p = _tmp(work, paths)
            written = run_quantizer(src, p, reference, [], im, threads=threads)
            files["reference"] = (p, {u.name: written.tensor_types.get(u.name) for u in units})
        seconds = decode_seconds({k: v[0] for k, v in files.items()}, threads)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    extra = {base: 0.0}
    for t in plans:
        if t == base:
            continue
        n = sum(u.n_elements for u in units if files[t][1].get(u.name) == t)
        if n:
            extra[t] = (seconds[t] - seconds[base]) / n
    cost = DecodeCost(seconds[base], extra, {reference: seconds["reference"]} if reference else {}, threads,
                      seconds, reference_types=files["reference"][1] if reference else {})
    write_json(cached, cost.to_dict())
    return cost


def floor_check(written: Path, src: Path, floor: DecodeFloor, threads: int | None, work: Path,
                im: dict | None = None) -> FloorCheck:
    """The written file against the floor, timed now in alternated rounds: a floor named by a type has that type
    written again beside it by llama.cpp's quantizer (removed afterwards); a tok/s floor is its own number. The
    allocation's speed model is additive per type and misses where per-call overhead is large beside the weights
    (small models: up to 18% on a loaded machine, benchmarks/results/allocator.md), so the file is checked."""
    if floor.reference is None:
        return check_against({"written": written}, floor, threads)
    paths: list[Path] = []
    try:
        ref = _tmp(work, paths)
        run_quantizer(src, ref, floor.reference, [], im, threads=threads)
        return check_against({"written": written, "reference": ref}, floor, threads)
    finally:
        for q in paths:
            q.unlink(missing_ok=True)


def check_against(files: dict[str, Path], floor: DecodeFloor, threads: int | None, kv: str = SPEED["kv"]) -> FloorCheck:
    """FloorCheck of files["written"] against files["reference"] (timed in the same rounds, at floor.fraction) or
    against floor.tps where the floor names no type. An inconclusive check (FloorCheck.inconclusive) is timed again,
    up to CHECK_EXTENSIONS more times, and decided on every round: a file as fast as its floor on a noisy machine
    has a median ratio under CHECK_MEDIAN often enough (medium pair, loaded: per-round ratios 0.67-3.8) that two
    short checks in a row sent the default to the floor type's own recipe, its KLD 1.0x the standard type's."""
    rounds = decode_rounds(files, threads, kv)
    check = _check(rounds, floor)
    for _ in range(CHECK_EXTENSIONS):
        if not check.inconclusive:
            break
        more = decode_rounds(files, threads, kv)
        rounds = {k: rounds[k] + more[k] for k in rounds}
        check = _check(rounds, floor)
    return check


def _check(rounds: dict[str, list[float]], floor: DecodeFloor) -> FloorCheck:
    w = np.asarray(rounds["written"])
    if floor.reference is None:
        floor_s = np.full_like(w, 1.0 / floor.tps)
    else:
        floor_s = np.asarray(rounds["reference"]) / floor.fraction
    return FloorCheck(float(1.0 / np.median(w)), float(1.0 / np.median(floor_s)), [float(x) for x in floor_s / w])


def floor_missed(what: str, got: float, want: float, tries: int | None = None) -> QuantgateError:
    """The one line for a written file (`what` "file", or "graph") that misses its floor: after `tries` rewrites, or
    (None) short by more than any allocation under the budget is predicted to make up."""
    why = (f" after {tries} {what}s (each asked the speed model for the shortfall)" if tries else
           ", and no allocation under this budget is predicted that much faster")
    return QuantgateError(f"decode floor not met by the written {what}: {got:.4g} tok/s measured against the floor's "
                          f"{want:.4g}{why}; lower the floor or raise the budget; nothing was written")


def _tmp(work: Path, paths: list[Path]) -> Path:
    fd, name = tempfile.mkstemp(prefix=".quantgate-speed-", suffix=GGUF_SUFFIX, dir=work)  # a name no one else has
    os.close(fd)
    paths.append(Path(name))
    return paths[-1]


def decode_seconds(files: dict[str, Path], threads: int | None, kv: str = SPEED["kv"]) -> dict[str, float]:
    """Median decode seconds per token of each file (or ONNX folder: `kv` "f32", its cache as exported), rounds
    alternated between all of them."""
    return {k: float(np.median(r)) for k, r in decode_rounds(files, threads, kv).items()}


def decode_rounds(files: dict[str, Path], threads: int | None, kv: str = SPEED["kv"]) -> dict[str, list[float]]:
    """Each round's decode seconds per token of each file, rounds alternated between all of them (round i of every
    file ran back to back, so their ratio is paired). `threads` None: one thread. llama.cpp's threads wait on each
    other, and on a machine where another process holds a core two threads decoded a medium model at 130 tok/s
    where one decodes it at thousands: a timing on every core measures the machine's load, not the types."""
    threads = threads or 1
    ids = list(np.random.default_rng(0).integers(3, 200, size=SPEED["prefill"] + SPEED["decode"]))
    n = SPEED["prefill"] + SPEED["decode"]
    opened = {k: open_runner(str(p), fixed_ctx(n, p), kv_type=kv, threads=threads, logits_all=False)
              for k, p in files.items()}
    runners = [o.runner.__enter__() for o in opened.values()]
    try:
        with stage(f"decode speed: {len(files)} files, {SPEED['rounds']} alternated rounds"):
            res = bench(runners, ids[:SPEED["prefill"]], ids[SPEED["prefill"]:], rounds=SPEED["rounds"], warmup=1)
    finally:
        for o in opened.values():
            o.runner.__exit__(None, None, None)
    return {k: [d / SPEED["decode"] for d in r["decode_rounds_s"]] for k, r in zip(opened, res)}

