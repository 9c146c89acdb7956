"""Every file format quantgate reads or writes, one door per format (issue 12).

- `kind`: what a path holds (the one place that tests a suffix)
- `hf`: model directories (config.json + safetensors + tokenizer.json) in every layout, read and written
- `gguf_layout`: what a quantgate GGUF holds (names from gguf-py's constants), shared by writer and reader
- `gguf`: reading and checking a GGUF with gguf-py; dequantizing it into our Model
- `onnx_io`: the ONNX export's I/O spec and file checks, shared by exporter, runner and reader
- `onnx`: reading an ONNX export's weights back (dequantized) into our Model
- `load`: `load_checkpoint(path)` for any of them

The writers are `quantgate.export.gguf` / `quantgate.export.onnx` (and `save_checkpoint` here for directories).
"""
from .gguf import GGUFInfo, inspect_gguf
from .hf import Loaded, save_checkpoint
from .kind import artifact_kind
from .load import load_checkpoint

__all__ = ["GGUFInfo", "Loaded", "artifact_kind", "inspect_gguf", "load_checkpoint", "save_checkpoint"]
