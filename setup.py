"""Installs the top-level cli.py as quantgate/cli.py (setuptools' package-dir maps packages, not modules).

Everything else is declared in pyproject.toml. Editable installs need setuptools' strict mode, which
links every build output, this one included:
    pip install -e . --config-settings editable_mode=strict
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CLI_SOURCE, CLI_TARGET = "cli.py", Path("quantgate") / "cli.py"


class BuildPy(build_py):
    def _cli_target(self) -> str:
        return str(Path(self.build_lib) / CLI_TARGET)

    def run(self):
        super().run()
        self.mkpath(str(Path(self._cli_target()).parent))
        self.copy_file(CLI_SOURCE, self._cli_target())

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [self._cli_target()]

    def get_output_mapping(self):
        return {**super().get_output_mapping(), self._cli_target(): CLI_SOURCE}


setup(cmdclass={"build_py": BuildPy})
