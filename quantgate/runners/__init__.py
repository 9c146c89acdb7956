"""One runner interface for every backend: token ids in, logits for every position out.

Metrics and reports only see `Runner`; the PyTorch (`runners.pytorch`), ONNX Runtime (`runners.ort`) and
llama.cpp (`runners.llama`) runners implement the same members: `logits(windows)`; `stream(ids, max_tokens,
sampler)`, generation as token records from quantgate.sampling's one loop and sampler (`generate` yields the ids);
`time_round(prefill, decode)` for the one bench protocol (`runners.bench`); `close()`. Logits are float32 numpy
arrays so backends compare without framework conversions.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .bench import bench
from .device import cuda_index, torch_device
from .llama import GenerationStats, LlamaRunner
from .ort import OrtRunner
from .pytorch import TorchRunner

__all__ = ["Runner", "bench", "TorchRunner", "OrtRunner", "LlamaRunner", "GenerationStats", "cuda_index", "torch_device"]


class Runner(Protocol):
    name: str
    vocab_size: int

    def logits(self, windows: np.ndarray) -> np.ndarray:
        """windows: int64 [B, T] (each starting with BOS) -> float32 [B, T, V]."""
        ...
