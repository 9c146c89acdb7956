"""The PyTorch backend of `quantgate quantize`: load a model, calibrate on held-out text, quantize it, save it.

The simulation itself (QuantLinear swaps, calibration, saved-scheme reload) lives in `quantgate.quant.simulate`.
"""
from __future__ import annotations

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..errors import QuantgateError
from ..formats import artifact_kind, load_checkpoint, save_checkpoint
from ..formats.hf import layout_for, open_hf
from ..fsio import check_output
from ..layerwise import needs_layerwise
from ..layouts import DEFAULT_LAYOUT_FOR_GATE
from .layerwise import quantize_layerwise
from .schemes import TorchScheme, get
from .simulate import quantize_, saved_quantization

__all__ = ["quantize_checkpoint"]


def quantize_checkpoint(model_path: str, scheme: str | TorchScheme, out: str, calib_data: str = "embedded",
                        n_windows: int = 32, ctx: int = 256, seed: int = 0, layerwise: bool | None = None) -> dict:
    """Load, calibrate on held-out text, quantize, save. `scheme` is a registry config or its torch name.

    A model directory whose fp32 weights do not fit in memory (or any, with `layerwise=True`) is quantized one
    block at a time and written as it goes (quantgate.quant.layerwise): the same file; False forbids that."""
    if isinstance(scheme, str):
        scheme = get("torch", scheme, "scheme")
    inputs = (model_path, *data_paths(calib_data if scheme.needs_calibration else None))
    check_output(out, "checkpoint", inputs)
    if artifact_kind(model_path) == "hf" and layerwise is not False:
        ckpt = open_hf(model_path, must_fit_block_by_block=True)
        if layerwise or needs_layerwise(ckpt.cfg):
            _check_not_quantized(ckpt.cfg, model_path)
            windows = _windows(scheme, ckpt.tokenizer, ckpt.cfg, model_path, calib_data, n_windows, ctx, seed)
            layout = layout_for(ckpt.cfg, ckpt.layout.name if ckpt.layout.name != DEFAULT_LAYOUT_FOR_GATE[
                ckpt.cfg.gate] else None)
            quantize_layerwise(ckpt, scheme, windows, out, layout, {"quantized_from": str(model_path)})
            return _summary(model_path, scheme, out, windows, True)
    elif layerwise:
        raise QuantgateError(f"--layerwise reads a model directory; {model_path} is a {artifact_kind(model_path)} file")
    loaded = load_checkpoint(model_path)
    _check_not_quantized(loaded.model.cfg, model_path)
    windows = _windows(scheme, loaded.tokenizer, loaded.model.cfg, model_path, calib_data, n_windows, ctx, seed)
    model = quantize_(loaded.model, scheme, windows)
    model.cfg.extra = {**model.cfg.extra, "quant_state": saved_quantization(model),
                       "quantized_from": str(model_path)}
    layout = loaded.layout if loaded.layout != DEFAULT_LAYOUT_FOR_GATE[model.cfg.gate] else None
    save_checkpoint(model, out, loaded.tokenizer, layout=layout, inputs=inputs)
    return _summary(model_path, scheme, out, windows, False)


def _check_not_quantized(cfg, model_path) -> None:
    if "quant_scheme" in cfg.extra:
        raise QuantgateError(f"{model_path} is already quantized ({cfg.extra['quant_scheme']['name']})")


def _windows(scheme: TorchScheme, tokenizer, cfg, model_path, calib_data, n_windows, ctx, seed):
    """The calibration windows a scheme needs (None for one that needs none)."""
    if not scheme.needs_calibration:
        return None
    if tokenizer is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot tokenize calibration text")
    check_ctx(ctx, cfg.max_seq_len, model_path)
    return calibration_windows(tokenizer, calib_data, n_windows, ctx, seed)


def _summary(model_path, scheme: TorchScheme, out, windows, layerwise: bool) -> dict:
    return {"model": str(model_path), "scheme": scheme.to_dict(), "out": str(out),
            "calibration_windows": 0 if windows is None else len(windows), "layerwise": layerwise}
