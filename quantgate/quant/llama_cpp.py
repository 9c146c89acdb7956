"""Quantize a GGUF with llama.cpp's own quantizer (`llama_model_quantize`), gate-aware if asked.

- `--type`: a llama.cpp file type (Q8_0 ... Q2_K); llama.cpp picks its usual per-tensor mixture.
- `--imatrix auto`: an importance matrix computed here in PyTorch (per input column, mean of x^2 over
  calibration tokens, keyed by GGUF tensor name: llama.cpp's imatrix convention) and handed to the
  quantizer in memory. PyTorch computes it because the model is ours to run; llama.cpp's imatrix tool
  would need a separate binary.
- `--gate-bits 8`: `attn_q` (q and gate rows, fused in one tensor in qwen35) stays Q8_0 through a
  per-tensor type override while everything else takes `--type`.

llama.cpp runs in a child process (`python -m quantgate.llama_worker quantize REQUEST`): a malformed file may
abort it.
The output is written to a temporary file and renamed.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..capture import capture
from ..errors import DiskFull, QuantgateError
from ..formats import load_checkpoint
from ..formats.gguf import GGUFInfo, inspect_gguf
from ..formats.gguf_layout import EXPERT_TENSORS, GGUF_ARCHS, LINEAR_TO_GGUF, tiled_heads
from ..fsio import atomic_path, check_output
from ..llama_worker import PEAK_PREFIX
from ..memory import note_child_peak
from .schemes import GGUF_FILE_TYPES, NEEDS_IMATRIX, GgufScheme, ggml_type, llama_file_type, with_gate_bits

# llama.cpp file types that `quantgate quantize` offers -> enum llama_ftype (gguf-py's LlamaFileType)
FILE_TYPES = {t: llama_file_type(t) for t in GGUF_FILE_TYPES}
# KeepAt scope q_and_gate as a regex over tensor names: qwen35 fuses q and gate rows in attn_q, so the whole
# q|gate projection is the only scope a GGUF can keep (not attn_q_norm, not attn_qkv)
GATE_PATTERN = r"attn_q\.weight"
# A hybrid has a second gate, the GDN's z (attn_gate), kept with attn_q under --gate-bits; and its small per-head
# projections (ssm_alpha, ssm_beta: value heads x dim) always stay Q8_0, as llama.cpp's and ik_llama.cpp's recipes
# keep them high (ssm_conv1d llama.cpp never quantizes).
HYBRID_GATE_PATTERN = r"attn_(q|gate)\.weight"
HYBRID_KEPT = [[r"ssm_(alpha|beta)\.weight", "Q8_0"]]


def exact_overrides(assign: dict[str, str]) -> list:
    """One exact-name override per unit (llama.cpp searches each pattern in the tensor's name)."""
    return [[f"^{re.escape(n)}$", ggml_type(t)] for n, t in assign.items()]


def run_quantizer(src: Path, dst: Path, qtype: str, overrides: list, im: dict | None = None,
                  threads: int | None = None, shown: Path | None = None) -> GGUFInfo:
    """llama.cpp's quantizer on `src` into `dst` (a path the caller owns and removes on failure), in its child
    process: file type `qtype` with per-tensor `overrides` ([regex over tensor names, ggml_type id], the first that
    matches wins, as llama.cpp's --tensor-type) and an importance matrix. Returns the written file's header."""
    request = {"src": str(src), "dst": str(dst), "ftype": FILE_TYPES[qtype], "threads": threads or 0,
               "overrides": overrides}
    with tempfile.TemporaryDirectory() as work:
        if im is not None:
            np.savez(Path(work) / "imatrix.npz", **im)
            request["imatrix"] = str(Path(work) / "imatrix.npz")
        (Path(work) / "request.json").write_text(json.dumps(request))
        # its own session: a terminal's Ctrl-C reaches only us, and we stop the child (subprocess.run kills it)
        proc = subprocess.run([sys.executable, "-m", "quantgate.llama_worker", "quantize",
                               str(Path(work) / "request.json")],
                              capture_output=True, text=True, start_new_session=True)
    for line in (proc.stdout or "").splitlines():  # the quantizer's own peak (quantgate.memory)
        if line.startswith(PEAK_PREFIX + " ") and line.split()[-1].isdecimal():
            note_child_peak(int(line.split()[-1]))
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower() or "GGML_ASSERT" in ln),
                   lines[-1] if lines else f"exit code {proc.returncode}")
        if any("iostream error" in ln or "failed to write" in ln for ln in lines):
            raise DiskFull(f"cannot write {shown or dst}: llama.cpp's quantizer could not write it (disk full or "
                           f"file size limit); nothing was kept")
        raise QuantgateError(f"llama.cpp could not quantize {src} to {qtype}: {why.strip()[:200]}")
    return inspect_gguf(dst)


