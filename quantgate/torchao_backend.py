"""Real integer kernels through torchao: `quantize_(model, Config())` on the block Linears.

int8-dynamic: Int8DynamicActivationInt8WeightConfig (int8 weights, per-token int8 activations; runs on
CPU and CUDA). int4-weight: Int4WeightOnlyConfig (group-wise int4 weights; CUDA only, bf16). The fake-
quantized schemes in `quantgate.schemes` measure accuracy anywhere; this backend is for speed where
torchao has kernels, and for checking that its accuracy matches the simulation.
"""
from __future__ import annotations

import torch

from .errors import QuantgateError
from .model import Model

TORCHAO_KINDS = ("int8-dynamic", "int4-weight")


def quantize_torchao_(model: Model, kind: str, device: str = "cpu", group_size: int = 128) -> Model:
    if kind not in TORCHAO_KINDS:
        raise QuantgateError(f"unknown torchao kind {kind!r}; choose from {', '.join(TORCHAO_KINDS)}")
    if kind == "int4-weight" and not str(device).startswith("cuda"):
        raise QuantgateError("torchao int4-weight needs a CUDA device (its kernels are GPU-only); use --device cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise QuantgateError("--device cuda was asked for but torch sees no CUDA device")
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        raise QuantgateError("the torchao backend needs torchao: pip install 'quantgate[torchao]'") from None
    if kind == "int8-dynamic":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        if model.cfg.dim % group_size:
            raise QuantgateError(f"int4 group size {group_size} does not divide the model width {model.cfg.dim}")
        model = model.to(torch.bfloat16)
        config = Int4WeightOnlyConfig(group_size=group_size)
    model = model.to(device).eval()
    quantize_(model, config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn.startswith("layers."))
    model.cfg.extra = {**model.cfg.extra, "torchao": kind}
    return model
