"""Byte-level BPE tokenizers (trained with HF `tokenizers`), a pure-byte option, and a symbol tokenizer for the
synthetic corpora (one token per symbol of their alphabet: the sink lab's, see `symbol_tokenizer`).

The first two are byte-level: ByteLevel(add_prefix_space=False, use_regex=True) pre-tokenization, the GPT-2
byte-to-unicode alphabet, so every UTF-8 text round-trips and GGUF export can use `gpt2` metadata.
Specials <|bos|>, <|eos|>, <|pad|> come first (ids 0, 1, 2). Text is always encoded without specials;
callers put BOS in front of every window themselves (DESIGN section 1).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .errors import QuantgateError
from .fsio import MAX_JSON_BYTES, read_bounded

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
UNK = "<|unk|>"  # the symbol tokenizer's id for a character outside its alphabet (tokenize_corpus refuses it)


class Tokenizer:
    """Thin wrapper: encode/decode without specials, plus the special ids a decoder needs."""

    def __init__(self, tok: HFTokenizer, bos_id: int, eos_id: int, pad_id: int | None = None):
        self.tok = tok
        tok.encode_special_tokens = True  # text that spells "<|bos|>" stays text, never becomes a control id
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = eos_id if pad_id is None else pad_id

    @property
    def unk_id(self) -> int | None:
        """The id of characters the vocabulary lacks (symbol tokenizers); None for byte-level ones, which lack none."""
        return self.tok.token_to_id(UNK)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        """Write tokenizer.json plus the HF side files that stock loaders look for."""
        directory = Path(directory)
        self.tok.save(str(directory / "tokenizer.json"))
        names = {k: self.tok.id_to_token(i) for k, i in
                 (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id))}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
               "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False, **names}
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `texts`. vocab_size counts the 256 bytes and the 3 specials."""
    if vocab_size < 256 + len(SPECIALS):
        raise QuantgateError(f"vocab size {vocab_size} is below 259 (256 bytes + 3 specials)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, *(tok.token_to_id(s) for s in SPECIALS))


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens + specials, no merges: for tests and for comparing without BPE effects."""
    return train_bpe([""], 256 + len(SPECIALS))


def symbol_tokenizer(symbols: str) -> Tokenizer:
    """One token per character of `symbols` after the specials and <|unk|>: a synthetic corpus's own alphabet.

    The sink lab needs it: with the 259-token byte vocabulary (62 of them used) the one-layer baseline learns the
    back-copy without parking its attention on BOS; with the task's own vocabulary it sinks, as Guo et al.'s models
    do on theirs (benchmarks/sink_lab_search.py, runs named vocab259). A BPE model with no merges and no
    pre-tokenizer splits text into characters; a character outside the alphabet becomes <|unk|>."""
    if not symbols or len(set(symbols)) != len(symbols) or any(c.isspace() for c in symbols):
        raise QuantgateError("a symbol tokenizer needs distinct, non-whitespace symbols")
    vocab = {t: i for i, t in enumerate((*SPECIALS, UNK, *symbols))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()  # tokens join without separators
    tok.add_special_tokens(list(SPECIALS) + [UNK])
    return Tokenizer(tok, *(tok.token_to_id(s) for s in SPECIALS))


def load_tokenizer(directory: Path, bos_id: int | None = None, eos_id: int | None = None,
                   pad_id: int | None = None) -> Tokenizer:
    """Load tokenizer.json from a model directory; special ids from the caller (config.json) or our names."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise QuantgateError(f"no tokenizer.json in {directory}")
    raw = read_bounded(path, MAX_JSON_BYTES)  # a regular file of bounded size (fsio)
    try:
        tok = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception subclasses with long messages
        raise QuantgateError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None
    ours = [tok.token_to_id(s) for s in SPECIALS]
    bos = bos_id if bos_id is not None else ours[0]
    eos = eos_id if eos_id is not None else ours[1]
    pad = pad_id if pad_id is not None else ours[2]
    if bos is None or eos is None:
        raise QuantgateError(f"{path}: cannot tell the BOS/EOS ids (set bos_token_id/eos_token_id in config.json)")
    return Tokenizer(tok, bos, eos, pad)
