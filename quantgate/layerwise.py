"""A checkpoint too large for memory, run one decoder block at a time over every window.

The sequential pipeline of llm-compressor and AutoRound, for quantgate's PyTorch verbs: the model's structure lives
on the meta device (so hooks attach to its modules as usual); the hidden states of all windows are kept, [N, T, D]
in fp32 (134 MB for 32 windows of 256 at d 4096); each block's weights are read from the checkpoint
(formats.hf.CheckpointWeights, fp32 as the in-memory model holds them) when its turn comes, run over every window
batch by batch, and dropped before the next block is read. The embedding is looked up in its stored dtype and the
output head is applied a slice of the vocabulary at a time, so neither table is ever held in fp32. Peak memory: one
block in fp32, plus the stored embedding or head, plus the hidden states, plus one batch's logits.

The arithmetic is the in-memory model's (the same Block.forward on the same fp32 weights, batch by batch), so the
logits agree with it to rounding (the head's vocabulary slices are separate matrix products). Written here because
the libraries that do this (llm-compressor's sequential pipeline, accelerate's disk offload) run transformers'
models, not ours.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from .capture import Hook, hooked
from .errors import QuantgateError
from .formats.hf import HFCheckpoint, fp32_load
from .memory import release_freed
from .model import Model, pytorch_only, rope_cache
from .quant.simulate import apply_saved_quantization, saved_kv_bits
from .progress import track

VOCAB_SLICE = 1 << 15  # output-head rows converted to fp32 at a time (32768 x d 4096: 0.5 GB)


class LayerwiseModel:
    """`ckpt` (an opened, checked model directory) run block by block; see the module docstring."""

    def __init__(self, ckpt: HFCheckpoint):
        pytorch_only(ckpt.cfg, "the layer-by-layer path")  # it adds no position table to the embeddings
        self.ckpt, self.cfg = ckpt, ckpt.cfg
        with torch.device("meta"):
            self.model = Model(self.cfg).eval()
        if "quant_scheme" in self.cfg.extra:  # a quantgate-quantized checkpoint: its QuantLinears, on meta too
            apply_saved_quantization(self.model, self.cfg.extra, str(ckpt.path / "config.json"))
        self.kv_bits = saved_kv_bits(self.model)
        self.weights = ckpt.weights()

    def _load(self, module: torch.nn.Module, prefix: str) -> None:
        sd = {n: self.weights[prefix + n].float() for n, _ in module.named_parameters()}
        module.load_state_dict(sd, strict=True, assign=True)

    @staticmethod
    def _drop(module: torch.nn.Module) -> None:
        module.to("meta")  # its tensors are freed; the module objects (and any hooks on them) stay
        release_freed()  # and the memory goes back to the OS before the next block is read

    @torch.inference_mode()
    def hidden(self, windows: np.ndarray, batch: int = 4, probe: bool = False,
               on_layer: Callable[[int, int, torch.Tensor, torch.Tensor | None], None] | None = None,
               label: str = "layer by layer",
               after_block: Callable[[int, torch.nn.Module], None] | None = None) -> list[torch.Tensor]:
        """The last block's output for every window, as per-batch tensors: each block loaded once, run over every
        batch, dropped. on_layer(i, first_window, h, attention probabilities) after block i on each batch;
        after_block(i, block) once block i has run over every batch, before its weights are dropped."""
        cfg = self.cfg
        T = windows.shape[1]
        cos, sin = rope_cache(cfg, torch.arange(T))
        emb = self.weights["embed_tokens.weight"]  # stored dtype: one row per token is all a lookup reads
        hs = [emb[torch.as_tensor(windows[i:i + batch])].float() for i in range(0, len(windows), batch)]
        del emb
        release_freed()
        for i, block in self.blocks(label):
            for b, h in enumerate(hs):
                hs[b], _present, probs = block(h, cos, sin, None, probe, kv_bits=self.kv_bits)
                if on_layer is not None:
                    on_layer(i, b * batch, hs[b], probs)
                del _present, probs
            if after_block is not None:
                after_block(i, block)
        return hs

    def blocks(self, label: str = "layer by layer") -> Iterator[tuple[int, torch.nn.Module]]:
        """(i, block i with its weights loaded), one block resident at a time: each is dropped when the caller
        asks for the next."""
        n = self.cfg.n_layers
        for i in track(range(n), label, total=n, memory=True):
            block = self.model.layers[i]
            self._load(block, f"layers.{i}.")
            yield i, block
            self._drop(block)

    @torch.inference_mode()
    def iter_normed(self, windows: np.ndarray, batch: int = 4) -> Iterator[tuple[int, torch.Tensor]]:
        """(first window, final normed hidden state [b, T, D] fp32) batch by batch, after one block-by-block pass
        over all windows: what the output head reads."""
        hs = self.hidden(windows, batch)
        norm = self.model.norm
        self._load(norm, "norm.")
        for b, h in enumerate(hs):
            yield b * batch, norm(h)
            hs[b] = None  # this batch's hidden states are no longer needed
        self._drop(norm)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight in its stored dtype (the embedding's when tied)."""
        return self.weights["embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"]

    @torch.inference_mode()
    def iter_logits(self, windows: np.ndarray, batch: int = 4) -> Iterator[tuple[int, np.ndarray]]:
        """(first window, fp32 logits [b, T, V]) batch by batch, after one block-by-block pass over all windows."""
        w = self.head_weight()  # stored dtype; converted a slice of rows at a time
        for i, x in self.iter_normed(windows, batch):
            yield i, sliced_head(x, w).numpy()


