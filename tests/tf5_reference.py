"""Run by a transformers-5 interpreter (the test venv's own, or QUANTGATE_TF5_PYTHON), not by pytest: stock
Qwen3.5 as the reference.

It imports only torch, transformers, safetensors and numpy, in a process of its own (one start-up for every job,
and nothing of quantgate's loaded beside it). `python tf5_reference.py JOBS.json` runs every job of the list
in one process (one start-up), each writing an .npz of float64 logits:

  ["logits", DIR, IDS.npy, OUT.npz]
      AutoModelForCausalLM.from_pretrained(DIR) on IDS: the full forward, and prefill(10) + one token at a time on
      transformers' own cache.
  ["make", SPEC.json, DIR, IDS.npy, OUT.npz]
      a random stock model from SPEC (a Qwen3_5TextConfig, or with "moe": true a Qwen3_5MoeTextConfig, or with
      "kind": "Qwen3" / "Qwen3Next" that model's Config and ForCausalLM; plus
      "multimodal": a tiny vision tower and the ConditionalGeneration class), weights drawn N(0, 0.1) (1-D ones 0.3 N(0, 1): norms stored zero-centred),
      saved with save_pretrained into DIR, and its logits on IDS.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch


def _forward(model, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        out = model(input_ids=ids[:, :10], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(10, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    return {"full": full.double().numpy(), "cached": torch.cat(steps, dim=1).double().numpy()}


def logits(folder: str, ids_file: str, out: str) -> None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    np.savez(out, cls=type(model).__name__, **_forward(model, torch.as_tensor(np.load(ids_file))))


def make(spec_file: str, folder: str, ids_file: str, out: str) -> None:
    import transformers
    spec = json.loads(open(spec_file).read())
    multimodal = spec.pop("multimodal", False)
    kind = spec.pop("kind", None) or ("Qwen3_5Moe" if spec.pop("moe", False) else "Qwen3_5")
    spec.pop("moe", None)
    text = getattr(transformers, f"{kind}TextConfig" if kind.startswith("Qwen3_5") else f"{kind}Config")(**spec)
    torch.manual_seed(0)
    if multimodal:
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 2,
                  "temporal_patch_size": 1, "spatial_merge_size": 1, "out_hidden_size": spec["hidden_size"]}
        cfg = getattr(transformers, f"{kind}Config")(text_config=text.to_dict(), vision_config=vision,
                                                    tie_word_embeddings=spec.get("tie_word_embeddings", False))
        model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg)
    else:
        model = getattr(transformers, f"{kind}ForCausalLM")(text)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape) if p.dim() == 1 else 0.1 * torch.randn(p.shape))
    model.eval()
    model.save_pretrained(folder)
    np.savez(out, cls=type(model).__name__, **_forward(model, torch.as_tensor(np.load(ids_file))))


if __name__ == "__main__":
    for job in json.loads(open(sys.argv[1]).read()):
        {"logits": logits, "make": make}[job[0]](*job[1:])
