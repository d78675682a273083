"""Development sessions of the TorchInstruments monorepo (see docs/development.md).

Plain `nox` runs the default matrix: lint, tests (one environment per package holding only that
package and its declared dependencies), e2e, minimums, wheels and legacy, each running the test
selection `helpers.suites` declares for it. `quick` (the edit-test loop), `demo`, `bench`,
`properties` and `mutation` run on request. The helpers live in nox_helpers.py; every pip call
goes through `helpers.install`, which applies the one torch pin in constraints/torch.txt. Loading
this file changes nothing on the machine: interpreters are looked up, not linked, and PATH is
left alone.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import nox


def _load_helpers() -> ModuleType:
    # By path: nox runs this file from its own entry point, where the repository root is not
    # necessarily on sys.path.
    path = Path(__file__).resolve().with_name("nox_helpers.py")
    spec = importlib.util.spec_from_file_location("nox_helpers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _load_helpers()
ROOT: Path = helpers.ROOT
PACKAGES_DIR: Path = helpers.PACKAGES_DIR
PACKAGES: tuple[str, ...] = helpers.PACKAGES

# What must NOT be importable in a package's test environment, beyond the sibling packages
# outside its dependency closure (derived from the pyprojects: helpers.absent_siblings). Proves
# the dependency direction: the reading side (ti-schema, ti-io, ti-dist) never pulls torch.
ABSENT_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "ti-schema": ("torch", "polars", "tensorboard"),
    "ti-core": ("polars", "tensorboard"),
    "ti-io": ("torch",),
    "ti-dist": ("torch",),
    "ti-trainers": (),
    "ti-examples": (),
}

MAIN_PYTHON = "3.11"
# ti-schema never needs torch, so it is also tested on newer interpreters; the torch pin is a
# cp311-only local wheel, which keeps every torch-bearing session on 3.11.
SCHEMA_PYTHONS = ("3.11", "3.12", "3.13")

PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
TEST_TOOLS = nox.project.dependency_groups(PYPROJECT, "test")
LINT_TOOLS = nox.project.dependency_groups(PYPROJECT, "lint")
BENCH_TOOLS = nox.project.dependency_groups(PYPROJECT, "bench")
LEGACY_TOOLS = nox.project.dependency_groups(PYPROJECT, "legacy")
SPARK_TOOLS = nox.project.dependency_groups(PYPROJECT, "spark")
LINT_PATHS = ("noxfile.py", "nox_helpers.py", "packages", "tests", "examples", "benchmarks")

nox.options.default_venv_backend = "virtualenv"  # pip sees the local torch wheel; uv does not
nox.options.error_on_missing_interpreters = False  # ti-schema on 3.12/3.13 only where present
nox.options.sessions = list(helpers.DEFAULT_SESSIONS)


def _absent(package: str) -> tuple[str, ...]:
    return (*ABSENT_THIRD_PARTY[package], *helpers.absent_siblings(package))


# --- sessions ----------------------------------------------------------------------------------


def _install_for_lint(session: nox.Session) -> None:
    """Every package (editable, with extras: mypy reads their imports), ruff, mypy, the test
    group."""
    helpers.install(session, *LINT_TOOLS, *TEST_TOOLS, *helpers.source_args(PACKAGES))


def _lint(session: nox.Session) -> None:
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    checks = {
        "ruff check": ("ruff", "check", "--output-format=concise", *paths),
        "ruff format": ("ruff", "format", "--check", *paths),
        "mypy": ("mypy", *(f"packages/{p}/src" for p in PACKAGES)),
    }
    failed = []
    for name, command in checks.items():  # all three run, so one report shows every problem
        try:
            session.run(*command)
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error("failed: " + ", ".join(failed))


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never")
def lint(session: nox.Session) -> None:
    """ruff (check + format) over the tree; mypy (strict) over every package's src."""
    _install_for_lint(session)
    _lint(session)


@nox.session(
    python=helpers.interpreter(MAIN_PYTHON),
    download_python="never",
    default=False,
    reuse_venv=True,
)
def quick(session: nox.Session) -> None:
    """The edit-test loop: lint, then every test not marked ``slow`` of each package and of
    tests/, in one environment holding every package (editable, so edits need no reinstall).
    The environment is kept between runs and pip runs only when what it installs changed (a
    pyproject, the torch pin). Not the isolation proofs nor the floors: `nox` runs those."""
    stamp = Path(session.virtualenv.location) / "ti-quick-installed.txt"
    wanted = helpers.install_inputs_digest()
    if not stamp.exists() or stamp.read_text(encoding="utf-8") != wanted:
        _install_for_lint(session)
        stamp.write_text(wanted, encoding="utf-8")
    _lint(session)
    helpers.run_suites(session, helpers.quick_suites(), "-m", "not slow", "-q")


# The id keeps the session names short (`tests(package='ti-io', python='3.11')`) when the
# interpreter is given by path.
TEST_MATRIX = [
    nox.param(
        package,
        helpers.interpreter(python),
        id=f"package={package!r}, python={python!r}",
        tags=[package],
    )
    for package in PACKAGES
    for python in (SCHEMA_PYTHONS if package == "ti-schema" else (MAIN_PYTHON,))
]


