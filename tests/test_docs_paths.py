"""Every repository path that README.md and docs/*.md name exists.

What counts as a path named:

- a Markdown link or image target that is relative (no scheme, not an anchor): resolved from the
  document's own folder, as a Markdown viewer does;
- a word of a code span or fenced code block that starts with one of the repository's top-level
  folders or files (:data:`ROOTS`) followed by ``/`` (or is one of those files): resolved from the
  repository root. Words with placeholders (``<name>``, ``{a,b}``, ``$VAR``) are examples, not paths;
  a word with ``*`` must match at least one file.

Paths under ``runs/``, ``.cache/`` and ``.venv/`` are what commands produce (examples of outputs), so
they are not in :data:`ROOTS`; nor are paths relative to a package folder (``costs/spec_costs.py`` in
the text about ``cdbench/harness/``), which no rule could resolve without guessing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("cdbench", "tests", "scripts", "docs", "reports", "benchmarks", "ci")
ROOT_FILES = ("README.md", "pyproject.toml")

_FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PLACEHOLDER = re.compile(r"[<>{}$]")


def _words(code: str) -> list[str]:
    """The words of code text that name a repository path (``--opt=path`` gives its value)."""
    found = []
    for word in code.split():
        word = word.split("=", 1)[1] if "=" in word else word
        word = word.strip("'\"").rstrip(".,;:)")
        if _PLACEHOLDER.search(word):
            continue
        if word in ROOT_FILES or (word.split("/", 1)[0] in ROOTS and "/" in word):
            found.append(word)
    return found


def named_paths(document: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for every repository path ``document`` names."""
    text = document.read_text()
    paths = []
    fences = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    for code in [*fences, *_SPAN.findall(prose)]:
        paths += [(word, REPO / word) for word in _words(code)]
    for target in _LINK.findall(prose):
        target = target.split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or _PLACEHOLDER.search(target):
            continue
        paths.append((target, (document.parent / target)))
    return paths


def _exists(path: Path) -> bool:
    if "*" in path.name or "*" in str(path.parent):
        return any(REPO.glob(str(path.relative_to(REPO))))
    return path.exists()


def test_the_rules_find_the_paths_a_document_names_and_only_those(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("Run `scripts/check.sh`, then `.venv/bin/pytest -m slow tests/results/test_x.py`.\n"
                   "See [the design](sub/design.md#top), [site](https://example.org/a/b) and `runs/default/`.\n"
                   "```bash\ncdbench run cdbench/configs/ci.yaml --out runs/ci --set a=reports/x/<name>.md\n```\n"
                   "The harness reads `costs/spec_costs.py`; `README.md` says so.\n")
    assert [written for written, _ in named_paths(doc)] == [
        "cdbench/configs/ci.yaml", "scripts/check.sh", "tests/results/test_x.py", "README.md", "sub/design.md"]
    assert named_paths(doc)[-1][1] == tmp_path / "sub" / "design.md"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repository_path_a_document_names_exists(document):
    missing = sorted({written for written, path in named_paths(document) if not _exists(path)})
    assert not missing, f"{document.relative_to(REPO)} names paths that do not exist: {', '.join(missing)}"
