"""One cell = one twin x backend x scheme: its artifact built by the functions `quantgate quantize` and `quantgate
export` call, scored against the twin's float logits, timed by the runners' one bench protocol, and cached."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ..errors import DiskFull, QuantgateError
from ..evaluate import evaluate_model
from ..export.gguf import export_checkpoint as export_gguf
from ..export.onnx import export_checkpoint as export_onnx
from ..formats import inspect_gguf, load_checkpoint
from ..formats.onnx_io import onnx_bytes
from ..fsio import atomic_file, interrupts, write_json
from ..gate_survival import check_gate_survival
from ..identity import key as ident_key
from ..info import model_info
from ..progress import console, stage
from ..quant import get as registry_get
from ..quant.build import CalibSettings, quantize
from ..runners import TorchRunner
from ..runners.bench import bench
from ..runners.open import fixed_ctx, open_runner
from .settings import BENCH_TOKENS, GATE_SURVIVAL_WINDOWS, Identity, ReportSettings

BENCH_ROUNDS = 3  # timed rounds per artifact (after one warm-up round), medians reported
PREFILL = 128     # the speed runs prefill this many tokens, then decode the rest of BENCH_TOKENS one at a time


class Artifacts:
    """Exported and quantized files under OUT/artifacts, each reused only while the key of what produced it still
    matches; otherwise it is built again. Each key is its own file (OUT/artifacts/.keys/), written once the artifact
    is complete, so that cells built side by side (report --executor ray) never write over each other's;
    artifacts/keys.json is the index of them all, written by the run."""

    def __init__(self, root: Path):
        self.root, self.file, self.dir = root, root / "keys.json", root / ".keys"
        self.log: dict[str, dict] = {}

    def _key_file(self, rel: str) -> Path:
        return self.dir / (rel.replace("/", "__") + ".key")

    def key_of(self, rel: str) -> str | None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return self._key_file(rel).read_text()
        return None

    def get(self, path: Path, k: str, build) -> Path:
        rel = path.relative_to(self.root).as_posix()
        if self.key_of(rel) == k and path.exists():
            self.log.setdefault(rel, {"key": k, "built": False})  # built earlier in this run stays "built"
            return path
        self._key_file(rel).unlink(missing_ok=True)  # no key while it is rebuilt: an interrupted build is not reused
        build(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        with atomic_file(self._key_file(rel), "w") as f:
            f.write(k)
        self.log[rel] = {"key": k, "built": True}
        return path

    def write_index(self) -> None:
        """artifacts/keys.json: every artifact's key, from the key files."""
        keys = {f.name[:-4].replace("__", "/"): f.read_text() for f in sorted(self.dir.glob("*.key"))} \
            if self.dir.is_dir() else {}
        write_json(self.file, keys)


def cached(path: Path, k: str, compute, label: str, timings: dict) -> dict:
    """`compute()`'s dict, stored at `path` with its key; a later run with the same key reads it back."""
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if isinstance(d, dict) and d.get("_key") == k:
                timings[label] = 0.0
                return d
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    t0 = time.time()
    console.print(f"[bold]{label}[/bold] ...")
    with stage(label):  # in a log, a line at least every 20 s while the cell builds and scores
        d = compute()
    d["_key"], d["_seconds"] = k, round(time.time() - t0, 2)
    timings[label] = d["_seconds"]
    write_json(path, d)
    return d


def _speed(runner, ids: list[int], kv: str) -> dict:
    """The runners' one bench protocol (quantgate.runners.bench): one warm-up round, then medians; with the KV-cache
    type the timed runs used (`speed_kv`), which a cell's accuracy may have been scored with another of."""
    b = bench([runner], ids[:PREFILL], ids[PREFILL:BENCH_TOKENS], rounds=BENCH_ROUNDS, warmup=1)[0]
    return {"prefill_tps": b["prefill_tps"], "decode_tps": b["decode_tps"], "speed_kv": kv,
            "speed_protocol": f"prefill {PREFILL}, decode {BENCH_TOKENS - PREFILL}, median of {BENCH_ROUNDS} after 1 warm-up"}


def _metrics(ev: dict) -> dict:
    keys = ("ppl", "reference_ppl", "delta_ppl_pct", "kld_mean", "kld_p99", "top1_agreement", "n_tokens", "n_windows",
            "kld_mean_ci95", "delta_ppl_pct_ci95", "top1_agreement_ci95", "per_window", "windows_id")
    return {k: ev[k] for k in keys}


def _calib(s: ReportSettings) -> CalibSettings:
    return CalibSettings(s.data, s.calib_windows, s.ctx)


def torch_fp32_cell(model, ids: list[int]) -> dict:
    """The float reference of the torch rows: exact by definition, timed like every other cell."""
    return {"bits_per_weight": 32.0, "kld_mean": 0.0, "top1_agreement": 1.0, "delta_ppl_pct": 0.0,
            **_speed(TorchRunner(model), ids, "f32")}


def torch_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str, ids: list[int]) -> dict:
    src, sch = getattr(s, twin), registry_get("torch", scheme)
    k = ident_key("torch", ident.code, ident.models[twin], scheme,
                  ident.calibration(s) if sch.needs_calibration else None)
    art = arts.get(arts.root / "torch" / f"{twin}-{scheme}", k, lambda p: quantize(src, sch, p, _calib(s)))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src)
    bits = model_info(str(art))["quantization"]["block_bits_per_weight"]  # the bits each stored Linear holds
    return {**_metrics(ev), "bits_per_weight": bits, "bytes": None, "layer_sqnr_db": ev.get("layer_sqnr_db"),
            "artifact": str(art)}


