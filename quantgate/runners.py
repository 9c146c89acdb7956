"""One runner interface for every backend: token ids in, logits for every position out.

Metrics and reports only see `Runner`; the ONNX Runtime and llama.cpp runners implement the same
two members. Logits are float32 numpy arrays so backends compare without framework conversions.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .errors import QuantgateError
from .model import Model


def cuda_index(device: str) -> int | None:
    """None for the CPU, else the CUDA device index of 'cuda' (0) or 'cuda:N'."""
    if device == "cpu":
        return None
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise QuantgateError(f"--device {device!r} is not cpu, cuda or cuda:N")


def torch_device(device: str) -> str:
    """`device` if torch can run on it here (cpu, cuda, cuda:N), else one error line."""
    idx = cuda_index(device)
    if idx is not None:
        if not torch.cuda.is_available():
            raise QuantgateError(f"--device {device} was asked for but torch sees no CUDA device")
        if idx >= torch.cuda.device_count():
            raise QuantgateError(f"--device {device}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return device


class Runner(Protocol):
    name: str
    vocab_size: int

    def logits(self, windows: np.ndarray) -> np.ndarray:
        """windows: int64 [B, T] (each starting with BOS) -> float32 [B, T, V]."""
        ...


class TorchRunner:
    """Runs our PyTorch model; `batch_size` windows per forward to bound memory."""

    def __init__(self, model: Model, device: str = "cpu", batch_size: int = 8, name: str = "torch"):
        self.model = model.to(torch_device(device)).eval()
        self.device, self.batch_size, self.name = device, batch_size, name
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def logits(self, windows: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(windows), self.batch_size):
            idx = torch.as_tensor(windows[i:i + self.batch_size], device=self.device)
            out.append(self.model(idx).float().cpu().numpy())  # fp32 whatever the model's dtype
        return np.concatenate(out, axis=0)
