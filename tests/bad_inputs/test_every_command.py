"""Bad input for the commands the file/format sweeps do not reach (analyze, attribute, report, demo, train,
export, generate, info): one `error:` line, exit code 2, nothing written, the inputs untouched."""
from __future__ import annotations

import os

import pytest

from conftest import dir_snapshot, run_cli, save_tiny_twins


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("every"), "t.txt")
    (d / "bin.txt").write_bytes(b"abc\x00\x01def" * 40)
    (d / "afile").write_text("a file where a folder must be\n")
    os.mkfifo(d / "fifo")  # nothing ever writes to it: reading it would block for good
    _wide_twin(d)
    return d


def _wide_twin(d):
    """The gated twin with 100 more (unused) vocabulary rows and no tokenizer: same ids, another vocabulary."""
    import dataclasses
    from quantgate.formats import load_checkpoint, save_checkpoint
    from quantgate.model import build_model
    m = load_checkpoint(d / "gated").model
    wide = build_model(dataclasses.replace(m.cfg, vocab_size=400, extra={}), seed=0)
    save_checkpoint(wide, d / "wide")


REPORT = ["report", "--models", "{d}/baseline", "{d}/gated"]  # the twins in the right order
CASES = {
    "analyze missing model": (["analyze", "{d}/nothere", "--data", "{d}/t.txt"], "does not exist"),
    "analyze binary text": (["analyze", "{d}/gated", "--data", "{d}/bin.txt"], "binary"),
    "analyze compare missing": (["analyze", "{d}/gated", "--data", "{d}/t.txt", "--compare", "{d}/nothere"],
                                "does not exist"),
    "analyze gate lost": (["analyze", "{d}/baseline", "--data", "{d}/t.txt", "--reference", "{d}/gated"],
                          "gate was lost"),
    "analyze reference without gate": (["analyze", "{d}/gated", "--data", "{d}/t.txt", "--reference",
                                        "{d}/baseline"], "no attention gate"),
    "attribute unknown scheme": (["attribute", "{d}/gated", "--scheme", "w9", "--data", "{d}/t.txt"],
                                 "unknown scheme 'w9'"),
    "report twins swapped": (["report", "--models", "{d}/gated", "{d}/baseline", "--data", "{d}/t.txt",
                              "--out", "{out}/r"], "baseline (no gate) first"),
    "report unknown backend": ([*REPORT, "--backends", "tpu", "--out", "{out}/r"], "unknown backend 'tpu'"),
    "report unknown gguf type": ([*REPORT, "--schemes", "gguf:Q9_9", "--out", "{out}/r"], "unknown gguf scheme 'Q9_9'"),
    "report unknown torch scheme": ([*REPORT, "--schemes", "torch:w8a8", "--out", "{out}/r"],
                                    "unknown torch scheme 'w8a8'"),
    "report malformed scheme item": ([*REPORT, "--schemes", "int4", "--out", "{out}/r"], "not backend:scheme"),
    "report binary text": ([*REPORT, "--data", "{d}/bin.txt", "--out", "{out}/r"], "binary"),
    "report out is a file": ([*REPORT, "--data", "{d}/t.txt", "--out", "{d}/afile"], "is a file"),
    "demo out is a file": (["demo", "--out", "{d}/afile"], "is a file"),
    "train out under a file": (["train", "--preset", "tiny", "--data", "{d}/t.txt", "--steps", "2",
                                "--out", "{d}/afile/run"], "which is a file"),
    "train unknown preset": (["train", "--preset", "huge", "--out", "{out}/run"], "'huge' is not one of"),
    "train lr nan": (["train", "--preset", "tiny", "--data", "{d}/t.txt", "--steps", "2", "--lr", "nan",
                      "--out", "{out}/run"], "is not a finite number"),
    "train weight decay nan": (["train", "--preset", "tiny", "--data", "{d}/t.txt", "--steps", "2", "--weight-decay",
                                "NaN", "--out", "{out}/run"], "is not a finite number"),
    "train grad clip inf": (["train", "--preset", "tiny", "--data", "{d}/t.txt", "--steps", "2", "--grad-clip", "inf",
                             "--out", "{out}/run"], "--grad-clip"),
    "generate temperature nan": (["generate", "{d}/gated", "--prompt", "x", "--temperature", "nan"],
                                 "is not a finite number"),
    # text is read from regular files only: a device never ends, a FIFO never returns
    "train data a device": (["train", "--preset", "tiny", "--data", "/dev/zero", "--steps", "2", "--out", "{out}/run"],
                            "not a regular file"),
    "eval data a fifo": (["eval", "{d}/gated", "--data", "{d}/fifo"], "not a regular file"),
    "analyze data a device": (["analyze", "{d}/gated", "--data", "/dev/urandom"], "not a regular file"),
    "eval reference with another vocabulary": (["eval", "{d}/gated", "--data", "{d}/t.txt", "--ctx", "32",
                                                "--max-windows", "1", "--reference", "{d}/wide"], "vocabulary of 400"),
    "train zero steps": (["train", "--preset", "tiny", "--data", "{d}/t.txt", "--steps", "0",
                          "--out", "{out}/run"], "Invalid value for '--steps'"),
    "export unknown format": (["export", "tflite", "{d}/gated", "--out", "{out}/x"], "No such command 'tflite'"),
    "export gguf bad outtype": (["export", "gguf", "{d}/gated", "--outtype", "q4", "--out", "{out}/x.gguf"],
                                "'q4' is not one of"),
    "generate zero tokens": (["generate", "{d}/gated", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    "info missing gguf": (["info", "{d}/nothere.gguf"], "does not exist"),
    "unknown command": (["tflite"], "No such command"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_line(work, tmp_path, name):
    args, needle = CASES[name]
    before = dir_snapshot(work)
    r = run_cli(*[a.format(d=work, out=tmp_path) for a in args])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, not even an empty folder
    assert dir_snapshot(work) == before and sorted(p.name for p in work.iterdir()) == sorted(
        ["afile", "baseline", "bin.txt", "fifo", "gated", "t.txt", "wide"])


def test_analyze_refuses_a_missing_compare_or_reference_before_analysing(monkeypatch, tmp_path):
    """The other model is checked from its headers first: no analysis pass runs for a command that will fail."""
    import quantgate.analyze as analyze_mod
    from quantgate.errors import QuantgateError
    ran = []
    monkeypatch.setattr(analyze_mod, "analyze", lambda *a, **k: ran.append(a) or {})
    monkeypatch.setattr(analyze_mod, "check_gate_survival", lambda *a, **k: ran.append(a) or {})
    for kw in ({"compare": str(tmp_path / "nothere")}, {"reference": str(tmp_path / "nothere")}):
        with pytest.raises(QuantgateError, match="does not exist"):
            analyze_mod.run_analyze(str(tmp_path / "m"), "embedded", 32, 4, "auto", 0, **kw)
    assert ran == []
