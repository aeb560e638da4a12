"""The package's shape: no import cycles, data flowing one way, typer only in the CLI.

The graph is built from the source with ``ast`` and counts every import,
those inside functions and under ``TYPE_CHECKING`` included: a cycle hidden
in a function is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cdbench"

# Each folder may import itself and the folders listed for it (the data flow of docs/architecture.md).
ALLOWED = {
    "_env": set(),
    "_files": set(),
    "backends": {"_env", "_files"},
    "kernels": {"_env", "_files"},
    "workloads": {"_env", "_files", "backends"},
    "harness": {"_env", "_files", "backends", "kernels", "workloads"},
    # a profile writes its own report at the end (reports never import profile/ back)
    "profile": {"_env", "_files", "backends", "kernels", "workloads", "harness", "reports"},
    "results": {"_env", "_files", "backends", "kernels", "workloads", "harness"},
    "reports": {"_env", "_files", "workloads", "results"},
    "campaigns": {"_env", "_files", "results", "reports"},
    # published results: entries as run configurations (results' config files), run through harness.run
    "published": {"_env", "_files", "harness", "results"},
    "cli": {"_env", "_files", "backends", "kernels", "workloads", "harness", "profile", "results", "reports",
            "campaigns", "published"},
    "__main__": {"cli"},  # python -m cdbench: the command line, nothing else
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ``cdbench`` modules ``path`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == "cdbench" or t.startswith("cdbench."))
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt in graph and not state.get(nxt):
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start):
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_folder_imports_only_what_the_data_flow_allows():
    graph = import_graph()
    assert set(ALLOWED) >= {_folder(m) for m in graph if _folder(m)}, "a new folder needs its place in ALLOWED"
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() if _folder(module)
                   for target in targets
                   if _folder(target) and _folder(target) != _folder(module)
                   and _folder(target) not in ALLOWED[_folder(module)])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("library", ["typer"])
def test_the_command_line_library_is_imported_only_in_the_cli(library):
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   for node in ast.walk(ast.parse(p.read_text()))
                   if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == library for a in node.names))
                   or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == library))
    assert users and all(u.startswith("cli/") for u in users), users
