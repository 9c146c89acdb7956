"""What `eval --reference` holds in memory at a real vocabulary (benchmarks/reference_store.py measures the peak):
the GGUF's NaN check reads the file in chunks instead of keeping its pages mapped, the metadata reader is dropped
once the tokenizer is built, and llama.cpp's logits arrive a window at a time straight into their array."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

import quantgate.formats.gguf as gguf_format
from quantgate.errors import QuantgateError
from quantgate.evaluate import batch_for_vocab


def _gguf(path, f32: np.ndarray, q8: np.ndarray) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("a.weight", f32)
    w.add_tensor("b.weight", quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("where", ["none", "f32 last chunk", "q8 scale last chunk"])
def test_nan_check_reads_in_chunks_and_finds_a_nan_anywhere(tmp_path, monkeypatch, where):
    monkeypatch.setattr(gguf_format, "FINITE_CHUNK_BYTES", 1024)  # many chunks per tensor
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((64, 256)).astype(np.float32)
    q8 = rng.standard_normal((64, 256)).astype(np.float32)
    if where == "f32 last chunk":
        f32[-1, -1] = np.nan
    elif where == "q8 scale last chunk":
        q8[-1, -32:] = np.inf  # the last block's scale is inf
    path = tmp_path / "m.gguf"
    _gguf(path, f32, q8)
    if where == "none":
        gguf_format.check_finite_weights(path)
        return
    with pytest.raises(QuantgateError, match=f"tensor {'a' if where.startswith('f32') else 'b'}.weight .* holds NaN"):
        gguf_format.check_finite_weights(path)


def test_readers_are_dropped_on_request(tmp_path):
    path = tmp_path / "m.gguf"
    _gguf(path, np.zeros((4, 32), np.float32), np.zeros((4, 32), np.float32))
    first = gguf_format.open_reader(path)
    assert gguf_format.open_reader(path) is first  # kept
    gguf_format.forget_readers()
    assert gguf_format.open_reader(path) is not first  # parsed again


def test_one_window_of_logits_at_a_time_at_qwen35s_vocabulary():
    assert batch_for_vocab(4, 256, 248_320) == 1  # 254 MB per window
    assert batch_for_vocab(4, 256, 151_936) == 1
    assert batch_for_vocab(4, 256, 32_000) == 4
