"""Reading a file the user named, with one clear error for each way it can fail."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_user_text(path: Path, what: str, kind: str, error: type[Exception]) -> str:
    """The UTF-8 text of ``path``; raises ``error`` naming ``what`` (e.g. "config file") and the
    reason (missing, a directory rather than a ``kind`` file, unreadable, not UTF-8)."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory, not a {kind} file") from None
    except OSError as err:  # permissions, a broken mount, ...
        raise error(f"{what} {path} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text") from None


def read_probe_file(path: Path, model: type[M], source: str, kind: str, error: type[Exception]) -> M:
    """``path``'s JSON as ``model``; raises ``error`` starting with ``source`` when the file cannot be read or
    is not a ``kind`` (naming the first field that fails)."""
    try:
        return model.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise error(f"{source}: cannot read the probe: {err.strerror or err}") from None
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise error(f"{source}: not a {kind} (field {field!r}: {first['msg']})") from None
