"""Per-tensor llama.cpp types under a size budget, chosen from measured sensitivity (issue 36).

    from quantgate.quant.allocate import allocate_gguf
    allocate_gguf("m-F32.gguf", "m-auto.gguf", target_bpw=4.5)

1. Units: every tensor llama.cpp's quantizer would quantize (2-D and larger; norms stay F32). The gates are units
   of their own where the file keeps them apart: a hybrid's `attn_gate` (GDN z), `ssm_alpha`, `ssm_beta`,
   `ssm_out`; in gated attention the gate rows share `attn_q` with q, so that tensor is the gate's unit.
2. Sensitivity, measured: a base file with every unit at the base type (Q8_0), then one file per (unit,
   candidate type) with that unit alone at the candidate, each written by llama.cpp's own quantizer (explicit
   per-tensor overrides) and scored by llama.cpp against the source file's own logits on calibration windows (the
   calibration split, disjoint from evaluation text). delta(u, t) = KLD(file) - KLD(base). Cached by content
   (the source file, the windows, the candidates, the code). For models too large to measure, `--sensitivity
   proxy` takes each unit's weight error instead (quant.proxy; weaker, as its benchmark shows).
3. Allocation: the predicted KLD of an assignment is KLD(base) + sum of its units' deltas (additive: an assumption,
   not checked per file; the gate A/B's 1-2% reversals on the small pair are its error showing); under a byte
   budget this is a multiple-choice knapsack, solved by dynamic programming over the budget. Bytes per type are
   ggml's block sizes. A decode floor adds a price on predicted decode time (quant.decode_cost); with the proxy, a
   limit on llama.cpp's predicted quantizer time adds another (quant.proxy.quantize_time: IQ4_XS quantizes about 3x
   slower than Q4_K, and an unlimited 9B allocation took 2.1x a plain quantize). A price finds only the convex hull
   of (KLD, time); exchanges of one or two units' types from its answer then reach the best assignment between
   (on small instances, where brute force can check it, every time).
4. The file is written by llama.cpp's quantizer with one override per unit, so stock llama.cpp opens it; the
   chosen type of every tensor goes to the file's metadata (`quantgate.allocation.tensor_types`, with the target and
   the predicted KLD) and to a JSON beside it with the measured sensitivity (`X.gguf.allocation.json`).

Written by hand: llama.cpp's `--target-bpw` is an unmerged PR and no library allocates llama.cpp types from
measured KLD under a size budget.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..errors import QuantgateError
from ..executor import LocalExecutor, Needs, open_executor
from ..formats import load_checkpoint
from ..formats.gguf_metadata import copy_with_metadata
from ..formats.kind import GGUF_SUFFIX
from ..formats.gguf import GGUFInfo, inspect_gguf, open_reader, tokenizer_from_gguf
from ..fsio import atomic_path, check_output, write_json
from ..identity import code_id, content_id, key
from ..metrics import window_scores
from ..progress import track
from ..reference import cache_dir
from ..runners.open import fixed_ctx, open_runner
from .decode_cost import SPEED as DECODE_SPEED, DecodeCost, floor_check, floor_missed, measure_decode_cost
from .llama_cpp import exact_overrides as overrides, importance_matrix, run_quantizer
from .gradient import ALL_ELEMENTS as GRADIENT_ALL, ROWS as GRADIENT_ROWS, fisher_rows, pilot, predict_seconds
from .proxy import (QUANTIZE_TIME, ROWS, QuantizeTime, proxy_deltas, quantize_speeds, quantize_time,
                    reference_type, weight_errors)
from .targets import DecodeFloor

CANDIDATES = ("Q2_K", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0")  # types llama.cpp's own mixtures use
# rows not a multiple of 256: 32-blocks, llama.cpp's own fallbacks for its k-quants there (IQ4_NL for Q2_K-IQ4_XS,
# Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K), so that every standard type's recipe is an allocation (a decode
# floor's recipe_plan), and Q4_0
SMALL_ROW_CANDIDATES = ("IQ4_NL", "Q4_0", "Q5_0", "Q5_1", "Q8_0")
BASE = "Q8_0"  # every unit's type while another one is measured
GATE_UNITS = (".attn_q.weight", ".attn_gate.weight", ".ssm_alpha.weight", ".ssm_beta.weight", ".ssm_out.weight")


@dataclass(frozen=True)
class Unit:
    """One tensor the allocator chooses a type for: its name, element count and row length (ggml's ne[0]);
    `allowed`: the types the user let the allocation use (`--types`; empty: every candidate)."""
    name: str
    n_elements: int
    row: int
    allowed: tuple[str, ...] = ()

    @property
    def is_gate(self) -> bool:
        """A gate unit (the report's A/B holds these at the base type)."""
        return self.name.endswith(GATE_UNITS)

    def candidates(self) -> tuple[str, ...]:
        """The types whose blocks fit its rows."""
        pool = CANDIDATES if self.row % 256 == 0 else SMALL_ROW_CANDIDATES
        return tuple(t for t in pool if self.row % _block(t) == 0 and (not self.allowed or t in self.allowed))

    def bytes(self, t: str) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
        return self.n_elements // block * size

    def bits(self, t: str) -> float:
        return _bits(t)


def _block(t: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]


def units_of(path: str | Path, types: tuple[str, ...] = ()) -> list[Unit]:
    """The tensors of an F32/F16/BF16 GGUF that llama.cpp's quantizer quantizes (2-D or more, rows of 32), each
    allowed `types` (empty: every candidate; BASE is always allowed, since every measurement starts from it)."""
    info = inspect_gguf(path)
    if info.file_type not in ("F32", "F16", "BF16"):
        raise QuantgateError(f"{path} is already quantized ({info.file_type}); allocate from the F32/F16 export")
    allowed = tuple(dict.fromkeys((*types, BASE))) if types else ()
    out = []
    for t in open_reader(path).tensors:
        shape = [int(d) for d in t.shape]
        if len(shape) >= 2 and shape[0] % 32 == 0 and not t.name.endswith(KEPT_FLOAT):
            out.append(Unit(t.name, int(np.prod(shape)), shape[0], allowed))
    return out


def parse_types(text: str | None) -> tuple[str, ...]:
    """`--types Q4_K,Q5_K,Q6_K`: the candidate types an allocation may use (empty: all of them). A type that is no
    candidate is one line naming the candidates."""
    if not text:
        return ()
    names = tuple(t.strip().upper() for t in text.split(",") if t.strip())
    known = (*CANDIDATES, *SMALL_ROW_CANDIDATES)
    bad = [t for t in names if t not in known]
    if bad or not names:
        raise QuantgateError(f"--types {text!r}: {', '.join(bad) or 'no type'} is not a candidate type; choose from "
                             f"{', '.join(dict.fromkeys(known))} (Q8_0 is always allowed)")
    return names


# Tensors llama.cpp's quantizer keeps in float whatever it is asked (llama-quant.cpp's name checks: MoE routers, a
# GDN/Mamba conv kernel). The measured path also learns this from its base file; the proxy path writes one file only.
KEPT_FLOAT = ("ffn_gate_inp.weight", "ssm_conv1d.weight")
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Sensitivity:
    """Per unit and type, the increase over every unit at BASE: measured KLD (`kind` "measured": base_kld, the
    calibration it was measured on) or the weight-error proxy (`kind` "proxy", quant.proxy: its own unit, base_kld
    0, `windows` the rows sampled per tensor)."""
    base_kld: float
    delta: dict[str, dict[str, float]]
    windows: int
    ctx: int
    data: str
    kind: str = "measured"
    base: str = BASE  # the type every other unit holds (an ONNX allocation's: quant.allocate_onnx.BASE)
    quantize_s: dict[str, float] | None = None  # the proxy's and gradient's: each type's quantizer CPU s per weight
    probe: dict[str, list] | None = None  # the calibrated kind's: per unit, [the type measured, its measured delta]

    @property
    def in_kld(self) -> bool:
        """Whether the deltas are KLD (measured, or predicted in its units), not the proxy's own unit."""
        return self.kind != "proxy"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "base_type": self.base, "base_kld": self.base_kld, "delta": self.delta,
                "windows": self.windows, "ctx": self.ctx, "data": self.data,
                **({"quantize_cpu_s_per_weight": self.quantize_s} if self.quantize_s else {}),
                **({"probe": self.probe} if self.probe else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Sensitivity":
        return cls(d["base_kld"], d["delta"], d["windows"], d["ctx"], d["data"], d.get("kind", "measured"),
                   d.get("base_type", BASE), d.get("quantize_cpu_s_per_weight"), d.get("probe"))


SENSITIVITIES = ("auto", "measured", "calibrated", "gradient", "proxy")
PROXY_ABOVE = 100_000_000  # weights: the ONNX and torch allocators' auto measures below, takes the proxy above
# --sensitivity auto on a GGUF: the best sensitivity whose predicted time fits AUTO_FACTOR times a plain quantize
# (every tensor at Q4_K, predicted from ggml's quantizer timed here), or AUTO_MIN_S, whichever is longer; so that the
# allocation, its quantizer run included, stays near 2x a plain quantize at 4B-9B (issue 50's goal) while a small
# model, whose plain quantize takes a second, still gets a KLD-based sensitivity
AUTO_FACTOR = 0.5
AUTO_MIN_S = 120.0
PILOT_ROWS = 16  # rows per tensor the auto choice's quantizer timing samples
PROBE_START_S = 1.3  # a measured probe's fixed cost: the quantizer's and llama.cpp's processes (0.8 probes/s, tiny)


def parse_sensitivity_time(text: str | None) -> tuple[float | None, float | None]:
    """`--sensitivity-time`: seconds (`300`) or a factor of a plain quantize's predicted time (`0.5x`), as (seconds,
    factor); None: the default (AUTO_FACTOR, at least AUTO_MIN_S)."""
    if text is None:
        return None, None
    t = text.strip().lower()
    try:
        value = float(t[:-1] if t.endswith("x") else t)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value) or value <= 0:
        raise QuantgateError(f"--sensitivity-time {text!r}: give seconds (300) or a factor of a plain quantize's "
                             f"time (0.5x), above 0")
    return (None, value) if t.endswith("x") else (value, None)


@dataclass
class AutoChoice:
    """What `--sensitivity auto` chose and why: the kind, the calibration windows it runs on, the time budget, and
    each candidate's predicted seconds (the gradient's at the windows asked for)."""
    kind: str
    windows: int
    budget_s: float
    plain_quantize_s: float
    predicted_s: dict[str, float]

    def to_dict(self) -> dict:
        return {"chose": self.kind, "windows": self.windows, "budget_s": round(self.budget_s, 1),
                "plain_quantize_s": round(self.plain_quantize_s, 1),
                "predicted_s": {k: round(v, 1) for k, v in self.predicted_s.items()}}

    def words(self) -> str:
        return (f"auto: {self.kind} ({self.windows} windows), the best predicted within {self.budget_s:.0f} s "
                f"(" + ", ".join(f"{k} {v:.0f} s" for k, v in self.predicted_s.items()) + ")")


def auto_budget(seconds: float | None, factor: float | None, plain_s: float) -> float:
    """The seconds auto's sensitivity may take: those asked, a factor of a plain quantize's predicted `plain_s`, or
    by default AUTO_FACTOR of it and at least AUTO_MIN_S."""
    if seconds is not None:
        return seconds
    return factor * plain_s if factor is not None else max(AUTO_MIN_S, AUTO_FACTOR * plain_s)


def choose_sensitivity(predicted: dict[str, float], gradient_at, n_windows: int, budget_s: float) -> tuple[str, int]:
    """(kind, windows): measured, calibrated or gradient where its predicted seconds fit the budget, in that order;
    else the gradient on as many windows as fit (`gradient_at(n)`: its seconds on n windows); else the proxy."""
    for kind in ("measured", "calibrated", "gradient"):
        if predicted[kind] <= budget_s:
            return kind, n_windows
    fits = [n for n in range(n_windows - 1, 0, -1) if gradient_at(n) <= budget_s]
    return ("gradient", fits[0]) if fits else ("proxy", n_windows)


def quantizer_speeds(src: Path, units: list[Unit], threads: int | None) -> dict[str, float]:
    """Wall seconds per weight of each candidate type's ggml quantizer on `threads` (every core by default), timed on
    PILOT_ROWS rows per tensor: what the auto choices predict a plain quantize and the probes from."""
    speeds = quantize_speeds(weight_errors(src, units, None, PILOT_ROWS, threads=threads))
    n = threads or os.cpu_count() or 1
    slowest = max(speeds.values())
    return {t: speeds.get(t, slowest) / n for t in {*speeds, *(t for u in units for t in u.candidates()),
                                                    *(reference_type(u) for u in units)}}


def plain_quantize_s(units: list[Unit], rate: dict[str, float]) -> float:
    """llama.cpp's quantizer with every tensor at Q4_K (Q5_0 on shorter rows), predicted: a plain Q4_K_M's bulk."""
    return sum(u.n_elements * rate[reference_type(u)] for u in units)


def auto_sensitivity(src: Path, units: list[Unit], n_windows: int, ctx: int, threads: int | None,
                     rate: dict[str, float], budget: float) -> AutoChoice:
    """Predict each sensitivity's time here from the quantizer speeds (quantizer_speeds) and one block read and run
    over one window (quant.gradient.pilot), and choose (choose_sensitivity)."""
    plain = plain_quantize_s(units, rate)
    p = pilot(src, ctx, threads)
    run = p["layers"] * p["forward_s"] * (1 + p["vocab"] / (12 * p["dim"]))  # one window, forward only
    errors = sum((u.n_elements if u.n_elements <= GRADIENT_ALL else GRADIENT_ROWS * u.row) *
                 sum(rate[t] for t in u.candidates()) for u in units)
    probe = sum(u.n_elements * rate[BASE] for u in units) + n_windows * run + PROBE_START_S
    gradient_at = lambda k: predict_seconds(p, k) + errors  # noqa: E731
    measured = n_windows * run + (1 + sum(len(u.candidates()) - 1 for u in units)) * probe
    predicted = {"measured": measured, "calibrated": gradient_at(n_windows) + n_windows * run + (1 + len(units)) * probe,
                 "gradient": gradient_at(n_windows)}
    kind, k = choose_sensitivity(predicted, gradient_at, n_windows, budget)
    return AutoChoice(kind, k, budget, plain, predicted)


# The default decode floor (`--decode-floor auto`): 1x the largest of these standard types whose own file fits the
# budget, the type the budget would otherwise name, so that the default file decodes as fast as the file it is
# compared with (without a floor, 16 of 32 allocated files in benchmarks/results/allocator.md decoded slower than
# 0.95x of it). On where its files and timings are predicted to fit the sensitivity's time budget, else off and said.
FLOOR_STANDARD = ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
READ_BYTES_PER_S = 4e9  # decode's weight reads on a laptop CPU, for the auto floor's time prediction only


def auto_floor(src: Path, units: list[Unit], unit_budget: int, rate: dict[str, float], budget_s: float,
               threads: int | None, work: Path, im: dict | None) -> tuple[DecodeFloor | None, dict]:
    """The default floor and what was decided: each standard type's file written by llama.cpp (to learn its types;
    removed), the largest whose units fit `unit_budget` bytes as the floor, so that its own recipe is always a plan
    that meets it (floor_plan); None where none fits (nothing standard to be as fast as) or where the floor's work is
    predicted over `budget_s`."""
    n = sum(u.n_elements for u in units)
    kinds = {t for u in units for t in u.candidates()}
    token_s = 0.6 * n / READ_BYTES_PER_S  # ~4.8 bits per weight read per token
    tokens = (DECODE_SPEED["rounds"] + 1) * (DECODE_SPEED["prefill"] + DECODE_SPEED["decode"])
    predicted = (len(FLOOR_STANDARD) * plain_quantize_s(units, rate) + (len(kinds) + 2) * n * rate[BASE]
                 + (len(kinds) + 2 + 2 * FLOOR_TRIES) * tokens * token_s)
    info = {"predicted_s": round(predicted, 1), "budget_s": round(budget_s, 1)}
    if predicted > budget_s:
        return None, {**info, "floor": None, "why": f"off: its files and timings are predicted at {predicted:.0f} s, "
                                                     f"over the {budget_s:.0f} s budget"}
    sizes = {}
    for t in track(FLOOR_STANDARD, "decode floor: the standard types' sizes", total=len(FLOOR_STANDARD)):
        fd, name = tempfile.mkstemp(prefix=".quantgate-std-", suffix=GGUF_SUFFIX, dir=work)
        os.close(fd)
        try:
            got = recipe_types(units, run_quantizer(src, Path(name), t, [], im, threads=threads).tensor_types)
            sizes[t] = (sum(u.bytes(got[u.name]) for u in units) if all(got[u.name] in u.candidates() for u in units)
                        else None)  # a recipe with a type no unit could take is no plan: no floor of this
        finally:
            Path(name).unlink(missing_ok=True)
    fits = [t for t in FLOOR_STANDARD if sizes[t] is not None and sizes[t] <= unit_budget]
    info["standard_unit_bytes"] = sizes
    if not fits:
        return None, {**info, "floor": None, "why": "off: no standard type's file fits the budget"}
    return DecodeFloor(reference=fits[-1]), {**info, "floor": fits[-1],
                                             "why": f"{fits[-1]}, the largest standard type within the budget"}


def proxy_sensitivity(src: Path, units: list[Unit], im: dict | None = None, rows: int | None = None,
                      seed: int = 0, threads: int | None = None) -> Sensitivity:
    """The weight-error proxy (quant.proxy) as a Sensitivity. Unlike the measured path it writes no base file, so
    it cannot know which units llama.cpp leaves in float: allocate_gguf learns that from the file it writes."""
    rows = rows or ROWS
    errors = weight_errors(src, units, im, rows, seed, threads)
    return Sensitivity(0.0, proxy_deltas(errors, BASE), rows, 0,
                       "weights" + (" + importance matrix" if im is not None else ""), "proxy",
                       quantize_s=quantize_speeds(errors))


def _windows(src: Path, calib_data: str, n_windows: int, ctx: int, seed: int) -> np.ndarray:
    check_ctx(ctx, inspect_gguf(src).context_length, src)
    return calibration_windows(tokenizer_from_gguf(open_reader(src)), calib_data, n_windows, ctx, seed)


def probe_kld(assign: dict[str, str], src: Path, windows: np.ndarray, ref: np.ndarray, threads: int | None,
              work: Path, im: dict | None) -> tuple[float, dict[str, str]]:
    """One probe: the file llama.cpp's quantizer writes with `assign` (in `work`, removed after), its mean KLD against
    the source's logits `ref` on `windows`, and the types it wrote. A function of its arguments alone, so that it runs
    as a task anywhere (quantgate.executor)."""
    fd, name = tempfile.mkstemp(prefix=".quantgate-sens-", suffix=GGUF_SUFFIX, dir=work)  # a name no one else has
    os.close(fd)
    tmp = Path(name)
    try:
        written = run_quantizer(src, tmp, BASE, overrides(assign), im, threads=threads)
        lg = _logits(tmp, windows, threads)
    finally:
        tmp.unlink(missing_ok=True)
    return (float(np.mean([window_scores(ref[i], lg[i], windows[i])["kld"].mean() for i in range(len(windows))])),
            written.tensor_types)


class _Probes:
    """KLD of files written by llama.cpp's quantizer with given per-tensor types, against the source's own logits on
    the calibration windows: one quantization and one scored run per assignment (the measured sensitivity's unit of
    work, and the calibrated one's), each a task of `executor` (quantgate.executor: here, or on a Ray cluster). The
    probes' files go in a scratch folder of this run's own, removed at the end, so that a task whose worker died
    leaves nothing behind."""

    def __init__(self, src: Path, windows: np.ndarray, threads: int | None, work: Path | None, im: dict | None,
                 executor=None):
        self.src, self.windows, self.threads, self.im = src, windows, threads, im
        self.ref = _logits(src, windows, threads)
        self.executor = executor or LocalExecutor()
        root = Path(work or cache_dir())
        root.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=".quantgate-probes-", dir=root))

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)  # this run's own scratch folder

    def __enter__(self) -> "_Probes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def klds(self, assigns: list[dict[str, str]], label: str | None = None) -> list[tuple[float, dict[str, str]]]:
        size = self.src.stat().st_size
        needs = Needs(cpus=self.threads or 1, memory=int(2.5 * size + self.ref.nbytes))
        return self.executor.map(probe_kld, assigns, needs, label,
                                 shared=dict(src=self.src, windows=self.windows, ref=self.ref, threads=self.threads,
                                             work=self.work, im=self.im))

    def base(self, units: list[Unit]) -> tuple[float, list[Unit]]:
        """The base file's KLD (every unit at BASE) and the units llama.cpp did quantize there (what it leaves in
        float is no unit)."""
        base_kld, types = self.klds([{u.name: BASE for u in units}])[0]
        return base_kld, [u for u in units if types.get(u.name) == BASE]


