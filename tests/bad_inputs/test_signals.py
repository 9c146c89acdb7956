"""Ctrl-C and SIGTERM in the middle of long commands: one error line, the signal's exit code, nothing
half-written (no output, no temporary files), and a report resumes afterwards."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run_cli, save_tiny_twins


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("sig"))
    env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
    for verb in (["onnx", "--out", str(d / "onnx")], ["gguf", "--out", str(d / "g.gguf")]):
        subprocess.run([sys.executable, "-m", "quantgate.cli", "export", verb[0], str(d / "gated"), *verb[1:]],
                       check=True, capture_output=True, env=env, cwd=tempfile.gettempdir())
    return d


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
    return subprocess.Popen([sys.executable, "-m", "quantgate.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(), env=env)


def _interrupt(p: subprocess.Popen, sig: int, after: float, once_in: Path | None = None) -> tuple[int, str]:
    """Signal `p` after `after` seconds, or (with `once_in`) as soon as a temporary output appears there: the
    command is then surely mid-write, not still importing or already shutting down."""
    if once_in is not None:
        deadline = time.time() + 120
        while not any(q.name.endswith(".tmp") for q in once_in.iterdir()) and time.time() < deadline:
            assert p.poll() is None, p.communicate()[1][-2000:]
            time.sleep(0.05)
    time.sleep(after)
    assert p.poll() is None, "the command finished before the signal: lengthen it"
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_onnx_export_leaves_nothing(twins, tmp_path, sig, code):
    out = tmp_path / "onnx"
    rc, err = _interrupt(_start("export", "onnx", str(twins / "gated"), "--out", str(out)), sig, 0.5, tmp_path)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary directory


# Each command is given enough calibration work to still be running when the signal lands (seconds here).
QUANTIZE = {
    "torch": ["quantize", "{d}/gated", "--scheme", "w8a8-static", "--calib-windows", "3000", "--out", "{out}/q"],
    "onnx": ["quantize", "{d}/onnx", "--scheme", "int8-static", "--calib-windows", "800", "--out", "{out}/q"],
    "gguf": ["quantize", "{d}/g.gguf", "--type", "Q4_K_M", "--imatrix", "auto", "--calib-windows", "2000",
             "--out", "{out}/q.gguf"],
}


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("backend", list(QUANTIZE))
def test_signal_during_quantize_leaves_nothing(twins, tmp_path, backend, sig, code):
    before = {p: p.read_bytes() for p in twins.rglob("*") if p.is_file()}
    args = [a.format(d=twins, out=tmp_path) for a in QUANTIZE[backend]]
    rc, err = _interrupt(_start(*args), sig, 5.0)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-2000:]
    assert list(tmp_path.iterdir()) == []
    assert {p: p.read_bytes() for p in twins.rglob("*") if p.is_file()} == before  # inputs untouched


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_report_then_resume(twins, tmp_path, sig, code):
    out = tmp_path / "rep"
    args = ["report", "--models", str(twins / "baseline"), str(twins / "gated"), "--data", str(twins / "text.txt"),
            "--schemes", "onnx:int4,gguf:Q4_0", "--windows", "2", "--ctx", "64", "--calib-windows", "2",
            "--out", str(out)]
    rc, err = _interrupt(_start(*args), sig, 10.0)
    word = "interrupted" if sig == signal.SIGINT else "terminated"
    assert rc == code and "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"error: {word}")
    assert not (out / "report.html").exists()
    leftovers = [p for p in out.rglob("*") if p.name.endswith((".tmp", ".old"))]
    assert leftovers == []
    done = {p.name for p in (out / "cells").glob("*.json")} if (out / "cells").is_dir() else set()
    r = run_cli(*args, env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "report.html").is_file() and done <= {p.name for p in (out / "cells").glob("*.json")}
