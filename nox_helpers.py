"""Helpers of noxfile.py: the monorepo as its pyproject files declare it, and how sessions
install, isolate and test a package (see docs/development.md).

Importing this module changes nothing: it reads files when its functions are called, never
writes, links or edits the environment. It does not import nox, so tests/test_nox_helpers.py
can check it in any test environment; the functions that drive a session take the session.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if TYPE_CHECKING:  # nox is only installed where nox runs
    import nox

ROOT: Final[Path] = Path(__file__).resolve().parent
PACKAGES_DIR: Final[Path] = ROOT / "packages"
TORCH_PIN: Final[Path] = ROOT / "constraints" / "torch.txt"
REPORTS: Final[Path] = ROOT / ".nox" / "reports"
"""Cross-session record of every pytest run; .ci/run sums these into its closing line."""

PACKAGES: Final[tuple[str, ...]] = (
    "ti-schema",
    "ti-core",
    "ti-io",
    "ti-dist",
    "ti-trainers",
    "ti-examples",
)
"""Every distribution under packages/, dependencies first."""
TEST_EXTRAS: Final[Mapping[str, tuple[str, ...]]] = {
    "ti-io": ("plot", "report"),
    "ti-trainers": ("lightning", "transformers"),
    "ti-examples": ("lightning", "transformers"),
}
"""Extras a package's own tests need (``ti compare --plot`` draws with matplotlib, ``ti report``
with plotly; the callbacks and the examples exercise Lightning and Transformers)."""

MUTATION_PACKAGES: Final[tuple[str, ...]] = ("ti-core", "ti-io")
"""Packages with a ``[tool.mutmut]`` table: the modules that decide what users read (ti-core's
reductions and histograms; ti-io's parts, consolidation, digest and result.json)."""

INDUCTOR_CACHE: Final[Path] = ROOT / ".nox" / "inductor-cache"
"""One on-disk torch.compile (inductor) cache for every test session: ti-core's compiled-capture
tests (tests(ti-core)) and tests/test_reliability_compile.py (e2e) compile tiny graphs, and
only the first to build a kernel pays the cold C++ build."""

# Tests must not reach a model hub (no network in CI) nor open plot windows; compiled graphs
# are cached across sessions (INDUCTOR_CACHE). PYTHONDONTWRITEBYTECODE is removed (None: nox
# drops it from the outer environment): machine images set it, and since installs run with
# --no-compile, every interpreter a test starts would then compile torch's modules from source
# again (`import torch, torch._dynamo, ti_io` measured 19 s with it, 4 s once bytecode is cached).
TEST_ENV: Final[Mapping[str, str | None]] = {
    "MPLBACKEND": "Agg",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
    "PYTHONDONTWRITEBYTECODE": None,
}


# --- the packages, as their pyproject.toml files declare them -----------------------------------


def module_name(package: str) -> str:
    """The import name of a distribution: ``ti-io`` -> ``ti_io``."""
    return package.replace("-", "_")


def project(package: str) -> dict[str, Any]:
    """The ``[project]`` table of ``packages/<package>/pyproject.toml``."""
    data = tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text(encoding="utf-8"))
    table: dict[str, Any] = data["project"]
    return table


def requirements(package: str, extras: Iterable[str] = ()) -> list[Requirement]:
    """What ``package`` declares: its dependencies, plus those of ``extras``."""
    table = project(package)
    declared = [Requirement(r) for r in table.get("dependencies", [])]
    optional: dict[str, list[str]] = table.get("optional-dependencies", {})
    for extra in extras:
        declared += [Requirement(r) for r in optional[extra]]
    return declared


def is_sibling(req: Requirement) -> bool:
    return canonicalize_name(req.name) in PACKAGES


def closure(package: str, extras: Iterable[str] = ()) -> list[str]:
    """``package`` and the sibling packages it declares, transitively; dependencies first."""
    ordered: list[str] = []

    def visit(name: str, with_extras: Iterable[str]) -> None:
        for req in requirements(name, with_extras):
            sibling = canonicalize_name(req.name)
            if is_sibling(req) and sibling not in ordered:
                visit(sibling, req.extras)
        if name not in ordered:
            ordered.append(name)

    visit(package, extras)
    return ordered