def base_artifact(s: ReportSettings, ident: Identity, arts: Artifacts, backend: str, twin: str) -> tuple[Path, str]:
    """(path, key) of the float export every quantized cell of `backend` and `twin` starts from, built if missing."""
    src = getattr(s, twin)
    if backend == "gguf":
        k = ident_key("gguf-F32", ident.code, ident.models[twin])
        return arts.get(arts.root / "gguf" / f"{twin}-F32.gguf", k, lambda p: export_gguf(src, p, "f32")), k
    k = ident_key("onnx-fp32", ident.code, ident.models[twin])
    return arts.get(arts.root / "onnx" / f"{twin}-fp32", k, lambda p: export_onnx(src, p)), k


def onnx_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str, ids: list[int]) -> dict:
    src, sch = getattr(s, twin), registry_get("onnx", scheme)
    fp32, k32 = base_artifact(s, ident, arts, "onnx", twin)
    art = fp32
    if sch.tool != "export":
        k = ident_key("onnx", k32, scheme, ident.calibration(s) if sch.needs_calibration else None)
        art = arts.get(arts.root / "onnx" / f"{twin}-{scheme}", k, lambda p: quantize(fp32, sch, p, _calib(s)))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src, threads=s.threads)
    n = load_checkpoint(src).model.num_params()
    size = onnx_bytes(art)
    return {**_metrics(ev), "bytes": size, "bits_per_weight": 8 * size / n, "artifact": str(art), "speed_kv": "f32"}


def gguf_cell(s: ReportSettings, ident: Identity, arts: Artifacts, twin: str, scheme: str, ids: list[int]) -> dict:
    src, root, sch = getattr(s, twin), arts.root / "gguf", registry_get("gguf", scheme)
    kv = sch.kv_type or "f32"  # kv-*: F16 weights, quantized KV cache: what a laptop would run
    scheme_file = "F16" if sch.kv_type else scheme
    if scheme_file == "F16":
        art = arts.get(root / f"{twin}-F16.gguf", ident_key("gguf-F16", ident.code, ident.models[twin]),
                       lambda p: export_gguf(src, p, "f16"))
    else:
        f32, k32 = base_artifact(s, ident, arts, "gguf", twin)
        calib = ident.calibration(s) if sch.needs_calibration else []  # an imatrix or allocation depends on it
        art = arts.get(root / f"{twin}-{scheme_file}.gguf", ident_key("gguf", k32, scheme_file, *calib),
                       lambda p: quantize(f32, sch, p, _calib(s), threads=s.threads))
    ev = evaluate_model(str(art), s.data, s.ctx, max_windows=s.windows, reference=src, kv_type=kv, threads=s.threads)
    speed_kv = kv if kv != "f32" else "f16"  # llama.cpp's default: what a user runs (scored at f32 for parity)
    info = inspect_gguf(art)
    return {**_metrics(ev), "bytes": info.n_bytes, "bits_per_weight": info.bits_per_weight, "kv_type": kv,
            "kv_rotation": ev["kv_rotation"], "artifact": str(art), "speed_kv": speed_kv}


def cell_speed(s: ReportSettings, backend: str, cell: dict, ids: list[int]) -> dict:
    """A scored cell's prefill and decode speed (ONNX and GGUF artifacts; the torch rows are timed on the float
    model alone), by the runners' one bench protocol: timed apart from the scoring, so that a cluster run times every
    artifact on one node, one at a time."""
    if backend not in ("onnx", "gguf") or "artifact" not in cell:
        return {}
    art = Path(cell["artifact"])
    kw = dict(kv_type=cell["speed_kv"], logits_all=False) if backend == "gguf" else {}
    with open_runner(str(art), fixed_ctx(max(s.ctx, BENCH_TOKENS) if backend == "gguf" else BENCH_TOKENS, art),
                     threads=s.threads, **kw).runner as r:
        return _speed(r, ids, cell["speed_kv"])


CELLS = {"torch": torch_cell, "onnx": onnx_cell, "gguf": gguf_cell}  # backend -> how its cells are built and scored


def score_cell(s: ReportSettings, ident: Identity, arts: Artifacts, backend: str, twin: str, scheme: str,
               ids: list[int], speed: bool = True) -> dict:
    """One cell's numbers; a configuration this model cannot take is recorded as {"error": ...}, not fatal.
    A gated artifact also gets its gate-survival check (do the quantized gates still open and close as the
    float ones do). `speed` False: no timing (the cluster run times the cells apart, cell_speed)."""
    try:
        cell = CELLS[backend](s, ident, arts, twin, scheme, ids)
        if speed:
            cell.update(cell_speed(s, backend, cell, ids))
    except DiskFull:
        raise
    except QuantgateError as e:
        if interrupts:
            raise
        return {"error": str(e)}
    if twin == "gated" and not scheme.startswith("kv-"):
        gs = check_gate_survival(cell["artifact"], s.gated, s.data, GATE_SURVIVAL_WINDOWS, s.ctx)
        cell["gate_survival"] = {k: gs[k] for k in ("worst_layer", "worst_mean_abs_diff", "max_frac_crossed_0.5")}
    return cell
