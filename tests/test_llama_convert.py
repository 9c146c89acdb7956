"""Our hybrid GGUF against the file llama.cpp's own convert_hf_to_gguf.py writes for the same Qwen3.5 checkpoint.

The converter comes from the sdist of the installed llama-cpp-python (its vendored llama.cpp; the wheel does not
ship it), fetched with pip (`QUANTGATE_LLAMA_CPP_SDIST` may name a downloaded .tar.gz instead), and runs in the
transformers-5 interpreter (QUANTGATE_TF5_PYTHON), which it needs for the tokenizer. The checkpoints carry a real
(small, trained) BPE tokenizer, so both files hold merges llama.cpp loads. Asserted: every tensor the same name,
type, shape and bytes; every model key both write equal; both files give the same logits in llama.cpp, within
1e-5 of PyTorch."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err, transformers5_python
from quantgate.export.gguf import export_checkpoint
from quantgate.formats import save_checkpoint
from quantgate.formats.gguf import open_reader
from quantgate.model import hybrid, make_twins, preset
from quantgate.runners import LlamaRunner
from quantgate.tokenizer import train_bpe
from test_streaming import with_mtp

TF5 = os.environ.get("QUANTGATE_TF5_PYTHON") or transformers5_python()
pytestmark = [pytest.mark.slow,  # fetches and unpacks the sdist, runs the converter: about a minute
              pytest.mark.skipif(not TF5, reason="needs transformers >= 5.2 (the converter reads the "
                                                 "tokenizer with it): pip install '.[test]'")]
SCRIPT = Path(__file__).with_name("llama_convert.py")
W = np.array([[0] + list(range(3, 40)), [0] + list(range(299, 262, -1))], dtype=np.int64)
OURS_ONLY = ("quantgate.",)  # our provenance keys; general.* (names, size labels) are each writer's own
# (value heads per key head, tied, twin, with an MTP head: kept by both writers, as the converter does without
# --no-mtp, and a Qwen3.5-MoE: qwen35moe, 8 routed experts, top 2, and a gated shared expert)
CASES = {"gated-r2": (2, False, "gated", False, False), "baseline-r1-tied": (1, True, "baseline", False, False),
         "gated-r2-mtp": (2, False, "gated", True, False), "moe-gated-r2": (2, False, "gated", False, True),
         "moe-gated-r2-mtp": (2, False, "gated", True, True)}
# written in bf16 as well as f32: the converter keeps some tensors F32 whatever the out type (a MoE's router and
# shared-expert gate, the conv), which an f32 export cannot show
BF16_CASES = ("moe-gated-r2-mtp", "gated-r2")
MOE = dict(n_experts=8, n_experts_used=2, expert_ffn_dim=32, shared_expert_ffn_dim=64)


def _sdist(tmp: Path) -> Path:
    """The llama.cpp tree of the installed llama-cpp-python's sdist: converter, its conversion package, gguf-py."""
    given = os.environ.get("QUANTGATE_LLAMA_CPP_SDIST")
    version = importlib.metadata.version("llama-cpp-python")
    if given:
        tar = Path(given)
    else:
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                            ":all:", "--no-deps", "-q", "-d", str(tmp)], capture_output=True, text=True, timeout=600)
        tars = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode or not tars:
            pytest.skip(f"could not fetch the llama-cpp-python {version} sdist (offline?): {r.stderr.strip()[-200:]}")
        tar = tars[0]
    root = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(tar) as t:
        members = [m for m in t.getmembers() if m.name == root + "convert_hf_to_gguf.py"
                   or m.name.startswith((root + "conversion/", root + "gguf-py/"))]
        assert members, f"{tar} holds no {root}convert_hf_to_gguf.py"
        t.extractall(tmp, members=members, filter="data")
    return tmp / root


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-convert")
    src = _sdist(d / "sdist")
    tok = train_bpe(["def f(x):\n    return x * 2  # a small corpus for a real BPE\n" * 50], 300)
    jobs, models = [], {}
    for case, (r, tied, role, mtp, moe) in CASES.items():
        cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32, tie_embeddings=tied),
                     value_heads_per_key_head=r)
        cfg = dataclasses.replace(cfg, **MOE) if moe else cfg
        base, gated = make_twins(cfg, "elementwise", seed=0)
        m = {"baseline": base, "gated": gated}[role]
        randomize_(m, 3)
        save_checkpoint(m.eval(), d / (case + "-trunk" if mtp else case), tok)
        if mtp:
            with_mtp(d / (case + "-trunk"), d / case, cfg)
        for outtype in ("f32", "bf16") if case in BF16_CASES else ("f32",):
            suffix = "" if outtype == "f32" else "-bf16"
            export_checkpoint(d / case, d / f"{case}{suffix}-ours.gguf", outtype)
            jobs.append([str(d / case), "--outfile", str(d / f"{case}{suffix}-ref.gguf"), "--outtype", outtype,
                         *([] if mtp else ["--no-mtp"])])
        models[case] = m
    (d / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([TF5, str(SCRIPT), str(src), str(d / "jobs.json")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, models


def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith(("GGUF.", *OURS_ONLY)) or (k.startswith("general.") and k != "general.architecture"):
            continue
        out[k] = f.contents()
    return out


def converted_vocab(fields: dict) -> int:
    """Tokens the trained tokenizer really has (the rest of the embedding's rows are padding)."""
    tokens = fields["tokenizer.ggml.tokens"]
    return next((i for i, t in enumerate(tokens) if t.startswith("<|quantgate_unused_")), len(tokens))


@pytest.mark.parametrize("case", sorted(CASES) + [f"{c}-bf16" for c in BF16_CASES])
def test_our_hybrid_gguf_holds_the_tensors_llama_cpps_converter_writes(converted, case):
    d, _ = converted
    ours, ref = open_reader(d / f"{case}-ours.gguf"), open_reader(d / f"{case}-ref.gguf")
    to, tr = {t.name: t for t in ours.tensors}, {t.name: t for t in ref.tensors}
    assert set(to) == set(tr)
    for name in sorted(tr):
        a, b = to[name], tr[name]
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name  # bit for bit
    fo, fr = _fields(ours), _fields(ref)
    # tokenizer.ggml.pre is what llama_convert.py tells the converter; rows past the trained vocabulary are padding,
    # which each writer names its own way ([PADn] there, <|quantgate_unused_n|> here)
    n = converted_vocab(fo)
    for f in (fo, fr):
        f.pop("tokenizer.ggml.pre")
        f["tokenizer.ggml.tokens"] = f["tokenizer.ggml.tokens"][:n]
    shared = sorted(set(fo) & set(fr))
    assert [k for k in shared if fo[k] != fr[k]] == []
    assert "tokenizer.ggml.merges" in shared and f"{fo['general.architecture']}.block_count" in shared
    arch = fo["general.architecture"]  # the converter writes the interval beside the per-layer flags, which we write
    assert set(fr) - set(fo) <= {f"{arch}.full_attention_interval", "tokenizer.ggml.add_eos_token"}, set(fr) - set(fo)


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_files_give_the_same_logits_in_llama_cpp(converted, case):
    d, models = converted
    with torch.no_grad():
        want = models[case](torch.as_tensor(W)).logits.numpy()
    with LlamaRunner(d / f"{case}-ours.gguf", n_ctx=64, kv_type="f32") as a, \
            LlamaRunner(d / f"{case}-ref.gguf", n_ctx=64, kv_type="f32") as b:
        ours, ref = a.logits(W), b.logits(W)
    assert np.array_equal(ours, ref)
    # a MoE's llama.cpp logits sit further from PyTorch's (tests/test_moe.py says by how much and why)
    assert rel_err(ref, want) <= (1e-4 if CASES[case][4] else 1e-5)
