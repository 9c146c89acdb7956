"""Which Linear inputs carry the quantization error: quantize one group at a time, measure each share.

Groups follow where outliers live: the attention input projections (q/k/v and the gate), o_proj (the
gated attention output), the MLP input projections (gate/up) and down_proj (the MLP's inner
activation, where DESIGN section 6 found almost all of the small twins' W8A8 error, in layer 0).
Each group, each layer, and each (layer, group) pair is quantized alone under the scheme; its KL
divergence from the float model is reported with its share of the sum over its kind.
"""
from __future__ import annotations

import copy

import numpy as np

from .calib_data import (calibration_split, check_ctx, data_paths, default_split, eval_windows, load_corpus,
                         sample_windows, tokenize_corpus)
from .errors import QuantgateError
from .evaluate import compare_to_reference
from .formats import load_checkpoint
from .fsio import check_output, write_json
from .model import Model, attention_only
from .progress import track
from .quant.schemes import TorchScheme as Scheme
from .quant.schemes import get
from .quant.simulate import quantize_
from .runners import TorchRunner

GROUPS = {
    "qkv_gate": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


def _in_group(name: str, group: str) -> bool:
    return name.endswith(GROUPS[group])


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


def attribute_error(model: Model, scheme: Scheme, calib: np.ndarray | None, windows: np.ndarray) -> dict:
    attention_only(model.cfg, "quantgate attribute")
    if scheme.weight_bits is None and scheme.act is None:
        raise QuantgateError(f"scheme {scheme.name} quantizes no Linear; there is nothing to attribute")
    ref = TorchRunner(model, name="float").logits(windows)

    def kld(only) -> float:
        q = quantize_(copy.deepcopy(model), scheme, calib, only=only)
        return compare_to_reference(TorchRunner(q, name=scheme.name), ref, windows)["kld_mean"]

    L = model.cfg.n_layers
    runs = [("all", None)] + [(("group", g), g) for g in GROUPS] + [(("layer", i), i) for i in range(L)] \
        + [(("cell", i, g), (i, g)) for i in range(L) for g in GROUPS]
    out: dict = {"scheme": scheme.name, "windows": len(windows), "groups": {}, "layers": {}, "cells": {}}
    for key, sel in track(runs, "attribute", total=len(runs)):
        if key == "all":
            out["kld_all"] = kld(None)
        elif key[0] == "group":
            out["groups"][sel] = kld(lambda n, g=sel: _in_group(n, g))
        elif key[0] == "layer":
            out["layers"][str(sel)] = kld(lambda n, i=sel: _layer_of(n) == i)
        else:
            i, g = sel
            out["cells"][f"{i}.{g}"] = kld(lambda n, i=i, g=g: _layer_of(n) == i and _in_group(n, g))
    for kind in ("groups", "layers", "cells"):
        total = sum(out[kind].values()) or 1.0
        out[f"{kind}_share"] = {k: v / total for k, v in out[kind].items()}
    return out


def attribute_model(model_path: str, scheme_name: str, data: str = "embedded", n_windows: int = 16,
                    n_calib: int = 16, ctx: int = 256, json_out: str | None = None) -> dict:
    """`quantgate attribute`: calibration from the valid split (embedded) and scoring on held-out text."""
    scheme = get("torch", scheme_name, "scheme")
    if json_out:
        check_output(json_out, "attribution", (model_path, *data_paths(data)), flag="--json")
    loaded = load_checkpoint(model_path)
    if loaded.tokenizer is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot tokenize the text")
    check_ctx(ctx, loaded.model.cfg.max_seq_len, model_path)
    corpus = load_corpus(data)
    test = corpus.split(default_split(data))
    windows = eval_windows(tokenize_corpus(test, loaded.tokenizer).ids, ctx, loaded.tokenizer.bos_id, n_windows)
    calib = None
    if scheme.needs_calibration:
        cal_split = corpus.split(calibration_split(data))
        calib = sample_windows(tokenize_corpus(cal_split, loaded.tokenizer), n_calib, ctx, seed=0)
    rep = {"model": str(model_path), **attribute_error(loaded.model, scheme, calib, windows)}
    if json_out:
        write_json(json_out, rep, kind="attribution")
    return rep
