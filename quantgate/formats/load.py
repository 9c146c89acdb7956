"""`load_checkpoint(path)`: any artifact quantgate reads, into our PyTorch Model (mlx-lm's `utils.load`).

A model directory loads as it is (a quantgate-quantized one with its saved scheme); a .gguf file or an ONNX
export is dequantized, tensor by tensor, so analyze, info and the gate-survival check see what the file holds.
"""
from __future__ import annotations

from pathlib import Path

from .gguf import load_gguf_model
from .hf import Loaded, load_hf
from .kind import artifact_kind
from .onnx import load_onnx_model

READERS = {"gguf": load_gguf_model, "onnx": load_onnx_model}  # artifact kind -> its reader (else a model directory)


def load_checkpoint(path: str | Path, with_tokenizer: bool = True) -> Loaded:
    """Load any supported artifact into our Model (fp32, eval mode); a .gguf file or an ONNX export is
    dequantized (and always comes with the tokenizer it carries)."""
    reader = READERS.get(artifact_kind(path))
    return reader(Path(path)) if reader else load_hf(path, with_tokenizer)