def measure_sensitivity(src: str | Path, units: list[Unit], calib_data: str = "embedded", n_windows: int = 8,
                        ctx: int = 128, seed: int = 0, threads: int | None = None,
                        work: Path | None = None, im: dict | None = None, executor=None) -> Sensitivity:
    """Each unit's KLD increase over the base file when it alone takes each candidate type (see the module
    docstring), cached by content. `im`: the importance matrix every quantization takes (the file will be written
    with it, so its sensitivity is measured with it)."""
    src = Path(src)
    windows = _windows(src, calib_data, n_windows, ctx, seed)
    cached = sensitivity_cache(src, units, windows, im)
    if cached.is_file():
        return Sensitivity.from_dict(json.loads(cached.read_text()))
    with _Probes(src, windows, threads, work, im, executor) as probes:
        base_kld, units = probes.base(units)
        base = {u.name: BASE for u in units}
        runs = [(u, t) for u in units for t in u.candidates() if t != BASE]
        got = probes.klds([{**base, u.name: t} for u, t in runs], "sensitivity: one unit at a time")
    delta: dict[str, dict[str, float]] = {u.name: {BASE: 0.0} for u in units}
    for (u, t), (kld, _types) in zip(runs, got):
        delta[u.name][t] = kld - base_kld
    sens = Sensitivity(base_kld, delta, len(windows), ctx, calib_data)
    write_json(cached, sens.to_dict())
    return sens


