"""Run by the optimum interpreter (QUANTGATE_OPTIMUM_PYTHON: a venv with `quantgate[optimum]`, which .ci/run builds),
not by pytest: optimum-onnx pins transformers < 4.58, so it cannot share the test venv's transformers 5.

`python optimum_reference.py EXPORT_DIR IDS.npy OUT.npz`: optimum's ORTModelForCausalLM opens the export (its own
loader and KV-cache handling), scores IDS and continues them greedily for 6 tokens; OUT.npz holds the float64
logits and the generated ids.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

if __name__ == "__main__":
    from optimum.onnxruntime import ORTModelForCausalLM
    folder, ids_file, out = sys.argv[1:4]
    model = ORTModelForCausalLM.from_pretrained(folder, use_cache=True, use_io_binding=False)
    ids = torch.as_tensor(np.load(ids_file))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    np.savez(out, logits=logits.double().numpy(), generated=gen.numpy())
