"""The main job: every fault is visible in its broken run's artifacts and absent elsewhere.

Assertions read history.parquet with Polars directly (not through ti_examples.evidence), so
they check what a user finds on disk; the derived parameter series (weight norm,
update-to-weight ratio) are read through the evidence frame and checked against torch's own
norms of the weights.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import polars as pl
import pytest
import torch

from ti_examples.cli import main
from ti_examples.experiments import ProblemResult, describe
from ti_examples.plotting import draw_comparison
from ti_examples.problems import LOSS, PROBLEMS, VARIANTS
from ti_examples.training import ExperimentConfig, make_batches, train
from ti_io import compare_runs, read_events
from ti_io.cli import main as ti_main
from ti_schema.testing import assert_artifact_dir_conforms

# Small but long enough for every fault to develop: the fault starts at step 8 (after four
# samples taken every 2 steps), and 16 faulty samples follow.
STEPS = 40
SAMPLE_EVERY = 2
ONSET_STEP = 4 * SAMPLE_EVERY
SAMPLES = STEPS // SAMPLE_EVERY
HEALTHY_SAMPLES = ONSET_STEP // SAMPLE_EVERY
assert {"baseline", "broken"} <= set(VARIANTS)  # the loops below check both sides


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ProblemResult]]:
    """Run find_problems once through its command-line entry point, quietly."""
    output = tmp_path_factory.mktemp("demo") / "out"
    results = main(
        [
            "--output",
            str(output),
            "--steps",
            str(STEPS),
            "--sample-every",
            str(SAMPLE_EVERY),
            "--quiet",
        ]
    )
    return output, results


CONFIG = ExperimentConfig(steps=STEPS, sample_every=SAMPLE_EVERY)


def history(output: Path, problem: str, variant: str) -> pl.DataFrame:
    return pl.read_parquet(output / problem / variant / "history.parquet")


def series(frame: pl.DataFrame, layer: str, signal: str, metric: str) -> pl.DataFrame:
    """sample_id, forward_index, value of one metric, sorted by sample."""
    return (
        frame.filter(
            (pl.col("layer") == layer)
            & (pl.col("signal") == signal)
            & (pl.col("metric") == metric)
            & (pl.col("call_index") == 0)
        )
        .select("sample_id", "forward_index", "value")
        .sort("sample_id")
    )


def split(frame: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Values before and after the onset step: every sample present, so that an ``np.all`` over
    either side can never pass on an empty array."""
    before = frame.filter(pl.col("forward_index") < ONSET_STEP)["value"].to_numpy()
    after = frame.filter(pl.col("forward_index") >= ONSET_STEP)["value"].to_numpy()
    assert (len(before), len(after)) == (HEALTHY_SAMPLES, SAMPLES - HEALTHY_SAMPLES)
    return before, after


