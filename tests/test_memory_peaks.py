"""Peak memory as each process saw it: a child started by a large parent does not report the parent's peak (Linux
keeps the parent's high-water mark in a fork+exec child's ru_maxrss, which once read 6.4 GB for a 2.9 GB eval)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quantgate import memory

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM needs Linux's /proc")

CHILD = """
import json
from quantgate.memory import peak_rss_bytes
print(json.dumps(peak_rss_bytes()))
"""


def test_a_child_of_a_large_process_reports_its_own_peak():
    big = np.ones(600 << 20, dtype=np.uint8)  # 600 MB resident in this process
    assert memory.own_peak_bytes() >= big.nbytes
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    child_peak = __import__("json").loads(out)["quantgate"]
    assert child_peak < big.nbytes, child_peak  # a bare python with quantgate.memory: well under 600 MB
    del big


def test_children_peaks_come_from_what_the_children_said(monkeypatch):
    monkeypatch.setattr(memory, "_CHILD_PEAKS", [])
    memory.note_child_peak(123 << 20)
    memory.note_child_peak(456 << 20)
    assert memory.peak_rss_bytes()["children"] == 456 << 20


def test_llama_cpps_worker_and_quantizer_report_their_peaks(tmp_path, monkeypatch):
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.quant.llama_cpp import quantize_gguf
    from quantgate.runners import LlamaRunner
    from quantgate.tokenizer import byte_tokenizer
    save_checkpoint(build_model(preset("tiny", vocab_size=300), seed=0), tmp_path / "m", byte_tokenizer())
    export_checkpoint(tmp_path / "m", tmp_path / "m.gguf", "f32")
    monkeypatch.setattr(memory, "_CHILD_PEAKS", [])
    quantize_gguf(tmp_path / "m.gguf", tmp_path / "q.gguf", "Q8_0")
    with LlamaRunner(tmp_path / "q.gguf", n_ctx=64) as r:
        r.logits(np.array([[1, 2, 3, 4]]))
    assert len(memory._CHILD_PEAKS) == 2, memory._CHILD_PEAKS
    assert all(10 << 20 < p < 4 << 30 for p in memory._CHILD_PEAKS), memory._CHILD_PEAKS
