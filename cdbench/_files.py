"""Reading a file the user named, with one clear error for each way it can fail."""

from __future__ import annotations

from pathlib import Path


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