def gradient_sensitivity(src: str | Path, units: list[Unit], calib_data: str = "embedded", n_windows: int = 8,
                         ctx: int = 128, seed: int = 0, threads: int | None = None,
                         im: dict | None = None) -> Sensitivity:
    """Each unit's KLD increase at each type predicted from the Fisher diagonal (quant.gradient): 1/(2P) times its
    Fisher-weighted squared weight error from ggml's own quantizers, over the same at BASE; the base KLD is the
    prediction for every unit at BASE. Cached by content (the file, the windows, the units, the importance matrix,
    the code)."""
    src = Path(src)
    windows = _windows(src, calib_data, n_windows, ctx, seed)
    cached = sensitivity_cache(src, units, windows, im, ("gradient", GRADIENT_ROWS, seed))
    if cached.is_file():
        return Sensitivity.from_dict(json.loads(cached.read_text()))
    fr = fisher_rows(src, units, windows, seed, GRADIENT_ROWS, threads)
    errors = weight_errors(src, units, im, seed=seed, threads=threads, weights=fr.by_unit)
    c = 0.5 / fr.positions
    pred = {n: {t: c * v for t, v in e["err"].items()} for n, e in errors.items()}
    sens = Sensitivity(float(sum(p[BASE] for p in pred.values())),
                       {n: {t: v - p[BASE] for t, v in p.items()} for n, p in pred.items()},
                       len(windows), ctx, calib_data, "gradient", quantize_s=quantize_speeds(errors))
    write_json(cached, sens.to_dict())
    return sens


