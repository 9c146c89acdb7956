"""Kept at this path for one release: model directories are read and written by `quantgate.formats.hf`, and
`load_checkpoint` (any artifact) is `quantgate.formats.load_checkpoint`."""
from __future__ import annotations

from .formats.hf import (HFFields, Loaded, TensorSource, available_memory, check_fits_in_memory, check_tensor_headers,
                         check_tokenizer_fits, config_from_hf, config_to_hf, load_hf, read_state_dict, save_checkpoint,
                         tensor_plan, write_state_dict)
from .formats.load import load_checkpoint

__all__ = ["Loaded", "HFFields", "config_from_hf", "check_fits_in_memory", "available_memory", "config_to_hf",
           "TensorSource", "tensor_plan", "check_tensor_headers", "read_state_dict", "write_state_dict", "load_hf",
           "check_tokenizer_fits", "save_checkpoint", "load_checkpoint"]
