"""The recording import stub that lets SGLang's scheduler import without torchvision (scripts/engine_costs/import_stub.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "cdbench_absent_vision"  # a name no installed package has


def _stub_module():
    spec = importlib.util.spec_from_file_location("engine_import_stub", ROOT / "scripts" / "engine_costs" / "import_stub.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stub():
    stub = _stub_module().RecordingStub.install(PACKAGE)
    yield stub
    sys.meta_path.remove(stub)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_imports_of_the_package_and_its_submodules_succeed_and_are_recorded(stub):
    transforms = importlib.import_module(f"{PACKAGE}.transforms.v2")
    mode = transforms.InterpolationMode.BICUBIC  # import-time attribute reads, as SGLang's helpers do

    class Resize(transforms.Transform):  # subclassing a stub attribute at import time works
        pass

    assert Resize.__mro__[-1] is object and repr(mode).startswith("<stub")
    assert sys.modules[PACKAGE].__version__ == "0.0.0+stub"
    uses = stub.uses("import")
    assert (PACKAGE, "import") in uses and (f"{PACKAGE}.transforms.v2", "import") in uses
    assert (f"{PACKAGE}.transforms.v2.InterpolationMode.BICUBIC", "attribute") in uses
    assert (f"{PACKAGE}.transforms.v2.Transform", "subclassed") in uses
    stub.require_unused("measure")  # nothing happened in the measure phase


def test_a_use_during_the_measurement_voids_it(stub):
    vision = importlib.import_module(PACKAGE)
    decode = vision.io.decode_image  # at import: allowed
    stub.phase("measure")
    stub.require_unused("measure")
    decode("picture.png")
    assert stub.uses("measure") == [(f"{PACKAGE}.io.decode_image", "call")]
    with pytest.raises(RuntimeError, match=r"stub was used during 'measure' \(1 uses: .*decode_image \(call\)\)"):
        stub.require_unused("measure")
    stub.phase("between")
    _ = vision.ops
    assert stub.uses("between") == [(f"{PACKAGE}.ops", "attribute")] and len(stub.uses("measure")) == 1


def test_python_protocol_probes_are_not_uses(stub):
    vision = importlib.import_module(PACKAGE)
    stub.phase("measure")
    assert not hasattr(vision.nms, "__wrapped__") and not hasattr(vision, "__file__")
    assert stub.uses("measure") == [(f"{PACKAGE}.nms", "attribute")]


def test_a_table_built_from_the_stub_at_import_is_empty_and_recorded(stub):
    # outlines 0.0.x builds an enum from pyairports.airports.AIRPORT_LIST when imported
    airports = importlib.import_module(f"{PACKAGE}.airports")
    assert list(airports.AIRPORT_LIST) == []
    assert (f"{PACKAGE}.airports.AIRPORT_LIST", "iterated") in stub.uses("import")


def test_the_stub_refuses_a_package_already_imported():
    with pytest.raises(RuntimeError, match="json is already imported"):
        _stub_module().RecordingStub.install("json")