def test_writes_every_run_with_valid_artifacts(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, results = demo
    assert [r.problem.name for r in results] == list(PROBLEMS)
    for name in PROBLEMS:
        for variant in VARIANTS:
            run = output / name / variant
            for artifact in ("history.parquet", "result.json", "index.md", "tensorboard"):
                assert (run / artifact).exists(), f"{run} lacks {artifact}"
            assert not (run / "history.parts").exists()
            assert_artifact_dir_conforms(run)
    assert ti_main(["validate", str(output / "detached" / "broken")]) == 0


def test_each_experiment_writes_its_report(demo: tuple[Path, list[ProblemResult]]) -> None:
    """report.html: the three runs side by side, a heat map per evidence signal and metric
    (tests/test_report_browser.py opens one in Chromium)."""
    output, results = demo
    for result in results:
        assert result.report == output / result.problem.name / "report.html"
        page = result.report.read_text(encoding="utf-8")
        assert f"page: {result.report}" in describe(result)
        for variant in VARIANTS:
            assert f"<th>{variant}</th>" in page
        for panel in result.problem.panels:
            if panel.tensor_path == "" and panel.metric != "l2_norm" and panel.signal != LOSS:
                assert f"<h2>{panel.signal} {panel.metric}</h2>" in page
                assert f"<td>{panel.layer}</td>" in page


def test_samples_follow_the_sampler(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    samples = (
        history(output, "inactive_relu", "broken")
        .select("sample_id", "forward_index")
        .unique()
        .sort("sample_id")
    )
    expected = list(range(0, STEPS, SAMPLE_EVERY))
    assert samples["forward_index"].to_list() == expected
    assert samples["sample_id"].to_list() == list(range(len(expected)))
    # four healthy samples, then the fault
    assert samples.filter(pl.col("forward_index") < ONSET_STEP).height == 4


def test_inactive_relu(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for variant in VARIANTS:
        frame = history(output, "inactive_relu", variant)
        zeros_before, zeros_after = split(series(frame, "act", "output", "zero_fraction"))
        grad_before, grad_after = split(series(frame, "fc1", "output_gradient", "zero_fraction"))
        assert zeros_before.max() < 0.9
        assert grad_before.max() < 0.9
        if variant == "broken":
            assert np.all(zeros_after == 1.0)
            assert np.all(grad_after == 1.0), "no gradient reaches fc1 through a dead ReLU"
        else:
            assert zeros_after.max() < 0.9
            assert grad_after.max() < 0.9


def test_saturation(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for variant in VARIANTS:
        frame = history(output, "saturation", variant)
        before, after = split(series(frame, "fc1", "output_gradient", "std"))
        ratio = np.median(after) / np.median(before)
        if variant == "broken":
            assert ratio < 0.1, f"gradient before the sigmoid should collapse, ratio {ratio}"
            pre_before, pre_after = split(series(frame, "fc1", "output", "std"))
            assert np.median(pre_after) > 100 * np.median(pre_before)
        else:
            assert ratio > 0.3, f"{variant}: ratio {ratio}"


def test_scale_growth(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for variant in VARIANTS:
        frame = history(output, "scale_growth", variant)
        before, after = split(series(frame, "fc2", "output", "std"))
        growth = np.nanmax(after) / np.median(before)
        if variant == "broken":
            assert growth > 1e3, f"output std should grow by orders of magnitude, got {growth}"
        else:
            assert growth < 10, f"{variant}: growth {growth}"


def test_scale_growth_parameters_show_the_learning_rate(
    demo: tuple[Path, list[ProblemResult]],
) -> None:
    """fc2's update-to-weight ratio jumps at the onset sample itself (each step moves the
    weights by about their own size), samples before the output's scale visibly grows; its
    weight norm then grows with the output. The baseline and the clipped run stay small."""
    _, results = demo
    series = next(r for r in results if r.problem.name == "scale_growth").series
    for variant in VARIANTS:
        frame = series.filter(pl.col("variant") == variant)
        ratio = frame.filter(pl.col("metric") == "update_to_weight").sort("sample_id")
        norm = frame.filter(pl.col("metric") == "l2_norm").sort("sample_id")
        assert ratio["value"].null_count() == norm["value"].null_count() == 0
        before, after = split(ratio)
        norm_before, norm_after = split(norm)
        if variant == "broken":
            onset = ratio.filter(pl.col("forward_index") == ONSET_STEP)["value"].item()
            # the learning rate went up 18x between the last healthy sample and this one
            assert onset > 10 * before[-1], f"ratio {onset} at the onset, before {before}"
            assert np.median(after) > 0.5
            assert norm_after.max() > 1e3 * np.median(norm_before)
        else:
            assert after.max() < 0.2, f"{variant}: update-to-weight {after.max()}"
            assert norm_after.max() < 2 * np.median(norm_before)


def test_scale_growth_weight_norm_and_ratio_equal_torch(
    demo: tuple[Path, list[ProblemResult]],
) -> None:
    """The evidence series, derived from the recorded mean, std and shape, equal torch's own
    norms of fc2.weight at each sampled forward and of the step that followed it."""
    _, results = demo
    result = next(r for r in results if r.problem.name == "scale_growth")
    problem = result.problem
    torch.manual_seed(CONFIG.seed)
    model = problem.build_model("broken")
    weights: list[torch.Tensor] = []
    model.fc2.register_forward_pre_hook(  # type: ignore[union-attr]
        lambda m, args: weights.append(m.weight.detach().double().clone())
    )
    train(problem, "broken", model, CONFIG)
    weights.append(model.fc2.weight.detach().double().clone())  # type: ignore[union-attr]
    frame = result.series.filter(pl.col("variant") == "broken")
    for metric in ("l2_norm", "update_to_weight"):
        rows = frame.filter(pl.col("metric") == metric).sort("sample_id")
        for index, value in zip(rows["forward_index"], rows["value"], strict=True):
            norm = float(torch.linalg.vector_norm(weights[index]))
            if metric == "update_to_weight":
                step = float(torch.linalg.vector_norm(weights[index + 1] - weights[index]))
                expected = step / norm
            else:
                expected = norm
            assert value == pytest.approx(expected, rel=1e-5), (metric, index)


def test_nonfinite(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for variant in VARIANTS:
        frame = history(output, "nonfinite", variant)
        fractions = frame.filter(pl.col("metric") == "nonfinite_fraction")
        assert fractions["value"].null_count() == 0
        before = fractions.filter(pl.col("forward_index") < ONSET_STEP)
        assert before["value"].max() == 0.0
        if variant == "broken":
            # the sampler's forwards (the sentinel's dense capture adds others: tested below)
            frame = frame.filter(pl.col("forward_index") % SAMPLE_EVERY == 0)
            _, standardized = split(series(frame, "standardize", "output", "nonfinite_fraction"))
            # one of the 16 features is 0/0 in every faulty batch
            assert np.all(standardized == pytest.approx(1 / 16))
            _, final = split(series(frame, "fc2", "output", "nonfinite_fraction"))
            assert np.all(final == 1.0)
        else:
            assert fractions["value"].max() == 0.0, f"{variant} has non-finite values"


def test_sentinel_names_where_the_first_nan_appeared(
    demo: tuple[Path, list[ProblemResult]],
) -> None:
    """The broken nonfinite run carries the flight recorder: one event, at the onset forward,
    whose replay reproduces it (real numerics) and names the standardization (the module that
    divides 0 by a zero std), printed beside the evidence table; the other runs have an empty
    events table."""
    output, results = demo
    result = next(r for r in results if r.problem.name == "nonfinite")
    (event,) = read_events(output / "nonfinite" / "broken").to_pylist()
    assert (event["kind"], event["signal"]) == ("nonfinite", "output")
    assert (event["layer"], event["forward_index"]) == ("standardize", ONSET_STEP)
    assert event["replay"] == "reproduced"
    assert event["dense_first_forward"] == ONSET_STEP + 1
    (line,) = result.events
    assert f"nonfinite at forward {ONSET_STEP}" in line
    assert "first module standardize" in line
    assert "replay reproduced" in line
    assert "real numerics" in line
    assert f"sentinel: {line}" in describe(result)
    for variant in ("baseline", "fixed"):
        assert read_events(output / "nonfinite" / variant).num_rows == 0
    # the dense capture: every forward after the onset event is sampled, whatever the sampler
    dense = history(output, "nonfinite", "broken").filter(
        pl.col("forward_index").is_between(ONSET_STEP + 1, ONSET_STEP + event["dense_forwards"])
    )
    assert dense["forward_index"].n_unique() == event["dense_forwards"]


def test_detached(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for variant in VARIANTS:
        frame = history(output, "detached", variant)
        all_samples = set(frame["sample_id"].unique().to_list())
        healthy = set(
            frame.filter(pl.col("forward_index") < ONSET_STEP)["sample_id"].unique().to_list()
        )
        grads = frame.filter(pl.col("signal") == "output_gradient")
        trunk_layers = [f"trunk.{i}" for i in range(4)]
        for layer in trunk_layers:
            got = set(grads.filter(pl.col("layer") == layer)["sample_id"].unique().to_list())
            if variant == "broken":
                assert got == healthy, f"{layer}: gradient rows only before the detach"
            else:
                assert got == all_samples, f"{variant} {layer}: a gradient row for every sample"
        head = set(grads.filter(pl.col("layer") == "head")["sample_id"].unique().to_list())
        assert head == all_samples


def test_attention_logits_grow_before_the_loss_falls_behind(
    demo: tuple[Path, list[ProblemResult]],
) -> None:
    """The attention's largest logit (the ``attention`` signal's ``max``) is ten times its
    healthy level while the loss is still with the baseline's; the loss falls behind later
    and stays there; QK-layernorm keeps the logits bounded and the loss with the baseline's."""
    output, results = demo
    result = next(r for r in results if r.problem.name == "attention_logits")
    steps = result.problem.min_steps
    assert len(result.losses["broken"]) == steps  # the experiment's own minimum length
    frame = result.series.filter(pl.col("variant").is_in(["baseline", "broken", "fixed"]))

    def values(series: str, variant: str) -> np.ndarray:
        rows = frame.filter(pl.col("series") == series, pl.col("variant") == variant)
        assert rows.height == steps // SAMPLE_EVERY
        assert rows["value"].null_count() == 0
        return rows.sort("sample_id")["value"].to_numpy()

    logit = "attn.sdpa[0] attention max"
    loss = "training loop loss mse"
    onset = ONSET_STEP // SAMPLE_EVERY
    healthy = values(logit, "broken")[:onset].max()
    grown = np.flatnonzero(values(logit, "broken") >= 10 * healthy)
    behind = np.flatnonzero(values(loss, "broken") >= 2 * values(loss, "baseline"))
    assert grown.size
    assert behind.size
    assert grown[0] >= onset
    assert behind[0] >= grown[0] + 5, (grown[0], behind[0])  # at least five samples later
    late = slice(-steps // SAMPLE_EVERY // 4, None)  # the last quarter of the run
    assert np.median(values(loss, "broken")[late]) > 2 * np.median(values(loss, "baseline")[late])
    assert values(logit, "broken")[late].min() > 100 * healthy
    fixed = values(logit, "fixed")
    assert fixed.max() < 2 * fixed[:onset].max()  # QK-layernorm bounds the logits
    assert np.median(values(loss, "fixed")[late]) < 1.5 * np.median(values(loss, "baseline")[late])
    # the loss series is the training loop's own loss at each sampled step
    broken_loss = frame.filter(pl.col("series") == loss, pl.col("variant") == "broken")
    for step, value in broken_loss.select("forward_index", "value").iter_rows():
        assert value == result.losses["broken"][step]
    # the recorded attention rows are the attention module's, one sdpa call per forward
    attention = history(output, "attention_logits", "broken").filter(
        pl.col("signal") == "attention"
    )
    assert set(attention["layer"]) == {"attn"}
    assert set(attention["tensor_path"]) == {"sdpa[0]"}


def test_observer_is_passive_and_exact(demo: tuple[Path, list[ProblemResult]]) -> None:
    """Losses match an unobserved run; a recorded statistic matches numpy float64."""
    output, results = demo
    problem = PROBLEMS["inactive_relu"]
    observed = next(r for r in results if r.problem is problem).losses["baseline"]
    torch.manual_seed(CONFIG.seed)
    model = problem.build_model("baseline")
    captured: list[np.ndarray] = []
    model.act.register_forward_hook(  # type: ignore[union-attr]
        lambda m, a, out: captured.append(out.detach().double().numpy())
    )
    assert train(problem, "baseline", model, CONFIG) == observed
    recorded = series(history(output, "inactive_relu", "baseline"), "act", "output", "std")
    assert recorded.height == SAMPLES
    assert len(captured) == STEPS
    for sample_id, forward_index, value in recorded.iter_rows():
        assert value == pytest.approx(np.std(captured[forward_index]), rel=1e-5), sample_id
    assert len(make_batches(CONFIG)) == STEPS


def test_comparison_csv_keeps_gaps(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    frame = pl.read_csv(output / "detached" / "comparison.csv")
    assert {"problem", "variant", "sample_id", "series", "value", "after_onset"} <= set(
        frame.columns
    )
    samples = len(range(0, STEPS, SAMPLE_EVERY))
    assert frame.height == len(VARIANTS) * len(PROBLEMS["detached"].panels) * samples
    trunk = frame.filter(
        (pl.col("series") == "trunk.0 output_gradient std") & (pl.col("variant") == "broken")
    )
    assert trunk.filter(pl.col("after_onset"))["value"].null_count() == samples - 4
    assert trunk.filter(~pl.col("after_onset"))["value"].null_count() == 0


def test_evidence_table(demo: tuple[Path, list[ProblemResult]]) -> None:
    _, results = demo
    detached = next(r for r in results if r.problem.name == "detached")
    row = detached.table.filter(
        (pl.col("series") == "trunk.0 output_gradient std") & (pl.col("variant") == "broken")
    )
    assert row["measured_after"].item() == "0/16"
    assert row["after_onset"].item() is None
    assert detached.onset_sample == 4


def test_plots_are_readable_pngs(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    for name, problem in PROBLEMS.items():
        path = output / name / "comparison.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = mpimg.imread(path)
        height, width = image.shape[:2]
        assert width >= 600
        assert height >= 250 * len(problem.panels)
        assert image[..., :3].std() > 0.05, "the image is not blank"


def test_refuses_an_output_that_holds_runs(demo: tuple[Path, list[ProblemResult]]) -> None:
    output, _ = demo
    with pytest.raises(SystemExit, match="already holds runs"):
        main(["--output", str(output), "--quiet", "--problem", "detached"])


def test_rejects_too_few_steps(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="steps must be >= 25"):
        main(["--output", str(tmp_path), "--steps", "10", "--quiet"])


def test_plot_draws_gaps_and_onset(demo: tuple[Path, list[ProblemResult]]) -> None:
    """Missing gradients are NaN in the drawn line (a gap), never zero; the onset is marked."""
    _, results = demo
    detached = next(r for r in results if r.problem.name == "detached")
    fig = draw_comparison(
        detached.series,
        detached.problem.panels,
        title="detached",
        onset_sample=detached.onset_sample,
        onset_step=ONSET_STEP,
        sample_every=SAMPLE_EVERY,
    )
    trunk_axes = fig.axes[0]
    lines = {line.get_label(): line for line in trunk_axes.get_lines()}
    broken_x = np.asarray(lines["broken"].get_xdata(), dtype=float)
    broken_y = np.asarray(lines["broken"].get_ydata(), dtype=float)
    assert np.isnan(broken_y[broken_x >= 4]).sum() == SAMPLES - HEALTHY_SAMPLES
    assert np.isfinite(broken_y[broken_x < 4]).sum() == HEALTHY_SAMPLES
    assert len(broken_y) == SAMPLES
    assert np.isfinite(np.asarray(lines["baseline"].get_ydata(), dtype=float)).sum() == SAMPLES
    onset = lines[f"fault onset (step {ONSET_STEP})"]
    assert list(onset.get_xdata()) == [4, 4]
    assert "no value at samples 4-19" in trunk_axes.get_title()
    assert trunk_axes.get_yscale() == "log"
    assert trunk_axes.get_ylabel()
    assert fig.axes[-1].get_xlabel().startswith("sample_id")
    legend = trunk_axes.get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} >= {"baseline", "broken", "fixed"}


def test_prints_evidence_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --quiet: a header and a Polars evidence table per experiment, then a summary."""
    main(["--output", str(tmp_path / "out"), "--steps", "25", "--problem", "detached"])
    printed = capsys.readouterr().out
    assert "== detached (fault from step 20 = sample 4)" in printed
    assert "measured_after" in printed
    trunk_broken = [
        line
        for line in printed.splitlines()
        if "trunk.0 output_gradient std" in line and "broken" in line
    ]
    assert len(trunk_broken) == 1
    assert "0/1" in trunk_broken[0]
    assert f"Artifacts of 3 runs under {tmp_path / 'out'}" in printed


def test_each_fault_shows_in_its_compare_table(demo: tuple[Path, list[ProblemResult]]) -> None:
    """``ti_io.compare_runs`` (what ``ti compare`` prints) on each experiment's three runs, with
    the onset at the first faulty sample: the broken run's row carries the fault, the others'
    do not."""
    output, _ = demo
    onset = ONSET_STEP // SAMPLE_EVERY  # sample ids 0..3 are healthy

    def rows(problem: str, layer: str, signal: str, metric: str) -> dict[str, dict[str, object]]:
        table = compare_runs(
            {variant: output / problem / variant for variant in VARIANTS},
            layer=layer,
            signal=signal,
            metric=metric,
            onset=onset,
        ).filter(pl.col("call_index") == 0, pl.col("tensor_path") == "", pl.col("mode") == "train")
        assert table.get_column("run").to_list() == list(VARIANTS)
        return {row["run"]: row for row in table.iter_rows(named=True)}

    dead = rows("inactive_relu", "act", "output", "zero_fraction")
    assert dead["broken"]["after_mean"] == 1.0
    assert all(dead[v]["after_mean"] < 0.9 for v in ("baseline", "fixed"))

    saturated = rows("saturation", "fc1", "output_gradient", "std")
    assert saturated["broken"]["after_mean"] < 0.1 * saturated["broken"]["before_mean"]
    assert saturated["broken"]["after_ratio"] < 0.1  # against the baseline, same samples
    assert saturated["fixed"]["after_mean"] > 0.3 * saturated["fixed"]["before_mean"]

    grown = rows("scale_growth", "fc2", "output", "std")
    assert grown["broken"]["latest_ratio"] > 1e3
    assert grown["fixed"]["latest"] < 10 * grown["fixed"]["before_mean"]

    nonfinite = rows("nonfinite", "standardize", "output", "nonfinite_fraction")
    assert nonfinite["broken"]["after_mean"] == pytest.approx(1 / 16)
    assert nonfinite["baseline"]["after_mean"] == nonfinite["fixed"]["after_mean"] == 0.0

    detached = rows("detached", "trunk.0", "output_gradient", "std")
    broken = detached["broken"]
    assert broken["samples_after"] > 0
    assert broken["measured_after"] == 0  # no gradient row after the detach, listed not dropped
    assert broken["before_mean"] is not None
    for variant in ("baseline", "fixed"):
        assert detached[variant]["measured_after"] == detached[variant]["samples_after"]
