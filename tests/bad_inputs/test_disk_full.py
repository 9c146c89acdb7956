"""A full disk, simulated with a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG as
they would with ENOSPC): one error line that says so, exit 2, no output and no temporary file left behind,
inputs unchanged."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest import export_gated_twin, save_tiny_twins, tree_snapshot

LIMIT = 200_000  # bytes: the models below write 0.5-2 MB


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("full"))
    export_gated_twin(d)
    return d


VERBS = {
    "export gguf": ["export", "gguf", "{d}/gated", "--out", "{out}/m.gguf"],
    "export onnx": ["export", "onnx", "{d}/gated", "--out", "{out}/onnx"],
    "quantize torch": ["quantize", "{d}/gated", "--scheme", "w4a16-g32", "--out", "{out}/q"],
    "quantize onnx": ["quantize", "{d}/onnx", "--scheme", "int8-weight", "--out", "{out}/q"],
    "quantize gguf": ["quantize", "{d}/g.gguf", "--type", "Q8_0", "--out", "{out}/q.gguf"],
    "train": ["train", "--preset", "tiny", "--byte-tokenizer", "--data", "{d}/text.txt", "--steps", "2",
              "--ckpt-every", "1", "--batch-size", "2", "--ctx", "32", "--out", "{out}/run"],
    "report": ["report", "--models", "{d}/baseline", "{d}/gated", "--data", "{d}/text.txt", "--backends", "gguf",
               "--schemes", "gguf:Q8_0", "--windows", "1", "--ctx", "32", "--out", "{out}/rep"],
}


SLOW = {"export onnx", "report"}  # a minute of tracing, a report's cells; CI's slow step runs them


@pytest.mark.parametrize("verb", [pytest.param(v, marks=pytest.mark.slow) if v in SLOW else v for v in VERBS])
def test_full_disk_gives_one_line_and_no_debris(work, tmp_path, verb):
    out = tmp_path / "out"
    out.mkdir()
    before = tree_snapshot(work)
    args = [a.format(d=work, out=out) for a in VERBS[verb]]
    env = {**os.environ, "QUANTGATE_PROGRESS": "0", "QUANTGATE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", *args], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env=env, preexec_fn=_limited, timeout=600)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert r.returncode == 2 and errors == [lines[-1]] and "Traceback" not in r.stderr, r.stderr[-2000:]
    if verb not in ("train", "report"):  # these two print progress lines before the error
        assert len(lines) == 1, r.stderr[-2000:]
    assert "disk full or file size limit" in lines[-1], lines[-1]
    left = [p for p in out.rglob("*") if p.name.endswith((".tmp", ".old")) or p.suffix in (".gguf", ".onnx")]
    assert left == [] and not (out / "q").exists() and not (out / "onnx").exists()
    assert tree_snapshot(work) == before


@pytest.mark.parametrize("size", ["64k", "112k"])  # the disk fills in the plots / at the JSON after them
def test_analyze_json_and_plots_on_a_disk_that_fills_keep_neither(work, tmp_path, size):
    """A real small filesystem (tmpfs): the plots wait in a staging folder and the JSON is written before they are
    moved in, so a full disk at any point leaves neither (the sweep found the JSON and half a plots folder)."""
    from conftest import small_filesystem
    with small_filesystem(tmp_path / "small", size) as fs:
        env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
        r = subprocess.run([sys.executable, "-m", "quantgate.cli", "analyze", str(work / "gated"), "--compare",
                            str(work / "baseline"), "--data", str(work / "text.txt"), "--ctx", "32", "--windows", "4",
                            "--json", str(fs / "a.json"), "--plots", str(fs / "plots")],
                           capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env, timeout=600)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert lines[-1].startswith("error: ") and "nothing was kept" in lines[-1], lines
        assert list(fs.iterdir()) == [], sorted(p.name for p in fs.iterdir())
