"""torchao's real integer kernels against our simulated schemes (CPU for int8; CUDA tests skip without a GPU)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("torchao", reason="torchao is in the test extra: pip install '.[test]'")

from quantgate.errors import QuantgateError  # noqa: E402
from quantgate.metrics import logit_errors  # noqa: E402
from quantgate.model import build_model, preset  # noqa: E402
from quantgate.quant.simulate import quantize_  # noqa: E402
from quantgate.quant.schemes import get  # noqa: E402
from quantgate.quant.torchao_backend import quantize_torchao_  # noqa: E402


def _model():
    return build_model(preset("tiny", gate="elementwise", dim=128, head_dim=32, vocab_size=300), seed=0).eval()


def _windows():
    w = np.random.default_rng(0).integers(3, 300, size=(4, 48))
    w[:, 0] = 0
    return w


def _logits(m, w, device="cpu"):
    with torch.inference_mode():
        return m(torch.as_tensor(w, device=device)).logits.float().cpu().numpy()


def test_torchao_int8_dynamic_on_cpu_matches_the_simulation():
    m, w = _model(), _windows()
    ref = _logits(m, w)
    real = logit_errors(ref, _logits(quantize_torchao_(copy.deepcopy(m), "int8-dynamic"), w))
    sim = logit_errors(ref, _logits(quantize_(copy.deepcopy(m), get("torch", "w8a8-dynamic")), w))
    assert 0 < real["kld_mean"] < 3 * sim["kld_mean"] + 1e-6 and sim["kld_mean"] < 3 * real["kld_mean"] + 1e-6
    assert real["top1_agreement"] > 0.95


def test_torchao_bad_inputs():
    with pytest.raises(QuantgateError, match="needs a CUDA device"):
        quantize_torchao_(_model(), "int4-weight", "cpu")
    with pytest.raises(QuantgateError, match="unknown torchao kind"):
        quantize_torchao_(_model(), "int3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,sim", [("int8-dynamic", "w8a8-dynamic"), ("int4-weight", "w4a16-g128")])
def test_torchao_cuda_kernels(kind, sim):
    m, w = _model(), _windows()
    ref = _logits(m, w)
    real = logit_errors(ref, _logits(quantize_torchao_(copy.deepcopy(m), kind, "cuda"), w, "cuda"))
    simulated = logit_errors(ref, _logits(quantize_(copy.deepcopy(m), get("torch", sim)), w))
    assert real["top1_agreement"] > 0.8
    assert real["kld_mean"] < 5 * simulated["kld_mean"] + 1e-3  # bf16 activations add their own error
