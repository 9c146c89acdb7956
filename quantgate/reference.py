"""The float reference's logits for KL divergence, stored compactly and computed on access.

At Qwen3.5's vocabulary (248,320) a reference's fp32 logits cost 254 MB per 256-token window: 16 windows of a 0.8B
model are 4 GB of disk, every window of WikiText-2's test split 250 GB. llama.cpp's --kl-divergence-base keeps them
as uint16 log-probabilities (half of that, and rounded). quantgate keeps what the logits are computed from instead:
the reference's final normed hidden states [N, T, D] in fp32, D/V of the size (4 MB per window at D 1024), and
recomputes logits = x @ W_head^T from the reference's own output head, a vocabulary slice at a time, when a
comparison reads a batch. Nothing is rounded: the logits differ from the reference's own only by the summation
order of the matrix products (the KLD error this introduces is measured in benchmarks/results/reference_store.json).

The hidden states are written with plain writes, batch by batch (a full disk is an OSError and one line, never the
SIGBUS of a memory map), into quantgate's cache, which has a size cap and evicts the least recently used references.
Written by hand: no library stores a model's KL-divergence base this way.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from .errors import QuantgateError
from .formats import artifact_kind, load_checkpoint
from .formats.hf import open_hf
from .fsio import atomic_path
from .identity import code_id, content_id, key
from .layerwise import LayerwiseRunner, needs_layerwise, sliced_head
from .progress import console, track
from .runners import TorchRunner

REFERENCE_WINDOWS = 64  # eval --reference's default window count: the report's (quantgate.report.settings)
CACHE_CAP_BYTES = 8 << 30  # the reference cache's default size cap; QUANTGATE_CACHE_MAX_GB changes it
DISK_MARGIN = 256 << 20  # free space a reference leaves on its disk


def cache_dir() -> Path:
    """Where references are kept: $QUANTGATE_CACHE, else $XDG_CACHE_HOME/quantgate, else ~/.cache/quantgate."""
    env = os.environ.get("QUANTGATE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantgate"


def cache_cap() -> int:
    """The cache's size cap in bytes ($QUANTGATE_CACHE_MAX_GB, default 8)."""
    env = os.environ.get("QUANTGATE_CACHE_MAX_GB")
    if not env:
        return CACHE_CAP_BYTES
    try:
        gb = float(env)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise QuantgateError(f"QUANTGATE_CACHE_MAX_GB={env!r}: give the cache's size cap as a positive number of GB")
    return int(gb * 1e9)


class OutputHead:
    """The reference's output head as x [.., D] -> fp32 logits [.., V]: its stored weight (from the model
    directory, converted a vocabulary slice at a time), or the loaded module itself (a quantized reference)."""

    def __init__(self, weight: torch.Tensor | None = None, module: torch.nn.Module | None = None):
        assert (weight is None) != (module is None)
        self.weight, self.module = weight, module
        self.vocab_size = int(weight.shape[0] if weight is not None else module.weight.shape[0])

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return sliced_head(x, self.weight)
        return self.module(x).float()


class ReferenceLogits:
    """The reference's fp32 logits [N, T, V] on N windows, read like an array (`ref[i:j]`, `len`, `shape`,
    `np.asarray`) but computed from the stored hidden states [N, T, D] a slice of windows at a time."""

    def __init__(self, hidden: np.ndarray, head: OutputHead, path: Path | None = None):
        self.hidden, self.head, self.path = hidden, head, path
        self.shape = (*hidden.shape[:2], head.vocab_size)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        x = torch.from_numpy(np.array(self.hidden[key], dtype=np.float32))
        return self.head(x).numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    @property
    def stored_bytes(self) -> int:
        return int(self.hidden.nbytes)


def stored_size(n_windows: int, ctx: int, dim: int) -> int:
    """Bytes a reference on n_windows windows of ctx tokens takes in the cache (fp32 hidden states + .npy header)."""
    return n_windows * ctx * dim * 4 + 128