def absent_siblings(package: str) -> tuple[str, ...]:
    """Import names of the sibling packages outside ``package``'s dependency closure (its test
    extras included): its test environment must not contain them."""
    inside = set(closure(package, TEST_EXTRAS.get(package, ())))
    return tuple(module_name(p) for p in PACKAGES if p not in inside)


def source_args(packages: Iterable[str], *, editable: bool = True) -> list[str]:
    """pip arguments installing ``packages`` from packages/ (with their test extras)."""
    args: list[str] = []
    for package in packages:
        extras = TEST_EXTRAS.get(package, ())
        target = f"{PACKAGES_DIR / package}{'[' + ','.join(extras) + ']' if extras else ''}"
        args += ["-e", target] if editable else [target]
    return args


# --- interpreters ---------------------------------------------------------------------------


def interpreter(version: str) -> str:
    """What to give nox as ``python=`` for ``version`` (``"3.12"``).

    The version itself when a ``pythonX.Y`` that is not a pyenv shim is on PATH (a venv's, the
    system's). pyenv's shims only run the active versions, so otherwise the newest final pyenv
    release of that version, by path (``$PYENV_ROOT/versions/3.12.1/bin/python3.12``); else
    the version, which nox reports as missing and skips. Only reads: nothing is linked and
    PATH is not changed.
    """
    name = f"python{version}"
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = shutil.which(name)
    if found and Path(found).parent != root / "shims":
        return version
    releases = {  # final releases only: X.Y.Z -> its pythonX.Y
        int(match[1]): path
        for path in (root / "versions").glob(f"{version}.*/bin/{name}")
        if (match := re.fullmatch(rf"{re.escape(version)}\.(\d+)", path.parent.parent.name))
    }
    return str(releases[max(releases)]) if releases else version


# --- what sessions run -------------------------------------------------------------------------


EDITABLE_BUILD_REQUIRES: Final[tuple[str, ...]] = ("editables",)
"""What hatchling's ``get_requires_for_build_editable`` adds for a package that lists its
``packages`` (ti-io does): without build isolation pip does not install it by itself."""


def build_requirements() -> list[str]:
    """The ``[build-system] requires`` of every package (hatchling), each once, and what an
    editable build of them needs besides."""
    found: dict[str, None] = {}
    for package in PACKAGES:
        text = (PACKAGES_DIR / package / "pyproject.toml").read_text(encoding="utf-8")
        found.update(dict.fromkeys(tomllib.loads(text)["build-system"]["requires"]))
    return [*found, *EDITABLE_BUILD_REQUIRES]


def install(session: nox.Session, *args: str) -> None:
    """The one way sessions call pip: always under the torch pin.

    --no-compile: byte-compiling torch's ~10k modules at install costs more than compiling the
    few that tests import, once, at their first import (TEST_ENV lets that bytecode be written).
    --no-build-isolation: the packages' build backend is installed into the session first, so
    pip does not make a fresh build environment for each local package (about 3 s each, some
    45 of them per CI run); ``wheels`` still builds each wheel in isolation.
    """
    if "-e" in args:  # local packages to build (the wheels session installs built wheels)
        session.install("--no-compile", "-c", str(TORCH_PIN), *build_requirements())
    session.install("--no-compile", "--no-build-isolation", "-c", str(TORCH_PIN), *args)


TEST_FILE: Final[re.Pattern[str]] = re.compile(r"test_.*\.py|.*_test\.py")
"""The names pytest collects as test files (its default ``python_files``)."""
_NOT_SOURCE: Final[frozenset[str]] = frozenset(
    {"mutants", "build", "dist", "runs", "stats", "__pycache__"}
)
"""Folders git ignores that may hold copies of test files."""


def find_test_files(root: Path) -> list[Path]:
    """Every test file under ``root``, wherever it lies, outside hidden folders (``.nox`` holds
    venvs full of other projects' tests) and the ignored ones that hold copies."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(
            d for d in subfolders if not d.startswith(".") and d not in _NOT_SOURCE
        )
        found += [Path(folder, name) for name in files if TEST_FILE.fullmatch(name)]
    return sorted(found)


def repository_test_files(root: Path = ROOT) -> list[Path]:
    """Every test file of the repository, relative to its root."""
    return [path.relative_to(root) for path in find_test_files(root)]


# --- what each session tests -------------------------------------------------------------------


class Suite(NamedTuple):
    """One pytest run of a session: ``label`` names its JUnit report, ``paths`` (relative to
    the repository root) are the test folders or files it collects, less ``ignore``;
    ``parallel``: spread over the machine's cores (pytest-xdist, a test file per worker)."""

    label: str
    paths: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    parallel: bool = False


