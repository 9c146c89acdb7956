"""One exception type for every bad input, so the CLI can print one line and exit non-zero."""
from __future__ import annotations


class QuantgateError(Exception):
    """A problem with the user's input or environment, described in one line that names the culprit."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise QuantgateError(message)