def gguf_scheme(scheme: GgufScheme | str, imatrix: str | None = None, gate_bits: int | None = None) -> GgufScheme:
    """The config a quantization runs: a registry config as given, or a file type's (its +gate8 variant for
    `gate_bits`, an importance matrix for `imatrix="auto"`). Checked here, in one line each: a KV-cache type is
    chosen at run time, some types need an importance matrix, and a keep override is 8-bit over the whole
    attn_q tensor (q|gate, the one scope a GGUF that stores q and gate rows together can hold)."""
    if isinstance(scheme, str):
        if imatrix not in (None, "auto"):
            raise QuantgateError(f"--imatrix must be 'auto' (computed from --calib-data), got {imatrix!r}")
        s = with_gate_bits("gguf", scheme.upper(), gate_bits)  # the registry says which types take a gate override
        s = replace(s, imatrix=True) if imatrix else s
    elif isinstance(scheme, GgufScheme):
        if imatrix is not None or gate_bits is not None:
            raise QuantgateError("imatrix and gate_bits come with a type's name; a registry config says its own")
        s = scheme
    else:
        raise QuantgateError(f"not a GGUF scheme: {scheme!r}")
    if s.kv_type:
        raise QuantgateError(f"gguf:{s.name} is a KV-cache type chosen at run time: quantgate eval/generate "
                             f"MODEL.gguf --kv-type {s.kv_type}")
    if s.file_type not in FILE_TYPES:
        raise QuantgateError(f"unknown GGUF type {s.file_type!r}; choose from {', '.join(FILE_TYPES)}")
    if s.file_type in NEEDS_IMATRIX and not s.imatrix:
        raise QuantgateError(f"{s.file_type} needs an importance matrix: add --imatrix auto")
    if s.keep and (s.keep.bits != 8 or s.keep.scope != "q_and_gate"):
        raise QuantgateError(f"gguf:{s.name} keeps {s.keep.scope} at {s.keep.bits} bits: a GGUF keeps the whole "
                             f"q|gate tensor (q_and_gate) at 8 bits")
    return s


