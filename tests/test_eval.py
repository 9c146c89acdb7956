"""`quantgate eval` against transformers' perplexity under the same convention."""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from conftest import make_hf_qwen3, make_hf_qwen3_next, run_cli
from quantgate.evaluate import eval_windows, token_nll
from quantgate.tokenizer import byte_tokenizer

TEXT = ("The gate multiplies each head's output by a sigmoid before o_proj.\n" * 12
        + "Massive activations ruin per-tensor INT8 quantization; the gate removes them at scale.\n" * 8)


def transformers_ppl(hf, ids: list[int], ctx: int, bos: int) -> float:
    """The DESIGN section 1 convention, computed independently with transformers' own loss."""
    span = ctx - 1
    total, count = 0.0, 0
    for i in range(len(ids) // span):
        w = torch.tensor([[bos] + ids[i * span:(i + 1) * span]])
        with torch.no_grad():
            out = hf(w, labels=w, use_cache=False)  # HF shifts labels and averages over ctx-1 tokens
        total += float(out.loss) * span
        count += span
    return math.exp(total / count)


def _checkpoint_with_tokenizer(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    tok = byte_tokenizer()
    tok.save(tmp_path)
    return tok


def test_eval_cli_equals_transformers(tmp_path):
    for name, hf in (("qwen3", make_hf_qwen3()), ("next", make_hf_qwen3_next(0.25))):
        d = tmp_path / name
        tok = _checkpoint_with_tokenizer(d, hf)
        text_file = tmp_path / "eval.txt"
        text_file.write_text(TEXT)
        r = run_cli("eval", str(d), "--data", str(text_file), "--ctx", "64", "--json")
        assert r.returncode == 0, r.stderr
        ours = json.loads(r.stdout)
        ref = transformers_ppl(hf, tok.encode(TEXT), 64, tok.bos_id)
        assert ours["n_tokens"] == (len(tok.encode(TEXT)) // 63) * 63
        assert abs(ours["ppl"] - ref) / ref < 1e-5, (ours["ppl"], ref)


def test_eval_of_a_long_text_file_equals_transformers_on_the_file_tokenized_whole(tmp_path):
    """README convention: a plain text file is one text, tokenized whole, cut into consecutive windows of ctx-1
    tokens with BOS in front. A multi-paragraph file of more than 8k characters (Python's own licence, held out
    from the embedded corpus) must give transformers' perplexity to 1e-5 with a BPE tokenizer, where cutting the
    file into pieces would change the tokens at every cut."""
    import sysconfig
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    from quantgate.tokenizer import train_bpe
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = lic.read_text() if lic.is_file() else "".join(f"Paragraph {i}: " + "the gate, the sink. " * 30 + "\n\n"
                                                          for i in range(40))
    assert len(text) > 8000 and text.count("\n\n") > 10
    d = tmp_path / "m"
    hf = make_hf_qwen3()
    hf.save_pretrained(d)
    tok = train_bpe([open(torch.__file__).read()], 300)  # trained on other text: the licence stays held out
    tok.save(d)
    (tmp_path / "licence.txt").write_text(text)
    r = run_cli("eval", str(d), "--data", str(tmp_path / "licence.txt"), "--ctx", "64", "--json")
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ours["n_tokens"] == (len(ids) // 63) * 63
    ref = transformers_ppl(hf, ids, 64, tok.bos_id)
    assert abs(ours["ppl"] - ref) / ref < 1e-5, (ours["ppl"], ref)


def test_eval_windows_convention():
    ids = np.arange(10, 30)
    w = eval_windows(ids, ctx=6, bos_id=0)
    assert w.shape == (4, 6)  # 20 tokens // 5 per window, tail of 0 dropped
    assert (w[:, 0] == 0).all() and w[1, 1] == 15
    w2 = eval_windows(np.arange(10, 32), ctx=6, bos_id=0)
    assert w2.shape == (4, 6)  # 22 tokens: the incomplete tail (2 tokens) is dropped
    w3 = eval_windows(ids, ctx=6, bos_id=0, max_windows=2)  # spread over the text, not its first two windows
    assert (w3 == w[[0, 3]]).all()
    assert (eval_windows(ids, ctx=6, bos_id=0, max_windows=9) == w).all()


def test_token_nll_matches_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    windows = rng.integers(0, 7, size=(2, 5))
    ref = -torch.log_softmax(torch.tensor(logits[:, :-1], dtype=torch.float64), -1).gather(
        -1, torch.tensor(windows[:, 1:, None])).squeeze(-1).numpy()
    np.testing.assert_allclose(token_nll(logits, windows), ref, rtol=1e-10)
