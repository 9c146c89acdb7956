"""One sampler and one generation loop for every backend (quantgate.sampling)."""
from __future__ import annotations

import numpy as np
import pytest

from quantgate.sampling import Done, NonFiniteLogits, Sampler, Token, stream


def test_greedy_top_k_and_top_p():
    logits = np.array([0.0, 3.0, 2.9, -1.0])
    assert Sampler().pick(logits) == 1
    assert {Sampler(1.0, top_k=1, seed=s).pick(logits) for s in range(20)} == {1}
    assert {Sampler(1.0, top_p=0.3, seed=s).pick(logits) for s in range(20)} == {1}  # 1 alone holds >= 30%
    drawn = {Sampler(1.0, top_k=2, top_p=1.0, seed=s).pick(logits) for s in range(40)}
    assert drawn == {1, 2}  # top-2, both drawn, never outside
    a = [Sampler(0.9, seed=7).pick(np.arange(50.0) / 10) for _ in range(3)]
    assert a == [Sampler(0.9, seed=7).pick(np.arange(50.0) / 10) for _ in range(3)]  # a seed gives the same draw
    with pytest.raises(NonFiniteLogits):
        Sampler().pick(np.array([0.0, np.nan]))


class Counting:
    """Logits that favour (last token + 1) mod V: a deterministic toy model."""

    def __init__(self, V: int = 10):
        self.V = V

    def _next(self, t: int) -> np.ndarray:
        x = np.zeros(self.V)
        x[(t + 1) % self.V] = 5.0
        return x

    def prefill(self, ids):
        return self._next(ids[-1])

    def decode(self, token):
        return self._next(token)


def test_stream_stops_at_max_tokens_and_at_a_stop_id():
    recs = list(stream(Counting(), [0, 1], 4, Sampler()))
    assert [r.id for r in recs if isinstance(r, Token)] == [2, 3, 4, 5]
    done = recs[-1]
    assert isinstance(done, Done) and done.prompt_tokens == 2 and done.new_tokens == 4
    recs = list(stream(Counting(), [0, 1], 10, Sampler(), stop_ids=(4,)))
    assert [r.id for r in recs if isinstance(r, Token)] == [2, 3] and recs[-1].new_tokens == 2


def test_torch_and_onnx_runtime_sample_the_same_tokens(tmp_path):
    """The same seed and temperature pick the same tokens on PyTorch and ONNX Runtime: one sampler, and logits
    that agree to fp32 precision."""
    from quantgate.export.onnx import export_onnx
    from quantgate.model import build_model, preset
    from quantgate.runners import OrtRunner, TorchRunner
    from quantgate.tokenizer import byte_tokenizer
    m = build_model(preset("tiny", gate="elementwise", vocab_size=300), seed=0).eval()
    export_onnx(m, byte_tokenizer(), tmp_path / "onnx")
    ids = [0, 104, 101, 108, 108, 111]
    with TorchRunner(m) as t, OrtRunner(tmp_path / "onnx") as o:
        a = [r.id for r in t.stream(ids, 24, Sampler(0.8, seed=3)) if isinstance(r, Token)]
        b = list(o.generate(ids, 24, temperature=0.8, seed=3))
    assert len(a) == 24 and a == b
    assert len(set(a)) > 1  # sampled, not a constant
