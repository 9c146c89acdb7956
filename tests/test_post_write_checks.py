"""Every writer checks what it wrote with quantgate's own reader before committing it, and a file or folder that
fails that check is never left at --out (nor a temporary beside it): one per writer, its check made to fail."""
from __future__ import annotations

import pytest

from conftest import export_gated_twin, save_tiny_twins
from quantgate.errors import QuantgateError


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("pw"))
    export_gated_twin(d)  # d/g.gguf (F32) and d/onnx (fp32)
    return d


def _failing(real, when=lambda *a, **k: True):
    """`real`, except that it raises the refusal its caller must act on when `when(args)` holds."""
    def check(*a, **k):
        if when(*a, **k):
            raise QuantgateError(f"{a[0] if a else ''}: made to fail by the test")
        return real(*a, **k)
    return check


def _is_temporary(path, *a, **k) -> bool:
    return str(path).rsplit("/", 2)[-2].startswith(".") or str(path).rsplit("/", 1)[-1].startswith(".")


def _nothing_left(out_parent, before: set) -> None:
    assert {p.name for p in out_parent.iterdir()} == before, sorted(p.name for p in out_parent.iterdir())


def test_export_gguf(twins, tmp_path, monkeypatch):
    import quantgate.export.gguf as g
    monkeypatch.setattr(g, "inspect_gguf", _failing(g.inspect_gguf))
    with pytest.raises(QuantgateError, match="own check; nothing was kept"):
        g.export_checkpoint(twins / "gated", tmp_path / "x.gguf", "f16")
    _nothing_left(tmp_path, set())


def test_quantize_gguf(twins, tmp_path, monkeypatch):
    import quantgate.quant.llama_cpp as q
    monkeypatch.setattr(q, "inspect_gguf", _failing(q.inspect_gguf, _is_temporary))
    with pytest.raises(QuantgateError, match="made to fail"):
        q.quantize_gguf(twins / "g.gguf", tmp_path / "x.gguf", "Q8_0", threads=1)
    _nothing_left(tmp_path, set())


@pytest.mark.parametrize("check", [pytest.param("onnx's checker", marks=pytest.mark.slow), "quantgate's reader"])
def test_export_onnx(twins, tmp_path, monkeypatch, check):
    import quantgate.formats.onnx_io as io
    if check == "onnx's checker":
        import onnx
        monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: (_ for _ in ()).throw(
            onnx.checker.ValidationError("made to fail by the test")))
    else:
        monkeypatch.setattr(io, "check_graph", _failing(io.check_graph))
    from quantgate.export.onnx import export_checkpoint
    with pytest.raises(QuantgateError, match="made to fail") as e:
        export_checkpoint(twins / "gated", tmp_path / "x")
    assert "\n" not in str(e.value)
    _nothing_left(tmp_path, set())


@pytest.mark.parametrize("scheme", ["int4", "int8-dynamic"])
def test_quantize_onnx(twins, tmp_path, monkeypatch, scheme):
    import quantgate.formats.onnx_io as io
    from quantgate.quant.ort import quantize_onnx
    monkeypatch.setattr(io, "check_graph", _failing(io.check_graph, _is_temporary))
    with pytest.raises(QuantgateError, match="own check; nothing was kept"):
        quantize_onnx(twins / "onnx", tmp_path / "x", scheme)
    _nothing_left(tmp_path, set())


@pytest.mark.parametrize("layerwise", [False, True])
def test_quantize_torch(twins, tmp_path, monkeypatch, layerwise):
    import quantgate.formats.hf as hf
    from quantgate.quant.torch_backend import quantize_checkpoint
    monkeypatch.setattr(hf, "open_hf", _failing(hf.open_hf, _is_temporary))
    with pytest.raises(QuantgateError, match="own check; nothing was kept"):
        quantize_checkpoint(str(twins / "gated"), "w4a16-g32", str(tmp_path / "x"), calib_data=str(twins / "text.txt"),
                            n_windows=2, ctx=32, layerwise=layerwise)
    _nothing_left(tmp_path, set())


def test_save_checkpoint(tmp_path, monkeypatch):
    """train and every other writer of model directories save through save_checkpoint."""
    import quantgate.formats.hf as hf
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    monkeypatch.setattr(hf, "open_hf", _failing(hf.open_hf, _is_temporary))
    with pytest.raises(QuantgateError, match="own check; nothing was kept"):
        hf.save_checkpoint(build_model(preset("tiny", vocab_size=300)), tmp_path / "m", byte_tokenizer())
    _nothing_left(tmp_path, set())
