"""Outputs never destroy what quantgate did not write, for every command that writes, through the CLI.

For each writing command: the output is the input, lies inside it, is a parent of it, is an existing folder
of the user's, or (--json/--plots) is an input file. Each is refused with one `error:` line and exit 2, and
the whole work folder is byte-identical afterwards: no input changed, nothing created, nothing removed.
"""
from __future__ import annotations

import pytest

from conftest import assert_refused, export_gated_twin, save_tiny_twins, tree_snapshot


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = save_tiny_twins(tmp_path_factory.mktemp("outputs") / "w", "t.txt")
    (w / "data").mkdir()
    (w / "data" / "a.txt").write_text("def g(y):\n    return y + 1\n" * 300)
    (w / "mine").mkdir()
    (w / "mine" / "notes.txt").write_text("the user's own notes\n")
    export_gated_twin(w)
    return w


TINY = ["--windows", "1", "--ctx", "32"]
COMMANDS = {  # command -> (argv before the output, the output flag)
    "train": (["train", "--preset", "tiny", "--byte-tokenizer", "--data", "{w}/data", "--steps", "1"], "--out"),
    "quantize torch": (["quantize", "{w}/gated", "--scheme", "w8a8-static", "--calib-data", "{w}/t.txt",
                        "--calib-windows", "1", "--ctx", "32"], "--out"),
    "quantize onnx": (["quantize", "{w}/onnx", "--scheme", "int8-dynamic"], "--out"),
    "quantize gguf": (["quantize", "{w}/g.gguf", "--type", "Q8_0"], "--out"),
    "export gguf": (["export", "gguf", "{w}/gated"], "--out"),
    "export onnx": (["export", "onnx", "{w}/gated"], "--out"),
    "analyze --json": (["analyze", "{w}/gated", "--data", "{w}/t.txt", *TINY], "--json"),
    "analyze --plots": (["analyze", "{w}/gated", "--data", "{w}/t.txt", *TINY], "--plots"),
    "attribute --json": (["attribute", "{w}/gated", "--scheme", "w8a16", "--data", "{w}/t.txt", *TINY], "--json"),
    "report": (["report", "--models", "{w}/baseline", "{w}/gated", "--data", "{w}/t.txt", *TINY], "--out"),
}
# the command's input (a folder or a file) that each output case is built around
INPUT = {"train": "{w}/data", "quantize torch": "{w}/gated", "quantize onnx": "{w}/onnx", "quantize gguf": "{w}/g.gguf",
         "export gguf": "{w}/gated", "export onnx": "{w}/gated", "analyze --json": "{w}/gated",
         "analyze --plots": "{w}/gated", "attribute --json": "{w}/gated", "report": "{w}/gated"}
FILE_OUTPUTS = ("quantize gguf", "export gguf", "analyze --json", "attribute --json")
CASES = {
    "output is the input": (lambda i: i, "is the input"),
    "output inside the input": (lambda i: i + "/sub" + (".gguf" if i.endswith(".gguf") else ""), "lies inside the input"),
    "output is a parent of the input": (lambda i: "{w}", "contains the input"),
}


def _params():
    for cmd in COMMANDS:
        for case in CASES:
            yield pytest.param(cmd, case, id=f"{cmd}: {case}")
        yield pytest.param(cmd, "output is the user's folder", id=f"{cmd}: output is the user's folder")
        if cmd in FILE_OUTPUTS:
            yield pytest.param(cmd, "output is the user's file", id=f"{cmd}: output is the user's file")
    for cmd, flag in (("analyze --json", "the text"), ("attribute --json", "the text"), ("analyze --json", "config"),
                      ("quantize torch", "the calibration text")):
        yield pytest.param(cmd, f"output is {flag} file", id=f"{cmd}: output is {flag} file")
    yield pytest.param("demo", "output is the user's folder", id="demo: output is the user's folder")


def _output_for(cmd: str, case: str) -> tuple[str, str]:
    if case in CASES:
        make, needle = CASES[case]
        return make(INPUT[cmd]), needle
    if case == "output is the user's folder":
        return "{w}/mine", ("is a folder; it must be a file path" if cmd in FILE_OUTPUTS else "quantgate did not write")
    if case == "output is the user's file":
        return "{w}/mine/notes.txt", "that quantgate wrote"
    if case == "output is config file":
        return "{w}/gated/config.json", "lies inside the input"
    return "{w}/t.txt", "is the input"


