"""What a path holds, decided in one place (mlx-lm's `utils.load` shape): every command that accepts "a model
directory, a .gguf or an ONNX export" asks `artifact_kind` instead of testing suffixes itself."""
from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"  # what a file needs to be read as a GGUF (a temporary one included)


def artifact_kind(path: str | Path) -> str:
    """"gguf" for a .gguf file, "onnx" for a model.onnx or a folder holding one, otherwise "hf" (a model
    directory; whether it exists and holds a model is the loader's check)."""
    p = Path(path)
    if p.suffix.lower() == GGUF_SUFFIX:
        return "gguf"
    if p.suffix.lower() == ".onnx" or (p.is_dir() and (p / "model.onnx").is_file()):
        return "onnx"
    return "hf"
