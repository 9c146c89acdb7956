"""SmoothQuant (Xiao et al. 2023), the peer baseline for W8A8: move activation outliers into the weights.

For each group of Linears that read one RMSNorm's output (q/k/v/gate after input_layernorm; gate/up after
post_attention_layernorm), channel j is divided by s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha) in the
norm's weight and multiplied back into the Linears' columns: the float model is unchanged, the activations
are flatter. o_proj and down_proj inputs have no norm to fold into and are left as they are (as in the
reference implementation for Llama-style models).
"""
from __future__ import annotations

import numpy as np
import torch

from ..model import Model
from ..capture import capture


def _groups(model: Model):
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        yield f"layers.{i}.input_layernorm", layer.input_layernorm, [
            m for m in (att.q_proj, att.k_proj, att.v_proj, att.g_proj) if m is not None]
        yield f"layers.{i}.post_attention_layernorm", layer.post_attention_layernorm, [
            layer.mlp.gate_proj, layer.mlp.up_proj]


def channel_absmax(model: Model, windows: np.ndarray, batch: int = 4) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of every norm that feeds a smoothing group."""
    stats: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(_m, _a, out):
            a = out.detach().float().abs().reshape(-1, out.shape[-1]).amax(0)
            stats[name] = a if name not in stats else torch.maximum(stats[name], a)
        return hook

    capture(model, windows, post=[(norm, hook_for(name)) for name, norm, _ in _groups(model)], batch=batch,
            label="smoothquant stats")
    return stats


@torch.no_grad()
def smooth_(model: Model, windows: np.ndarray, alpha: float = 0.5) -> Model:
    """Apply the SmoothQuant rescaling in place; the float function of the model is preserved."""
    xmax = channel_absmax(model, windows)
    for name, norm, linears in _groups(model):
        wmax = torch.stack([m.weight.abs().amax(0) for m in linears]).amax(0)
        s = (xmax[name].clamp(min=1e-5) ** alpha / wmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
        norm.weight.div_(s.to(norm.weight.dtype))
        for m in linears:
            m.weight.mul_(s.to(m.weight.dtype)[None, :])
    return model
