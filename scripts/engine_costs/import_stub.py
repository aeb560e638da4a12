"""An import stub that records every use, for importing engine modules whose measured paths never need a package.

SGLang's ``managers.schedule_batch`` (and so its scheduler and result processor) imports torchvision
through its multimodal helpers, and no CPU build of torchvision installs here. ``RecordingStub.install``
puts a stub package in its place: ``import torchvision.x.y`` and ``from torchvision.x import z`` succeed,
every attribute read or call on the stub (or on anything read from it) is recorded with the current
phase, and ``uses(phase)`` lists them. A measurement sets the phase to ``"measure"`` around its timed
calls and then requires ``uses("measure") == []``: had a measured path touched torchvision, the stub's
answers would have been meaningless, so such a measurement is refused, not reported.

Runs in the engine's environment: standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field


@dataclass
class UseLog:
    """The uses recorded so far, each as (phase, dotted name, what: 'attribute' / 'call' / 'import')."""

    phase: str = "import"
    uses: list[tuple[str, str, str]] = field(default_factory=list)

    def record(self, name: str, what: str) -> None:
        self.uses.append((self.phase, name, what))


class _Leaf:
    """What an attribute of the stub returns: usable as a class, a value or a callable, every use recorded."""

    def __init__(self, log: UseLog, name: str) -> None:
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> _Leaf:
        if attr.startswith("__") and attr.endswith("__"):  # Python's own protocol probes (copy, pickle, typing)
            raise AttributeError(attr)
        name = f"{self._name}.{attr}"
        self._log.record(name, "attribute")
        return _Leaf(self._log, name)

    def __call__(self, *args: object, **kwargs: object) -> _Leaf:
        self._log.record(self._name, "call")
        return _Leaf(self._log, f"{self._name}()")

    def __iter__(self):  # a module-level table built from a stub attribute at import time: empty
        self._log.record(self._name, "iterated")
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple:  # ``class X(torchvision.Something)`` at import time
        self._log.record(self._name, "subclassed")
        return (object,)

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Leaf:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        log: UseLog = self.__dict__["_stub_log"]
        name = f"{self.__name__}.{attr}"
        log.record(name, "attribute")
        return _Leaf(log, name)


class RecordingStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that answers ``package`` and all its submodules with recording stub modules."""

    def __init__(self, package: str, version: str = "0.0.0+stub") -> None:
        self.package = package
        self.version = version
        self.log = UseLog()

    @classmethod
    def install(cls, package: str) -> RecordingStub:
        """Stub ``package`` for this process; refuses if the real one is already imported."""
        if package in sys.modules and not isinstance(sys.modules[package], _StubModule):
            raise RuntimeError(f"{package} is already imported: the stub would not replace it")
        stub = cls(package)
        sys.meta_path.insert(0, stub)
        return stub

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__dict__["_stub_log"] = self.log
        module.__path__ = []  # a package: its submodules are stubs too
        if spec.name == self.package:
            module.__version__ = self.version
        self.log.record(spec.name, "import")
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass

    def phase(self, name: str) -> None:
        """Uses recorded from now on carry ``name``."""
        self.log.phase = name

    def uses(self, phase: str) -> list[tuple[str, str]]:
        """(dotted name, what) of every use recorded in ``phase``."""
        return [(name, what) for p, name, what in self.log.uses if p == phase]

    def require_unused(self, phase: str) -> None:
        """Raise if anything of the stub was used in ``phase``: a measurement of that phase is void."""
        used = self.uses(phase)
        if used:
            shown = ", ".join(f"{name} ({what})" for name, what in used[:5])
            raise RuntimeError(f"the {self.package} stub was used during {phase!r} ({len(used)} uses: {shown}): "
                               "the measured path needs the real package")
