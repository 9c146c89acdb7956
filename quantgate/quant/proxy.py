"""The allocator's cheap sensitivity: importance-weighted weight error on sampled rows, for models too large to
measure (issue 36).

Measured sensitivity (quant.allocate.measure_sensitivity) is one llama.cpp quantization and one scored run per
tensor and type: hours at 0.8B on two cores, impossible at 9B. The proxy asks instead how much each tensor's
weights move when it takes each type:

    err(u, t) = sum over u's rows and columns of imp[col] * (w - dequant(quant_t(w)))^2

on `rows` sampled rows per tensor, scaled to all of them, where quant_t and dequant are ggml's own row functions
(the code llama.cpp's quantizer runs, called in the llama.cpp worker process) and imp is the importance matrix's
mean squared input per column (1 everywhere without one). A perturbation dW of a matmul changes its output by
dW x, whose expected squared norm is that sum; summed over tensors it stands for the KLD's increase when the
network's Jacobians are alike. They are not, and the proxy is weak: on the medium pair its allocations carry
2.4-3.4x the KLD (predicted from measured deltas) of measured ones, and its rank agreement across tensors at one
type is near zero (benchmarks/results/allocator_proxy.md). Treating the token embedding as a lookup (one row's
error, not the sum) was tried first and was far worse (it sent the embedding to Q2_K: 77-1132x), so no tensor is
rescaled. The proxy is in its own unit (squared output error), not KLD: `Sensitivity.kind` says "proxy", and the
allocation's predicted KLD is not stated.

Written by hand: no library ranks llama.cpp types per tensor from ggml's own quantization error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from ..errors import QuantgateError
from ..memory import note_child_peak
from ..progress import stage
from ..llama_worker import PEAK_PREFIX

ROWS = 256  # rows sampled per tensor: the error's relative spread over rows is small (checked by the benchmark)


def weight_errors(src: Path, units, im: dict | None = None, rows: int = ROWS, seed: int = 0,
                  threads: int | None = None, weights: dict | None = None) -> dict:
    """{unit name: {"err": {type: error}, "sq": squared norm, "rows": n, "sampled": rows sampled, "quantize_s":
    {type: CPU seconds on the sampled rows}}} for every unit, its candidate types and its reference_type, computed in
    the llama.cpp worker (a ggml abort ends in one line, not in this process) on `threads` threads (default: every
    core, as llama.cpp's quantizer). `weights` (quant.gradient.FisherRows.by_unit): per unit name (rows, per-element
    weights [k, row], each row's factor to the whole tensor), in place of `rows` rows drawn at random weighted by
    the importance matrix."""
    request = {"src": str(src), "rows": rows, "seed": seed, "threads": threads,
               "units": [[u.name, {t: _type_info(t) for t in dict.fromkeys((*u.candidates(), reference_type(u)))}]
                         for u in units]}
    with tempfile.TemporaryDirectory() as work:
        if im is not None:
            np.savez(Path(work) / "imatrix.npz", **im)
            request["imatrix"] = str(Path(work) / "imatrix.npz")
        if weights is not None:
            arrays = {}
            for j, u in enumerate(units):
                r, w, s = weights.get(u.name, (np.zeros(0, np.int64), np.zeros((0, u.row), np.float32),
                                               np.zeros(0, np.float32)))
                arrays.update({f"r{j}": r, f"w{j}": w, f"s{j}": s})
            np.savez(Path(work) / "weights.npz", **arrays)
            request["weights"] = str(Path(work) / "weights.npz")
        req, out = Path(work) / "request.json", Path(work) / "errors.json"
        req.write_text(json.dumps(request))
        with stage(f"weight error: {len(units)} tensors x their types, {rows} rows each"):
            proc = subprocess.run([sys.executable, "-m", "quantgate.llama_worker", "proxy", str(req), str(out)],
                                  capture_output=True, text=True, start_new_session=True)
        for line in (proc.stdout or "").splitlines():
            if line.startswith(PEAK_PREFIX + " ") and line.split()[-1].isdecimal():
                note_child_peak(int(line.split()[-1]))
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            raise QuantgateError(f"the weight-error proxy failed on {src}: "
                                 f"{lines[-1] if lines else f'exit code {proc.returncode}'}")
        return json.loads(out.read_text())


def _type_info(t: str) -> tuple[int, int, int]:
    q = GGMLQuantizationType[t]
    block, size = GGML_QUANT_SIZES[q]
    return int(q), block, size


def proxy_deltas(errors: dict, base: str) -> dict[str, dict[str, float]]:
    """Each unit's error at each type over its error at the base type."""
    return {name: {t: v - e["err"][base] for t, v in e["err"].items()} for name, e in errors.items()}


# The allocator's quantize-time limit (`quantize --quantize-time`): llama.cpp's quantizer on the allocated types may
# take at most this many times what it takes with every tensor at reference_type, or QUANTIZE_SLACK_S seconds more,
# whichever is longer. Why: ggml quantizes IQ4_XS about 3x slower than Q4_K (benchmarks/results/allocator_proxy.md),
# and an unlimited 9B allocation that chose it for the FFN took 2.1x a plain Q4_K_M quantize, most of it in
# llama.cpp's quantizer. The slack keeps a small model's allocation (a quantizer of seconds) free of the limit.
QUANTIZE_TIME = 1.5
QUANTIZE_SLACK_S = 60.0


def reference_type(u) -> str:
    """The type a plain Q4_K_M quantize gives most of a model's weights: Q4_K, or Q5_0 where rows are not a multiple
    of 256 (llama.cpp's fallback for Q4_K there). The quantize-time limit is a multiple of its time."""
    return "Q4_K" if u.row % 256 == 0 else "Q5_0"


def quantize_speeds(errors: dict) -> dict[str, float]:
    """CPU seconds per weight of each type's quantizer (one thread), over every unit's sampled rows."""
    secs: dict[str, float] = {}
    elements: dict[str, int] = {}
    for e in errors.values():
        n = e["sampled"] * e["row"]
        for t, v in e.get("quantize_s", {}).items():
            secs[t] = secs.get(t, 0.0) + v
            elements[t] = elements.get(t, 0) + n
    return {t: secs[t] / elements[t] for t in secs if elements[t] > 0}


@dataclass
class QuantizeTime:
    """llama.cpp's quantizer time on an assignment, predicted from each type's CPU seconds per weight (quantize_speeds)
    over the threads it runs on (`extra`: wall seconds per weight), against the limit the allocation must keep:
    max(factor x reference_s, reference_s + QUANTIZE_SLACK_S), reference_s every unit at reference_type."""
    extra: dict[str, float]
    reference_s: float
    limit_s: float
    factor: float
    threads: int
    slack_s: float = QUANTIZE_SLACK_S

    def predict(self, units, types: dict[str, str]) -> float:
        """Predicted wall seconds of llama.cpp's quantizer on `types` (unit name -> type)."""
        return sum(u.n_elements * self.extra.get(types[u.name], 0.0) for u in units)

    def to_dict(self) -> dict:
        return {"factor": self.factor, "slack_s": self.slack_s, "reference": "every tensor at Q4_K (Q5_0 where "
                "rows are not a multiple of 256)", "reference_s": self.reference_s, "limit_s": self.limit_s,
                "threads": self.threads, "cpu_s_per_weight": {t: v * self.threads for t, v in self.extra.items()}}


def quantize_time(units, speeds: dict[str, float], factor: float, threads: int | None) -> QuantizeTime | None:
    """The quantize-time limit for `units` from the measured `speeds` (None: no limit, factor 0, or a type untimed)."""
    if not factor or any(t not in speeds for u in units for t in (*u.candidates(), reference_type(u))):
        return None
    n = threads or os.cpu_count() or 1
    extra = {t: v / n for t, v in speeds.items()}
    ref = sum(u.n_elements * extra[reference_type(u)] for u in units)
    return QuantizeTime(extra, ref, max(factor * ref, ref + QUANTIZE_SLACK_S), factor, n, QUANTIZE_SLACK_S)
