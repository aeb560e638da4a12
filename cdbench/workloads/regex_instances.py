"""Seeded strings that fully match a regular expression.

The pattern is parsed with Python's own regex parser (``re._parser``) and the
parse tree is walked with a seeded generator; unbounded repeats stop a few
steps past their minimum so instances stay short.

>>> import numpy as np, re
>>> text = regex_instance(r"[a-z]{3}-\\d+", np.random.default_rng(0))
>>> bool(re.fullmatch(r"[a-z]{3}-\\d+", text))
True

Lookarounds and word boundaries are not steered: the caller validates the
result (``re.fullmatch``) and retries with a fresh draw.
"""

from __future__ import annotations

import re
import string

import numpy as np

try:  # Python >= 3.11
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

# Characters drawn for "any" and negated classes: printable ASCII, no controls,
# so every instance survives JSON and grammar round trips unchanged.
_PRINTABLE = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
_CATEGORY_CHARS = {
    sre_constants.CATEGORY_DIGIT: string.digits,
    sre_constants.CATEGORY_NOT_DIGIT: string.ascii_letters + "_-. ",
    sre_constants.CATEGORY_SPACE: " ",
    sre_constants.CATEGORY_NOT_SPACE: string.ascii_letters + string.digits,
    sre_constants.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    sre_constants.CATEGORY_NOT_WORD: " -.,;:!?/",
}
# How far an open-ended repeat (``*``, ``+``, ``{m,}``) may go past its minimum.
OPEN_REPEAT_EXTRA = 3


class RegexInstanceError(ValueError):
    """The pattern cannot be parsed or has a construct the generator does not handle."""


def regex_instance(pattern: str, rng: np.random.Generator, *, flags: int = 0) -> str:
    """One string generated from ``pattern`` (meant to ``re.fullmatch`` it).

    Raises :class:`RegexInstanceError` when the pattern does not parse.
    """
    try:
        tree = sre_parse.parse(pattern, flags)
    except (re.error, OverflowError, RecursionError) as exc:
        raise RegexInstanceError(f"invalid regex {pattern!r}: {exc}") from exc
    ignore_case = bool((flags | tree.state.flags) & re.IGNORECASE)
    groups: dict[int, str] = {}
    return _walk(tree, rng, groups, ignore_case)


def _pick(rng: np.random.Generator, chars: str | list[str]) -> str:
    return chars[int(rng.integers(len(chars)))]


def _class_chars(items: list, ignore_case: bool) -> tuple[list[str], bool]:
    """Candidate characters of a ``[...]`` class and whether it is negated."""
    negated = False
    members: set[str] = set()
    for op, av in items:
        if op is sre_constants.NEGATE:
            negated = True
        elif op is sre_constants.LITERAL:
            members.add(chr(av))
        elif op is sre_constants.RANGE:
            lo, hi = av
            # Wide ranges (e.g. \u0000-\uffff) are sampled, not enumerated.
            if hi - lo > 200:
                printable = [c for c in _PRINTABLE if lo <= ord(c) <= hi]
                members.update(printable or [chr(lo + i) for i in range(0, hi - lo, max(1, (hi - lo) // 50))])
            else:
                members.update(chr(c) for c in range(lo, hi + 1))
        elif op is sre_constants.CATEGORY:
            members.update(_CATEGORY_CHARS.get(av, ""))
        else:
            raise RegexInstanceError(f"unsupported class item {op}")
    if negated:
        excluded = members | ({c.swapcase() for c in members} if ignore_case else set())
        return [c for c in _PRINTABLE if c not in excluded], True
    return sorted(members), False


def _walk(tree, rng: np.random.Generator, groups: dict[int, str], ignore_case: bool) -> str:
    out: list[str] = []
    for op, av in tree:
        if op is sre_constants.LITERAL:
            out.append(chr(av))
        elif op is sre_constants.NOT_LITERAL:
            out.append(_pick(rng, [c for c in _PRINTABLE if c != chr(av)]))
        elif op is sre_constants.ANY:
            out.append(_pick(rng, _PRINTABLE))
        elif op is sre_constants.IN:
            chars, _ = _class_chars(av, ignore_case)
            if not chars:
                raise RegexInstanceError("empty character class")
            out.append(_pick(rng, chars))
        elif op is sre_constants.BRANCH:
            _, branches = av
            out.append(_walk(branches[int(rng.integers(len(branches)))], rng, groups, ignore_case))
        elif op is sre_constants.SUBPATTERN:
            group, _add_flags, _del_flags, sub = av
            text = _walk(sub, rng, groups, ignore_case)
            if group is not None:
                groups[group] = text
            out.append(text)
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            hi = lo + OPEN_REPEAT_EXTRA if hi is sre_constants.MAXREPEAT else min(hi, lo + OPEN_REPEAT_EXTRA)
            count = int(rng.integers(lo, hi + 1))
            out.extend(_walk(sub, rng, groups, ignore_case) for _ in range(count))
        elif op is sre_constants.GROUPREF:
            out.append(groups.get(av, ""))
        elif op is getattr(sre_constants, "ATOMIC_GROUP", None):
            out.append(_walk(av, rng, groups, ignore_case))
        elif op in (sre_constants.AT, sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            continue  # zero-width: not steered; validation rejects a bad draw
        elif op is sre_constants.CATEGORY:
            out.append(_pick(rng, _CATEGORY_CHARS.get(av, "a")))
        else:
            raise RegexInstanceError(f"unsupported regex construct {op}")
    return "".join(out)
