"""A safetensors file written one tensor at a time, in any order, to the same bytes `safetensors.save_file` writes.

`save_file` takes every tensor at once and serializes each to bytes before writing, so saving a model needs it in
memory twice; the library has no incremental writer. A layer-by-layer quantizer has one block at a time. The format
is simple enough to lay out ahead (8-byte little-endian header length, a JSON header of dtype/shape/data_offsets,
the data): with every name, dtype and shape known up front, the header and every tensor's offset follow, and each
tensor is written at its offset when it is ready, converted to its file dtype a slice of rows at a time (a bf16
embedding is never held in fp32 whole). Written by hand for that reason; `tests/test_quantize_layerwise.py` checks
the bytes against `save_file`'s.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# safetensors orders the data by dtype (its enum, largest first: F64 > F32 > BF16 > F16), then by name
DTYPE_RANK = {"F64": 0, "F32": 1, "BF16": 2, "F16": 3}
CHUNK_BYTES = 64 << 20  # converted and written at a time


class SafetensorsWriter:
    """`specs`: name -> (dtype, shape) of every tensor the file will hold; `write(name, t)` each exactly once;
    `close()` checks nothing was left out."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[str, tuple]], metadata: dict[str, str] | None = None):
        bad = [n for n, (d, _s) in specs.items() if d not in DTYPES]
        if bad:
            raise ValueError(f"{bad[0]}: dtype {specs[bad[0]][0]} is not one of {sorted(DTYPES)}")
        order = sorted(specs, key=lambda n: (DTYPE_RANK[specs[n][0]], n))
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.slots: dict[str, tuple[int, int, str, tuple]] = {}
        offset = 0
        for n in order:
            dtype, shape = specs[n]
            size = int(torch.Size(shape).numel()) * DTYPES[dtype].itemsize
            header[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.slots[n] = (offset, size, dtype, tuple(shape))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # save_file pads the header with spaces to a multiple of 8
        self.data_start = 8 + len(text)
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(text)) + text)
        self.f.truncate(self.data_start + offset)
        self.pending = set(specs)

    def write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.pending:
            raise ValueError(f"{name}: {'already written' if name in self.slots else 'not in this file'}")
        offset, size, dtype, shape = self.slots[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the header says {shape}")
        flat = t.detach().reshape(-1)
        per = max(1, CHUNK_BYTES // DTYPES[dtype].itemsize)
        self.f.seek(self.data_start + offset)
        for i in range(0, flat.numel(), per):
            part = flat[i:i + per].to(DTYPES[dtype]).contiguous()
            self.f.write(memoryview(part.view(torch.uint8).numpy()))  # the tensor's own bytes, not a copy
        self.pending.discard(name)

    def close(self) -> None:
        """Flush and close; refused (the caller's temporary folder then goes) if a tensor was never written."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} tensors were never written, e.g. {sorted(self.pending)[0]}")

    def abort(self) -> None:
        """Close without the checks (the write failed; the caller removes the file)."""
        self.f.close()
