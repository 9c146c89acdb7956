"""Static checks of the code's structure (issue 12): decisions that must live in one place."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("quantgate", "export", "calib_data") for p in (ROOT / d).rglob("*.py")] + [ROOT / "cli.py"]


def test_one_place_decides_what_kind_of_path_it_is():
    """Only quantgate/formats tests a path's suffix for .gguf/.onnx; everything else asks artifact_kind."""
    suffix_test = re.compile(r'''["']\.(gguf|onnx)["']''')
    where = [str(p.relative_to(ROOT)) for p in SOURCES if suffix_test.search(p.read_text())]
    assert where == ["quantgate/formats/__init__.py"], where


def test_llama_cpp_enums_are_not_retyped():
    """llama.cpp's type ids come from gguf-py (LlamaFileType, GGMLQuantizationType), never a literal table."""
    # the ids a hand copy would carry: llama_ftype Q4_K_M 15, Q8_0 7, BF16 32; ggml_type q8_0 8, q4_0 2
    table = re.compile(r'"(Q4_K_M"\s*:\s*15|Q8_0"\s*:\s*7|[bB][fF]16"\s*:\s*32|q8_0"\s*:\s*8|q4_0"\s*:\s*2)\b')
    where = [str(p.relative_to(ROOT)) for p in SOURCES if table.search(p.read_text())]
    assert where == [], where