@pytest.mark.parametrize("cmd,case", list(_params()))
def test_output_that_would_destroy_user_data_is_refused(cli_server, work, cmd, case):
    out, needle = _output_for(cmd, case)
    argv, flag = (["demo"], "--out") if cmd == "demo" else COMMANDS[cmd]
    before = tree_snapshot(work.parent)
    r = cli_server.run(*[a.format(w=work) for a in argv], flag, out.format(w=work), timeout=300)
    assert_refused(r, needle)
    assert tree_snapshot(work.parent) == before  # every input byte-identical, nothing created or removed


def test_own_artifacts_are_replaced_and_folders_holding_user_files_are_not(cli_server, work, tmp_path):
    out = tmp_path / "g.gguf"
    for _ in range(2):  # a GGUF quantgate wrote may be written again
        r = cli_server.run("export", "gguf", work / "gated", "--out", out)
        assert r.code == 0, r.stderr[-2000:]
    q = tmp_path / "q"
    for _ in range(2):  # so may a model folder it wrote, holding nothing else
        r = cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", q)
        assert r.code == 0, r.stderr[-2000:]
    (q / "my-notes.md").write_text("keep me")
    before = tree_snapshot(tmp_path)
    assert_refused(cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", q), "my-notes.md")
    assert tree_snapshot(tmp_path) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", empty)  # an empty folder is fine
    assert r.code == 0 and (empty / "model.safetensors").is_file(), r.stderr[-2000:]


def test_symlinked_output_to_an_input_is_refused(cli_server, work, tmp_path):
    (tmp_path / "link").symlink_to(work / "gated")
    before = tree_snapshot(work.parent)
    assert_refused(cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", tmp_path / "link"),
                   "is the input")
    assert tree_snapshot(work.parent) == before and (tmp_path / "link").is_symlink()


def test_plots_never_overwrite_a_users_file_in_an_unmarked_folder(cli_server, work, tmp_path):
    """A folder holding only PNGs named like quantgate's plots is still the user's: no marker, no licence."""
    mine = tmp_path / "figures"
    mine.mkdir()
    (mine / "max_activation.png").write_bytes(b"the user's own figure")
    before = tree_snapshot(tmp_path)
    r = cli_server.run("analyze", work / "gated", "--data", work / "t.txt", *TINY, "--plots", mine, timeout=300)
    assert_refused(r, "quantgate did not write")
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("cmd", ["quantize torch", "export gguf", "analyze --json"])
def test_a_symlink_at_the_output_is_never_replaced(cli_server, work, tmp_path, cmd):
    """Even a link to quantgate's own artifact: the link stays a link, its target unchanged."""
    argv, flag = COMMANDS[cmd]
    target = tmp_path / ("real.gguf" if cmd == "export gguf" else "real.json" if cmd == "analyze --json" else "real")
    r = cli_server.run(*[a.format(w=work) for a in argv], flag, target, timeout=300)
    assert r.code == 0, r.stderr[-2000:]
    (tmp_path / "link").symlink_to(target)
    before = tree_snapshot(tmp_path)
    r = cli_server.run(*[a.format(w=work) for a in argv], flag, tmp_path / "link", timeout=300)
    assert_refused(r, "symbolic link")
    assert tree_snapshot(tmp_path) == before and (tmp_path / "link").is_symlink()


def test_a_marker_alone_licenses_no_deletion(cli_server, work, tmp_path):
    """quantgate.json's file list is not proof: a listed file whose content changed, or a marker without the content
    hashes quantgate records, stops the replacement; the folder is kept as it is."""
    q = tmp_path / "q"
    r = cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", q)
    assert r.code == 0, r.stderr[-2000:]
    (q / "tokenizer_config.json").write_text('{"the user": "edited this"}')  # a listed name, other content
    before = tree_snapshot(tmp_path)
    assert_refused(cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", q),
                   "not what quantgate wrote")
    assert tree_snapshot(tmp_path) == before
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "model.safetensors").write_bytes(b"the user's weights")
    (forged / "quantgate.json").write_text('{"artifact": "checkpoint", "files": ["model.safetensors", '
                                           '"quantgate.json"]}')
    before = tree_snapshot(tmp_path)
    assert_refused(cli_server.run("quantize", work / "gated", "--scheme", "w8a16", "--out", forged),
                   "without the content hashes")
    assert tree_snapshot(tmp_path) == before