@nox.session(download_python="never")
@nox.parametrize(("package", "python"), TEST_MATRIX)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests in an environment holding only it and its declared dependencies."""
    tests_dir = PACKAGES_DIR / package / "tests"
    if not helpers.find_test_files(tests_dir):
        session.skip(f"NO TESTS: {tests_dir.relative_to(ROOT)} holds no test files yet")
    closure = helpers.closure(package, helpers.TEST_EXTRAS.get(package, ()))
    helpers.install(session, *TEST_TOOLS, *helpers.source_args(closure))
    helpers.assert_absent(session, package, _absent(package))
    helpers.run_suites(session, helpers.suites("tests", package))


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never")
def e2e(session: nox.Session) -> None:
    """Cross-package tests in tests/, with every package and extra installed: the only session
    that runs the fault matrix, the kills, the multi-rank jobs and the soaks."""
    if not helpers.find_test_files(ROOT / "tests"):
        session.skip("NO TESTS: tests/ holds no test files yet")
    helpers.install(session, *TEST_TOOLS, *helpers.source_args(PACKAGES))
    helpers.run_suites(session, helpers.suites("e2e"))


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never")
def minimums(session: nox.Session) -> None:
    """What a floor can break: every package's test suite, and the cross-package tests of
    third-party APIs (``helpers.FLOOR_CROSS_PACKAGE_TESTS``), with numpy, pyarrow, Polars,
    TensorBoard and the rest at the lowest versions the pyprojects allow (torch: the pin)."""
    floors_file = Path(session.create_tmp()).resolve() / "floors.txt"
    floors = helpers.write_floor_constraints(floors_file)
    session.log("floors: " + ", ".join(f"{n}=={v}" for n, v in floors.items()))
    helpers.install(session, "-c", str(floors_file), *TEST_TOOLS, *helpers.source_args(PACKAGES))
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "-m", "pip", "check", silent=False)
    helpers.run_suites(session, helpers.suites("minimums"))


WHEEL_CHECK = """
import sys
from importlib import import_module, metadata

site, *packages = sys.argv[1:]
for package in packages:
    module = package.replace("-", "_")
    path = import_module(module).__file__
    assert path.startswith(site), f"{module} imported from {path}, not the wheel"
    for ep in metadata.distribution(package).entry_points:
        assert ep.load() is not None, ep
        print(f"{package}: entry point {ep.group} {ep.name} = {ep.value} loads")