def reference_logits(ref_path: str, windows: np.ndarray, data_key: str, batch: int = 4,
                     announce: str | None = None) -> ReferenceLogits:
    """The fp32 logits of the reference `ref_path` on `windows` (see the module docstring): its hidden states are
    computed once and cached under a key of the reference's contents, the windows' tokens and the code
    (quantgate.identity); the output head is read from the reference each time. `announce`: a line printed once
    the cache is found or room for it is made (after every refusal)."""
    k = key("ref-hidden", content_id(ref_path), code_id(), data_key, list(windows.shape),
            hashlib.sha256(windows.tobytes()).hexdigest())
    path = cache_dir() / f"ref-hidden-{k}.npy"
    hidden = _cached(path, windows)
    if hidden is not None:
        _say(announce)
        return ReferenceLogits(hidden, reference_head(ref_path), path)
    runner = _reference_runner(ref_path)
    cfg = runner.lw.cfg if isinstance(runner, LayerwiseRunner) else runner.model.cfg
    need = stored_size(len(windows), windows.shape[1], cfg.dim)
    make_room(path.parent, need)
    _say(announce)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
                                                 "fortran_order": False, "shape": (*windows.shape, cfg.dim)})
        for _i, x in track(_iter_normed(runner, windows, batch), "reference hidden states",
                           total=-(-len(windows) // batch)):
            x = x.float().contiguous().numpy()
            if not np.isfinite(x).all():
                raise QuantgateError(f"the reference {ref_path} produced NaN or Inf activations: its weights or "
                                     f"activations are not finite")
            f.write(x.astype("<f4", copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    head = OutputHead(module=runner.model.lm_head) if not isinstance(runner, LayerwiseRunner) and \
        not _head_from_file(ref_path) else reference_head(ref_path)
    del runner
    return ReferenceLogits(np.load(path, mmap_mode="r"), head, path)


def _say(line: str | None) -> None:
    if line:
        console.print(line, markup=False, highlight=False)


def _cached(path: Path, windows: np.ndarray) -> np.ndarray | None:
    """A cached reference's hidden states (memory-mapped) if `path` holds a whole one for these windows; the file's
    time is refreshed, which the eviction reads. A torn or foreign file is recomputed."""
    if not path.is_file():
        return None
    with contextlib.suppress(ValueError, OSError):
        cached = np.load(path, mmap_mode="r")
        if cached.shape[:2] == windows.shape and cached.dtype == np.float32:
            os.utime(path)
            return cached
    return None


def _reference_runner(ref_path: str):
    """The fp32 PyTorch runner of the reference: a model directory runs block by block (quantgate.layerwise), so
    the pass holds one block, the stored embedding and the windows' hidden states, never the whole fp32 model (the
    same arithmetic to rounding); anything else (a sink-lab model, a GGUF or ONNX read back) loads whole."""
    if artifact_kind(ref_path) == "hf":
        ckpt = open_hf(ref_path, must_fit_block_by_block=True)
        if not ckpt.cfg.is_lab:
            return LayerwiseRunner(ckpt, name="reference (layer by layer)")
    return torch_runner(ref_path, name="reference")


def torch_runner(path: str, name: str = "torch", layerwise: bool | None = None):
    """The fp32 PyTorch runner of any artifact; a model directory whose fp32 weights do not fit in memory (or any,
    with `layerwise=True`) runs block by block (quantgate.layerwise), never whole."""
    if artifact_kind(path) == "hf" and layerwise is not False:
        ckpt = open_hf(path, must_fit_block_by_block=True)
        if layerwise or needs_layerwise(ckpt.cfg):
            return LayerwiseRunner(ckpt, name=f"{name} (layer by layer)")
    return TorchRunner(load_checkpoint(path).model, name=name)


@torch.inference_mode()
def _iter_normed(runner, windows: np.ndarray, batch: int):
    """(first window, final normed hidden states [b, T, D]) of a TorchRunner or LayerwiseRunner, batch by batch."""
    if isinstance(runner, LayerwiseRunner):
        yield from runner.lw.iter_normed(windows, batch)
        return
    for i in range(0, len(windows), batch):
        idx = torch.as_tensor(windows[i:i + batch], device=runner.device)
        yield i, runner.model(idx, kv_bits=runner.kv_bits, head=False).logits.float().cpu()


def _head_from_file(ref_path: str) -> bool:
    """Whether the head is read as stored from a float model directory (a quantized one runs its own module)."""
    if artifact_kind(ref_path) != "hf":
        return False
    return "quant_scheme" not in open_hf(ref_path, with_tokenizer=False).cfg.extra


def reference_head(ref_path: str) -> OutputHead:
    """The reference's output head: its stored weight from a float model directory (memory-mapped, never the whole
    model), else the head module of the loaded model."""
    if _head_from_file(ref_path):
        ckpt = open_hf(ref_path, with_tokenizer=False)
        name = "embed_tokens.weight" if ckpt.cfg.tie_embeddings else "lm_head.weight"
        return OutputHead(weight=ckpt.weights()[name])
    return OutputHead(module=load_checkpoint(ref_path).model.lm_head)


def make_room(folder: Path, need: int) -> None:
    """Refuse in one line a reference its disk cannot hold, or one larger than the cache's cap; otherwise evict the
    least recently used references until the cache and this one fit under the cap. Only quantgate's own cache files
    (ref-*.npy) are ever removed."""
    cap = cache_cap()
    fewer = "pass a smaller --max-windows, or point QUANTGATE_CACHE at a disk with room"
    if need > cap:
        raise QuantgateError(f"the reference needs {need / 1e9:.2f} GB in {folder}, more than the cache's cap of "
                             f"{cap / 1e9:.2f} GB: {fewer}, or raise QUANTGATE_CACHE_MAX_GB")
    entries = sorted(_entries(folder), key=lambda e: e[1])  # oldest first
    used = sum(size for _p, _t, size in entries)
    while entries and used + need > cap:
        p, _t, size = entries.pop(0)
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            used -= size
    where = folder
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need + DISK_MARGIN > free:
        raise QuantgateError(f"the reference needs {need / 1e9:.2f} GB in {folder} and its disk has {free / 1e9:.2f} "
                             f"GB free: {fewer}; nothing was written")


def _entries(folder: Path) -> list[tuple[Path, float, int]]:
    """(path, last use, bytes) of every reference file in the cache."""
    out = []
    if folder.is_dir():
        for p in folder.glob("ref-*.npy"):
            with contextlib.suppress(OSError):
                st = p.stat()
                out.append((p, st.st_mtime, st.st_size))
    return out


def cache_size(folder: Path | None = None) -> int:
    """Bytes the cached references take."""
    return sum(size for _p, _t, size in _entries(folder or cache_dir()))

