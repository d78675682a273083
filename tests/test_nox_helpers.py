"""nox_helpers.py: the dependency closures and the isolation rows derived from the pyprojects,
and the test selections of the sessions (every test file runs in one of CI's sessions)."""

from __future__ import annotations

import ast
import importlib.util
import os
import tomllib
import zipfile
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
    assert helpers.closure("ti-dist") == ["ti-schema", "ti-io", "ti-dist"]  # no torch
    assert helpers.closure("ti-examples") == ["ti-schema", "ti-core", "ti-io", "ti-examples"]
    assert helpers.closure("ti-trainers") == ["ti-schema", "ti-core", "ti-io", "ti-trainers"]


def test_absent_siblings_are_those_outside_the_closure(helpers: ModuleType) -> None:
    assert {p: helpers.absent_siblings(p) for p in helpers.PACKAGES} == {
        "ti-schema": ("ti_core", "ti_io", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-core": ("ti_io", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-io": ("ti_core", "ti_dist", "ti_trainers", "ti_examples"),
        "ti-dist": ("ti_core", "ti_trainers", "ti_examples"),
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


def test_every_test_file_of_the_repository_runs_in_a_default_session(helpers: ModuleType) -> None:
    files = helpers.repository_test_files()
    assert Path("tests/test_nox_helpers.py") in files
    assert Path("packages/ti-core/tests/test_api.py") in files
    assert helpers.uncovered_test_files(files) == []
    for session, runs in helpers.default_suites().items():
        for suite in runs:
            for path in (*suite.paths, *suite.ignore):
                assert (ROOT / path).exists(), (session, suite.label, path)


def test_a_test_file_outside_every_selection_is_reported(
    helpers: ModuleType, tmp_path: Path
) -> None:
    for name in (
        "examples/test_new.py",  # a new folder of tests no session knows
        "packages/ti-core/tests/test_kept.py",
        "tests/sub/checks_test.py",
        ".nox/e2e/lib/site-packages/x/test_vendored.py",  # venvs are not the repository's
        "packages/ti-io/build/lib/test_built.py",
        "packages/ti-core/tests/helpers.py",  # not a test file
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    files = helpers.repository_test_files(tmp_path)
    assert files == [
        Path("examples/test_new.py"),
        Path("packages/ti-core/tests/test_kept.py"),
        Path("tests/sub/checks_test.py"),
    ]
    assert helpers.uncovered_test_files(files) == [Path("examples/test_new.py")]


def test_a_file_every_session_ignores_is_reported(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled = Path("packages/ti-core/tests/test_compiled.py")
    assert helpers.uncovered_test_files([compiled]) == []
    package_suite = helpers._package_suite

    def ignoring(package: str, ignore: tuple[str, ...] = ()) -> object:
        return package_suite(package, ignore=(*ignore, str(compiled)))

    monkeypatch.setattr(helpers, "_package_suite", ignoring)  # tests(ti-core) drops it too
    assert helpers.uncovered_test_files([compiled]) == [compiled]


def test_the_sessions_run_the_declared_selections(helpers: ModuleType) -> None:
    """The noxfile's default list is DEFAULT_SESSIONS, and each test session runs its own
    ``helpers.suites(...)``: the selections the coverage test reads are what nox runs."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    sessions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert set(helpers.DEFAULT_SESSIONS) <= set(sessions)
    (default,) = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions"
    ]
    assert ast.unparse(default.value) == "list(helpers.DEFAULT_SESSIONS)"
    for name in helpers.DEFAULT_SESSIONS:
        if name == "lint":
            continue
        calls = {
            ast.unparse(call)
            for call in ast.walk(sessions[name])
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "helpers.run_suites"
        }
        assert any(f"helpers.suites({name!r}" in call for call in calls), (name, calls)


def test_wheels_and_minimums_select_what_they_exist_for(helpers: ModuleType) -> None:
    suites = helpers.default_suites()
    # minimums: every package's whole suite at the floors, plus the third-party API round trips
    minimums = {s.label: s.paths for s in suites["minimums"]}
    for package in helpers.PACKAGES:
        assert minimums[package] == (f"packages/{package}/tests",)
    assert minimums["e2e-floors"] == helpers.FLOOR_CROSS_PACKAGE_TESTS
    # what minimums leaves out of a suite still runs in that package's own session
    (core,) = [s for s in suites["minimums"] if s.label == "ti-core"]
    assert core.ignore == helpers.MINIMUMS_IGNORE
    assert helpers.uncovered_test_files([Path(p) for p in core.ignore]) == []
    # the fault matrix and the other slow end-to-end tests run once, in e2e
    once = Path("tests/test_reliability_finalization.py")
    runs = [s for runs in suites.values() for s in runs]
    assert [s.label for s in runs if any(Path(p) in (once, *once.parents) for p in s.paths)] == [
        "e2e"
    ]
    # wheels: a representative test of every package, none of tests/
    wheels = {s.label: s.paths for s in suites["wheels"]}
    assert set(wheels) == set(helpers.PACKAGES)
    assert all(paths for paths in wheels.values())
    assert not any(p.startswith("tests/") for paths in wheels.values() for p in paths)


def test_a_wheel_missing_a_file_of_its_source_tree_is_reported(
    helpers: ModuleType, tmp_path: Path
) -> None:
    src = tmp_path / "ti-x" / "src" / "ti_x"
    for name in ("__init__.py", "py.typed", "reduction/__init__.py", "reduction/rows.py"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "rows.cpython-311.pyc").write_text("")  # not shipped, not needed
    wheel = tmp_path / "ti_x-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("ti_x/__init__.py", "ti_x/reduction/__init__.py", "ti_x-0.1.dist-info/RECORD"):
            zf.writestr(name, "")
    missing = helpers.missing_from_wheel(wheel, "ti-x", packages_dir=tmp_path)
    assert missing == ["ti_x/py.typed", "ti_x/reduction/rows.py"]
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("ti_x/py.typed", "")
        zf.writestr("ti_x/reduction/rows.py", "")
    assert helpers.missing_from_wheel(wheel, "ti-x", packages_dir=tmp_path) == []