print("every package imports from its installed wheel; every entry point loads")
"""
"""Run in the wheels venv, with site-packages and the package names as arguments."""


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never")
def wheels(session: nox.Session) -> None:
    """What the wheels carry: each package's wheel built, its ``Requires-Dist`` equal to its
    pyproject's and holding every file of the package's source tree; installed (not the
    sources) and imported from site-packages, every entry point loaded and the ``ti`` command
    run; then the representative tests of each package (``helpers.WHEEL_TESTS``) from an empty
    folder."""
    tmp = Path(session.create_tmp()).resolve()
    wheelhouse = tmp / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheelhouse),
            str(PACKAGES_DIR / package),
        )  # fmt: skip

    built: dict[str, Path] = {}
    for package in PACKAGES:
        (wheel,) = wheelhouse.glob(f"{package.replace('-', '_')}-*.whl")
        built[package] = wheel
        declared = helpers.declared_requires(package)
        listed = helpers.wheel_requires(wheel)
        if declared != listed:
            session.error(
                f"{wheel.name} METADATA does not match {package}/pyproject.toml: "
                f"extra {sorted(listed - declared)}, missing {sorted(declared - listed)}"
            )
        session.log(f"{wheel.name}: Requires-Dist = {sorted(listed)}")
        missing = helpers.missing_from_wheel(wheel, package)
        if missing:
            session.error(f"{wheel.name} lacks files of {package}'s source tree: {missing}")

    targets = []
    for package, wheel in built.items():
        extras = helpers.TEST_EXTRAS.get(package, ())
        targets.append(f"{wheel}[{','.join(extras)}]" if extras else str(wheel))
    helpers.install(session, *TEST_TOOLS, *targets)
    site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(site, str)
    session.run("python", "-c", WHEEL_CHECK, site.strip(), *PACKAGES, silent=False)
    session.run("ti", "--help", silent=True)  # the console script the ti-io wheel installs

    # Run from an empty folder so nothing from the checkout is importable; importlib mode
    # keeps pytest from putting test or source folders on sys.path.
    run_dir = tmp / "run"
    run_dir.mkdir(exist_ok=True)
    session.chdir(run_dir)
    config = ("-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider")
    helpers.run_suites(session, helpers.suites("wheels"), *config)


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never")
def legacy(session: nox.Session) -> None:
    """tests/migration with the released torchinstruments 0.8.0 installed from its own
    requirements (Polars < 2): its runs upgraded, its sinks fed, migration.md's 0.8.0 snippets
    run. Elsewhere those tests skip."""
    packages = helpers.source_args(("ti-schema", "ti-core", "ti-io"))
    helpers.install(session, *TEST_TOOLS, *LEGACY_TOOLS, *packages)
    helpers.run_suites(session, helpers.suites("legacy"))


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never", default=False)
def demo(session: nox.Session) -> None:
    """The main job: examples/find_problems.py with every package and extra installed."""
    script = ROOT / "examples" / "find_problems.py"
    if not script.exists():
        session.error("examples/find_problems.py does not exist yet")
    helpers.install(session, *helpers.source_args(PACKAGES))
    # Without --output the script writes to a new timestamped folder under runs/, so the demo can
    # be run again without clearing the previous results.
    session.run(
        "python", str(script), *session.posargs, env={"MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    )


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never", default=False)
def spark(session: nox.Session) -> None:
    """docs/reading-at-scale.md's Spark recipe (benchmarks/spark_recipe.py): pyspark in local
    mode reads an all-ranks run written by ti-io and reproduces ``ti summary`` of every rank;
    arguments after `--` go to the script. Needs Java 17, from Debian's packages:
    ``apt-get install -y openjdk-17-jre-headless``."""
    if shutil.which("java") is None:
        session.error("Spark needs Java 17: apt-get install -y openjdk-17-jre-headless (Debian)")
    helpers.install(session, *SPARK_TOOLS, *helpers.source_args(("ti-schema", "ti-io")))
    session.run("python", str(ROOT / "benchmarks" / "spark_recipe.py"), *session.posargs)


PROPERTY_TESTS = (
    (
        "packages/ti-core/tests/test_properties.py",
        "packages/ti-core/tests/test_reducers.py",
        "packages/ti-core/tests/test_histograms.py",
    ),
    ("packages/ti-schema/tests/test_mutations.py",),
)
"""The files holding Hypothesis property tests (with their example-based neighbours), per
package."""


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never", default=False)
def properties(session: nox.Session) -> None:
    """The property tests unseeded and ten times longer: the Hypothesis profile ``properties``
    (registered in packages/ti-core/tests/conftest.py). Each run draws new examples; a failure
    prints the blob that reproduces it (``@reproduce_failure``)."""
    helpers.install(session, *TEST_TOOLS, *helpers.source_args(("ti-schema", "ti-core")))
    env = {**helpers.TEST_ENV, "TI_HYPOTHESIS_PROFILE": "properties"}
    for paths in PROPERTY_TESTS:  # one pytest per package: each tests folder has its own conftest
        session.run("pytest", *paths, "-p", "no:cacheprovider", *session.posargs, env=env)


MUTMUT = "mutmut==3.8.1"
"""Exact, like the linters: a new mutmut may generate other mutants and move the scores."""


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never", default=False)
@nox.parametrize("package", list(helpers.MUTATION_PACKAGES))
def mutation(session: nox.Session, package: str) -> None:
    """mutmut over the modules of ``package`` whose numbers users read (``[tool.mutmut]`` in
    its pyproject.toml names them and the tests that judge them), in a copy of the package so
    ``mutants/`` never lands in the tree. Prints the score of each module and writes
    ``.nox/reports/mutation-<package>.json``. Arguments after ``--`` go to ``mutmut run``
    (mutant names or globs, e.g. ``"ti_io.finish.digest*"``, or ``--max-children N``); a rerun
    in the same environment continues where the last one stopped."""
    closure = helpers.closure(package, helpers.TEST_EXTRAS.get(package, ()))
    helpers.install(session, MUTMUT, *TEST_TOOLS, *helpers.source_args(closure))
    work = helpers.mutation_workdir(Path(session.create_tmp()), package)
    env = dict(helpers.TEST_ENV)
    with session.chdir(work):
        session.run("mutmut", "run", *session.posargs, env=env)
        listing = session.run("mutmut", "results", "--all", "true", silent=True, env=env)
    scores = helpers.mutation_scores(str(listing or ""))
    session.log(helpers.format_mutation_scores(scores))
    helpers.REPORTS.mkdir(parents=True, exist_ok=True)
    report = helpers.REPORTS / f"mutation-{package}.json"
    report.write_text(json.dumps(scores, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    session.log(f"wrote {report.relative_to(ROOT)}; survivors: `mutmut show NAME` in {work}")


@nox.session(python=helpers.interpreter(MAIN_PYTHON), download_python="never", default=False)
def bench(session: nox.Session) -> None:
    """The benchmark harness (benchmarks/run.py; arguments after `--` go to it), then the
    in-process measurement of the attached-but-unsampled cost (benchmarks/unsampled_overhead.py):
    the 1.02x / 1.05x targets are finer than separate processes resolve on a shared machine."""
    script = ROOT / "benchmarks" / "run.py"
    if not script.exists():
        session.error("benchmarks/run.py does not exist yet")
    bench_packages = ("ti-schema", "ti-core", "ti-io", "ti-dist")
    helpers.install(session, *BENCH_TOOLS, *helpers.source_args(bench_packages))
    session.run("python", str(script), *session.posargs)
    # exits 1 when a target fails; a benchmark run reports, it does not fail the session
    session.run("python", str(ROOT / "benchmarks" / "unsampled_overhead.py"), success_codes=[0, 1])
