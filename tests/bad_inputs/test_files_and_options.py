"""Bad input: exit code 2, one clear error line naming the culprit, no traceback, nothing written, inputs unchanged.

Every command below runs with a snapshot of the whole pytest temporary tree (every fixture's inputs) taken before
and compared after, so "nothing written, nothing changed" is checked for each refused command.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import dir_snapshot, make_hf_qwen3
from conftest import run_cli as _run_cli
from quantgate.tokenizer import byte_tokenizer, train_bpe

_ROOT: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def _watch_everything(tmp_path_factory):
    _ROOT[:] = [tmp_path_factory.getbasetemp()]


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def run_cli(*args, **kw):
    """The CLI, with whether it left every file and folder under the pytest tree as it found them."""
    before = _tree(_ROOT[0])
    r = _run_cli(*args, **kw)
    r.tree_unchanged = _tree(_ROOT[0]) == before
    return r


def assert_one_line_error(r, *needles: str) -> str:
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.tree_unchanged, "the refused command wrote, changed or removed something"
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
    # info reads headers only (issue 25: it answers at once for a 27B); every verb that reads the weights refuses
    assert run_cli("info", str(good_model)).returncode == 0
    out = good_model.parent / "nan.gguf"
    assert_one_line_error(run_cli("export", "gguf", str(good_model), "--out", str(out)),
                          "model.layers.0.mlp.down_proj.weight", "NaN")
    assert not out.exists()
    assert_one_line_error(run_cli("eval", str(good_model), "--max-windows", "1", "--ctx", "16"),
                          "model.layers.0.mlp.down_proj.weight", "NaN")


def test_truncated_safetensors(good_model):
    f = good_model / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert_one_line_error(run_cli("info", str(good_model)), "model.safetensors")


def test_pickled_weights_are_refused(tmp_path):
    import torch
    d = tmp_path / "pkl"
    hf = make_hf_qwen3()
    hf.save_pretrained(d)  # transformers 5 writes safetensors only: make the pickled checkpoint older versions wrote
    (d / "model.safetensors").unlink()
    torch.save(hf.state_dict(), d / "pytorch_model.bin")
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
    from quantgate.formats import load_checkpoint, save_checkpoint
    from quantgate.errors import QuantgateError
    loaded = load_checkpoint(good_model)
    before = dir_snapshot(good_model)
    with pytest.raises(QuantgateError, match="is the input"):
        save_checkpoint(loaded.model, good_model, loaded.tokenizer, inputs=(good_model,))
    assert dir_snapshot(good_model) == before


# --- GGUF files (llama.cpp is never allowed to take the process down) -----------------------------

@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    import struct

    from quantgate.formats import save_checkpoint
    from quantgate.export.gguf import export_checkpoint, export_gguf
    from quantgate.model import build_model, preset
    d = tmp_path_factory.mktemp("gguf")
    tok = byte_tokenizer()
    for gate in ("none", "elementwise"):
        save_checkpoint(build_model(preset("tiny", vocab_size=300, gate=gate), seed=0), d / gate, tok)
        export_checkpoint(d / gate, d / f"{gate}.gguf")
    export_gguf(build_model(preset("tiny", vocab_size=300, gate="elementwise"), seed=0), tok, d / "aborts.gguf",
                identity_layers=0)
    good = (d / "elementwise.gguf").read_bytes()
    n = struct.unpack("<Q", good[8:16])[0]
    (d / "truncated.gguf").write_bytes(good[: len(good) // 2])
    (d / "magic.gguf").write_bytes(b"GGUX" + good[4:])
    (d / "arch.gguf").write_bytes(good.replace(b"qwen35", b"qwen99"))
    (d / "count.gguf").write_bytes(good[:8] + struct.pack("<Q", n + 1) + good[16:])
    (d / "count2.gguf").write_bytes(good[:8] + struct.pack("<Q", n - 1) + good[16:])
    (d / "text.txt").write_text("hello world " * 300)
    return d


@pytest.mark.parametrize("name,needle", [("truncated", "truncated"), ("magic", "not a GGUF file"),
                                         ("arch", "architecture 'qwen99' is not supported"),
                                         ("count", "count.gguf: "), ("count2", "count2.gguf: ")])
@pytest.mark.parametrize("verb", ["eval", "quantize", "generate"])
def test_malformed_gguf_gives_one_line_and_no_output(gguf_files, tmp_path, name, needle, verb):
    f = gguf_files / f"{name}.gguf"
    before = f.read_bytes()
    out = tmp_path / "out.gguf"
    args = {"eval": ["eval", str(f), "--data", str(gguf_files / "text.txt"), "--ctx", "32"],
            "quantize": ["quantize", str(f), "--type", "Q4_0", "--out", str(out)],
            "generate": ["generate", str(f), "--prompt", "hi", "--max-tokens", "4"]}[verb]
    assert_one_line_error(run_cli(*args), needle)
    assert not out.exists() and list(tmp_path.iterdir()) == [] and f.read_bytes() == before


def test_llama_cpp_abort_becomes_one_line(gguf_files):
    """Passes every check, then llama.cpp asserts on decode: the CLI still ends with one error line."""
    r = run_cli("generate", str(gguf_files / "aborts.gguf"), "--prompt", "hello", "--max-tokens", "4")
    assert_one_line_error(r, "llama.cpp stopped")


@pytest.mark.parametrize("args,needle", [
    (["--type", "Q9_K"], "unknown GGUF type 'Q9_K'"),
    (["--type", "IQ3_XXS"], "needs an importance matrix"),
    ([], "--type is required"),
    (["--type", "Q4_0", "--scheme", "w8a8-static"], "--scheme is for the torch backend"),
])
def test_gguf_quantize_bad_options(gguf_files, tmp_path, args, needle):
    out = tmp_path / "o.gguf"
    assert_one_line_error(run_cli("quantize", str(gguf_files / "elementwise.gguf"), *args, "--out", str(out)), needle)
    assert not out.exists()


def test_gguf_quantize_refuses_requantizing_gate_bits_without_gate_and_overwriting(gguf_files, tmp_path):
    q = tmp_path / "q.gguf"
    assert run_cli("quantize", str(gguf_files / "none.gguf"), "--type", "Q8_0", "--out", str(q)).returncode == 0
    assert_one_line_error(run_cli("quantize", str(q), "--type", "Q4_0", "--out", str(tmp_path / "r.gguf")),
                          "already quantized")
    assert_one_line_error(run_cli("quantize", str(gguf_files / "none.gguf"), "--type", "Q4_0", "--gate-bits", "8",
                                  "--out", str(tmp_path / "g.gguf")), "has no attention gate")
    src = gguf_files / "none.gguf"
    before = src.read_bytes()
    assert_one_line_error(run_cli("quantize", str(src), "--type", "Q4_0", "--out", str(src)), "is the input")
    assert src.read_bytes() == before


def test_gguf_export_bad_inputs(gguf_files, tmp_path):
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    notok = tmp_path / "notok"
    save_checkpoint(build_model(preset("tiny", vocab_size=300), seed=0), notok)
    assert_one_line_error(run_cli("export", "gguf", str(notok), "--out", str(tmp_path / "x.gguf")),
                          "must embed its tokenizer")
    assert_one_line_error(run_cli("export", "gguf", str(gguf_files / "none.gguf"), "--out", str(tmp_path / "y.gguf")),
                          "already a GGUF")
    assert_one_line_error(run_cli("export", "gguf", str(gguf_files / "none"), "--out", "/proc/x.gguf"), "/proc")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


def test_gguf_eval_refuses_a_reference_with_another_tokenizer(gguf_files, tmp_path):
    other = tmp_path / "other"
    make_hf_qwen3().save_pretrained(other)
    train_bpe(["some other text entirely " * 50], 280).save(other)
    r = run_cli("eval", str(gguf_files / "none.gguf"), "--data", str(gguf_files / "text.txt"), "--ctx", "32",
                "--reference", str(other))
    assert_one_line_error(r, "different tokenizers")


# --- ONNX exports -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_dirs(tmp_path_factory):
    import shutil

    import onnx
    from onnx import TensorProto, helper

    from quantgate.formats import save_checkpoint
    from quantgate.export.onnx import export_checkpoint
    from quantgate.model import build_model, preset
    d = tmp_path_factory.mktemp("onnxbad")
    save_checkpoint(build_model(preset("tiny", vocab_size=300), seed=0), d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "good")
    good = (d / "good" / "model.onnx").read_bytes()
    for name, data in (("truncated", good[: len(good) // 3]), ("garbage", b"\x00\xffnot a protobuf" * 100)):
        shutil.copytree(d / "good", d / name)
        (d / name / "model.onnx").write_bytes(data)
    shutil.copytree(d / "good", d / "foreign")  # a valid ONNX graph that is not a decoder
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])),
              str(d / "foreign" / "model.onnx"))
    (d / "text.txt").write_text("hello world " * 300)
    (d / "short.txt").write_text("hi")
    return d


@pytest.mark.parametrize("name,needle", [("truncated", "corrupt or truncated ONNX"), ("garbage", "corrupt or truncated"),
                                         ("foreign", "do not match a quantgate decoder")])
@pytest.mark.parametrize("verb", ["eval", "quantize", "generate"])
def test_malformed_onnx_gives_one_line_and_no_output(onnx_dirs, tmp_path, name, needle, verb):
    src = onnx_dirs / name
    before = dir_snapshot(src)
    out = tmp_path / "out"
    args = {"eval": ["eval", str(src), "--data", str(onnx_dirs / "text.txt"), "--ctx", "32"],
            "quantize": ["quantize", str(src), "--scheme", "int4", "--out", str(out)],
            "generate": ["generate", str(src), "--prompt", "hi", "--max-tokens", "4"]}[verb]
    assert_one_line_error(run_cli(*args), needle)
    assert not out.exists() and list(tmp_path.iterdir()) == [] and dir_snapshot(src) == before


@pytest.mark.parametrize("args,needle", [
    (["--scheme", "int3"], "unknown ONNX scheme 'int3'"),
    (["--scheme", "int8-dynamic", "--gate-bits", "8"], "applies to int4"),
    (["--scheme", "int4", "--gate-bits", "8"], "has no gate projection"),
    (["--scheme", "int4", "--block-size", "48"], "--block-size"),
    (["--scheme", "int8-static", "--calib-data", "SHORT"], "too short for one window"),
    (["--type", "Q4_0"], "--scheme is required"),
])
def test_onnx_quantize_bad_options(onnx_dirs, tmp_path, args, needle):
    out = tmp_path / "o"
    args = [str(onnx_dirs / "short.txt") if a == "SHORT" else a for a in args]
    assert_one_line_error(run_cli("quantize", str(onnx_dirs / "good"), *args, "--out", str(out)), needle)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_onnx_quantize_refuses_requantizing_and_overwriting(onnx_dirs, tmp_path):
    q = tmp_path / "q"
    assert run_cli("quantize", str(onnx_dirs / "good"), "--scheme", "int8-weight", "--out", str(q)).returncode == 0
    assert_one_line_error(run_cli("quantize", str(q), "--scheme", "int4", "--out", str(tmp_path / "r")),
                          "already quantized")
    before = dir_snapshot(onnx_dirs / "good")
    assert_one_line_error(run_cli("quantize", str(onnx_dirs / "good"), "--scheme", "int4", "--out",
                                  str(onnx_dirs / "good")), "is the input")
    assert dir_snapshot(onnx_dirs / "good") == before


@pytest.fixture(scope="module")
def short_external(onnx_dirs):
    """The good export with its weights moved to model.onnx.data, one initializer's external-data length cut below
    what its shape needs (the file itself long enough): the held-out sweep's case."""
    import shutil

    import onnx
    d = onnx_dirs / "extshort"
    shutil.copytree(onnx_dirs / "good", d)
    m = onnx.load(str(d / "model.onnx"))
    onnx.save(m, str(d / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    m = onnx.load(str(d / "model.onnx"), load_external_data=False)
    big = max((t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL),
              key=lambda t: int({e.key: e.value for e in t.external_data}["length"]))
    for e in big.external_data:
        if e.key == "length":
            e.value = str(int(e.value) // 2)
    onnx.save(m, str(d / "model.onnx"))
    return d


@pytest.mark.parametrize("verb", ["info", "export gguf", "quantize int4", "quantize int8-weight", "eval"])
def test_external_data_shorter_than_its_shape_gives_one_line(short_external, onnx_dirs, tmp_path, verb):
    out = tmp_path / "out"
    args = {"info": ["info", str(short_external)],
            "export gguf": ["export", "gguf", str(short_external), "--out", str(out)],
            "quantize int4": ["quantize", str(short_external), "--scheme", "int4", "--out", str(out)],
            "quantize int8-weight": ["quantize", str(short_external), "--scheme", "int8-weight", "--out", str(out)],
            "eval": ["eval", str(short_external), "--data", str(onnx_dirs / "text.txt"), "--ctx", "32"]}[verb]
    assert_one_line_error(run_cli(*args), "needs", "bytes, and its external data in model.onnx.data holds")
    assert not out.exists()


@pytest.mark.parametrize("verb", ["eval", "analyze"])
@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_layerwise_on_an_export_is_refused_not_ignored(gguf_files, onnx_dirs, verb, kind):
    src = str(gguf_files / "elementwise.gguf") if kind == "gguf" else str(onnx_dirs / "good")
    text = str(gguf_files / "text.txt")
    args = ["eval", src, "--data", text, "--ctx", "32"] if verb == "eval" else \
        ["analyze", src, "--data", text, "--ctx", "32", "--windows", "2"]
    assert_one_line_error(run_cli(*args, "--layerwise"), "--layerwise runs a model directory", "drop --layerwise")


@pytest.mark.parametrize("verb", ["info", "eval", "export gguf"])
def test_a_tensor_in_two_unindexed_safetensors_files_is_refused(good_model, tmp_path, verb):
    """Without an index, which copy would win is the file order: refused (transformers 5 refuses such a folder)."""
    sd = load_file(str(good_model / "model.safetensors"))
    name = next(k for k in sd if k.endswith("q_proj.weight"))
    save_file({name: sd[name] * 2}, str(good_model / "model-extra.safetensors"), metadata={"format": "pt"})
    (tmp_path / "t.txt").write_text("hello world " * 300)
    out = tmp_path / "x.gguf"
    args = {"info": ["info", str(good_model)],
            "eval": ["eval", str(good_model), "--data", str(tmp_path / "t.txt"), "--ctx", "32"],
            "export gguf": ["export", "gguf", str(good_model), "--out", str(out)]}[verb]
    assert_one_line_error(run_cli(*args), f"tensor {name} is in both", "no model.safetensors.index.json")
    assert not out.exists()


def test_a_weights_file_the_address_space_cannot_map_gives_one_line(tmp_path):
    """safetensors maps the whole file; under an address-space limit (ulimit -v) the map fails: one line, not
    safetensors' RuntimeError. The 5 GB file is sparse (no disk used)."""
    import os
    import resource
    import struct
    import subprocess
    import sys
    import tempfile
    src = tmp_path / "src"
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    save_checkpoint(build_model(preset("tiny", vocab_size=300)), src, byte_tokenizer())
    d = tmp_path / "big"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (d / f).write_bytes((src / f).read_bytes())
    n = 5 * (1 << 30) // 4
    hdr = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [n // 256, 256],
                                                    "data_offsets": [0, n * 4]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr)
        f.truncate(8 + len(hdr) + n * 4)

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "info", str(d)], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env={**os.environ, "QUANTGATE_PROGRESS": "0"}, preexec_fn=limited,
                       timeout=300)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert "cannot map its 5.4 GB into this process's address space" in lines[0], lines