PARALLEL_SUITES: Final[frozenset[str]] = frozenset({"ti-core", "e2e"})
"""The suites long enough that two workers pay for their start (on 2 cores, inductor cache
warm: ti-core 88 s in one process, 62 s in two; tests/ 173 s of tests in one, 112 s in all in
two). Each worker takes whole test files (``--dist loadfile``), so a module's fixtures run
once."""

MINIMUMS_IGNORE: Final[tuple[str, ...]] = (
    "packages/ti-core/tests/test_compiled.py",
    "packages/ti-core/tests/test_torch_apis.py",
)
"""ti-core's torch.compile tests, left out of ``minimums``: their subject is Dynamo tracing our
capture, and torch is at the same pin there as in ``tests(ti-core)``, which runs them; no floor
of numpy, pyarrow, Polars or TensorBoard reaches a compiled graph (75 s of ti-core's 153 s)."""

DEFAULT_SESSIONS: Final[tuple[str, ...]] = ("lint", "tests", "e2e", "minimums", "wheels", "legacy")
"""What plain ``nox`` (and so CI) runs, in this order."""

FLOOR_CROSS_PACKAGE_TESTS: Final[tuple[str, ...]] = (
    "tests/test_schema_roundtrip.py",
    "tests/test_io_core_written_data.py",
    "tests/test_io_tensorboard_writers.py",
    "tests/test_io_object_store_writes.py",
)
"""The cross-package tests whose subject is a third-party API a floor can break: the
contract's types written and read back by pyarrow and Polars, TensorBoard's own reader on
the event files, and pyarrow's S3 filesystem writing a run to a real S3-protocol server.
``minimums`` runs them beside the package suites; the rest of ``tests/`` (the fault matrix,
kills, ranks, soaks) exercises ti's own code and runs once, in ``e2e``."""

WHEEL_TESTS: Final[Mapping[str, tuple[str, ...]]] = {
    "ti-schema": ("test_sink_contract.py", "test_validate_history.py"),
    "ti-core": ("test_api.py",),
    "ti-io": ("test_recovery_and_cli.py",),
    "ti-dist": ("test_policies.py",),
    "ti-trainers": ("test_attachment.py",),
    "ti-examples": ("test_find_problems.py",),
}
"""The representative tests ``wheels`` runs of each package, from the installed wheel: the
public API and what the layout of a wheel carries (entry points: ti-core's sink and rank-policy
lookups, ti-dist's policies; the ``ti`` command: ti-io's recovery and CLI tests; ti-examples'
main job end to end)."""


def package_tests(package: str) -> str:
    return f"packages/{package}/tests"


def _package_suite(package: str, ignore: tuple[str, ...] = ()) -> Suite:
    tests = package_tests(package)
    mine = tuple(p for p in ignore if p.startswith(tests + "/"))
    return Suite(package, (tests,), ignore=mine, parallel=package in PARALLEL_SUITES)


def suites(session: str, package: str | None = None) -> tuple[Suite, ...]:
    """The pytest runs of a default session (of ``tests``: the one of ``package``)."""
    if session == "tests":
        if package is None:
            raise ValueError("suites('tests') needs the package")
        return (_package_suite(package),)
    if session == "e2e":
        return (Suite("e2e", ("tests",), parallel="e2e" in PARALLEL_SUITES),)
    if session == "minimums":
        packages = [_package_suite(p, ignore=MINIMUMS_IGNORE) for p in PACKAGES]
        return (*packages, Suite("e2e-floors", FLOOR_CROSS_PACKAGE_TESTS))
    if session == "wheels":
        return tuple(
            Suite(p, tuple(f"{package_tests(p)}/{name}" for name in WHEEL_TESTS[p]))
            for p in PACKAGES
        )
    if session == "legacy":
        return (Suite("legacy", ("tests/migration",)),)
    if session == "lint":
        return ()
    raise ValueError(f"{session!r} is not a default session: {', '.join(DEFAULT_SESSIONS)}")