def importance_matrix(model, windows: np.ndarray, batch: int = 4) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean of x^2 per input column of that tensor's input, over every token. A MoE's stacked
    expert tensor gets one such row per expert, concatenated in expert order (llama.cpp's layout: n_per_row x
    n_expert values), each over the tokens routed to that expert; an expert no calibration token reached gets ones
    (what quantizing without an importance matrix assumes)."""

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hook_for(name):
        def hook(_m, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    for mname, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if mname == "lm_head":
            gname = "output.weight" if not model.cfg.tie_embeddings else None
        elif mname.startswith("layers."):
            i, _, rest = mname[len("layers."):].partition(".")
            expert = _expert_slot(rest)
            gname = f"blk.{i}.{expert[0]}#{expert[1]}" if expert else \
                f"blk.{i}.{LINEAR_TO_GGUF[rest]}" if rest != "self_attn.g_proj" else None
        else:
            gname = None
        if gname:
            hooks.append((mod, hook_for(gname)))
    capture(model, windows, pre=hooks, batch=batch)
    im = {k: (sums[k] / counts[k]).numpy().astype(np.float32) for k in sums if "#" not in k}
    cfg = model.cfg
    for i in range(cfg.n_layers) if cfg.is_moe else ():
        for proj, theirs in EXPERT_TENSORS.items():
            n_in = cfg.expert_ffn_dim if proj.startswith("down") else cfg.dim
            key = f"blk.{i}.{theirs}"
            im[key] = np.concatenate([(sums[f"{key}#{j}"] / counts[f"{key}#{j}"]).numpy() if f"{key}#{j}" in sums
                                      else np.ones(n_in) for j in range(cfg.n_experts)]).astype(np.float32)
    for i in range(cfg.n_layers):  # ssm_out's input columns are the value channels, which the export reorders
        name = f"blk.{i}.{LINEAR_TO_GGUF['linear_attn.out_proj']}"
        if name in im:
            rows = (tiled_heads(cfg)[:, None] * cfg.linear_value_dim + torch.arange(cfg.linear_value_dim)).reshape(-1)
            im[name] = im[name][rows.numpy()]
    return im


def _expert_slot(rest: str) -> tuple[str, int] | None:
    """(GGUF stacked tensor, expert j) for `mlp.experts.{j}.{proj}` under a layer, else None."""
    parts = rest.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdecimal():
        return EXPERT_TENSORS[parts[3] + ".weight"], int(parts[2])
    return None


def quantize_gguf(src: str | Path, out: str | Path, scheme: GgufScheme | str, imatrix: str | None = None,
                  gate_bits: int | None = None, calib_data: str = "embedded", calib_windows: int = 32, ctx: int = 256,
                  seed: int = 0, threads: int | None = None) -> dict:
    """Quantize `src` (an F32/F16/BF16 GGUF) to `out`. Returns the tensor types and sizes of the result.

    `scheme`: the registry's config (`quantgate.quant.get("gguf", "Q4_K_M+gate8")`), whose file type, importance
    matrix and keep override are what runs; or a file type's name, with `imatrix="auto"` and `gate_bits`."""
    s = gguf_scheme(scheme, imatrix, gate_bits)
    qtype, gate_bits, imatrix = s.file_type, s.keep.bits if s.keep else None, "auto" if s.imatrix else None
    src, out = Path(src), Path(out)
    info = inspect_gguf(src)
    if info.file_type not in ("F32", "F16", "BF16"):
        raise QuantgateError(f"{src} is already quantized ({info.file_type}); quantize the F32/F16 export instead")
    if gate_bits and (GGUF_ARCHS[info.arch].read_gate == "none" or info.gate == "none"):
        raise QuantgateError(f"{src} has no attention gate (arch {info.arch}): --gate-bits applies to gated models")
    check_output(out, "gguf", (src, *data_paths(calib_data if imatrix else None)))

    im = None
    if imatrix == "auto":
        loaded = load_checkpoint(src)
        check_ctx(ctx, loaded.model.cfg.max_seq_len, src)
        windows = calibration_windows(loaded.tokenizer, calib_data, calib_windows, ctx, seed)
        im = importance_matrix(loaded.model, windows)

    hybrid = bool(info.recurrent_layers)
    kept = [[p, ggml_type(t)] for p, t in HYBRID_KEPT] if hybrid else []
    gate = [[HYBRID_GATE_PATTERN if hybrid else GATE_PATTERN, ggml_type(f"Q{s.keep.bits}_0")]] if s.keep else []
    with atomic_path(out, "gguf") as tmp:
        result = run_quantizer(src, tmp, qtype, gate + kept, im, threads, out)
    counts: dict[str, int] = {}
    for name, t in result.tensor_types.items():
        counts[t] = counts.get(t, 0) + 1
    return {"src": str(src), "out": str(out), "type": qtype, "imatrix": imatrix, "gate_bits": gate_bits,
            "bytes": out.stat().st_size, "src_bytes": src.stat().st_size,
            "bits_per_weight": round(result.bits_per_weight, 3), "tensor_type_counts": counts,
            "attn_q_types": sorted({t for n, t in result.tensor_types.items() if n.endswith(".attn_q.weight")}),
            **({"router_types": sorted({t for n, t in result.tensor_types.items() if n.endswith(".ffn_gate_inp.weight")}),
                "shared_expert_gate_types": sorted({t for n, t in result.tensor_types.items()
                                                    if n.endswith(".ffn_gate_inp_shexp.weight")})}
               if info.arch == "qwen35moe" else {}),
            **({"gdn_gate_types": sorted({t for n, t in result.tensor_types.items() if n.endswith(".attn_gate.weight")}),
                "kept_high": {n: t for n, t in result.tensor_types.items() if n.endswith(("ssm_alpha.weight",
                                                                                         "ssm_beta.weight"))}}
               if hybrid else {})}
