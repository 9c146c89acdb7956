"""Our PyTorch model behind the Runner interface (float or simulated-quantized alike)."""
from __future__ import annotations

import numpy as np
import torch

from ..model import Model
from .device import torch_device


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
