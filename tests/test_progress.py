"""Progress in a log: with stderr a file or pipe, long work prints a plain line (stage, done/total, its fields,
rate, time left) at least every QUANTGATE_PROGRESS_EVERY seconds; QUANTGATE_PROGRESS=0 prints none."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import save_tiny_twins


def _timed_stderr(args: list[str], env: dict) -> tuple[int, list[tuple[float, str]]]:
    """Run the CLI with stderr a pipe; each stderr line with the time it arrived."""
    p = subprocess.Popen([sys.executable, "-m", "quantgate.cli", *args], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True, cwd=tempfile.gettempdir(), env={**os.environ, **env})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln.rstrip())) for ln in p.stderr])
    reader.start()
    rc = p.wait(timeout=600)
    reader.join()
    return rc, lines


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_training_in_a_log_prints_plain_progress_lines_with_no_long_gap(tmp_path):
    d = save_tiny_twins(tmp_path)
    args = ["train", "--twins", "--preset", "tiny", "--byte-tokenizer", "--data", str(d / "text.txt"), "--steps", "60",
            "--batch-size", "4", "--ctx", "64", "--out", str(tmp_path / "run")]
    env = {"QUANTGATE_PROGRESS_EVERY": "0.5"}
    start = time.monotonic()
    rc, lines = _timed_stderr(args, {**env, "QUANTGATE_PROGRESS": "1"})
    assert rc == 0, lines[-5:]
    progress = [(t, ln) for t, ln in lines if re.match(r"train: \d+/60, ", ln)]
    assert len(progress) >= 2, lines
    # the stage, done/total, each twin's loss, the tokens/s field, elapsed and (once there is a rate) time left
    assert any(re.search(r"train: \d+/60, [\d,]+ tok/s, baseline \d+\.\d+, gated \d+\.\d+, [\d.]+/s, "
                         r"\dm\d\ds elapsed, \dm\d\ds left", ln) for _t, ln in progress), progress
    times = [start] + [t for t, _ln in lines]
    first = next(t for t, ln in lines if ln.startswith("train: "))
    gaps = [b - a for a, b in zip(times, times[1:]) if a >= first]
    assert max(gaps) < 0.5 + 2.0, gaps  # the interval, plus the reporter's tick and a loaded machine's slack
    # off: no progress line at all
    rc, quiet = _timed_stderr(args[:-1] + [str(tmp_path / "run2")], {**env, "QUANTGATE_PROGRESS": "0"})
    assert rc == 0 and not any(re.match(r"train: \d+/60", ln) for _t, ln in quiet)


def test_a_report_cell_without_a_count_of_its_own_still_prints_in_a_log(tmp_path, monkeypatch, capfd):
    """A cell's export or quantization has no bar of its own; its stage line names it with the time taken (the demo's
    log once went 34 s without a line while ONNX Runtime quantized)."""
    from quantgate.report.cells import cached
    monkeypatch.setenv("QUANTGATE_PROGRESS", "1")
    monkeypatch.setenv("QUANTGATE_PROGRESS_EVERY", "0.3")

    def slow():
        time.sleep(1.5)
        return {"x": 1}

    assert cached(tmp_path / "c.json", "k", slow, "onnx gated int8-dynamic", {})["x"] == 1
    err = capfd.readouterr().err
    assert re.search(r"^onnx gated int8-dynamic: 0m0\ds elapsed$", err, re.M), err


def test_the_interval_is_read_while_the_reporter_runs(tmp_path, monkeypatch, capfd):
    """One reporter thread serves the whole process: started by a step under one interval, it still keeps the
    interval set later (it once kept the first, so a library user's second call, or a test after another, spoke 20 s
    late)."""
    from quantgate.progress import stage
    monkeypatch.setenv("QUANTGATE_PROGRESS", "1")
    monkeypatch.setenv("QUANTGATE_PROGRESS_EVERY", "20")
    with stage("first step"):
        time.sleep(0.3)
    monkeypatch.setenv("QUANTGATE_PROGRESS_EVERY", "0.3")
    with stage("second step"):
        time.sleep(1.5)
    err = capfd.readouterr().err
    assert re.search(r"^second step: 0m0\ds elapsed$", err, re.M), err


def test_a_long_verb_without_a_bar_of_its_own_still_prints_in_a_log(tmp_path, monkeypatch):
    """llama.cpp's quantizer has no bar: `quantgate quantize X.gguf > log` once sat silent for minutes at a 0.8B shape.
    Every long verb carries a heartbeat in a log; `generate` streams text instead and carries none."""
    from click.testing import CliRunner

    import quantgate.quant.build as build
    from quantgate.cli import main
    monkeypatch.setenv("QUANTGATE_PROGRESS", "1")
    monkeypatch.setenv("QUANTGATE_PROGRESS_EVERY", "0.3")

    def slow_quantize(*_a, **_k):
        time.sleep(1.5)
        return {"out": "x"}

    monkeypatch.setattr(build, "quantize", slow_quantize)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    r = CliRunner().invoke(main, ["quantize", str(src), "--type", "Q8_0", "--out", str(tmp_path / "q.gguf")])
    assert r.exit_code == 0, r.output
    assert re.search(r"^quantize: 0m0\ds elapsed$", r.stderr, re.M), r.stderr
    # the heartbeat stops with the verb: nothing after the peak-memory line
    assert r.stderr.rstrip().splitlines()[-1].startswith("peak memory"), r.stderr


def test_the_heartbeat_gives_way_to_a_bar_and_is_off_with_progress_off(monkeypatch, capfd):
    from quantgate.progress import track, verb
    monkeypatch.setenv("QUANTGATE_PROGRESS", "1")
    monkeypatch.setenv("QUANTGATE_PROGRESS_EVERY", "0.2")
    with verb("eval"):
        for _ in track(range(3), "windows", total=3):
            time.sleep(0.4)
    err = capfd.readouterr().err
    assert re.search(r"^windows: \d/3", err, re.M) and not re.search(r"eval: .* \| windows", err), err
    monkeypatch.setenv("QUANTGATE_PROGRESS", "0")
    with verb("eval"):
        time.sleep(0.6)
    assert capfd.readouterr().err == ""
