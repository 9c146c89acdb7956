"""Which device a runner was asked for: one parser for every backend's --device (cpu, cuda, cuda:N)."""
from __future__ import annotations

from ..errors import QuantgateError


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
    import torch  # here, not at the top: the ONNX Runtime and llama.cpp runners parse devices without torch
    idx = cuda_index(device)
    if idx is not None:
        if not torch.cuda.is_available():
            raise QuantgateError(f"--device {device} was asked for but torch sees no CUDA device")
        if idx >= torch.cuda.device_count():
            raise QuantgateError(f"--device {device}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return device
