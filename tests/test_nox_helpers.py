"""nox_helpers.py: the dependency closures and the isolation rows derived from the pyprojects."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def helpers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nox_helpers", ROOT / "nox_helpers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_closures_follow_the_declared_dependencies(helpers: ModuleType) -> None:
    assert helpers.closure("ti-schema") == ["ti-schema"]
    assert helpers.closure("ti-io") == ["ti-schema", "ti-io"]  # the reading side: no ti-core
    assert helpers.closure("ti-dist") == ["ti-schema", "ti-core", "ti-dist"]
    assert helpers.closure("ti-examples") == ["ti-schema", "ti-core", "ti-io", "ti-examples"]
    assert helpers.closure("ti-trainers") == ["ti-schema", "ti-core", "ti-io", "ti-trainers"]


def test_absent_siblings_are_those_outside_the_closure(helpers: ModuleType) -> None:
    assert {p: helpers.absent_siblings(p) for p in helpers.PACKAGES} == {
        "ti-schema": ("ti_core", "ti_io", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-core": ("ti_io", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-io": ("ti_core", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-dist": ("ti_io", "ti_trainers", "ti_examples"),
        "ti-trainers": ("ti_dist", "ti_examples"),
        "ti-examples": ("ti_dist",),
    }


def test_every_package_is_listed_dependencies_first(helpers: ModuleType) -> None:
    on_disk = {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}
    assert set(helpers.PACKAGES) == on_disk
    for package in helpers.PACKAGES:
        position = helpers.PACKAGES.index(package)
        assert all(helpers.PACKAGES.index(d) <= position for d in helpers.closure(package))


def test_interpreter_lookup_only_reads(helpers: ModuleType) -> None:
    path_before = os.environ.get("PATH")
    spec = helpers.interpreter("3.11")
    assert spec == "3.11" or Path(spec).name == "python3.11"
    assert helpers.interpreter("2.99") == "2.99"  # not installed: nox skips it
    assert os.environ.get("PATH") == path_before
