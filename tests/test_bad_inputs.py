"""Bad input: one clear error line naming the culprit, a non-zero exit, nothing written."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from conftest import dir_snapshot, make_hf_qwen3, run_cli
from quantgate.tokenizer import byte_tokenizer, train_bpe


def assert_one_line_error(r, *needles: str) -> str:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def good_model(tmp_path):
    d = tmp_path / "model"
    make_hf_qwen3().save_pretrained(d)
    byte_tokenizer().save(d)
    return d


def _edit_tensors(d, fn):
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _eval(model, tmp_path, text="hello world " * 200):
    f = tmp_path / "t.txt"
    f.write_text(text)
    return run_cli("eval", str(model), "--data", str(f), "--ctx", "32", "--json")


def test_good_model_evaluates(good_model, tmp_path):
    r = _eval(good_model, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ppl"] > 1


def test_missing_directory(tmp_path):
    assert_one_line_error(run_cli("info", str(tmp_path / "nope")), "nope", "does not exist")


def test_unknown_model_type(good_model, tmp_path):
    c = json.loads((good_model / "config.json").read_text())
    c["model_type"] = "llama"
    (good_model / "config.json").write_text(json.dumps(c))
    assert_one_line_error(run_cli("info", str(good_model)), "config.json", "llama")


def test_hybrid_qwen3_next_refused(tmp_path):
    from conftest import make_hf_qwen3_next
    d = tmp_path / "n"
    make_hf_qwen3_next().save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c["layer_types"] = ["linear_attention", "full_attention"]
    (d / "config.json").write_text(json.dumps(c))
    assert_one_line_error(run_cli("info", str(d)), "linear-attention")


def test_missing_tensor(good_model):
    _edit_tensors(good_model, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    assert_one_line_error(run_cli("info", str(good_model)), "model.layers.1.mlp.up_proj.weight", "missing")


def test_misshaped_tensor(good_model):
    def cut(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:-1]
    _edit_tensors(good_model, cut)
    assert_one_line_error(run_cli("info", str(good_model)), "model.layers.0.self_attn.k_proj.weight", "shape")


def test_nan_weights(good_model):
    def poison(sd):
        sd["model.layers.0.mlp.down_proj.weight"][3, 4] = float("nan")
    _edit_tensors(good_model, poison)
    assert_one_line_error(run_cli("info", str(good_model)), "model.layers.0.mlp.down_proj.weight", "NaN")


def test_truncated_safetensors(good_model):
    f = good_model / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert_one_line_error(run_cli("info", str(good_model)), "model.safetensors")


def test_pickled_weights_are_refused(tmp_path):
    d = tmp_path / "pkl"
    make_hf_qwen3().save_pretrained(d, safe_serialization=False)
    assert_one_line_error(run_cli("info", str(d)), "pickled weights are never loaded")


def test_tokenizer_larger_than_embedding(good_model, tmp_path):
    import random
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    big = train_bpe([" ".join(rng.choice(words) for _ in range(3000))], 400)
    assert big.vocab_size > 300
    big.save(good_model)  # the embedding has 300 rows
    assert_one_line_error(_eval(good_model, tmp_path), "tokenizer.json", str(big.vocab_size), "300")


@pytest.mark.parametrize("content,needle", [(b"", "empty"), (b"   \n\n", "empty"),
                                            (b"abc\x00\x01\x02def" * 10, "binary"),
                                            (b"caf\xe9 au lait " * 20, "not UTF-8")])
def test_bad_text(good_model, tmp_path, content, needle):
    f = tmp_path / "bad.txt"
    f.write_bytes(content)
    before = dir_snapshot(tmp_path)
    r = run_cli("eval", str(good_model), "--data", str(f), "--ctx", "32")
    assert_one_line_error(r, "bad.txt", needle)
    out = tmp_path / "run"
    r = run_cli("train", "--preset", "tiny", "--data", str(f), "--out", str(out), "--steps", "2")
    assert_one_line_error(r, "bad.txt", needle)
    assert dir_snapshot(tmp_path) == before  # nothing written, the input untouched


def test_text_too_short_for_a_window(good_model, tmp_path):
    assert_one_line_error(_eval(good_model, tmp_path, text="hi"), "too short")


def test_output_over_input_refused(good_model):
    from quantgate.checkpoint import load_checkpoint, save_checkpoint
    from quantgate.errors import QuantgateError
    loaded = load_checkpoint(good_model)
    before = dir_snapshot(good_model)
    with pytest.raises(QuantgateError, match="overwrite the input"):
        save_checkpoint(loaded.model, good_model, loaded.tokenizer, inputs=(good_model,))
    assert dir_snapshot(good_model) == before
