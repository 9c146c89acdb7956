"""A full disk, simulated with a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG as
they would with ENOSPC): one error line, exit 2, no output and no temporary file left behind."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile

import pytest

from quantgate.checkpoint import save_checkpoint
from quantgate.model import build_model, preset
from quantgate.tokenizer import byte_tokenizer

LIMIT = 200_000  # bytes: the models below write 0.5-2 MB


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    save_checkpoint(build_model(preset("tiny", vocab_size=300, gate="elementwise"), seed=0), d / "m", byte_tokenizer())
    return d / "m"


@pytest.mark.parametrize("verb", [
    ["export", "gguf", "{m}", "--out", "{out}/m.gguf"],
    ["export", "onnx", "{m}", "--out", "{out}/onnx"],
    ["quantize", "{m}", "--scheme", "w4a16-g32", "--out", "{out}/q"],
])
def test_full_disk_gives_one_line_and_no_debris(model, tmp_path, verb):
    out = tmp_path / "out"
    out.mkdir()
    args = [a.format(m=model, out=out) for a in verb]
    env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", *args], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env=env, preexec_fn=_limited, timeout=300)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: ") and ("disk full" in lines[0] or "too large" in lines[0].lower())
    assert list(out.iterdir()) == []