def calibrated_sensitivity(src: str | Path, units: list[Unit], grad: Sensitivity, calib_data: str = "embedded", n_windows: int = 8, ctx: int = 128, seed: int = 0,
                           threads: int | None = None, work: Path | None = None, im: dict | None = None,
                           executor=None) -> Sensitivity:
    """The gradient's curve over types, each unit's scaled to its KLD measured at one type: the base file and one file
    per unit (that unit alone at the type a plain Q4_K_M gives most weights, proxy.reference_type: Q4_K, or Q5_0 on
    shorter rows), instead of one per unit and type; one set of probes serves every budget. A unit whose measured
    or predicted delta there is not positive takes the median scale of the others. The base KLD is measured."""
    src = Path(src)
    windows = _windows(src, calib_data, n_windows, ctx, seed)
    probe = {u.name: reference_type(u) if reference_type(u) in u.candidates() else BASE for u in units}
    cached = sensitivity_cache(src, units, windows, im, ("calibrated", probe, grad.to_dict()))
    if cached.is_file():
        return Sensitivity.from_dict(json.loads(cached.read_text()))
    with _Probes(src, windows, threads, work, im, executor) as probes:
        base_kld, units = probes.base(units)
        base = {u.name: BASE for u in units}
        asked = [u for u in units if probe[u.name] != BASE]
        got = probes.klds([{**base, u.name: probe[u.name]} for u in asked], "sensitivity: one unit at one type")
    measured = {u.name: 0.0 for u in units} | {u.name: kld - base_kld for u, (kld, _t) in zip(asked, got)}
    ratio = {n: m / grad.delta[n][probe[n]] for n, m in measured.items()
             if m > 0 and grad.delta[n].get(probe[n], 0) > 0}
    typical = float(np.median(list(ratio.values()))) if ratio else 1.0
    delta = {u.name: {t: d * ratio.get(u.name, typical) for t, d in grad.delta[u.name].items()} for u in units}
    sens = Sensitivity(base_kld, delta, len(windows), ctx, calib_data, "calibrated", quantize_s=grad.quantize_s,
                       probe={n: [probe[n], measured[n]] for n in measured})
    write_json(cached, sens.to_dict())
    return sens


def sensitivity_cache(src: Path, units: list[Unit], windows: np.ndarray, im: dict | None, *more) -> Path:
    """Where the measured sensitivity of `src` on `windows` is cached: keyed by the file's content, the code, the
    units and their candidates, the windows and the importance matrix (and `more`: what else a kind depends on)."""
    k = key("sensitivity", content_id(src), code_id(), BASE, [(u.name, u.candidates()) for u in units],
            hashlib.sha256(windows.tobytes()).hexdigest(), _im_digest(im), *more)
    return cache_dir() / f"sens-{k}.json"


