"""quantgate: quantize and deploy LLMs with gated attention, and measure what the gate does to outliers.

The public API, one function per verb of the CLI (the README's "verb -> module" table says where each lives):

    import quantgate as qg
    qg.train_model(qg.TrainConfig(preset="small", twins=True), "runs/a")
    loaded = qg.load_checkpoint("runs/a/gated")              # a model directory, a .gguf or an ONNX export
    qg.export_gguf("runs/a/gated", "gated.gguf")
    qg.quantize_artifact("gated.gguf", qg.scheme("gguf", "Q4_K_M+gate8"), "gated-q4.gguf")
    qg.evaluate_model("gated-q4.gguf", "embedded", ctx=256, reference="runs/a/gated")

Names load on first use (the lazy-loading pattern of SciPy's and scikit-image's packages, SPEC 1): importing
`quantgate` or running `quantgate --help` does not pay for torch, onnx and llama.cpp until something needs them.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute). No name is a submodule's (train, generate, analyze, ... are modules): Python
# sets a package attribute to each submodule it imports, which would shadow a function of the same name.
API = {
    "TrainConfig": ("quantgate.train", "TrainConfig"),
    "train_model": ("quantgate.train", "train"),
    "load_checkpoint": ("quantgate.formats", "load_checkpoint"),
    "save_checkpoint": ("quantgate.formats", "save_checkpoint"),
    "artifact_kind": ("quantgate.formats", "artifact_kind"),
    "export_gguf": ("quantgate.export.gguf", "export_checkpoint"),
    "export_onnx": ("quantgate.export.onnx", "export_checkpoint"),
    "scheme": ("quantgate.quant", "get"),
    "list_schemes": ("quantgate.quant", "listing"),
    "quantize_artifact": ("quantgate.quant.build", "quantize"),
    "CalibSettings": ("quantgate.quant.build", "CalibSettings"),
    "evaluate_model": ("quantgate.evaluate", "evaluate_model"),
    "generate_text": ("quantgate.generate", "generate"),
    "analyze_model": ("quantgate.analyze", "analyze"),
    "model_info": ("quantgate.info", "model_info"),
    "ReportSettings": ("quantgate.report", "ReportSettings"),
    "run_report": ("quantgate.report", "run_report"),
    "QuantgateError": ("quantgate.errors", "QuantgateError"),
}
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'quantgate' has no attribute {name!r}")
    module, attr = API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
