"""nox_helpers.py: the dependency closures and the isolation rows derived from the pyprojects."""

from __future__ import annotations

import importlib.util
import os
import tomllib
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


def test_mutation_scores_count_each_module_from_mutmut_results(helpers: ModuleType) -> None:
    # The lines `mutmut results --all true` prints (functions and methods, every status).
    listing = "\n".join(
        [
            "    ti_io.parts.x_conform__mutmut_1: killed",
            "    ti_io.parts.x_conform__mutmut_2: survived",
            "    ti_io.parts.xǁPartWriterǁ_run__mutmut_3: timeout",
            "    ti_io.parts.xǁPartWriterǁ_run__mutmut_4: not checked",
            "    ti_io.digest.x_digest__mutmut_1: killed",
            "    ti_io.digest.x_digest__mutmut_2: no tests",
            "    ti_io.digest.x_digest__mutmut_3: caught by type check",
            "    ti_io.digest.x_digest__mutmut_4: skipped",
            "",
        ]
    )
    scores = helpers.mutation_scores(listing)
    assert set(scores) == {"ti_io.parts", "ti_io.digest"}
    parts, digest = scores["ti_io.parts"], scores["ti_io.digest"]
    # parts: 4 mutants, 3 judged (not checked is not), killed + timeout caught
    assert (parts["mutants"], parts["judged"], parts["caught"]) == (4, 3, 2)
    assert parts["score"] == pytest.approx(2 / 3, abs=1e-4)
    assert parts["survivors"] == ["ti_io.parts.x_conform__mutmut_2: survived"]
    # digest: a mutant no test reaches counts against the score; a skipped one is not judged
    assert (digest["mutants"], digest["judged"], digest["caught"]) == (4, 3, 2)
    assert digest["survivors"] == ["ti_io.digest.x_digest__mutmut_2: no tests"]
    table = helpers.format_mutation_scores(scores)
    assert "ti_io.digest" in table
    assert "66.7%" in table
    assert helpers.mutation_scores("") == {}
    with pytest.raises(ValueError, match="not a mutmut mutant name"):
        helpers.mutant_module("ti_io.parts.conform")


def test_mutation_targets_are_declared_in_the_package_pyprojects(helpers: ModuleType) -> None:
    for package in helpers.MUTATION_PACKAGES:
        pyproject = ROOT / "packages" / package / "pyproject.toml"
        config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["mutmut"]
        assert config["only_mutate"], package
        for pattern in config["only_mutate"]:
            assert list((pyproject.parent).glob(pattern)), (package, pattern)
        for tests in config["pytest_add_cli_args_test_selection"]:
            assert (pyproject.parent / tests).exists(), (package, tests)
