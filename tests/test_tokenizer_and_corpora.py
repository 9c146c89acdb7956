"""Tokenizers, the embedded corpus, other text sources, splits and samplers."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import shared_file
from quantgate.calib_data import load_corpus, sample_windows, split_of, tokenize_corpus
from quantgate.calib_data.embedded import stdlib_documents
from quantgate.errors import QuantgateError
from quantgate.tokenizer import byte_tokenizer, load_tokenizer, train_bpe

TEXT = "def gate(x):\n    return sigmoid(x) * attention(x)  # café, naïve, 日本語\n"


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    assert tok.vocab_size == 259 and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8")) and min(ids) >= 3
    assert tok.decode(ids) == TEXT


def test_bpe_trains_merges_and_round_trips(tmp_path):
    docs = [d.text for d in stdlib_documents(max_bytes=300_000)]
    tok = train_bpe(docs, 600)
    assert tok.vocab_size == 600
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.decode(ids) == TEXT
    assert tok.encode("<|bos|>") != [tok.bos_id]  # specials are never produced from text
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXT) == ids and again.bos_id == tok.bos_id


def test_embedded_corpus_is_stable_and_offline():
    a, b = load_corpus("embedded", max_chars=500_000), load_corpus("stdlib", max_chars=500_000)
    assert a.fingerprint == b.fingerprint and a.n_chars >= 500_000
    names = [d.name for d in a.documents]
    assert names == sorted(names) and all(n.startswith("stdlib/") for n in names)
    assert not any("/test/" in n or "site-packages" in n for n in names)


def test_split_is_by_document_and_deterministic():
    c = load_corpus("embedded", max_chars=3_000_000)
    parts = {s: c.split(s) for s in ("train", "valid", "test")}
    names = {s: {d.name for d in p.documents} for s, p in parts.items()}
    assert sum(len(v) for v in names.values()) == len(c.documents)
    assert not (names["train"] & names["test"]) and not (names["valid"] & names["test"])
    assert names["valid"] and names["test"]
    assert {d.name for d in load_corpus("embedded", max_chars=3_000_000).split("test").documents} == names["test"]
    assert all(split_of(n, 0.05, 0.05) == "test" for n in names["test"])


def test_file_folder_glob_sources(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 2000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta\n\n" * 3000)
    (tmp_path / ".hidden").write_text("never read")
    folder = load_corpus(tmp_path)
    assert {d.name.split("#")[0] for d in folder.documents} == {str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.md")}
    assert len(folder.documents) > 2  # long files are cut into ~4k-char documents
    assert "".join(d.text for d in load_corpus(tmp_path / "a.txt").documents) == "alpha " * 2000
    assert load_corpus(str(tmp_path / "**" / "*.md")).n_chars == len("beta\n\n" * 3000)
    with pytest.raises(QuantgateError, match="no files match"):
        load_corpus(str(tmp_path / "*.none"))


def test_wikitext_splits_at_articles():
    path = shared_file("wikitext-2", "valid.txt")
    c = load_corpus(path)
    assert len(c.documents) > 50
    assert all(d.text.lstrip("\n").startswith(" = ") for d in c.documents[1:10])


def test_hf_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [" = Title One = ", "first article text " * 50, " = Title Two = ", "second " * 80]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows})}).save_to_disk(tmp_path / "ds")
    c = load_corpus(tmp_path / "ds")
    assert len(c.documents) == 2 and "first article" in c.documents[0].text
    datasets.Dataset.from_dict({"content": ["x"]}).save_to_disk(tmp_path / "nocol")
    with pytest.raises(QuantgateError, match="no 'text' column"):
        load_corpus(tmp_path / "nocol")


def test_sampler_is_seeded_and_starts_with_bos():
    c = load_corpus("embedded", max_chars=200_000)
    stream = tokenize_corpus(c, byte_tokenizer())
    a, b = sample_windows(stream, 6, 32, seed=3), sample_windows(stream, 6, 32, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, sample_windows(stream, 6, 32, seed=4))
    assert (a[:, 0] == 0).all() and (a[:, 1:] != 0).all()
    with pytest.raises(QuantgateError):
        sample_windows(stream, 0, 32, seed=0)
