"""Real integer kernels through torchao: `quantize_(model, Config())` on the block Linears.

int8-dynamic: Int8DynamicActivationInt8WeightConfig (int8 weights, per-token int8 activations; runs on
CPU and CUDA). int4-weight: Int4WeightOnlyConfig (group-wise int4 weights; CUDA only, bf16) in torchao's
`tile_packed_to_4d` format, whose matmul is PyTorch's own tinygemm kernel (`aten._weight_int4pack_mm`):
torchao 0.18's default `plain` format needs the separate `mslk` package, which nothing here installs. The fake-
quantized schemes in `quantgate.quant` measure accuracy anywhere; this backend is for speed where
torchao has kernels, and for checking that its accuracy matches the simulation.
"""
from __future__ import annotations

import torch

from ..errors import QuantgateError
from ..model import Model, attention_only
from .schemes import names
from ..runners import torch_device

TORCHAO_KINDS = tuple(names("torchao"))  # the registry's torchao entries


def quantize_torchao_(model: Model, kind: str, device: str = "cpu", group_size: int = 128) -> Model:
    attention_only(model.cfg, "torchao quantization")
    if kind not in TORCHAO_KINDS:
        raise QuantgateError(f"unknown torchao kind {kind!r}; choose from {', '.join(TORCHAO_KINDS)}")
    if kind == "int4-weight" and not str(device).startswith("cuda"):
        raise QuantgateError("torchao int4-weight needs a CUDA device (its kernels are GPU-only); use --device cuda")
    torch_device(device)
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        raise QuantgateError("the torchao backend needs torchao: pip install 'quantgate[torchao]'") from None
    if kind == "int8-dynamic":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        cfg = model.cfg
        widths = {"hidden size": cfg.dim, "o_proj input (heads x head_dim)": cfg.n_heads * cfg.head_dim,
                  "down_proj input (ffn)": cfg.ffn_dim}
        for what, w in widths.items():  # torchao would silently leave such a Linear unquantized
            if w % group_size:
                raise QuantgateError(f"torchao int4 group size {group_size} does not divide the {what} {w}")
        model = model.to(torch.bfloat16)
        config = Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d")
    model = model.to(device).eval()
    try:
        quantize_(model, config,
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn.startswith("layers."))
    except (ImportError, AssertionError, RuntimeError, NotImplementedError) as e:  # a kernel or package missing
        raise QuantgateError(f"torchao {kind} failed on {device}: {str(e).splitlines()[0][:160]}") from None
    model.cfg.extra = {**model.cfg.extra, "torchao": kind}
    return model