@torch.inference_mode()
def sliced_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 logits x @ w.T with the head weight `w` [V, D] (any stored dtype) converted VOCAB_SLICE rows at a time,
    so the table is never held in fp32 whole."""
    return torch.cat([x @ w[v:v + VOCAB_SLICE].float().T for v in range(0, w.shape[0], VOCAB_SLICE)], dim=-1)


class LayerwiseRunner:
    """The Runner interface for evaluation (`logits`, `iter_logits`) over a LayerwiseModel: `iter_logits` makes one
    block-by-block pass for a whole set of windows, which quantgate.evaluate uses; `logits` answers one call."""

    def __init__(self, ckpt: HFCheckpoint, name: str = "torch (layer by layer)", batch_size: int = 4):
        self.lw, self.name, self.batch_size = LayerwiseModel(ckpt), name, batch_size
        self.vocab_size = ckpt.cfg.vocab_size

    def iter_logits(self, windows: np.ndarray, batch: int = 4) -> Iterator[tuple[int, np.ndarray]]:
        yield from self.lw.iter_logits(windows, batch)

    def logits(self, windows: np.ndarray) -> np.ndarray:
        return np.concatenate([lg for _, lg in self.lw.iter_logits(windows, self.batch_size)], axis=0)

    def close(self) -> None:
        pass


def iter_logits(runner, windows: np.ndarray, batch: int = 4) -> Iterator[tuple[int, np.ndarray]]:
    """(first window, logits) of any runner batch by batch: a layer-by-layer runner in one pass over its blocks,
    any other one call of `logits` per batch."""
    if hasattr(runner, "iter_logits"):
        yield from runner.iter_logits(windows, batch)
        return
    for i in range(0, len(windows), batch):
        yield i, runner.logits(windows[i:i + batch])


def check_layerwise_applies(layerwise: bool | None, kind: str, path) -> None:
    """--layerwise runs a PyTorch model directory block by block; a GGUF or an ONNX export runs whole in its own
    runtime, so asking for it there is refused rather than ignored."""
    if layerwise and kind in ("gguf", "onnx"):
        raise QuantgateError(f"--layerwise runs a model directory one decoder block at a time; {path} is "
                             f"{'a GGUF' if kind == 'gguf' else 'an ONNX export'}, which "
                             f"{'llama.cpp' if kind == 'gguf' else 'ONNX Runtime'} runs whole: drop --layerwise")


def needs_layerwise(cfg) -> bool:
    """Whether the in-memory loader would refuse this model (formats.hf.check_fits_in_memory's rule)."""
    _n, need, avail = fp32_load(cfg)
    return avail is not None and need > avail


def capture_layerwise(lw: LayerwiseModel, windows: np.ndarray, pre: Iterable[Hook] = (), post: Iterable[Hook] = (),
                      batch: int = 4, probe: bool = False, on_layer=None, label: str = "layer by layer",
                      keep: list | None = None, after_block=None) -> None:
    """quantgate.capture.capture for a LayerwiseModel: the hooks attached to its (meta) modules fire as each block
    runs; on_layer(i, first_window, h, probs); after_block(i, block) once block i has seen every window; `keep`
    receives the final hidden states."""
    with hooked(pre, post):
        hs = lw.hidden(windows, batch, probe, on_layer, label, after_block)
    if keep is not None:
        keep.extend(hs)
