"""Our PyTorch model behind the Runner interface (float or simulated-quantized alike)."""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from ..errors import QuantgateError
from ..model import Model
from ..quant.simulate import saved_kv_bits
from ..sampling import Done, NonFiniteLogits, Sampler, Token, stream
from .bench import bench
from .device import torch_device


class TorchRunner:
    """Runs our PyTorch model; `batch_size` windows per forward to bound memory. `kv_bits`: a quantized KV cache
    (k and v rounded per token and head), like llama.cpp's --kv-type; by default what the model's saved scheme
    asks for (kv-int8, kv-int4), else float."""

    def __init__(self, model: Model, device: str = "cpu", batch_size: int = 8, name: str = "torch",
                 kv_bits: int | None = None):
        self.model = model.to(torch_device(device)).eval()
        self.device, self.batch_size, self.name = device, batch_size, name
        self.vocab_size = model.cfg.vocab_size
        self.kv_bits = kv_bits if kv_bits is not None else saved_kv_bits(model)

    @torch.inference_mode()
    def logits(self, windows: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(windows), self.batch_size):
            idx = torch.as_tensor(windows[i:i + self.batch_size], device=self.device)
            out.append(self.model(idx, kv_bits=self.kv_bits).logits.float().cpu().numpy())  # fp32 whatever the dtype
        return np.concatenate(out, axis=0)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> np.ndarray:
        """An empty KV cache, then the prompt in one batch: the last position's logits (quantgate.sampling)."""
        m = self.model
        out = m(torch.tensor([ids], device=self.device), kv_bits=self.kv_bits)
        self._past, self._pos = out.past, len(ids)
        return out.logits[0, -1].float().cpu().numpy()

    @torch.inference_mode()
    def decode(self, token: int) -> np.ndarray:
        out = self.model(torch.tensor([[token]], device=self.device), past=self._past, start_pos=self._pos,
                         kv_bits=self.kv_bits)
        self._past, self._pos = out.past, self._pos + 1
        return out.logits[0, -1].float().cpu().numpy()

    def stream(self, ids: list[int], max_tokens: int, sampler: Sampler,
               stop_ids: tuple[int, ...] = ()) -> Iterator[Token | Done]:
        try:
            yield from stream(self, ids, max_tokens, sampler, stop_ids)
        except NonFiniteLogits:
            raise QuantgateError(f"{self.name}: the model produced NaN or Inf logits: its activations overflowed") \
                from None

    @torch.inference_mode()
    def time_round(self, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
        """Seconds to prefill `prefill_ids` in one batch from an empty KV cache, then decode `decode_ids` one at a
        time on it (the runners' bench protocol, quantgate.runners.bench)."""
        m, dev = self.model, self.device
        t0 = time.perf_counter()
        out = m(torch.tensor([prefill_ids], device=dev), kv_bits=self.kv_bits)
        if dev != "cpu":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        past, pos = out.past, len(prefill_ids)
        for t in decode_ids:
            out = m(torch.tensor([[t]], device=dev), past=past, start_pos=pos, kv_bits=self.kv_bits)
            past, pos = out.past, pos + 1
        if dev != "cpu":
            torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1

    def bench(self, prefill_ids: list[int], decode_ids: list[int], repeats: int = 5, warmup: int = 0) -> dict:
        """Medians over `repeats` rounds of `time_round` (quantgate.runners.bench)."""
        return bench([self], prefill_ids, decode_ids, rounds=repeats, warmup=warmup)[0]

    def close(self) -> None:
        """Nothing to release (the model stays the caller's); here so every runner has the same interface."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
