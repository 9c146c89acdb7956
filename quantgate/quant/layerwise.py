"""A PyTorch scheme applied to a checkpoint one decoder block at a time, the quantized checkpoint written as it goes.

The sequential pipeline of llm-compressor and AutoRound for quantgate's own schemes: the float model runs block by
block over every calibration window (quantgate.layerwise.LayerwiseModel), the Calibrator's hooks record what the
scheme needs from each block's Linears while it runs, and once a block has seen every window its Linears are
quantized, its tensors written into the output file at their offsets (formats.safetensors_stream), and its weights
dropped. Calibration reads the float model's activations, as the in-memory `quantize_` does (one pass, GPTQ Hessians
from float inputs), so the two paths write the same file. Peak memory: one block in fp32, its Hessians or samples,
the hidden states of every window, and the slice of the embedding being written.

SmoothQuant is not run this way: its statistics and its smoothing are a second pass per block (not built; refused).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import torch

from ..errors import QuantgateError
from ..formats.hf import HFCheckpoint, check_written, hf_tensors, write_side_files
from ..formats.safetensors_stream import SafetensorsWriter
from ..fsio import atomic_dir
from ..layerwise import LayerwiseModel, capture_layerwise
from ..layouts import GLOBAL_NAMES, Layout
from .schemes import TorchScheme
from .simulate import Calibration, Calibrator, block_linears, check_applies, check_windows, quant_state_of, \
    quantize_linears

DISK_MARGIN = 1 << 30  # free space kept beyond the file itself


def file_specs(ckpt: HFCheckpoint, layout: Layout) -> dict[str, tuple[str, tuple]]:
    """Every tensor the quantized checkpoint holds (their names, fp32, shapes), from meta tensors: nothing read."""
    meta = {k: torch.empty(s, device="meta") for k, s in ckpt.shapes.items()}
    return {t: ("F32", tuple(v.shape)) for t, v in hf_tensors(ckpt.cfg, layout, meta).items()}


def check_disk(out: str | Path, specs: dict) -> None:
    """Refuse before any work an output the disk cannot hold (the weights are written in fp32)."""
    need = sum(int(torch.Size(s).numel()) * 4 for _d, s in specs.values()) + DISK_MARGIN
    where = Path(out).absolute().parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise QuantgateError(f"{out}: the quantized checkpoint needs {need / 1e9:.1f} GB (fp32 weights), and "
                             f"{where} has {free / 1e9:.1f} GB free")


def quantize_layerwise(ckpt: HFCheckpoint, scheme: TorchScheme, windows: np.ndarray | None, out: str | Path,
                       layout: Layout, extra: dict, batch: int = 4) -> dict:
    """Write `ckpt` quantized under `scheme` to the checkpoint folder `out` (already checked by the caller), block
    by block. `extra`: what config.json records beside the scheme (quantized_from). Returns the quant_state."""
    cfg = ckpt.cfg
    check_applies(scheme, cfg)
    if scheme.smooth_alpha is not None:
        raise QuantgateError(f"scheme {scheme.name} (SmoothQuant) runs the whole model in memory, and {ckpt.path} "
                             f"does not fit: use w8a8-static or another scheme")
    if scheme.needs_calibration:
        check_windows(scheme, windows)
    specs = file_specs(ckpt, layout)
    check_disk(out, specs)
    lw = LayerwiseModel(ckpt)
    linears = block_linears(lw.model)
    cal = Calibrator(linears, scheme) if scheme.needs_calibration else None
    state: dict = {"act_ranges": {}, "weight_bits": {}, "group_sizes": {}}
    with atomic_dir(out, "checkpoint") as tmp:
        writer = SafetensorsWriter(tmp / "model.safetensors", specs, {"format": "pt"})
        try:
            def finish(i: int, block: torch.nn.Module) -> None:
                prefix = f"layers.{i}."
                mine = {n: m for n, m in linears.items() if n.startswith(prefix)}
                quantize_linears(lw.model, mine, scheme, cal.take(list(mine)) if cal else Calibration())
                part = quant_state_of(block.named_modules(prefix=f"layers.{i}"))
                for k in state:
                    state[k].update(part[k])
                for theirs, t in hf_tensors(cfg, layout, {prefix + k: v for k, v in block.state_dict().items()}
                                            ).items():
                    writer.write(theirs, t)

            label = f"quantize {scheme.name} layer by layer"
            if cal is not None:
                capture_layerwise(lw, windows, pre=cal.hooks(), batch=batch, label=label, after_block=finish)
            else:
                for i, block in lw.blocks(label):
                    finish(i, block)
            _write_globals(lw, layout, writer)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        out_cfg = dataclasses.replace(cfg, extra={**cfg.extra, "quant_scheme": scheme.to_dict(),
                                                  "quant_state": state, **extra})
        write_side_files(tmp, out_cfg, layout, ckpt.tokenizer)
        check_written(tmp, out)
    return state


def _write_globals(lw: LayerwiseModel, layout: Layout, writer: SafetensorsWriter) -> None:
    """The embedding, the final norm and an untied head, which no scheme quantizes: the tables go from their stored
    dtype to fp32 a slice at a time inside the writer (exact), the norm through the layout's transform."""
    norm = {"norm.weight": lw.weights["norm.weight"]}
    for theirs, t in hf_tensors(lw.cfg, layout, norm).items():
        writer.write(theirs, t)
    for ours in ("embed_tokens.weight",) + (() if lw.cfg.tie_embeddings else ("lm_head.weight",)):
        writer.write(GLOBAL_NAMES[ours], lw.weights[ours])
