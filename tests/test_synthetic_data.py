"""The synthetic Bigram-Backcopy corpus (calib_data.synthetic): seeded, one byte token per symbol, the
back-copy rule, its splits and how the split policy treats it."""
from __future__ import annotations

import numpy as np
import pytest

from quantgate.calib_data import SYNTHETIC_NAMES, calibration_split, data_paths, default_split, load_corpus
from quantgate.calib_data.synthetic import (BIGRAM_BACKCOPY, SYMBOLS, TRIGGERS, backcopy_violations,
                                            generate_chains, stationary, transition_matrix, trigger_indices)
from quantgate.errors import QuantgateError
from quantgate.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(BIGRAM_BACKCOPY)


def test_named_and_deterministic(corpus):
    assert BIGRAM_BACKCOPY in SYNTHETIC_NAMES
    again = load_corpus(BIGRAM_BACKCOPY)
    assert [d.text for d in again.documents] == [d.text for d in corpus.documents]
    assert again.fingerprint == corpus.fingerprint
    assert 2_000_000 <= corpus.n_chars <= 4_000_000 and len(corpus.documents) >= 1000
    probs = transition_matrix()
    chains = generate_chains(4, 50, probs, trigger_indices(probs))
    assert np.array_equal(chains, generate_chains(4, 50, probs, trigger_indices(probs)))


def test_every_symbol_is_one_byte_token(corpus):
    tok = byte_tokenizer()
    for d in corpus.documents[:20]:
        ids = tok.encode(d.text)
        assert len(ids) == len(d.text) and tok.decode(ids) == d.text
        assert min(ids) >= 3  # no specials
    assert set("".join(d.text for d in corpus.documents[:200])) <= set(SYMBOLS)
    assert len(tok.encode(SYMBOLS)) == len(SYMBOLS)


def test_backcopy_rule_holds(corpus):
    assert sum(backcopy_violations(d.text) for d in corpus.documents) == 0
    text = "".join(d.text for d in corpus.documents[:100])
    n_trig = sum(text.count(t) for t in TRIGGERS)
    # Guo et al.'s rate: the triggers are the most frequent symbols, about a quarter of all positions
    assert 0.2 < n_trig / len(text) < 0.35
    for d in corpus.documents[:100]:
        assert d.text[0] not in TRIGGERS  # a fresh chain: a trigger always has a symbol before it
        for i in range(1, len(d.text) - 1):
            if d.text[i] in TRIGGERS:
                assert d.text[i + 1] == d.text[i - 1]
    t = TRIGGERS[0]
    assert backcopy_violations(f"x{t}y") == 1 and backcopy_violations(f"x{t}x") == 0


def test_splits_and_split_policy(corpus):
    sizes = {s: len(corpus.split(s).documents) for s in ("train", "valid", "test")}
    assert all(n > 0 for n in sizes.values()) and sizes["train"] > 10 * sizes["test"]
    assert default_split(BIGRAM_BACKCOPY) == "test" and calibration_split(BIGRAM_BACKCOPY) == "valid"
    assert default_split("embedded") == "test" and default_split("some/file.txt") == "all"
    assert data_paths(BIGRAM_BACKCOPY) == []


def test_max_chars_caps(corpus):
    assert load_corpus(BIGRAM_BACKCOPY, max_chars=10_000).n_chars <= 10_000 + len(corpus.documents[0].text)


def test_unknown_synthetic_name_errors():
    with pytest.raises(QuantgateError, match="unknown synthetic corpus synthetic:xyz; choose from "
                                             "synthetic:bigram-backcopy"):
        load_corpus("synthetic:xyz")


def test_triggers_are_the_most_frequent_symbols(corpus):
    """As Guo et al. choose them: the top 3 of the chain's stationary distribution (the back-copy moves the text's own
    counts a little, so each is among the text's 5 most frequent symbols)."""
    probs = transition_matrix()
    pi = stationary(probs)
    assert np.allclose(pi @ probs, pi) and abs(pi.sum() - 1) < 1e-12
    assert "".join(SYMBOLS[i] for i in trigger_indices(probs)) == TRIGGERS
    text = "".join(d.text for d in corpus.documents[:300])
    counts = {c: text.count(c) for c in SYMBOLS}
    assert set(TRIGGERS) <= set(sorted(counts, key=counts.get)[-5:])


def test_symbol_tokenizer_is_the_corpus_alphabet(corpus, tmp_path):
    """The sink lab's tokenizer: one token per symbol, the specials and <|unk|> first; saved and read back the
    same; a text outside the alphabet is refused in one line, never read as <|unk|> or dropped."""
    from quantgate.calib_data import tokenize_corpus
    from quantgate.tokenizer import load_tokenizer, symbol_tokenizer
    tok = symbol_tokenizer(SYMBOLS)
    assert tok.vocab_size == len(SYMBOLS) + 4 and (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 2, 3)
    for d in corpus.documents[:20]:
        ids = tok.encode(d.text)
        assert len(ids) == len(d.text) and tok.decode(ids) == d.text and min(ids) >= 4
    assert len(set(tok.encode(SYMBOLS))) == len(SYMBOLS)
    tok.save(tmp_path)
    back = load_tokenizer(tmp_path)
    assert back.encode(SYMBOLS) == tok.encode(SYMBOLS) and back.unk_id == 3 and back.decode(tok.encode("ab9")) == "ab9"
    assert byte_tokenizer().unk_id is None
    with pytest.raises(QuantgateError, match="outside the tokenizer's alphabet"):
        tokenize_corpus(load_corpus("embedded", max_chars=20_000), tok)
    for bad in ("", "aa", "a b"):
        with pytest.raises(QuantgateError, match="distinct, non-whitespace"):
            symbol_tokenizer(bad)


def test_symbol_tokenizer_takes_only_a_synthetic_corpus(tmp_path):
    from conftest import run_cli
    from quantgate.train import TrainConfig
    with pytest.raises(QuantgateError, match="synthetic corpus"):
        TrainConfig(symbol_tokenizer=True, data="embedded")
    with pytest.raises(QuantgateError, match="give one of them"):
        TrainConfig(symbol_tokenizer=True, byte_tokenizer=True, data=BIGRAM_BACKCOPY)
    r = run_cli("train", "--symbol-tokenizer", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "synthetic corpus" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()
