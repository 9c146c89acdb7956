"""Atomic writes: a failure leaves nothing behind; a success looks like any other file."""
from __future__ import annotations

import os

import pytest

from quantgate.errors import QuantgateError
from quantgate.fsio import atomic_dir, atomic_file, check_not_input


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


def test_failed_dir_write_keeps_the_old_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "m") as d:
            (d / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["old.txt"]


def test_finished_outputs_get_umask_permissions(tmp_path):
    with atomic_file(tmp_path / "f.json", "w") as f:
        f.write("{}")
    with atomic_dir(tmp_path / "d") as d:
        (d / "x").write_text("x")
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~_umask()


def test_output_inside_input_is_refused(tmp_path):
    with pytest.raises(QuantgateError, match="overwrite the input"):
        check_not_input(tmp_path / "model" / "sub", tmp_path / "model")
    check_not_input(tmp_path / "other", tmp_path / "model")  # a sibling is fine


@pytest.mark.parametrize("writer", ["file", "dir"])
def test_a_signal_a_library_swallowed_still_stops_the_commit(tmp_path, writer):
    from quantgate import fsio
    target = tmp_path / "out"
    fsio.interrupts.append(2)  # what the CLI's handler records before raising KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            if writer == "file":
                with fsio.atomic_file(target) as f:
                    f.write(b"complete")  # the library caught the interrupt and finished its work
            else:
                with fsio.atomic_dir(target) as d:
                    (d / "x").write_bytes(b"complete")
    finally:
        fsio.interrupts.clear()
    assert list(tmp_path.iterdir()) == []
