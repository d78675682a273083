"""``find_problems``: the main job. Five experiments, three matched runs each, with evidence."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from ti_examples.experiments import ProblemResult, describe, run_dirs, run_problem, select_problems
from ti_examples.problems import PROBLEMS, VARIANTS, Problem, Variant
from ti_examples.training import ExperimentConfig


def default_output() -> Path:
    """A new timestamped directory under ``runs/``."""
    return Path("runs") / datetime.now(UTC).strftime("find-problems-%Y%m%d-%H%M%S")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = ExperimentConfig()
    parser = argparse.ArgumentParser(
        prog="find_problems.py",
        description=(
            "Reproduce five training faults with matched baseline, broken and fixed runs, "
            "and write their TorchInstruments artifacts, evidence tables and plots."
        ),
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="output directory (default: a new timestamped directory under runs/)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help=(
            f"training steps per run (default: {defaults.steps}; attention_logits trains at "
            "least 100)"
        ),
    )
    parser.add_argument(
        "--sample-every",
        type=int,
        default=defaults.sample_every,
        help=(
            "sample one forward every N steps; the fault starts after four samples "
            f"(default: {defaults.sample_every})"
        ),
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed shared by all runs")
    parser.add_argument(
        "--problem",
        action="append",
        choices=list(PROBLEMS),
        help="run only this experiment (repeatable; default: all five)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar and no evidence tables"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[ProblemResult]:
    """Run the selected experiments; returns their results (the CLI ignores them)."""
    args = parse_args(argv)
    try:
        config = ExperimentConfig(steps=args.steps, sample_every=args.sample_every, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"find_problems.py: {exc}") from exc
    output: Path = args.output or default_output()
    problems = select_problems(args.problem)
    taken = [
        str(path)
        for problem in problems
        for path in run_dirs(output, problem).values()
        if path.exists() and any(path.iterdir())
    ]
    if taken:
        raise SystemExit(
            f"find_problems.py: --output {output} already holds runs ({', '.join(taken)}); "
            "choose a new directory or remove the old one"
        )
    output.mkdir(parents=True, exist_ok=True)
    results = []
    with tqdm(
        total=len(problems) * len(VARIANTS), desc="experiments", unit="run", disable=args.quiet
    ) as bar:

        def advance(problem: Problem, variant: Variant) -> None:
            bar.set_postfix_str(f"{problem.name}/{variant}")
            bar.update(1)

        for problem in problems:
            result = run_problem(problem, output, config, on_run_done=advance)
            results.append(result)
            if not args.quiet:
                tqdm.write(describe(result))
    if not args.quiet:
        print(f"\nArtifacts of {len(results) * len(VARIANTS)} runs under {output}")
    return results
