"""`quantgate quantize --backend torch`: load a model, calibrate on held-out text, quantize it, save it.

The simulation itself (QuantLinear swaps, calibration, saved-scheme reload) lives in `quantgate.quant.simulate`;
its names are re-exported here for one release (`quantgate.quantize.quantize_`, `block_linears`, ...).
"""
from __future__ import annotations

from .calib_data import calibration_windows, check_ctx, data_paths
from .errors import QuantgateError
from .formats import load_checkpoint, save_checkpoint
from .fsio import check_output
from .layouts import DEFAULT_LAYOUT_FOR_GATE
from .quant.schemes import TorchScheme, get
from .quant.simulate import (Calibration, apply_saved_quantization, block_bits_per_weight, block_linears, calibrate,
                             quantize_, saved_quantization)

__all__ = ["quantize_checkpoint", "Calibration", "apply_saved_quantization", "block_bits_per_weight",
           "block_linears", "calibrate", "calibration_windows", "quantize_", "saved_quantization"]


def quantize_checkpoint(model_path: str, scheme: str | TorchScheme, out: str, calib_data: str = "embedded",
                        n_windows: int = 32, ctx: int = 256, seed: int = 0) -> dict:
    """Load, calibrate on held-out text, quantize, save. `scheme` is a registry config or its torch name."""
    if isinstance(scheme, str):
        scheme = get("torch", scheme, "scheme")
    inputs = (model_path, *data_paths(calib_data if scheme.needs_calibration else None))
    check_output(out, "checkpoint", inputs)
    loaded = load_checkpoint(model_path)
    if "quant_scheme" in loaded.model.cfg.extra:
        raise QuantgateError(f"{model_path} is already quantized ({loaded.model.cfg.extra['quant_scheme']['name']})")
    windows = None
    if scheme.needs_calibration:
        if loaded.tokenizer is None:
            raise QuantgateError(f"{model_path}: no tokenizer.json, cannot tokenize calibration text")
        check_ctx(ctx, loaded.model.cfg.max_seq_len, model_path)
        windows = calibration_windows(loaded.tokenizer, calib_data, n_windows, ctx, seed)
    model = quantize_(loaded.model, scheme, windows)
    model.cfg.extra = {**model.cfg.extra, "quant_state": saved_quantization(model),
                       "quantized_from": str(model_path)}
    layout = loaded.layout if loaded.layout != DEFAULT_LAYOUT_FOR_GATE[model.cfg.gate] else None
    save_checkpoint(model, out, loaded.tokenizer, layout=layout, inputs=inputs)
    return {"model": str(model_path), "scheme": scheme.to_dict(), "out": str(out),
            "calibration_windows": 0 if windows is None else len(windows)}
