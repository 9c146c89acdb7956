"""One way to watch the PyTorch model run: forward hooks on chosen modules while windows go through in batches.

Calibration (activation ranges, GPTQ Hessians), SmoothQuant's statistics, GGUF importance matrices, the gate
inputs of the gate-survival check, per-layer SQNR and the outlier analysis all need the same loop: register the
hooks, run the windows batch by batch in inference mode, and remove the hooks whatever happens. It lives here
once; each caller keeps only what its hooks record.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

from .progress import track

Hook = tuple[nn.Module, Callable]  # (module, hook): a pre-hook gets (module, args), a hook (module, args, output)


@contextlib.contextmanager
def hooked(pre: Iterable[Hook] = (), post: Iterable[Hook] = ()) -> Iterator[None]:
    """Forward pre-hooks and forward hooks attached for the duration of the block, always removed after."""
    handles = [m.register_forward_pre_hook(f) for m, f in pre] + [m.register_forward_hook(f) for m, f in post]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def batches(windows: np.ndarray, batch: int, label: str | None = None, device=None) -> Iterator[torch.Tensor]:
    """[batch, T] token tensors of `windows` in order, with a progress bar when `label` names the work."""
    starts = range(0, len(windows), batch)
    if label:
        starts = track(starts, label, total=-(-len(windows) // batch))
    for i in starts:
        yield torch.as_tensor(windows[i:i + batch], device=device)


def capture(model: nn.Module, windows: np.ndarray, pre: Iterable[Hook] = (), post: Iterable[Hook] = (),
            batch: int = 4, label: str | None = None, device=None, **forward) -> None:
    """Run `windows` through `model` (eval mode, inference mode) with the hooks attached; `forward` goes to each
    call (e.g. probe=True, on_layer=... for the outlier analysis)."""
    model.eval()
    with hooked(pre, post), torch.inference_mode():
        for x in batches(windows, batch, label, device):
            model(x, **forward)
