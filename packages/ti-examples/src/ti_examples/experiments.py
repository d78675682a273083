"""Run the matched baseline / broken / fixed runs of an experiment and write its evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import polars as pl

from ti_examples.evidence import comparison_frame, evidence_table, onset_sample
from ti_examples.plotting import plot_comparison
from ti_examples.problems import DERIVED_METRICS, LOSS, PROBLEMS, VARIANTS, Problem, Variant
from ti_examples.training import ExperimentConfig, run_variant
from ti_io import read_events
from ti_io.read.events import describe_event
from ti_io.report import write_report


@dataclass(frozen=True)
class ProblemResult:
    """Where one experiment's artifacts are and what its evidence says."""

    problem: Problem
    directory: Path
    run_dirs: dict[Variant, Path]
    onset_step: int
    onset_sample: int
    series: pl.DataFrame
    """The frame behind comparison.csv and comparison.png (see ``evidence.SERIES_COLUMNS``)."""
    table: pl.DataFrame
    """The printed evidence table (see ``evidence.evidence_table``)."""
    plot: Path
    csv: Path
    report: Path
    """report.html: the three runs side by side (``ti report``), the panels' signals and
    metrics as heat maps of every layer."""
    losses: dict[Variant, list[float]]
    events: tuple[str, ...] = ()
    """The broken run's flight-recorder events, one line each (problems with the sentinel)."""


def run_dirs(output_dir: Path, problem: Problem) -> dict[Variant, Path]:
    """``OUTPUT/<problem>/<variant>`` for every variant."""
    return {variant: output_dir / problem.name / variant for variant in VARIANTS}


def run_problem(
    problem: Problem,
    output_dir: Path,
    config: ExperimentConfig,
    *,
    on_run_done: Callable[[Problem, Variant], None] | None = None,
) -> ProblemResult:
    """Train the three matched runs, then write comparison.csv, comparison.png and
    report.html."""
    config = replace(config, steps=max(config.steps, problem.min_steps))
    directories = run_dirs(output_dir, problem)
    losses: dict[Variant, list[float]] = {}
    for variant, run_dir in directories.items():
        losses[variant] = run_variant(problem, variant, run_dir, config)
        if on_run_done is not None:
            on_run_done(problem, variant)
    series = comparison_frame(directories, problem.panels, config.onset_step, losses)
    first_faulty = onset_sample(series)
    problem_dir = output_dir / problem.name
    csv_path = problem_dir / "comparison.csv"
    series.with_columns(problem=pl.lit(problem.name)).select("problem", *series.columns).write_csv(
        csv_path
    )
    plot = plot_comparison(
        series,
        problem.panels,
        title=f"{problem.name}: baseline vs broken vs fixed",
        onset_sample=first_faulty,
        onset_step=config.onset_step,
        sample_every=config.sample_every,
        path=problem_dir / "comparison.png",
    )
    recorded = [panel for panel in problem.panels if panel.signal != LOSS]
    report = write_report(
        {variant: str(path) for variant, path in directories.items()},
        problem_dir / "report.html",
        signals=sorted({panel.signal for panel in recorded}),
        metrics=sorted({panel.metric for panel in recorded if panel.metric not in DERIVED_METRICS}),
    )
    return ProblemResult(
        problem=problem,
        directory=problem_dir,
        run_dirs=directories,
        onset_step=config.onset_step,
        onset_sample=first_faulty,
        series=series,
        table=evidence_table(series),
        plot=plot,
        csv=csv_path,
        report=report,
        losses=losses,
        events=_broken_events(problem, directories["broken"]),
    )


def _broken_events(problem: Problem, run_dir: Path) -> tuple[str, ...]:
    """The sentinel's events of the broken run, described (none without the sentinel)."""
    if not problem.sentinel:
        return ()
    return tuple(describe_event(event) for event in read_events(run_dir).to_pylist())


def select_problems(names: Iterable[str] | None = None) -> list[Problem]:
    """The named problems (all of them when ``names`` is None), with a clear error for typos."""
    if names is None:
        return list(PROBLEMS.values())
    chosen = []
    for name in names:
        if name not in PROBLEMS:
            raise ValueError(f"unknown problem {name!r}; choose from {', '.join(PROBLEMS)}")
        chosen.append(PROBLEMS[name])
    return chosen


def describe(result: ProblemResult) -> str:
    """A header and the evidence table of one experiment, as printed by find_problems."""
    p = result.problem
    with pl.Config(
        tbl_rows=50,
        tbl_cols=10,
        tbl_width_chars=120,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        fmt_str_lengths=40,
    ):
        table = str(result.table)
    recorder = "".join(f"sentinel: {line}\n" for line in result.events)
    return (
        f"\n== {p.name} (fault from step {result.onset_step} = sample {result.onset_sample})\n"
        f"fault:    {p.fault}\n"
        f"evidence: {p.evidence}\n"
        f"fix:      {p.fix}\n"
        f"{recorder}"
        f"{table}\n"
        f"plot: {result.plot}\ncsv:  {result.csv}\npage: {result.report}"
    )
