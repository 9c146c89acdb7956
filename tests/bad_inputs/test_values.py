"""Malformed values end in one line, checked at the boundary: config.json of any shape or range, hand-edited
scheme metadata, GGUF metadata and tensors that disagree with each other, non-finite weights on every backend,
ONNX folders with missing external data or foreign fields, out-of-range options, and one documented rule for a
context longer than the model's and a prompt longer than the context, on PyTorch, ONNX Runtime and llama.cpp.

Every case: exit 2, one `error:` line naming the culprit, no traceback, nothing written, inputs byte-identical.
"""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from conftest import assert_refused, export_gated_twin, run_cli, save_tiny_twins, tree_snapshot

CONTEXT = 512  # the tiny preset's max_seq_len, which the twins below keep


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from quantgate.quant.torch_backend import quantize_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, hybrid, preset
    from quantgate.tokenizer import byte_tokenizer
    d = save_tiny_twins(tmp_path_factory.mktemp("values"))
    save_checkpoint(build_model(hybrid(preset("tiny", vocab_size=300, n_layers=4, gate="elementwise"))),
                    d / "hybrid", byte_tokenizer())
    quantize_checkpoint(str(d / "gated"), "w8a8-static", str(d / "q"), str(d / "text.txt"), 2, 32)
    export_gated_twin(d)
    r = run_cli("quantize", str(d / "g.gguf"), "--type", "Q8_0", "--out", str(d / "g8.gguf"))
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def _edit_json(path, fn):
    obj = json.loads(path.read_text())
    obj = fn(obj) or obj
    path.write_text(json.dumps(obj))


def _set(key, value):
    def fn(c):
        c[key] = value
    return fn


def _scheme(key, value):
    def fn(c):
        c["quantgate"]["quant_scheme"][key] = value
    return fn


def _ranges(fn_value):
    def fn(c):
        r = c["quantgate"]["quant_state"]["act_ranges"]
        r[next(iter(r))] = fn_value
    return fn


def _gguf_field_offset(path, key: str) -> tuple[int, int]:
    """(offset of the key's value, its width) in a GGUF file."""
    from gguf import GGUFReader
    f = GGUFReader(str(path)).fields[key]
    klen = struct.unpack_from("<Q", path.read_bytes(), f.offset)[0]
    return f.offset + 12 + klen, f.parts[-1].nbytes


def _gguf_value(key: str, value: int):
    def fn(path):
        raw = bytearray(path.read_bytes())
        at, width = _gguf_field_offset(path, key)
        raw[at:at + width] = value.to_bytes(width, "little")
        path.write_bytes(bytes(raw))
    return fn


def _gguf_add_string(key: str, value: str):
    """A copy of the GGUF with one more string key, written by gguf-py's own metadata copier."""
    def fn(path):
        import gguf
        from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
        reader = gguf.GGUFReader(str(path))
        tmp = path.with_name(path.name + ".new")
        writer = gguf.GGUFWriter(str(tmp), arch=str(reader.get_field("general.architecture").contents()))
        copy_with_new_metadata(reader, writer, {key: MetadataDetails(gguf.GGUFValueType.STRING, value)}, [])
        del reader
        tmp.replace(path)
    return fn


def _gguf_rename_key(key: str):
    def fn(path):
        raw = path.read_bytes()
        path.write_bytes(raw.replace(key.encode(), key[:-1].encode() + b"X", 1))
    return fn


def _gguf_nan(tensor: str, byte_in_block: int = 0):
    """Poison one value of an F32 tensor, or the fp16 scale of a Q8_0 block (byte_in_block 0)."""
    def fn(path):
        from gguf import GGUFReader
        t = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor)
        raw = bytearray(path.read_bytes())
        at = int(t.data_offset) + byte_in_block
        nan = np.array([np.nan], dtype=np.float32 if t.tensor_type.name == "F32" else np.float16).tobytes()
        raw[at:at + len(nan)] = nan
        path.write_bytes(bytes(raw))
    return fn


