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
import subprocess
import sys
import tempfile
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
                  threads: int | None = None) -> dict:
    """{unit name: {"err": {type: error}, "sq": squared norm, "rows": n}} for every unit and its candidate types,
    computed in the llama.cpp worker (a ggml abort ends in one line, not in this process) on `threads` threads
    (default: every core, as llama.cpp's quantizer)."""
    request = {"src": str(src), "rows": rows, "seed": seed, "threads": threads,
               "units": [[u.name, {t: _type_info(t) for t in u.candidates()}] for u in units]}
    with tempfile.TemporaryDirectory() as work:
        if im is not None:
            np.savez(Path(work) / "imatrix.npz", **im)
            request["imatrix"] = str(Path(work) / "imatrix.npz")
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