def default_suites() -> dict[str, tuple[Suite, ...]]:
    """Every pytest run of the default sessions, by session (``tests``: all its packages)."""
    return {
        session: (
            tuple(s for p in PACKAGES for s in suites(session, p))
            if session == "tests"
            else suites(session)
        )
        for session in DEFAULT_SESSIONS
    }


def uncovered_test_files(files: Iterable[Path]) -> list[Path]:
    """The test files (relative to ROOT) that no default session collects."""

    def within(file: Path, paths: Iterable[str]) -> bool:
        return any(file == Path(p) or Path(p) in file.parents for p in paths)

    runs = [s for session in default_suites().values() for s in session]
    return [
        f for f in files if not any(within(f, s.paths) and not within(f, s.ignore) for s in runs)
    ]


def quick_suites() -> tuple[Suite, ...]:
    """What ``nox -s quick`` runs (without the tests marked slow): every package's tests, then
    tests/."""
    return (*(_package_suite(p) for p in PACKAGES), *suites("e2e"))


def install_inputs_digest() -> str:
    """A digest of every file that decides what the sessions install (the pyprojects and the
    torch pin): ``quick`` reinstalls when it changes."""
    inputs = [ROOT / "pyproject.toml", TORCH_PIN]
    inputs += [PACKAGES_DIR / p / "pyproject.toml" for p in PACKAGES]
    digest = hashlib.sha256()
    for path in inputs:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def run_pytest(session: nox.Session, label: str, paths: Iterable[Path], *args: str) -> None:
    """One pytest run over ``paths``. Paths without test files are reported and skipped; paths
    with test files that collect nothing fail (pytest's exit 5 is not success here)."""
    paths = [path for path in paths if path.is_file() or find_test_files(path)]
    if not paths:
        session.warn(f"NO TESTS: {label} holds no test files; nothing run")
        return
    REPORTS.mkdir(parents=True, exist_ok=True)
    report = REPORTS / re.sub(r"[^\w.-]+", "_", f"{session.name}--{label}.xml")
    # CI replays one fixed Hypothesis seed so a landing never depends on a lucky draw; local runs
    # keep exploring new examples.
    seed = ("--hypothesis-seed=0",) if os.environ.get("CI") else ()
    session.run(
        "pytest",
        *map(str, paths),
        f"--junitxml={report}",
        *seed,
        *args,
        *session.posargs,
        env=dict(TEST_ENV),
    )


PYTEST_WORKERS: Final[int] = max(1, min(4, os.cpu_count() or 1))
"""pytest-xdist workers of a parallel suite: one per core, at most four (CI has two)."""


def run_suites(session: nox.Session, runs: Iterable[Suite], *args: str) -> None:
    """Each suite in its own pytest (each tests folder has its own conftest); all run even when
    one fails, so one log shows every failure."""
    import nox.command

    failed = []
    for suite in runs:
        options = [f"--ignore={ROOT / p}" for p in suite.ignore]
        if suite.parallel:
            options += ["--numprocesses", str(PYTEST_WORKERS), "--dist", "loadfile"]
        try:
            run_pytest(session, suite.label, [ROOT / p for p in suite.paths], *options, *args)
        except nox.command.CommandFailed:
            failed.append(suite.label)
    if failed:
        session.error("tests failed: " + ", ".join(failed))


def assert_absent(session: nox.Session, package: str, absent: Iterable[str]) -> None:
    """Prove isolation: ``package`` imports, and what it must not depend on is not importable."""
    names = list(absent)
    module = module_name(package)
    code = (
        f"import importlib.util as u, {module}; "
        f"present = [m for m in {names} if u.find_spec(m)]; "
        f"assert not present, 'must not be installed: ' + ', '.join(present); "
        f"print('isolation ok: {module} imports; not installed: {', '.join(names)}')"
    )
    session.run("python", "-c", code, silent=False)


# --- lower bounds and wheels ---------------------------------------------------------------------


def write_floor_constraints(path: Path) -> dict[str, str]:
    """Constraints pinning every third-party dependency to the lowest version its pyproject
    allows. One floor per name across the monorepo; torch is left to constraints/torch.txt."""
    floors: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    for package in PACKAGES:
        optional = project(package).get("optional-dependencies", {})
        for req in requirements(package, optional):
            name = canonicalize_name(req.name)
            if is_sibling(req) or name == "torch":
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


