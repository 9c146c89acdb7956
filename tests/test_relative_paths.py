"""Paths as users type them: relative to the working directory (the README's `--out runs/a`). Writing, rewriting a
file quantgate wrote inside its own run folder, and reading back must work the same as with absolute paths."""
from __future__ import annotations

import json

from conftest import run_cli

TINY = ["--preset", "tiny", "--byte-tokenizer", "--max-chars", "100000", "--batch-size", "2", "--ctx", "32"]


def test_verbs_take_relative_paths_and_rewrite_their_own_files(tmp_path):
    # a run folder's log is rewritten at every checkpoint: the file quantgate wrote is proven its own and replaced
    r = run_cli("train", *TINY, "--twins", "--steps", "4", "--ckpt-every", "2", "--out", "runs/a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "runs/a/state/train_log.json").read_text())
    steps = [("export", "gguf", "runs/a/gated", "--out", "g.gguf"),
             ("analyze", "runs/a/gated", "--windows", "2", "--ctx", "32", "--json", "out/an.json"),
             ("eval", "runs/a/gated", "--reference", "runs/a/baseline", "--ctx", "32", "--max-windows", "2")]
    for argv in steps:
        for attempt in (1, 2):  # the second time replaces what the first wrote
            r = run_cli(*argv, cwd=tmp_path)
            assert r.returncode == 0, (argv, attempt, r.stderr[-2000:])
    assert (tmp_path / "g.gguf").stat().st_size > 0 and json.loads((tmp_path / "out/an.json").read_text())
