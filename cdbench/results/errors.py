"""The error of reading a folder that is not a (complete) run folder, shared by the modules that read them."""

from __future__ import annotations


class ResultsError(FileNotFoundError):
    """A folder that is not a (complete) run folder."""


__all__ = ["ResultsError"]