def _im_digest(im: dict | None) -> str | None:
    if im is None:
        return None
    h = hashlib.sha256()
    for name in sorted(im):
        h.update(name.encode())
        h.update(np.ascontiguousarray(im[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def _logits(path: Path, windows: np.ndarray, threads: int | None) -> np.ndarray:
    opened = open_runner(str(path), fixed_ctx(windows.shape[1], path), threads=threads)
    with opened.runner as r:
        return r.logits(windows)


@dataclass
class Allocation:
    """The chosen type per unit, its tensor bytes and predicted KLD, the budget it met, and (with a decode floor)
    its predicted decode seconds per token."""
    types: dict[str, str]
    unit_bytes: int
    predicted_kld: float
    budget_bytes: int
    predicted_decode_s: float | None = None
    recipe: str | None = None  # the floor's own llama.cpp type, where its per-tensor types are this allocation
    predicted_quantize_s: float | None = None  # with a quantize-time limit: llama.cpp's quantizer, predicted


def recipe_types(units: list[Unit], written: dict[str, str | None]) -> dict[str, str | None]:
    """A standard file's types as an assignment of the units: a tensor the file kept in float (llama.cpp's recipes
    keep some small ones so, e.g. a qwen35 identity layer's ssm_alpha) at BASE instead, fewer bytes and no slower."""
    return {u.name: BASE if written.get(u.name) in FLOAT_TYPES else written.get(u.name) for u in units}


def recipe_plan(units: list[Unit], sens: Sensitivity, cost: DecodeCost | None, floor: DecodeFloor | None,
                budget_bytes: int) -> Allocation | None:
    """The floor's own recipe as an allocation: the per-tensor types llama.cpp gave the floor's reference type on
    this model, which decodes as fast as the floor by definition (a floor of at most 1x that type). None where the
    floor names no type or asks more than 1x, where a unit's type there is not one of its candidates, or where the
    recipe does not fit the budget."""
    if cost is None or floor is None or floor.reference is None or floor.fraction > 1 or not cost.reference_types:
        return None
    types = recipe_types(units, cost.reference_types)
    if any(t not in u.candidates() or t not in sens.delta[u.name] for u in units for t in [types[u.name]]):
        return None
    if sum(u.bytes(types[u.name]) for u in units) > budget_bytes:
        return None
    plan = _plan(types, units, sens, budget_bytes)
    plan.predicted_decode_s, plan.recipe = cost.predict(units, types), floor.reference
    return plan


def floor_plan(units: list[Unit], sens: Sensitivity, budget_bytes: int, cost: DecodeCost, limit_s: float,
               floor: DecodeFloor, quant: QuantizeTime | None = None) -> Allocation:
    """The allocation under a decode floor: the KLD-optimal one predicted fast enough, or the floor's own recipe
    (recipe_plan) where that is predicted to lose less KLD or no allocation is predicted fast enough. The recipe's
    speed is the floor's, so the allocator is never worse than the file the user measured it against; it can only
    be that file's types (whose quantizer time is a plain quantize's: `quant` bounds only the allocation)."""
    recipe = recipe_plan(units, sens, cost, floor, budget_bytes)
    if recipe is not None:
        if quant is not None:
            recipe.predicted_quantize_s = quant.predict(units, recipe.types)
        limits = [(cost, limit_s)] + ([(quant, quant.limit_s)] if quant is not None else [])
        if all(c.predict(units, recipe.types) <= lim * (1 + 1e-12) for c, lim in limits):
            better = _exchange(recipe.types, units, sens, budget_bytes, limits)  # the recipe, bettered where it can be
            if better != recipe.types:
                recipe = _plan(better, units, sens, budget_bytes)
                recipe.predicted_decode_s = cost.predict(units, better)
                if quant is not None:
                    recipe.predicted_quantize_s = quant.predict(units, better)
    try:
        plan = allocate(units, sens, budget_bytes, None, cost, limit_s, quant)
    except QuantgateError as e:
        if recipe is None or "decode floor out of reach" not in str(e):
            raise
        return recipe
    return recipe if recipe is not None and recipe.predicted_kld < plan.predicted_kld else plan


BUCKETS = 4000  # the budget's resolution in the allocation's dynamic program
FLOOR_TRIES = 3  # files written and timed against a decode floor before a shortfall is an error


def allocate(units: list[Unit], sens: Sensitivity, budget_bytes: int, fixed: dict[str, str] | None = None,
             cost: DecodeCost | None = None, limit_s: float | None = None,
             quant: QuantizeTime | None = None) -> Allocation:
    """Types that minimise the predicted KLD with the units' bytes under `budget_bytes`; `fixed` units keep the type
    given (the gate A/B's held arm). With a decode cost and `limit_s` (the most decode seconds per token the floor
    allows), the predicted decode time must stay under it too, and with `quant` llama.cpp's predicted quantizer time
    under its limit: a Lagrangian relaxation (minimise KLD + lam * each time over its limit, lam searched by
    bisection until every time fits), since a second capacity would square the dynamic program. Raises when even the
    cheapest types do not fit, or no allocation is predicted fast enough."""
    limits = [(c, lim) for c, lim in ((cost, limit_s), (quant, quant.limit_s if quant else None))
              if c is not None and lim is not None]

    def timed(a: Allocation) -> Allocation:
        if cost is not None and limit_s is not None:
            a.predicted_decode_s = cost.predict(units, a.types)
        if quant is not None:
            a.predicted_quantize_s = quant.predict(units, a.types)
        return a

    def fits(a: Allocation) -> bool:
        return all(c.predict(units, a.types) <= lim * (1 + 1e-12) for c, lim in limits)  # sums in any order

    plan = timed(_cheapest_kld(units, sens, {u.name: dict(sens.delta[u.name]) for u in units}, budget_bytes, fixed))
    if fits(plan):
        return plan

    def at(lam: float) -> Allocation:
        sc = {u.name: {t: d + lam * u.n_elements * sum(c.extra.get(t, 0.0) / lim for c, lim in limits)
                       for t, d in sens.delta[u.name].items()} for u in units}
        return timed(_cheapest_kld(units, sens, sc, budget_bytes, fixed))

    # a first lam: KLD and time (over its limit) on one scale; the proxy has no base KLD, so its typical delta
    scale = sens.base_kld or float(np.median([abs(d) for dd in sens.delta.values() for d in dd.values() if d] or [0]))
    lo, hi = 0.0, max(scale, 1e-9)
    fast = at(hi)
    for _ in range(60):
        if fits(fast):
            break
        lo, hi = hi, hi * 4
        fast = at(hi)
    else:
        if cost is not None and limit_s is not None and fast.predicted_decode_s > limit_s:
            raise QuantgateError(f"decode floor out of reach under this budget: the fastest allocation is predicted "
                                 f"at {1 / fast.predicted_decode_s:.4g} tok/s, the floor asks {1 / limit_s:.4g} tok/s; "
                                 f"lower the floor or raise the budget; nothing was written")
        raise QuantgateError(f"quantize-time limit out of reach under this budget: the quickest allocation is "
                             f"predicted at {fast.predicted_quantize_s:.4g} s of llama.cpp's quantizer, the limit is "
                             f"{quant.limit_s:.4g} s; raise --quantize-time (0: no limit); nothing was written")
    for _ in range(40):  # bisection: the least lam whose allocation fits the time (less lam, less KLD)
        mid = (lo + hi) / 2
        a = at(mid)
        if fits(a):
            hi, fast = mid, a
        else:
            lo = mid
    return timed(_plan(_exchange(fast.types, units, sens, budget_bytes, limits, fixed), units, sens, budget_bytes))


def _exchange(types: dict[str, str], units: list[Unit], sens: Sensitivity, budget_bytes: int, limits: list,
              fixed: dict[str, str] | None = None, rounds: int = 1000) -> dict[str, str]:
    """Better a feasible assignment by exchanges: the change of one unit's type, or of two units' at once (one up,
    one down), that lowers the predicted KLD most while the bytes and every predicted time (`limits`: [(model with
    .predict and per-weight .extra, limit)]) stay within their limits, until none does. Why: a price on time finds
    only the assignments on the convex hull of (KLD, time), and the best one under a limit often lies between two of
    them; exchanges from the priced answer, or from a floor's recipe, reach in there. Written by hand (a local
    search; no library holds one for this knapsack)."""
    free = [u for u in units if u.name not in (fixed or {})]
    moves = [(i, t) for i, u in enumerate(free) for t in u.candidates() if t in sens.delta[u.name]]
    if not moves:
        return dict(types)
    owner = np.array([i for i, _t in moves] + [-1])  # the last move changes nothing: pairs with it are single moves
    kld = np.array([sens.delta[free[i].name][t] for i, t in moves] + [0.0])
    size = np.array([free[i].bytes(t) for i, t in moves] + [0], dtype=np.float64)
    cost = [np.array([free[i].n_elements * c.extra.get(t, 0.0) for i, t in moves] + [0.0]) for c, _lim in limits]
    same = owner[:, None] == owner[None, :]
    same[-1, -1] = False
    types = dict(types)
    for _ in range(rounds):
        at = np.array([j for j, (i, t) in enumerate(moves) if types[free[i].name] == t])  # each unit's current move
        if len(at) != len(free):  # a unit at a type it cannot take (not from the allocator): left as it is
            return types

        def change(v: np.ndarray) -> np.ndarray:  # each move's change from the current assignment
            return np.append(v[:-1] - v[at][owner[:-1]], 0.0)
        dk, db = change(kld), change(size)
        ok = (db[:, None] + db[None, :] <= budget_bytes - sum(u.bytes(types[u.name]) for u in units)) & ~same
        for c_arr, (c, lim) in zip(cost, limits):
            dt = change(c_arr)
            ok &= dt[:, None] + dt[None, :] <= lim * (1 + 1e-12) - c.predict(units, types)
        gain = np.where(ok, dk[:, None] + dk[None, :], np.inf)
        a, b = divmod(int(np.argmin(gain)), len(owner))
        if not gain[a, b] < -1e-9 * max(abs(float(kld[at].sum())), 1e-30):
            break
        for m in (a, b):
            if owner[m] >= 0:
                types[free[owner[m]].name] = moves[m][1]
    return types


def _cheapest_kld(units: list[Unit], sens: Sensitivity, score: dict[str, dict[str, float]], budget_bytes: int,
                  fixed: dict[str, str] | None) -> Allocation:
    """The assignment that minimises the summed `score` (the KLD deltas, or those plus a decode-time price) under the
    byte budget. A multiple-choice knapsack, solved by dynamic programming over the budget in BUCKETS steps (each
    unit's bytes rounded to the nearest step; the answer is checked in bytes, and a smaller capacity taken until it
    fits), then the bytes left are spent on the best upgrades that fit."""
    fixed = fixed or {}
    free = [u for u in units if u.name not in fixed]
    held_bytes = sum(u.bytes(fixed[u.name]) for u in units if u.name in fixed)
    left = budget_bytes - held_bytes
    cheapest = held_bytes + sum(min(u.bytes(t) for t in u.candidates()) for u in free)
    if cheapest > budget_bytes:
        raise QuantgateError(f"the budget holds {budget_bytes:,} bytes of weights; the smallest types take "
                             f"{cheapest:,}")
    step = max(1, -(-left // BUCKETS))
    n = left // step + len(free)  # room for the rounding; the capacity search below keeps what truly fits
    inf = np.inf
    best = np.zeros(n + 1)  # least summed score using at most b steps
    picks = []
    for u in free:
        opts = [(t, round(u.bytes(t) / step), score[u.name][t]) for t in u.candidates() if t in score[u.name]]
        new, pick = np.full(n + 1, inf), np.full(n + 1, -1, dtype=np.int16)
        for j, (_t, w, d) in enumerate(opts):
            if w > n:
                continue
            cand = np.full(n + 1, inf)
            cand[w:] = best[:n + 1 - w] + d
            better = cand < new
            new[better], pick[better] = cand[better], j
        best = new
        picks.append((opts, pick))
    for cap in range(n, -1, -1):  # bytes rounded to the nearest step: the first capacity whose answer truly fits
        if not np.isfinite(best[cap]):
            break
        types, b = dict(fixed), cap
        for u, (opts, pick) in zip(reversed(free), reversed(picks)):
            t, w, _d = opts[pick[b]]
            types[u.name] = t
            b -= w
        if sum(u.bytes(types[u.name]) for u in units) <= budget_bytes:
            break
    else:
        types = {}
    if not types or sum(u.bytes(types[u.name]) for u in units) > budget_bytes:
        types = {**{u.name: min(u.candidates(), key=u.bytes) for u in free}, **fixed}
    return _plan(_fill(types, free, score, budget_bytes - sum(u.bytes(types[u.name]) for u in units)), units, sens,
                 budget_bytes)


def _fill(types: dict[str, str], free: list[Unit], score: dict[str, dict[str, float]], room: int) -> dict[str, str]:
    """Spend the bytes the rounding left: the upgrade that lowers the score most and fits, until none does."""
    types = dict(types)
    while True:
        best = None
        for u in free:
            now = types[u.name]
            for t in u.candidates():
                if t not in score[u.name]:
                    continue
                extra, gain = u.bytes(t) - u.bytes(now), score[u.name][now] - score[u.name][t]
                if 0 <= extra <= room and gain > 0 and (best is None or gain > best[0]):
                    best = (gain, u, t, extra)
        if best is None:
            return types
        _gain, u, t, extra = best
        types[u.name], room = t, room - extra


def _plan(types: dict[str, str], units: list[Unit], sens: Sensitivity, budget_bytes: int) -> Allocation:
    used = sum(u.bytes(types[u.name]) for u in units)
    return Allocation({u.name: types[u.name] for u in units}, used,
                      sens.base_kld + sum(sens.delta[u.name][types[u.name]] for u in units), budget_bytes)


def held_gates(units: list[Unit], free: Allocation) -> dict[str, str]:
    """The gate A/B's held arm: every gate unit at the type the free allocation gave most of the other units'
    weights (the allocation's base type), or the type nearest it in bits that the unit takes. Units of either
    format (GGUF tensors, ONNX nodes: quant.allocate_onnx) say their own bits per weight."""
    weight: dict[str, int] = {}
    for u in units:
        if not u.is_gate:
            weight[free.types[u.name]] = weight.get(free.types[u.name], 0) + u.n_elements
    if not weight:
        return {u.name: free.types[u.name] for u in units}
    base = max(weight, key=weight.get)
    ref = next(u for u in units if free.types[u.name] == base and not u.is_gate).bits(base)
    return {u.name: min(u.candidates(), key=lambda t: abs(u.bits(t) - ref)) for u in units if u.is_gate}


def _bits(t: str) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
    return 8 * size / block


def budget_from(units: list[Unit], total_elements: int, other_bytes: int, header_bytes: int,
                target_bpw: float | None, target_bytes: int | None, float_bytes: int) -> int:
    """The units' byte budget for a target in bits per weight (over every tensor, as llama.cpp counts it) or in file
    bytes (tensors and the header: metadata, tokenizer); a target below what the smallest types give or not below
    the float file is one line naming what is reachable, in the target's own unit. `other_bytes`: tensors that are
    no unit (norms)."""
    lo = sum(min(u.bytes(t) for t in u.candidates()) for u in units) + other_bytes  # tensor bytes, all cheapest
    if target_bytes is not None:
        want = target_bytes - header_bytes

        def say(b: int) -> str:  # tensor bytes as the file size a user asked in
            f = b + header_bytes
            return f"{f / 1e9:.3g} GB" if f >= 1e8 else f"{f:,} bytes"
    else:
        want = int(target_bpw * total_elements / 8)

        def say(b: int) -> str:
            return f"{8 * b / total_elements:.2f} bpw"
    if want < lo:
        raise QuantgateError(f"target {say(want)} is below the smallest file the candidate types give ({say(lo)}); "
                             f"nothing was written")
    if want >= float_bytes:
        raise QuantgateError(f"target {say(want)} is not below the float file ({say(float_bytes)}): nothing to "
                             f"allocate; nothing was written")
    return want - other_bytes


def allocate_gguf(src: str | Path, out: str | Path, target_bpw: float | None = None, target_bytes: int | None = None,
                  calib_data: str = "embedded", calib_windows: int = 8, ctx: int = 128, seed: int = 0,
                  threads: int | None = None, hold_gates: bool = False, imatrix: bool = False,
                  decode_floor: DecodeFloor | str | None = "auto", sensitivity: str = "auto",
                  types: tuple[str, ...] = (), quantize_factor: float | None = None,
                  sensitivity_time: str | None = None, executor: str | None = None) -> dict:
    """Write `out` from the F32/F16/BF16 GGUF `src` with per-tensor types chosen under the target (bits per weight
    over all tensors, or file bytes); `hold_gates` keeps the gate units at the allocation's base type (the A/B's
    held arm: the same budget, the gates given no more bits than most of the model); `imatrix`: every
    quantization, the measured ones and the written file, takes an importance matrix from the calibration windows;
    `decode_floor`: the file's decode speed ("auto", the default: auto_floor; None: none), predicted from per-type
    timings taken here with `threads`
    (quant.decode_cost), must not fall below it; `sensitivity`: "measured" (KLD per tensor and type), "gradient"
    (KLD predicted from the Fisher diagonal, quant.gradient), "calibrated" (the gradient scaled to one measured KLD
    per tensor), "proxy" (weight error, quant.proxy) or "auto" (the best whose predicted time fits
    `sensitivity_time`: parse_sensitivity_time, default AUTO_FACTOR x a plain quantize, at least AUTO_MIN_S);
    `executor` ("local" or "ray": quantgate.executor) runs the measured and calibrated probes;
    `types`: the candidate types allowed (parse_types; empty: all), e.g. leaving out IQ4_XS, whose quantizer is about
    3x slower than Q4_K's and whose CPU decode is slower than its size suggests; `quantize_factor` (default
    QUANTIZE_TIME; 0: no limit): with the proxy, which times each type's quantizer on its sampled rows, llama.cpp's
    quantizer on the chosen types is predicted to take at most that many times its time with every tensor at Q4_K,
    or a minute more (quant.proxy.quantize_time).
    The chosen types land in the file's metadata (quantgate.allocation.*) and, with the measured sensitivity, in
    `out`.allocation.json. Returns that summary."""
    if (target_bpw is None) == (target_bytes is None):
        raise QuantgateError("give one target: --target-bpw or --target-size")
    if target_bpw is not None and not 1.0 <= target_bpw <= 32.0:
        raise QuantgateError(f"--target-bpw must be between 1 and 32, got {target_bpw}")
    factor = QUANTIZE_TIME if quantize_factor is None else quantize_factor
    if not (np.isfinite(factor) and (factor == 0 or factor >= 1)):
        raise QuantgateError(f"--quantize-time must be 0 (no limit) or at least 1 (times a Q4_K quantize), got "
                             f"{quantize_factor}")
    src, out = Path(src), Path(out)
    units = units_of(src, types)
    if not units:
        raise QuantgateError(f"{src} has no tensor llama.cpp quantizes")
    side = out.with_name(out.name + ".allocation.json")
    check_output(out, "gguf", (src, *data_paths(calib_data)))
    check_output(side, "allocation", (src,))
    tensors = open_reader(src).tensors
    total = sum(int(np.prod([int(d) for d in t.shape])) for t in tensors)
    float_bytes = sum(int(t.n_bytes) for t in tensors)
    header = (src.stat().st_size - float_bytes + 32 * len(tensors)  # + each tensor's alignment padding, at most
              + _metadata_bytes(units))

    def budget_for(kept: list[Unit]) -> int:  # what llama.cpp leaves in float keeps its source bytes
        names = {u.name for u in kept}
        other = sum(int(t.n_bytes) for t in tensors if t.name not in names)
        return budget_from(kept, total, other, header, target_bpw, target_bytes, float_bytes)

    budget_for(units)  # a target out of reach is refused before anything is measured
    if sensitivity not in SENSITIVITIES:
        raise QuantgateError(f"--sensitivity must be one of {', '.join(SENSITIVITIES)}, got {sensitivity!r}")
    seconds, factor_s = parse_sensitivity_time(sensitivity_time)
    executor = open_executor(executor)  # a cluster that cannot be joined is refused before any work
    if sensitivity_time is not None and sensitivity != "auto":
        raise QuantgateError("--sensitivity-time is the time budget of --sensitivity auto")
    clock = _Phases()
    choice = floor_auto = None
    if sensitivity == "auto" or decode_floor == "auto":
        rate = quantizer_speeds(src, units, threads)
        time_budget = auto_budget(seconds, factor_s, plain_quantize_s(units, rate))
    if sensitivity == "auto":
        choice = auto_sensitivity(src, units, calib_windows, ctx, threads, rate, time_budget)
        sensitivity, calib_windows = choice.kind, choice.windows
        clock.lap("auto choice")
    im = _importance(src, calib_data, calib_windows, ctx, seed) if imatrix else None
    if sensitivity == "proxy":
        sens = proxy_sensitivity(src, units, im, seed=seed, threads=threads)
    elif sensitivity == "measured":
        sens = measure_sensitivity(src, units, calib_data, calib_windows, ctx, seed, threads, out.parent, im, executor)
    else:
        sens = gradient_sensitivity(src, units, calib_data, calib_windows, ctx, seed, threads, im)
        if sensitivity == "calibrated":
            sens = calibrated_sensitivity(src, units, sens, calib_data, calib_windows, ctx, seed, threads, out.parent,
                                          im, executor)
    units = [u for u in units if u.name in sens.delta]  # llama.cpp quantizes these
    clock.lap("sensitivity")
    cost = limit = None
    if decode_floor == "auto":
        decode_floor, floor_auto = auto_floor(src, units, budget_for(units), rate, time_budget, threads, out.parent,
                                              im)
        clock.lap("decode floor: standard sizes")
    if decode_floor is not None:
        kinds = tuple(sorted({t for u in units for t in u.candidates()}))
        cost = measure_decode_cost(src, units, BASE, kinds, decode_floor.reference, threads, out.parent, im)
        limit = cost.plan_limit_s(decode_floor, units)
        clock.lap("decode_cost")

    def quant_for(kept: list[Unit]) -> QuantizeTime | None:  # the proxy timed each type's quantizer
        return quantize_time(kept, sens.quantize_s, factor, threads) if sens.quantize_s else None

    def plan_for(kept: list[Unit], limited: bool = True) -> Allocation:
        budget, q = budget_for(kept), quant_for(kept) if limited else None
        if cost is not None and not hold_gates:  # the held arm holds the gates, which the floor's recipe does not
            return floor_plan(kept, sens, budget, cost, limit, decode_floor, q)
        p = allocate(kept, sens, budget, None, cost, limit, q)
        return allocate(kept, sens, budget, held_gates(kept, p), cost, limit, q) if hold_gates else p

    def write(plan: Allocation) -> GGUFInfo:
        written = run_quantizer(src, raw, BASE, overrides(plan.types), im, threads=threads, shown=out)
        _check_types({n: (t, written.tensor_types.get(n)) for n, t in plan.types.items()
                      if written.tensor_types.get(n) != t})
        clock.lap("llama.cpp quantizer")
        return written

    plan = plan_for(units)
    clock.lap("allocation")
    target = f"{target_bpw:g} bpw" if target_bpw is not None else f"{target_bytes} bytes"
    measured = sens.in_kld
    with atomic_path(out, "gguf") as tmp:
        fd, name = tempfile.mkstemp(prefix=".quantgate-alloc-", suffix=GGUF_SUFFIX, dir=tmp.parent)
        os.close(fd)
        raw = Path(name)  # llama.cpp's file, before the type map joins its metadata
        try:
            for attempt in range(2):
                written = run_quantizer(src, raw, BASE, overrides(plan.types), im, threads=threads, shown=out)
                mismatch = {n: (t, written.tensor_types.get(n)) for n, t in plan.types.items()
                            if written.tensor_types.get(n) != t}
                kept_float = {n for n, (_t, w) in mismatch.items() if w in FLOAT_TYPES}
                if attempt == 0 and mismatch and set(mismatch) == kept_float:
                    # the proxy path learns here what llama.cpp leaves in float (the measured path learnt it from
                    # its base file): those tensors keep their source bytes, the rest is planned again and written
                    units = [u for u in units if u.name not in kept_float]
                    plan = plan_for(units)
                    continue
                break
            clock.lap("llama.cpp quantizer")
            _check_types(mismatch)
            tries: list[dict] = []
            # the written file against the floor; a file measurably slower asks the model for more speed. The
            # floor's own recipe is not timed: its tensor types are the floor file's.
            while cost is not None and plan.recipe is None:
                check = floor_check(raw, src, decode_floor, threads, out.parent, im)
                tries.append({**check.to_dict(), "predicted_tps": 1 / plan.predicted_decode_s})
                clock.lap("floor check")
                if check.met:
                    break
                recipe = None if hold_gates else recipe_plan(units, sens, cost, decode_floor, budget_for(units))
                if len(tries) == FLOOR_TRIES and recipe is None:
                    raise floor_missed("file", check.written_tps, check.floor_tps, len(tries))
                limit *= check.ratio
                try:
                    plan = plan_for(units) if len(tries) < FLOOR_TRIES else recipe
                except QuantgateError as e:
                    if "decode floor out of reach" not in str(e):
                        raise
                    raise floor_missed("file", check.written_tps, check.floor_tps) from None
                written = write(plan)
            meta = {f"{META}.target": target, f"{META}.sensitivity": sens.kind, f"{META}.hold_gates": hold_gates,
                    f"{META}.imatrix": imatrix, f"{META}.types_allowed": ",".join(types) if types else "all",
                    f"{META}.calibration": (f"{calib_data}: {sens.windows} windows of {sens.ctx} tokens" if measured
                                            else f"{sens.data}: {sens.windows} sampled rows per tensor"),
                    f"{META}.tensor_types": [f"{n}={t}" for n, t in plan.types.items()]}
            if choice is not None:
                meta[f"{META}.sensitivity_auto"] = choice.words()
            if floor_auto is not None and cost is None:
                meta[f"{META}.decode_floor"] = f"auto {floor_auto['why']}"
            if measured:
                meta[f"{META}.predicted_kld"] = float(plan.predicted_kld)
            if cost is not None:
                meta[f"{META}.decode_floor"] = (("auto: " if floor_auto else "")
                                                + floor_words(decode_floor, plan, tries))
                meta[f"{META}.predicted_decode_tps"] = float(1 / plan.predicted_decode_s)
            quant = quant_for(units)
            if quant is not None:
                meta[f"{META}.quantize_time"] = (
                    f"at most {factor:g}x llama.cpp's quantizer time with every tensor at Q4_K (Q5_0 on shorter rows), or "
                    f"{quant.slack_s:.0f} s more (limit {quant.limit_s:.0f} s predicted here on {quant.threads} "
                    f"threads; this file {quant.predict(units, plan.types):.0f} s)")
            copy_with_metadata(raw, tmp, meta)
            clock.lap("metadata copy")
        finally:
            raw.unlink(missing_ok=True)
    summary = {"src": str(src), "out": str(out), "target_bpw": target_bpw, "target_bytes": target_bytes,
               "bytes": out.stat().st_size, "bits_per_weight": round(written.bits_per_weight, 4),
               "sensitivity_kind": sens.kind, **({"sensitivity_auto": choice.to_dict()} if choice else {}),
               **({"decode_floor_auto": floor_auto} if floor_auto else {}),
               "predicted_kld": plan.predicted_kld if measured else None,
               **({} if measured else {"predicted_proxy_error": plan.predicted_kld}),
               "hold_gates": hold_gates, "imatrix": imatrix, "types_allowed": list(types) or "all",
               "types": plan.types, "gate_types": {n: t for n, t in plan.types.items() if n.endswith(GATE_UNITS)},
               "sensitivity": sens.to_dict(), "seconds": clock.seconds}
    if quant is not None:
        summary["quantize_time"] = {**quant.to_dict(), "predicted_s": quant.predict(units, plan.types),
                                    **quantize_time_price(plan_for, units, quant, plan, measured)}
    if cost is not None:
        summary.update(decode_floor=str(decode_floor), floor_tps=1 / cost.limit_s(decode_floor),
                       predicted_decode_tps=1 / plan.predicted_decode_s, decode_cost=cost.to_dict(),
                       floor_checks=tries, floor_recipe=plan.recipe)
    write_json(side, summary, kind="allocation")
    return summary


def quantize_time_price(plan_for, units: list[Unit], quant: QuantizeTime, plan: Allocation, measured: bool) -> dict:
    """What the quantize-time limit cost: the allocation planned without it, its predicted quantizer seconds and
    predicted error (KLD, or the proxy's), beside the written one's."""
    try:
        free = plan_for(units, limited=False)
    except QuantgateError as e:  # e.g. a decode floor that only the limited plan met
        return {"binds": None, "unlimited": str(e)}
    word = "predicted_kld" if measured else "predicted_proxy_error"
    free_s = quant.predict(units, free.types)
    return {"binds": free_s > quant.limit_s, f"unlimited_{word}": free.predicted_kld, "unlimited_predicted_s": free_s,
            word: plan.predicted_kld}


def floor_words(floor: DecodeFloor, plan: Allocation, tries: list[dict], what: str = "file") -> str:
    """What the file's (or graph's) metadata says about its floor: the floor's own recipe, or the last check's
    numbers."""
    if plan.recipe is not None:
        return (f"{floor} (met by {plan.recipe}'s own {'tensor types' if what == 'file' else 'options'}: no "
                f"allocation predicted as fast was predicted to lose less"
                + (f"; {len(tries)} allocated {what}s were measurably slower" if tries else "") + ")")
    c = tries[-1]
    return (f"{floor} ({c['floor_tps']:.4g} tok/s here; the {what} measured {c['written_tps']:.4g}, median "
            f"per-round ratio {c['ratio_median']:.3f} over {c['rounds']} rounds)")


def _check_types(mismatch: dict) -> None:
    if mismatch:
        raise QuantgateError(f"llama.cpp wrote other types than the allocation asked for: {list(mismatch.items())[:3]}")


class _Phases:
    """Wall seconds per phase of an allocation (where the time goes at 9B is a measured question)."""
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._t, 2)
        self._t = now


META = "quantgate.allocation"  # the GGUF metadata keys the allocator adds (stock llama.cpp ignores them)


def _metadata_bytes(units: list[Unit]) -> int:
    """An upper bound on what the allocation's metadata adds to the file (the type map: each name, "=", a type)."""
    return 1024 + sum(len(u.name.encode()) + 16 for u in units)


def _importance(src: Path, calib_data: str, n_windows: int, ctx: int, seed: int) -> dict:
    """The importance matrix `quantize --imatrix auto` computes, from the same calibration windows."""
    loaded = load_checkpoint(src)
    check_ctx(ctx, loaded.model.cfg.max_seq_len, src)
    windows = calibration_windows(loaded.tokenizer, calib_data, n_windows, ctx, seed)
    return importance_matrix(loaded.model, windows)
