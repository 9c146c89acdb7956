"""The README's set-up commands are the ones CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci_lines) == 1
    assert ci_lines[0] in readme.splitlines()
    assert any("quantgate demo" in ln and ln.startswith("python3 -m venv") for ln in readme.splitlines())
