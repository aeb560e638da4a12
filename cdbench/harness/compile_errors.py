"""A run's compile errors (each failed spec's key text → the backend's reason), held compactly.

A streamed ``model`` run of unique copies (the default workload) has about one copy in a hundred fail to
compile (10,485 of a million requests); a dict entry of each failed copy's text and reason costs about 230
bytes, so a run of ten million requests held about 25 MB of them to its end, and more the longer it ran. Here
a copy's text is kept as its item's text (once) and its copy number, and each distinct reason once: about
30 bytes a failed copy. The mapping itself is built only when it is first read (tests, a caller of
:func:`cdbench.harness.run.simulate`); a saved run does not read it.

>>> errors = CompileErrors()
>>> errors.add(7, "json_schema:a#copy12", "too deep")
>>> errors.add(3, "regex:b", "bad escape")
>>> dict(errors)
{'regex:b': 'bad escape', 'json_schema:a#copy12': 'too deep'}
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping

from cdbench.harness.costs.spec_profile import COPY_MARK


class CompileErrors(Mapping[str, str]):
    """Failed specs' texts and reasons, added by compile-cache key (in any order); read in key order, as
    ``dict`` of the entries sorted by key would be."""

    def __init__(self) -> None:
        self._keys = array("q")  # each entry's compile-cache key
        self._stems = array("q")  # its text's stem (the text before its copy mark, or all of it), by index
        self._copies = array("q")  # its copy number (-1: the text is its stem alone)
        self._reasons = array("q")  # its reason, by index
        self._stem_index: dict[str, int] = {}
        self._reason_index: dict[str, int] = {}
        self._built: dict[str, str] | None = None

    def add(self, key: int, text: str, reason: str) -> None:
        stem, mark, number = text.rpartition(COPY_MARK)
        # only a number that prints back as itself is kept as one (``#copy007`` stays text)
        if not mark or not (number.isascii() and number.isdigit()) or str(int(number)) != number:
            stem, copy = text, -1
        else:
            copy = int(number)
        self._keys.append(key)
        self._stems.append(self._stem_index.setdefault(stem, len(self._stem_index)))
        self._copies.append(copy)
        self._reasons.append(self._reason_index.setdefault(reason, len(self._reason_index)))
        self._built = None

    def merged(self, more: Mapping[int, tuple[str, str]]) -> CompileErrors:
        """These entries and ``more`` (key → (text, reason)), as a new mapping."""
        out = CompileErrors()
        out._keys, out._stems, out._copies, out._reasons = (array("q", a) for a in (
            self._keys, self._stems, self._copies, self._reasons))
        out._stem_index, out._reason_index = dict(self._stem_index), dict(self._reason_index)
        for key, (text, reason) in more.items():
            out.add(key, text, reason)
        return out

    def _mapping(self) -> dict[str, str]:
        if self._built is None:
            stems, reasons = list(self._stem_index), list(self._reason_index)
            built: dict[str, str] = {}
            for i in sorted(range(len(self._keys)), key=self._keys.__getitem__):
                stem, copy = stems[self._stems[i]], self._copies[i]
                built[stem if copy < 0 else f"{stem}{COPY_MARK}{copy}"] = reasons[self._reasons[i]]
            self._built = built
        return self._built

    def __getitem__(self, text: str) -> str:
        return self._mapping()[text]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __repr__(self) -> str:
        return f"CompileErrors({self._mapping()!r})"

    def __reduce__(self):  # (to a rank's parent process) as the plain mapping it reads as
        return dict, (self._mapping(),)


__all__ = ["CompileErrors"]
