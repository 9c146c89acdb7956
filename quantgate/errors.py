"""One exception type for every bad input, so the CLI can print one line and exit non-zero."""
from __future__ import annotations


class QuantgateError(Exception):
    """A problem with the user's input or environment, described in one line that names the culprit."""


class DiskFull(QuantgateError):
    """Writing failed because the disk (or a file-size limit) is full: never a result to record and move past."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise QuantgateError(message)