def wheel_requires(wheel: Path) -> set[str]:
    """The ``Requires-Dist`` lines of a built wheel."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8")
    return {
        str(Requirement(line.split(":", 1)[1].strip()))
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    }


def missing_from_wheel(wheel: Path, package: str, packages_dir: Path = PACKAGES_DIR) -> list[str]:
    """The files of ``package``'s source tree (``src/<module>/``: modules, ``py.typed``, data)
    that its built wheel does not hold."""
    src = packages_dir / package / "src"
    tree = {
        f.relative_to(src).as_posix()
        for f in (src / module_name(package)).rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    }
    with zipfile.ZipFile(wheel) as zf:
        return sorted(tree - set(zf.namelist()))


def declared_requires(package: str) -> set[str]:
    """What ``package``'s wheel must list as ``Requires-Dist`` (extras as markers)."""
    declared = {str(r) for r in requirements(package)}
    optional: dict[str, list[str]] = project(package).get("optional-dependencies", {})
    for extra, reqs in optional.items():
        for raw in reqs:
            req = Requirement(raw)
            marker = f'extra == "{extra}"'
            req = Requirement(f"{raw}; {marker}" if req.marker is None else f"{raw} and {marker}")
            declared.add(str(req))
    return declared


# --- mutation testing (nox -s mutation) ----------------------------------------------------------

# mutmut's statuses that count as the tests catching the mutant (a timeout is a mutant the tests
# noticed by hanging), and those that say nothing about the tests (not run yet, skipped).
_CAUGHT: Final[frozenset[str]] = frozenset({"killed", "timeout", "caught by type check"})
_UNJUDGED: Final[frozenset[str]] = frozenset({"not checked", "skipped"})


def mutation_workdir(tmp: Path, package: str) -> Path:
    """A copy of ``packages/<package>`` under ``tmp`` for mutmut to work in (it writes
    ``mutants/`` next to the sources). An earlier copy's ``mutants/`` is kept, so a rerun
    continues; the sources and tests are refreshed from the tree."""
    work = tmp / "mutation" / package
    shutil.copytree(
        PACKAGES_DIR / package,
        work,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("mutants", "__pycache__", ".pytest_cache", "*.egg-info"),
    )
    return work


def mutant_module(name: str) -> str:
    """The module of a mutmut mutant name: ``ti_io.parts.xǁPartWriterǁ_run__mutmut_3`` and
    ``ti_io.parts.x_conform__mutmut_1`` are both ``ti_io.parts``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith(("x_", "xǁ")):
            return ".".join(parts[:i])
    raise ValueError(f"not a mutmut mutant name: {name!r}")


def mutation_scores(listing: str) -> dict[str, dict[str, Any]]:
    """Per module, from ``mutmut results --all true``: the count of each status, ``judged``
    (mutants the tests ran against), ``caught`` and ``score`` (caught / judged; None when none
    was judged) and the names of the survivors."""
    modules: dict[str, dict[str, Any]] = {}
    for line in listing.splitlines():
        if not line.strip() or ": " not in line:
            continue
        name, status = (x.strip() for x in line.rsplit(": ", 1))
        entry = modules.setdefault(mutant_module(name), {"statuses": {}, "survivors": []})
        entry["statuses"][status] = entry["statuses"].get(status, 0) + 1
        if status not in _CAUGHT | _UNJUDGED:
            entry["survivors"].append(f"{name}: {status}")
    for entry in modules.values():
        statuses = entry["statuses"]
        judged = sum(n for status, n in statuses.items() if status not in _UNJUDGED)
        caught = sum(n for status, n in statuses.items() if status in _CAUGHT)
        entry.update(
            mutants=sum(statuses.values()),
            judged=judged,
            caught=caught,
            score=round(caught / judged, 4) if judged else None,
        )
    return modules


def format_mutation_scores(scores: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per module: mutants, judged, caught, score and the statuses."""
    lines = [f"{'module':<36}{'mutants':>8}{'judged':>8}{'caught':>8}{'score':>8}  statuses"]
    for module, entry in sorted(scores.items()):
        score = "-" if entry["score"] is None else f"{entry['score']:.1%}"
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(entry["statuses"].items()))
        lines.append(
            f"{module:<36}{entry['mutants']:>8}{entry['judged']:>8}{entry['caught']:>8}"
            f"{score:>8}  {statuses}"
        )
    return "\n".join(lines)