def _onnx_external_missing(d):
    import onnx
    m = onnx.load(str(d / "model.onnx"))
    onnx.save(m, str(d / "model.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
    (d / "weights.bin").unlink()


def _nan_safetensors(d):
    from safetensors.torch import load_file, save_file
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _hf_dataset_with_ints(d):
    import datasets
    datasets.Dataset.from_dict({"text": [1, 2, 3]}).save_to_disk(str(d / "ds"))


TEXT, OUT = "{d}/text.txt", "{d}/out"
EVAL = ["--data", TEXT, "--ctx", "32", "--max-windows", "1"]
CASES = {  # name -> (artifact to copy, edit(path) or None, argv, needle)
    # config.json of any shape or range
    "config not an object": ("gated", lambda p: (p / "config.json").write_text("[]"), ["info", "{m}"],
                             "must hold a JSON object"),
    "zero heads": ("gated", lambda p: _edit_json(p / "config.json", _set("num_attention_heads", 0)), ["info", "{m}"],
                   "num_attention_heads must be an integer"),
    "negative hidden size": ("gated", lambda p: _edit_json(p / "config.json", _set("hidden_size", -64)),
                             ["eval", "{m}", *EVAL], "hidden_size must be an integer"),
    "heads not a multiple of kv heads": ("baseline", lambda p: _edit_json(p / "config.json",
                                                                          _set("num_key_value_heads", 3)),
                                         ["info", "{m}"], "multiple of n_kv_heads"),
    "rope theta zero": ("baseline", lambda p: _edit_json(p / "config.json", _set("rope_theta", 0)), ["info", "{m}"],
                        "rope_theta must be a positive number"),
    # rope settings: a scaled rope, or a block of the wrong shape, never runs as plain rope (transformers 5 keeps
    # these in rope_parameters, transformers 4 in rope_scaling; both are read)
    "rope_parameters yarn": ("baseline", lambda p: _edit_json(p / "config.json", _set("rope_parameters", {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128})),
        ["eval", "{m}", *EVAL], "rope_parameters.rope_type \"yarn\" is a scaled rope"),
    "rope_scaling linear": ("gated", lambda p: _edit_json(p / "config.json", _set("rope_scaling", {
        "type": "linear", "factor": 2.0})), ["info", "{m}"], "rope_scaling.rope_type \"linear\""),
    "rope_parameters llama3 (hybrid)": ("hybrid", lambda p: _edit_json(p / "config.json", lambda c: c[
        "rope_parameters"].update(rope_type="llama3", factor=8.0)), ["info", "{m}"], "\"llama3\" is a scaled rope"),
    "rope_parameters a list": ("baseline", lambda p: _edit_json(p / "config.json", _set("rope_parameters", [
        {"rope_type": "default", "rope_theta": 1e6}])), ["info", "{m}"], "rope_parameters must be a JSON object"),
    "rope_parameters per layer type": ("baseline", lambda p: _edit_json(p / "config.json", _set("rope_parameters", {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})), ["info", "{m}"], "per-layer-type"),
    "rope theta a string inside rope_parameters": ("hybrid", lambda p: _edit_json(p / "config.json", lambda c: c[
        "rope_parameters"].update(rope_theta="1e7")), ["info", "{m}"], "rope_parameters.rope_theta must be"),
    "partial rotary on a qwen3 model": ("baseline", lambda p: _edit_json(p / "config.json", _set(
        "rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.5})), ["info", "{m}"],
        "partial_rotary_factor 0.5 is not part of a qwen3 model"),
    "gguf rope scaled (yarn)": ("g.gguf", _gguf_add_string("qwen35.rope.scaling.type", "yarn"),
                                ["eval", "{m}", *EVAL], "a scaled rope"),
    "layers as a string": ("baseline", lambda p: _edit_json(p / "config.json", _set("num_hidden_layers", "2")),
                           ["info", "{m}"], "num_hidden_layers must be an integer"),
    "bos outside the vocabulary": ("baseline", lambda p: _edit_json(p / "config.json", _set("bos_token_id", 9999)),
                                   ["info", "{m}"], "bos_id 9999 is not a token id"),
    "a model too large for memory": ("baseline", lambda p: _edit_json(p / "config.json", lambda c: c.update(
        vocab_size=1 << 22, hidden_size=1 << 17)), ["eval", "{m}", *EVAL], "of memory available"),
    "tokenizer.json malformed": ("gated", lambda p: (p / "tokenizer.json").write_text('{"model": 5}'),
                                 ["eval", "{m}", *EVAL], "not a valid tokenizer.json"),
    "NaN weight": ("gated", _nan_safetensors, ["eval", "{m}", *EVAL], "NaN"),
    # saved scheme metadata edited by hand
    "scheme act unknown": ("q", lambda p: _edit_json(p / "config.json", _scheme("act", "weird")), ["eval", "{m}", *EVAL],
                           "quant_scheme.act must be"),
    "scheme bits as a string": ("q", lambda p: _edit_json(p / "config.json", _scheme("weight_bits", "8")),
                                ["info", "{m}"], "quant_scheme.weight_bits must be"),
    "scheme unknown field": ("q", lambda p: _edit_json(p / "config.json", _scheme("colour", "red")), ["info", "{m}"],
                             "unknown fields"),
    "activation range reversed": ("q", lambda p: _edit_json(p / "config.json", _ranges([5.0, -5.0])),
                                  ["eval", "{m}", *EVAL], "act_ranges"),
    "activation range a string": ("q", lambda p: _edit_json(p / "config.json", _ranges("wide")), ["info", "{m}"],
                                  "act_ranges"),
    # GGUF metadata and tensors that disagree
    "gguf head count disagrees with attn_q": ("g.gguf", _gguf_value("qwen35.attention.head_count", 2),
                                              ["eval", "{m}", *EVAL], "the header implies"),
    "gguf without head_count": ("g.gguf", _gguf_rename_key("qwen35.attention.head_count"), ["info", "{m}"],
                                "qwen35.attention.head_count is missing"),
    "gguf block count too large": ("g.gguf", _gguf_value("qwen35.block_count", 9), ["quantize", "{m}", "--type",
                                                                                    "Q8_0", "--out", OUT + "/q.gguf"],
                                   "missing"),
    "gguf context zero": ("g.gguf", _gguf_value("qwen35.context_length", 0), ["generate", "{m}", "--prompt", "x"],
                          "context_length = 0"),
    "gguf NaN weight (F32) on eval": ("g.gguf", _gguf_nan("blk.0.ffn_down.weight"), ["eval", "{m}", *EVAL],
                                      "holds NaN or Inf values"),
    "gguf NaN scale (Q8_0) on eval": ("g8.gguf", _gguf_nan("blk.1.attn_v.weight"), ["eval", "{m}", *EVAL],
                                      "holds NaN or Inf values"),
    "gguf NaN scale on generate": ("g8.gguf", _gguf_nan("blk.0.ffn_up.weight"), ["generate", "{m}", "--prompt", "x"],
                                   "holds NaN or Inf values"),
    # ONNX folders
    "onnx external data missing": ("onnx", _onnx_external_missing, ["eval", "{m}", *EVAL], "which is missing"),
    "onnx quantgate.json wrong type": ("onnx", lambda p: _edit_json(p / "quantgate.json", _set("bos_id", "x")),
                                       ["eval", "{m}", *EVAL], "bos_id must be a token id"),
    "onnx config.json wrong context": ("onnx", lambda p: _edit_json(p / "config.json",
                                                                    _set("max_position_embeddings", -1)),
                                       ["generate", "{m}", "--prompt", "x"], "max_position_embeddings must be"),
    # options out of range
    "seed negative": ("gated", None, ["analyze", "{m}", "--data", TEXT, "--seed", "-1"], "Invalid value for '--seed'"),
    "ctx zero": ("gated", None, ["quantize", "{m}", "--scheme", "w8a8-static", "--ctx", "0", "--out", OUT],
                 "Invalid value for '--ctx'"),
    "max windows negative": ("gated", None, ["eval", "{m}", "--data", TEXT, "--max-windows", "-1"],
                             "Invalid value for '--max-windows'"),
    "windows zero": ("gated", None, ["analyze", "{m}", "--data", TEXT, "--windows", "0"],
                     "Invalid value for '--windows'"),
    "threads negative": ("gated", None, ["generate", "{m}", "--prompt", "x", "--threads", "-1"],
                         "Invalid value for '--threads'"),
    "temperature negative": ("gated", None, ["generate", "{m}", "--prompt", "x", "--temperature", "-1"],
                             "Invalid value for '--temperature'"),
    "device misspelt": ("gated", None, ["eval", "{m}", *EVAL, "--device", "gpu0"], "is not cpu, cuda or cuda:N"),
    "datasets column of ints": ("gated", None, ["eval", "{m}", "--data", "{d}/ds"], "holds int values, not text"),
}
# one rule on every backend: a window longer than the model's context, and a prompt that fills it, are refused
for backend, artifact in (("torch", "gated"), ("onnxruntime", "onnx"), ("llama.cpp", "g.gguf")):
    CASES[f"ctx longer than the model's ({backend})"] = (
        artifact, None, ["eval", "{m}", "--data", TEXT, "--ctx", str(CONTEXT + 1)], f"context of {CONTEXT} tokens")
    CASES[f"prompt longer than the context ({backend})"] = (
        artifact, None, ["generate", "{m}", "--prompt", "x" * CONTEXT], f"context is {CONTEXT}: shorten the prompt")


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_value_gives_one_line(cli_server, base, tmp_path, name):
    artifact, edit, argv, needle = CASES[name]
    d = tmp_path / "case"
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("cache"))
    if name == "datasets column of ints":
        _hf_dataset_with_ints(d)
    if edit is not None:
        edit(d / artifact)
    before = tree_snapshot(tmp_path)
    r = cli_server.run(*[a.format(d=d, m=d / artifact) for a in argv], timeout=300)
    assert_refused(r, needle)
    assert tree_snapshot(tmp_path) == before  # inputs byte-identical, nothing written


@pytest.mark.parametrize("artifact", ["gated", "onnx", "g.gguf"])
def test_generation_stops_when_the_context_is_full(cli_server, base, artifact):
    """The same documented behaviour on every backend: new tokens stop once prompt + new tokens fill the context."""
    prompt = "x" * (CONTEXT - 5)  # BOS + 507 byte tokens: room for 4 new ones
    r = cli_server.run("generate", base / artifact, "--prompt", prompt, "--max-tokens", "64", "--kv-type", "f32",
                       timeout=300)
    assert r.code == 0, r.stderr[-2000:]
    said = [ln for ln in r.lines if ln.startswith("stopped after")]
    speed = next(ln for ln in r.lines if " new tokens: decode" in ln)  # "... prompt 508 tokens: ...; N new tokens: ..."
    n = int(speed.split(" new tokens")[0].split()[-1])
    assert n <= 4 and (n < 4 or said == [f"stopped after 4 new tokens: the model's context of {CONTEXT} tokens is full"])


def test_a_device_that_is_not_here_is_refused_and_never_recorded(cli_server, base):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU tests cover it")
    for m, needle in ((base / "gated", "torch sees no CUDA device"), (base / "onnx", "needs onnxruntime-gpu"),
                      (base / "g.gguf", "no GPU backend")):
        r = cli_server.run("eval", m, *[a.format(d=base) for a in EVAL], "--device", "cuda:0", timeout=300)
        assert_refused(r, needle)
