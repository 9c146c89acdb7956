"""Outputs and atomic writes: a failure leaves nothing behind, and nothing quantgate did not write is replaced."""
from __future__ import annotations

import json
import os
import signal

import pytest

from quantgate import fsio
from quantgate.errors import QuantgateError
from quantgate.fsio import atomic_dir, atomic_file, check_not_input, check_output, claim_folder, write_json


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_failed_file_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "out.bin") as f:
            f.write(b"half")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_removes_the_folders_it_created_and_only_those(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "kept" / "new" / "deeper" / "out.bin") as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_failed_dir_write_keeps_the_old_dir(tmp_path):
    with atomic_dir(tmp_path / "m", "checkpoint") as d:
        (d / "config.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "m", "checkpoint") as d:
            (d / "config.json").write_text("new")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert (tmp_path / "m" / "config.json").read_text() == "old"


def test_finished_outputs_get_umask_permissions_and_a_marker(tmp_path):
    with atomic_file(tmp_path / "f.json", "w") as f:
        f.write("{}")
    with atomic_dir(tmp_path / "d", "onnx") as d:
        (d / "model.onnx").write_text("x")
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~_umask()
    mark = json.loads((tmp_path / "d" / "quantgate.json").read_text())
    assert mark["artifact"] == "onnx" and mark["files"] == ["model.onnx", "quantgate.json"]


@pytest.mark.parametrize("where", ["same", "inside", "parent", "grandparent"])
def test_output_overlapping_an_input_is_refused(tmp_path, where):
    model = tmp_path / "runs" / "a" / "gated"
    model.mkdir(parents=True)
    out = {"same": model, "inside": model / "sub", "parent": model.parent, "grandparent": tmp_path / "runs"}[where]
    with pytest.raises(QuantgateError, match="never writes over its inputs"):
        check_output(out, "checkpoint", (model,))
    check_not_input(tmp_path / "runs" / "a" / "other", (model,))  # a sibling is fine


def test_symlinks_and_hard_links_are_resolved(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    with pytest.raises(QuantgateError, match="is the input"):
        check_output(tmp_path / "link", "checkpoint", (model,))
    src = tmp_path / "a.gguf"
    src.write_bytes(b"GGUF....")
    os.link(src, tmp_path / "b.gguf")
    with pytest.raises(QuantgateError, match="is the input"):
        check_output(tmp_path / "b.gguf", "gguf", (src,))


def test_existing_outputs_are_replaced_only_when_ours_of_the_same_kind(tmp_path):
    user = tmp_path / "Documents"
    user.mkdir()
    (user / "thesis.tex").write_text("mine")
    with pytest.raises(QuantgateError, match="did not write"):
        check_output(user, "checkpoint")
    with pytest.raises(QuantgateError, match="did not write"):
        check_output(user, "report")
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", "onnx")  # an empty folder is fine
    with atomic_dir(tmp_path / "exp", "onnx") as d:
        (d / "model.onnx").write_text("x")
    check_output(tmp_path / "exp", "onnx")  # ours, same kind: may be replaced
    with pytest.raises(QuantgateError, match="holds an ONNX export, not a model directory"):
        check_output(tmp_path / "exp", "checkpoint")
    (tmp_path / "exp" / "notes.txt").write_text("mine")
    with pytest.raises(QuantgateError, match="'notes.txt', which quantgate did not write"):
        check_output(tmp_path / "exp", "onnx")
    with pytest.raises(QuantgateError, match="notes.txt"):  # the writer checks again when it commits
        with atomic_dir(tmp_path / "exp", "onnx") as d:
            (d / "model.onnx").write_text("y")
    assert (tmp_path / "exp" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "exp" / "model.onnx").read_text() == "x"


def test_files_are_replaced_only_when_ours(tmp_path):
    f = tmp_path / "out.json"
    f.write_text('{"mine": 1}')
    with pytest.raises(QuantgateError, match="not an analysis JSON file that quantgate wrote"):
        check_output(f, "analysis")
    with pytest.raises(QuantgateError):
        write_json(f, {"x": 1}, kind="analysis")
    assert f.read_text() == '{"mine": 1}'
    g = tmp_path / "ours.json"
    write_json(g, {"x": 1}, kind="analysis")
    check_output(g, "analysis")
    write_json(g, {"x": 2}, kind="analysis")
    assert json.loads(g.read_text()) == {"quantgate_artifact": "analysis", "x": 2}
    with pytest.raises(QuantgateError, match="not an attribution JSON"):
        check_output(g, "attribution")
    with pytest.raises(QuantgateError, match="is a folder"):
        check_output(tmp_path, "gguf")


def test_containers_are_claimed_only_after_checks(tmp_path):
    out = tmp_path / "a" / "rep"
    check_output(out, "report")
    assert not (tmp_path / "a").exists()  # the check creates nothing
    claim_folder(out, "report")
    assert json.loads((out / "quantgate.json").read_text())["artifact"] == "report"
    (out / "user-notes.txt").write_text("x")  # a container is written into, never replaced whole
    check_output(out, "report")
    with pytest.raises(QuantgateError, match="holds a report folder, not a demo folder"):
        check_output(out, "demo")


@pytest.mark.parametrize("writer", ["file", "dir"])
def test_a_signal_a_library_swallowed_still_stops_the_commit(tmp_path, writer):
    target = tmp_path / "out"
    fsio.interrupts.append(2)  # what the CLI's handler records before raising KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            if writer == "file":
                with fsio.atomic_file(target) as f:
                    f.write(b"complete")  # the library caught the interrupt and finished its work
            else:
                with fsio.atomic_dir(target, "checkpoint") as d:
                    (d / "x").write_bytes(b"complete")
    finally:
        fsio.interrupts.clear()
    assert list(tmp_path.iterdir()) == []


def test_a_second_ctrl_c_during_cleanup_cannot_leave_debris(tmp_path):
    """SIGINT arriving while a failed write removes its temporary folder is held until the removal is done."""
    import shutil
    real = shutil.rmtree

    def rmtree_interrupted(path, *a, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, in the middle of the cleanup
        return real(path, *a, **kw)

    shutil.rmtree = rmtree_interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_dir(tmp_path / "out", "checkpoint") as d:
                (d / "big").write_bytes(b"x" * 1000)
                raise KeyboardInterrupt  # the first Ctrl-C
    finally:
        shutil.rmtree = real
    assert list(tmp_path.iterdir()) == []


def test_files_inside_a_container_are_replaced_only_with_the_content_quantgate_recorded(tmp_path):
    out = claim_folder(tmp_path / "rep", "report")
    with atomic_file(out / "report.md", "w") as f:
        f.write("first")
    with atomic_file(out / "report.md", "w") as f:  # ours, unchanged: replaced
        f.write("second")
    assert (out / "report.md").read_text() == "second" and fsio.proven_ours(out / "report.md") is None
    (out / "report.md").write_text("the user's edit")
    with pytest.raises(QuantgateError, match="is not a file quantgate wrote"):
        with atomic_file(out / "report.md", "w") as f:
            f.write("third")
    assert (out / "report.md").read_text() == "the user's edit"
    (out / "notes.md").write_text("mine")  # never recorded
    assert fsio.proven_ours(out / "notes.md") is not None
    with pytest.raises(QuantgateError):
        with atomic_file(out / "notes.md", "w") as f:
            f.write("x")
    assert (out / "notes.md").read_text() == "mine"


def test_artifacts_record_every_files_hash_and_a_changed_one_stops_replacement(tmp_path):
    with atomic_dir(tmp_path / "m", "checkpoint") as d:
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"weights")
    mark = json.loads((tmp_path / "m" / "quantgate.json").read_text())
    assert set(mark["sha256"]) == {"config.json", "model.safetensors"}
    check_output(tmp_path / "m", "checkpoint")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"retrained by the user")
    with pytest.raises(QuantgateError, match="not what quantgate wrote"):
        check_output(tmp_path / "m", "checkpoint")
    with pytest.raises(QuantgateError, match="not what quantgate wrote"):
        with atomic_dir(tmp_path / "m", "checkpoint") as d:
            (d / "config.json").write_text("{}")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == b"retrained by the user"


def test_a_symlinked_output_is_refused_even_when_it_points_to_an_artifact_of_ours(tmp_path):
    with atomic_dir(tmp_path / "m", "checkpoint") as d:
        (d / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "m")
    with pytest.raises(QuantgateError, match="symbolic link"):
        check_output(tmp_path / "link", "checkpoint")
    with pytest.raises(QuantgateError, match="symbolic link"):
        with atomic_dir(tmp_path / "link", "checkpoint") as d:
            (d / "config.json").write_text("{}")
    assert (tmp_path / "link").is_symlink()
    claim_folder(tmp_path / "rep", "report")
    (tmp_path / "replink").symlink_to(tmp_path / "rep")
    check_output(tmp_path / "replink", "report")  # a container is written into through the link, never replaced
