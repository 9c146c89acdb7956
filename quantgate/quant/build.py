"""`quantize(source, scheme, out)`: one door to every backend's quantizer, chosen by the scheme's type.

torchao's `quantize_` dispatches on `type(config)` through a handler table; this is the same move for
whole artifacts: a TorchScheme writes a model directory (quant.torch_backend, PyTorch), a TorchBudget one with bits
per Linear (quant.allocate_torch), an OnnxScheme an ONNX
directory (quant.ort, onnxruntime.quantization), a GgufScheme a .gguf (quant.llama_cpp, llama.cpp's quantizer). Each
backend receives the config object itself and reads its fields, the keep override's bits and scope included. `quantgate quantize`
and the report's cells both call it, so a report cell's artifact is exactly what the CLI would write.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantgateError
from .allocate import allocate_gguf
from .allocate_onnx import allocate_onnx
from .allocate_torch import allocate_torch
from .llama_cpp import quantize_gguf
from .ort import quantize_onnx
from .torch_backend import quantize_checkpoint
from .schemes import GgufBudget, GgufScheme, OnnxBudget, OnnxScheme, TorchaoScheme, TorchBudget, TorchScheme
from .targets import parse_floor


@dataclass(frozen=True)
class CalibSettings:
    """Where calibration windows come from (schemes that need them: static activations, GPTQ, SmoothQuant,
    ONNX int8-static, GGUF imatrix)."""
    data: str = "embedded"
    windows: int = 32
    ctx: int = 256
    seed: int = 0


def _torch(src, s: TorchScheme, out, c: CalibSettings, threads, layerwise=None) -> dict:
    return quantize_checkpoint(src, s, out, c.data, c.windows, c.ctx, c.seed, layerwise)


def _torch_budget(src, s: TorchBudget, out, c: CalibSettings, threads) -> dict:
    return allocate_torch(src, out, s.target_bpw, c.data, c.windows, c.ctx, c.seed, s.hold_gates)


def _onnx(src, s: OnnxScheme, out, c: CalibSettings, threads) -> dict:
    return quantize_onnx(src, out, s, calib_data=c.data, calib_windows=c.windows, ctx=c.ctx, seed=c.seed)


def _gguf(src, s: GgufScheme, out, c: CalibSettings, threads) -> dict:
    return quantize_gguf(src, out, s, calib_data=c.data, calib_windows=c.windows, ctx=c.ctx, seed=c.seed,
                         threads=threads)


def _gguf_budget(src, s: GgufBudget, out, c: CalibSettings, threads) -> dict:
    floor = parse_floor(s.decode_floor) if s.decode_floor else None
    return allocate_gguf(src, out, s.target_bpw, s.target_bytes, c.data, c.windows, c.ctx, c.seed, threads,
                         s.hold_gates, s.imatrix, floor)


def _onnx_budget(src, s: OnnxBudget, out, c: CalibSettings, threads) -> dict:
    return allocate_onnx(src, out, s.target_bpw, s.target_bytes, c.data, c.windows, c.ctx, c.seed, threads,
                         s.hold_gates)


def _torchao(src, s: TorchaoScheme, out, c: CalibSettings, threads) -> dict:
    raise QuantgateError(f"torchao:{s.name} quantizes when the model is loaded: quantgate eval MODEL --torchao {s.name}")


HANDLERS = {TorchScheme: _torch, TorchBudget: _torch_budget, OnnxScheme: _onnx, OnnxBudget: _onnx_budget, GgufScheme: _gguf,
            GgufBudget: _gguf_budget, TorchaoScheme: _torchao}


def quantize(source: str | Path, scheme, out: str | Path, calib: CalibSettings = CalibSettings(),
             threads: int | None = None, layerwise: bool | None = None) -> dict:
    """Quantize `source` under `scheme` (a registry config: `quantgate.quant.get("gguf", "Q4_K_M")`) into `out`.
    `layerwise` (PyTorch schemes): True runs the model one block at a time whatever its size, False never, None
    when it does not fit in memory (the GGUF and ONNX quantizers always stream). Returns the backend's summary."""
    handler = HANDLERS.get(type(scheme))
    if handler is None:
        raise QuantgateError(f"not a quantization scheme: {scheme!r}")
    if handler is _torch:
        return handler(source, scheme, out, calib, threads, layerwise)
    if layerwise:
        raise QuantgateError("--layerwise applies to PyTorch schemes (a model directory); the llama.cpp and ONNX "
                             "quantizers always work a tensor at a time")
    return handler(source, scheme, out, calib, threads)
