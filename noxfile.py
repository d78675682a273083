"""Development sessions of the TorchInstruments monorepo (see docs/development.md).

Plain `nox` runs the default matrix: lint, tests (one environment per package holding only that
package and its declared dependencies), e2e, minimums and wheels. `demo` and `bench` run on
request. Every pip call goes through `_install`, which applies the one torch pin in
constraints/torch.txt.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
import zipfile
from collections.abc import Iterable
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
TORCH_PIN = ROOT / "constraints" / "torch.txt"
# Cross-session record of every pytest run; .ci/run sums these into its closing line.
REPORTS = ROOT / ".nox" / "reports"

PACKAGES = ("ti-schema", "ti-core", "ti-io", "ti-dist", "ti-examples")
# Extras a package's own tests need (the examples exercise Lightning and Transformers).
TEST_EXTRAS = {"ti-examples": ("lightning", "transformers")}
# What must NOT be importable in a package's test environment: proves the dependency direction.
ABSENT = {
    "ti-schema": ("torch", "polars", "tensorboard", "ti_core", "ti_io", "ti_dist", "ti_examples"),
    "ti-core": ("polars", "tensorboard", "ti_io", "ti_dist", "ti_examples"),
    "ti-io": ("ti_dist", "ti_examples"),
    "ti-dist": ("tensorboard", "ti_io", "ti_examples"),
    "ti-examples": ("ti_dist",),
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
LINT_PATHS = ("noxfile.py", "packages", "tests", "examples", "benchmarks")

# Tests must not reach a model hub (no network in CI) nor open plot windows.
TEST_ENV = {"MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

nox.options.default_venv_backend = "virtualenv"  # pip sees the local torch wheel; uv does not
nox.options.error_on_missing_interpreters = False  # ti-schema on 3.12/3.13 only where present
nox.options.sessions = ["lint", "tests", "e2e", "minimums", "wheels", "legacy"]


def _expose_pyenv_interpreters() -> None:
    """Let nox find pyenv's non-active interpreters (its shims only run the active version).

    Symlinks just `pythonX.Y` for each missing version into .nox/interpreters and puts that
    folder first on PATH; nothing else on PATH changes.
    """
    versions_dir = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not versions_dir.is_dir():
        return
    links = ROOT / ".nox" / "interpreters"
    for version in SCHEMA_PYTHONS:
        name = f"python{version}"
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            continue
        releases = {  # final releases only: X.Y.Z -> its pythonX.Y
            int(match[1]): path
            for path in versions_dir.glob(f"{version}.*/bin/{name}")
            if (match := re.fullmatch(rf"{re.escape(version)}\.(\d+)", path.parent.parent.name))
        }
        candidates = [releases[patch] for patch in sorted(releases)]
        if not candidates:
            continue
        links.mkdir(parents=True, exist_ok=True)
        link = links / name
        link.unlink(missing_ok=True)
        link.symlink_to(candidates[-1])
    if links.is_dir() and str(links) not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{links}{os.pathsep}{os.environ.get('PATH', '')}"


_expose_pyenv_interpreters()


# --- the packages, as their pyproject.toml files declare them -----------------------------------


def _project(package: str) -> dict[str, object]:
    data = tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text(encoding="utf-8"))
    project: dict[str, object] = data["project"]
    return project


def _requirements(package: str, extras: Iterable[str] = ()) -> list[Requirement]:
    project = _project(package)
    declared = [Requirement(r) for r in project.get("dependencies", [])]  # type: ignore[attr-defined]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})  # type: ignore[assignment]
    for extra in extras:
        declared += [Requirement(r) for r in optional[extra]]
    return declared


def _is_sibling(req: Requirement) -> bool:
    return canonicalize_name(req.name) in PACKAGES


def _closure(package: str, extras: Iterable[str] = ()) -> list[str]:
    """`package` and the sibling packages it declares, transitively; dependencies first."""
    ordered: list[str] = []

    def visit(name: str, with_extras: Iterable[str]) -> None:
        for req in _requirements(name, with_extras):
            sibling = canonicalize_name(req.name)
            if _is_sibling(req) and sibling not in ordered:
                visit(sibling, req.extras)
        if name not in ordered:
            ordered.append(name)

    visit(package, extras)
    return ordered


def _source_args(packages: Iterable[str], *, editable: bool = True) -> list[str]:
    args: list[str] = []
    for package in packages:
        extras = TEST_EXTRAS.get(package, ())
        target = f"{PACKAGES_DIR / package}{'[' + ','.join(extras) + ']' if extras else ''}"
        args += ["-e", target] if editable else [target]
    return args


def _all_package_args() -> list[str]:
    return _source_args(PACKAGES)


# --- helpers shared by the sessions ---------------------------------------------------------------


def _install(session: nox.Session, *args: str) -> None:
    """The one way sessions call pip: always under the torch pin.

    --no-compile: byte-compiling torch's ~10k modules at install costs more than compiling the
    few that tests import.
    """
    session.install("--no-compile", "-c", str(TORCH_PIN), *args)


def _test_files(path: Path) -> list[Path]:
    return sorted({*path.rglob("test_*.py"), *path.rglob("*_test.py")})


def _pytest(session: nox.Session, label: str, path: Path, *args: str) -> None:
    """Run one test directory. A folder without test files is reported and skipped; a folder
    with test files that collects nothing fails (pytest's exit 5 is not success here)."""
    if not _test_files(path):
        session.warn(f"NO TESTS: {path.relative_to(ROOT)} holds no test files; nothing run")
        return
    REPORTS.mkdir(parents=True, exist_ok=True)
    report = REPORTS / re.sub(r"[^\w.-]+", "_", f"{session.name}--{label}.xml")
    # CI replays one fixed Hypothesis seed so a landing never depends on a lucky draw; local runs
    # keep exploring new examples.
    seed = ("--hypothesis-seed=0",) if os.environ.get("CI") else ()
    session.run(
        "pytest",
        str(path),
        f"--junitxml={report}",
        *seed,
        *args,
        *session.posargs,
        env=TEST_ENV,
    )


def _pytest_all(session: nox.Session, *args: str) -> None:
    """Every package's tests, then tests/; all run even when one fails, so one log shows all."""
    failed = []
    runs = [(p, PACKAGES_DIR / p / "tests") for p in PACKAGES] + [("e2e", ROOT / "tests")]
    for label, path in runs:
        try:
            _pytest(session, label, path, *args)
        except nox.command.CommandFailed:
            failed.append(label)
    if failed:
        session.error("tests failed: " + ", ".join(failed))


def _assert_absent(session: nox.Session, package: str) -> None:
    """Prove isolation: what the package must not depend on is not importable here."""
    absent = list(ABSENT[package])
    module = package.replace("-", "_")
    code = (
        f"import importlib.util as u, {module}; "
        f"present = [m for m in {absent} if u.find_spec(m)]; "
        f"assert not present, 'must not be installed: ' + ', '.join(present); "
        f"print('isolation ok: {module} imports; not installed: {', '.join(absent)}')"
    )
    session.run("python", "-c", code, silent=False)


def _write_floor_constraints(path: Path) -> dict[str, str]:
    """Constraints pinning every third-party dependency to the lowest version its pyproject
    allows. One floor per name across the monorepo; torch is left to constraints/torch.txt."""
    floors: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    for package in PACKAGES:
        optional = _project(package).get("optional-dependencies", {})
        for req in _requirements(package, optional):  # type: ignore[arg-type]
            name = canonicalize_name(req.name)
            if _is_sibling(req) or name == "torch":
                continue
            lows = [s.version for s in req.specifier if s.operator == ">="]
            if len(lows) != 1:
                problems.append(f"{package}: '{req}' needs exactly one '>=' lower bound")
                continue
            seen = floors.setdefault(name, (lows[0], package))
            if seen[0] != lows[0]:
                problems.append(
                    f"{name}: {seen[1]} says >={seen[0]} but {package} says >={lows[0]}; "
                    "use one floor for the whole monorepo"
                )
    if problems:
        raise RuntimeError("lower bounds are inconsistent:\n  " + "\n  ".join(problems))
    pins = {name: low for name, (low, _) in sorted(floors.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{name}=={low}\n" for name, low in pins.items()), encoding="utf-8")
    return pins


def _wheel_requires(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8")
    return {
        str(Requirement(line.split(":", 1)[1].strip()))
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    }


def _declared_requires(package: str) -> set[str]:
    declared = {str(r) for r in _requirements(package)}
    optional: dict[str, list[str]] = _project(package).get("optional-dependencies", {})  # type: ignore[assignment]
    for extra, reqs in optional.items():
        for raw in reqs:
            req = Requirement(raw)
            marker = f'extra == "{extra}"'
            req = Requirement(f"{raw}; {marker}" if req.marker is None else f"{raw} and {marker}")
            declared.add(str(req))
    return declared


# --- sessions ----------------------------------------------------------------------------------


@nox.session(python=MAIN_PYTHON, download_python="never")
def lint(session: nox.Session) -> None:
    """ruff (check + format) over the tree; mypy (strict) over every package's src."""
    _install(session, *LINT_TOOLS, *TEST_TOOLS, *_all_package_args())
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


TEST_MATRIX = [
    nox.param(package, python, tags=[package])
    for package in PACKAGES
    for python in (SCHEMA_PYTHONS if package == "ti-schema" else (MAIN_PYTHON,))
]


@nox.session(download_python="never")
@nox.parametrize(("package", "python"), TEST_MATRIX)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests in an environment holding only it and its declared dependencies."""
    tests_dir = PACKAGES_DIR / package / "tests"
    if not _test_files(tests_dir):
        session.skip(f"NO TESTS: {tests_dir.relative_to(ROOT)} holds no test files yet")
    _install(session, *TEST_TOOLS, *_source_args(_closure(package, TEST_EXTRAS.get(package, ()))))
    _assert_absent(session, package)
    _pytest(session, package, tests_dir)


@nox.session(python=MAIN_PYTHON, download_python="never")
def e2e(session: nox.Session) -> None:
    """Cross-package tests in tests/, with every package and extra installed."""
    if not _test_files(ROOT / "tests"):
        session.skip("NO TESTS: tests/ holds no test files yet")
    _install(session, *TEST_TOOLS, *_all_package_args())
    _pytest(session, "e2e", ROOT / "tests")


@nox.session(python=MAIN_PYTHON, download_python="never")
def minimums(session: nox.Session) -> None:
    """Every package's tests and e2e at the lowest versions the pyprojects allow."""
    floors_file = Path(session.create_tmp()).resolve() / "floors.txt"
    floors = _write_floor_constraints(floors_file)
    session.log("floors: " + ", ".join(f"{n}=={v}" for n, v in floors.items()))
    _install(session, "-c", str(floors_file), *TEST_TOOLS, *_all_package_args())
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "-m", "pip", "check", silent=False)
    _pytest_all(session)


@nox.session(python=MAIN_PYTHON, download_python="never")
def wheels(session: nox.Session) -> None:
    """Build the five wheels, check their metadata, install them (not the sources), test them."""
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
        declared, listed = _declared_requires(package), _wheel_requires(wheel)
        if declared != listed:
            session.error(
                f"{wheel.name} METADATA does not match {package}/pyproject.toml: "
                f"extra {sorted(listed - declared)}, missing {sorted(declared - listed)}"
            )
        session.log(f"{wheel.name}: Requires-Dist = {sorted(listed)}")

    targets = []
    for package, wheel in built.items():
        extras = TEST_EXTRAS.get(package, ())
        targets.append(f"{wheel}[{','.join(extras)}]" if extras else str(wheel))
    _install(session, *TEST_TOOLS, *targets)
    site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(site, str)
    modules = [p.replace("-", "_") for p in PACKAGES]
    session.run(
        "python",
        "-c",
        "import sys, importlib\n"
        f"site = {site.strip()!r}\n"
        f"for name in {modules!r}:\n"
        "    path = importlib.import_module(name).__file__\n"
        "    assert path.startswith(site), f'{name} imported from {path}, not the wheel'\n"
        "print('all five packages import from the installed wheels')\n",
        silent=False,
    )

    # Run from an empty folder so nothing from the checkout is importable; importlib mode
    # keeps pytest from putting test or source folders on sys.path.
    run_dir = tmp / "run"
    run_dir.mkdir(exist_ok=True)
    session.chdir(run_dir)
    config = ("-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider")
    _pytest_all(session, *config)


@nox.session(python=MAIN_PYTHON, download_python="never")
def legacy(session: nox.Session) -> None:
    """tests/migration with the released torchinstruments 0.8.0 installed from its own
    requirements (Polars < 2): its runs upgraded, its sinks fed, migration.md's 0.8.0 snippets
    run. Elsewhere those tests skip."""
    packages = _source_args(("ti-schema", "ti-core", "ti-io"))
    _install(session, *TEST_TOOLS, *LEGACY_TOOLS, *packages)
    _pytest(session, "legacy", ROOT / "tests" / "migration")


@nox.session(python=MAIN_PYTHON, download_python="never", default=False)
def demo(session: nox.Session) -> None:
    """The main job: examples/find_problems.py with every package and extra installed."""
    script = ROOT / "examples" / "find_problems.py"
    if not script.exists():
        session.error("examples/find_problems.py does not exist yet")
    _install(session, *_all_package_args())
    # Without --output the script writes to a new timestamped folder under runs/, so the demo can
    # be run again without clearing the previous results.
    session.run(
        "python", str(script), *session.posargs, env={"MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    )


@nox.session(python=MAIN_PYTHON, download_python="never", default=False)
def bench(session: nox.Session) -> None:
    """The benchmark harness (benchmarks/run.py; arguments after `--` go to it), then the
    in-process measurement of the attached-but-unsampled cost (benchmarks/unsampled_overhead.py):
    the 1.02x / 1.05x targets are finer than separate processes resolve on a shared machine."""
    script = ROOT / "benchmarks" / "run.py"
    if not script.exists():
        session.error("benchmarks/run.py does not exist yet")
    _install(session, *BENCH_TOOLS, *_source_args(("ti-schema", "ti-core", "ti-io", "ti-dist")))
    session.run("python", str(script), *session.posargs)
    # exits 1 when a target fails; a benchmark run reports, it does not fail the session
    session.run("python", str(ROOT / "benchmarks" / "unsampled_overhead.py"), success_codes=[0, 1])
