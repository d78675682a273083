"""Reading at scale: every reader of a long run, its time and peak RSS, beside DuckDB.

Builds runs with the project's own writer, then runs each reader in a fresh process and records
its wall time and the peak RSS of the whole process (``os.wait4``), next to DuckDB (same thread
count) computing the same aggregation over the same files:

- one rank, for each ``--sizes`` (default 21.6M and 216M rows): a real training run (50 blocks
  of ``Linear(64, 64)`` + ``Tanh``, every forward sampled: 1,800 history rows per sample) grown
  to the size by repeating its samples with shifted sample ids through a ``DirectorySink``;
  ``remove_observer``'s finalization (the sink's ``close()``, timed in the writing process),
  ``ti consolidate`` (a hard-linked copy of the parts taken before ``close()``: a killed run),
  ``ti summary --csv``, ``ti compare --csv`` (the run against the consolidated copy),
  ``ti report`` (one run's page) and ``ti validate``;
- every rank writing, ``--ranks`` (default 64 ranks x 3.4M rows): the same model with the
  ``parameter`` signal, each rank's outputs and gradients its own, its parameters the replicas'
  (DDP); ``ti drift``, ``ti_dist.compare_ranks(metric="std")`` and ``combine_shards`` (a DDP run
  holds no sharded tensor: the scan is the cost).

References: DuckDB's ``GROUP BY`` with ``quantile_cont`` / ``max_by`` (summary), a full join of
the two runs by measurement and sample (compare), the heat maps' cells per column of samples
(report), ``COPY`` of the parts into one Parquet file and
the summary aggregation (consolidate and finalization), the replica-drift and cross-rank
aggregations (drift, compare_ranks); for ``ti validate``, pyarrow reading every page of every
file once with checksums verified. A reference that fails (DuckDB out of memory) says so.

    python benchmarks/reading.py                              # 21.6M, 216M, 64 ranks x 3.4M
    python benchmarks/reading.py --sizes 21.6M --ranks none   # one size
    python benchmarks/reading.py --sizes 200k --ranks 3x40k   # the smoke size of the tests

Needs the ``bench`` dependency group (duckdb, psutil). ``--workdir`` keeps the runs (else a
temporary directory, removed); ``--output`` writes the table as CSV too.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED_STEPS = 40
BLOCKS = 50
WIDTH = 64
THREADS = str(len(os.sched_getaffinity(0)))
HERE = Path(__file__).resolve()


# --- building runs (in their own processes: `reading.py _build ...`) ----------------------------


def _seed(signals: tuple[str, ...]) -> tuple[Any, Any]:
    """A real training run's RunInfo and history rows (``SEED_STEPS`` samples)."""
    import torch
    from torch import nn

    from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer

    torch.manual_seed(0)
    layers = [m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    model = nn.Sequential(*layers)
    sink = MemorySink()
    inject_observer(model, sink=sink, output_dir=None, sampler=AlwaysSampler(), signals=signals)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, WIDTH)
    for _ in range(SEED_STEPS):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    return sink.run, sink.table()


def _grown(table: Any, rows: int, rank: int | None, ranks: int) -> Any:
    """Batches of ``table`` repeated with shifted sample ids and forward indices until
    ``rows`` rows; with ``rank``, each rank's outputs and gradients scaled apart."""
    import pyarrow as pa
    import pyarrow.compute as pc

    samples = int(pc.max(table["sample_id"]).as_py()) + 1
    if rank is not None:
        table = table.set_column(
            table.schema.get_field_index("rank"),
            "rank",
            pa.array([rank] * table.num_rows, pa.int32()),
        )
        own = pc.is_in(table["signal"], pa.array(["output", "output_gradient"]))
        scaled = pc.if_else(
            own, pc.multiply(table["value"], 1.0 + rank / max(ranks, 1)), table["value"]
        )
        table = table.set_column(table.schema.get_field_index("value"), "value", scaled)
    written, shift = 0, 0
    while written < rows:
        for batch in table.to_batches(max_chunksize=1 << 20):
            for name in ("sample_id", "forward_index"):
                at = batch.schema.get_field_index(name)
                batch = batch.set_column(at, name, pc.add(batch[name], shift))
            if written + batch.num_rows > rows:
                batch = batch.slice(0, rows - written)
            yield batch
            written += batch.num_rows
            if written >= rows:
                return
        shift += samples


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_run(out: Path, rows: int, killed: Path) -> None:
    """One rank's run of ``rows`` rows in ``out``; the parts, before finalization, hard-linked
    into ``killed`` (a run whose writer was killed); prints close()'s seconds and peak RSS."""
    from ti_io import DirectorySink, HistoryConfig

    info, table = _seed(("output", "output_gradient"))
    sink = DirectorySink(out, history_config=HistoryConfig())
    sink.open(info)
    for batch in _grown(table, rows, None, 1):
        sink.write_history(batch)
    sink.flush()
    shutil.copytree(out, killed, copy_function=os.link)
    before = _peak_mb()
    start = time.perf_counter()
    sink.close()
    seconds = time.perf_counter() - start
    print(json.dumps({"close_s": seconds, "peak_mb": _peak_mb(), "peak_before_close_mb": before}))


def build_ranks(out: Path, ranks: int, rows: int) -> None:
    """Every rank's finalized run of ``rows`` rows under ``out/rank-NNN``."""
    from dataclasses import replace

    from ti_io import DirectorySink, HistoryConfig

    info, table = _seed(("output", "output_gradient", "parameter"))
    for rank in range(ranks):
        sink = DirectorySink(out / f"rank-{rank:03d}", history_config=HistoryConfig())
        sink.open(replace(info, rank=rank, world_size=ranks))
        for batch in _grown(table, rows, rank, ranks):
            sink.write_history(batch)
        sink.close()


# --- measuring -----------------------------------------------------------------------------------


@dataclass
class Measured:
    size: str
    command: str
    seconds: float | None
    peak_mb: float | None
    reference: str = ""
    reference_seconds: float | None = None
    reference_peak_mb: float | None = None
    note: str = ""


def _run(argv: list[str], *, cwd: Path | None = None) -> tuple[float, float, str, int]:
    """Seconds, peak RSS (MB) of the whole process, stdout+stderr tail, exit status."""
    start = time.perf_counter()
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, text=True
    )
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss / 1024, output[-2000:], process.returncode


def _ti(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from ti_io.cli import main; sys.exit(main())", *args]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _duckdb(*statements: str) -> list[str]:
    """DuckDB (``THREADS`` threads, spilling to the temporary directory) running
    ``statements``, the last one's rows fetched."""
    spill = Path(tempfile.gettempdir()) / "ti-duckdb"
    code = (
        "import duckdb, sys\n"
        "c = duckdb.connect()\n"
        f"c.execute('SET threads={THREADS}')\n"
        "c.execute(\"SET memory_limit='16GB'\")\n"  # keeps the machine alive; ti holds 1 GB
        f"c.execute(\"SET temp_directory='{spill}'\")\n"
        "for statement in sys.argv[1:-1]: c.execute(statement)\n"
        "print(len(c.sql(sys.argv[-1]).fetchall()), 'rows')\n"
    )
    return [sys.executable, "-c", code, *statements]


_KEYS = "layer, call_index, signal, tensor_path, mode, grad_enabled, metric"


def summary_query(files: str, window: int) -> str:
    """DuckDB: ``ti summary``'s aggregation (and result.json's) over ``files``."""
    return f"""
SELECT {_KEYS}, max(sample_id) latest_sample, arg_max(value, sample_id) latest,
  count(value) observations, count(*) - count(value) unavailable, avg(value) mean,
  stddev_pop(value) std, min(value) min, quantile_cont(value, 0.25) p25,
  quantile_cont(value, 0.5) p50, quantile_cont(value, 0.75) p75, max(value) max,
  list_avg(list_slice(max_by(value, sample_id, {2 * window}) FILTER (WHERE value IS NOT NULL),
    {window + 1}, {2 * window})) previous_window_mean,
  list_avg(max_by(value, sample_id, {window}) FILTER (WHERE value IS NOT NULL))
    recent_window_mean
FROM read_parquet('{files}') GROUP BY ALL"""


def compare_query(first: str, second: str, window: int) -> str:
    """DuckDB: ``ti compare``'s aggregation of two runs (aligned by sample id)."""
    return f"""
WITH a AS (SELECT {_KEYS}, sample_id, value AS va FROM read_parquet('{first}')),
b AS (SELECT {_KEYS}, sample_id, value AS vb FROM read_parquet('{second}')),
shared AS (SELECT DISTINCT sample_id FROM a INTERSECT SELECT DISTINCT sample_id FROM b),
g AS (SELECT * FROM a FULL JOIN b USING ({_KEYS}, sample_id) SEMI JOIN shared USING (sample_id))
SELECT {_KEYS}, count(*) samples, count(va) measured_a, count(vb) measured_b,
  max(sample_id) latest_sample, arg_max(va, sample_id) latest_a, arg_max(vb, sample_id) latest_b,
  list_avg(max_by(va, sample_id, {window})) recent_a,
  list_avg(max_by(vb, sample_id, {window})) recent_b,
  list_avg(list_slice(max_by(va, sample_id, {2 * window}), {window + 1}, {2 * window}))
    previous_a,
  list_avg(list_slice(max_by(vb, sample_id, {2 * window}), {window + 1}, {2 * window}))
    previous_b
FROM g GROUP BY ALL"""


def report_query(files: str, columns: int = 400) -> str:
    """DuckDB: ``ti report``'s reduction (the min, max and mean of each tensor's output and
    output-gradient std per column of consecutive samples) over ``files``."""
    return f"""
        WITH ids AS (SELECT DISTINCT sample_id FROM read_parquet('{files}')),
        columns AS (
            SELECT sample_id, (row_number() OVER (ORDER BY sample_id) - 1) * {columns}
                // count(*) OVER () AS col
            FROM ids
        )
        SELECT layer, call_index, signal, tensor_path, mode, grad_enabled, metric, col,
               min(value), max(value), avg(value)
        FROM read_parquet('{files}') JOIN columns USING (sample_id)
        WHERE signal IN ('output', 'output_gradient')
          AND metric IN ('std', 'nonfinite_fraction') AND isfinite(value)
        GROUP BY ALL
    """


def drift_query(files: str) -> str:
    """DuckDB: ``replica_drift``'s aggregation (the value most ranks hold, who differs)."""
    key = "forward_index, signal, layer, tensor_path, metric"
    return f"""
WITH r AS (SELECT {key}, rank, value FROM read_parquet('{files}') WHERE signal = 'parameter'),
held AS (SELECT {key}, value, count(*) n, min(rank) lowest FROM r GROUP BY ALL),
reference AS (SELECT {key}, arg_max(value, n * 100000 - lowest) reference FROM held GROUP BY ALL)
SELECT {key}, count(*) n_ranks, count(*) FILTER (WHERE r.value IS DISTINCT FROM reference)
  differing, min(r.value), max(r.value), list(rank ORDER BY rank), list(r.value ORDER BY rank)
FROM r JOIN reference USING ({key}) GROUP BY ALL"""


def ranks_query(files: str) -> str:
    """DuckDB: ``compare_ranks(metric="std")``'s aggregation (median, MAD, min and max)."""
    key = "layer, call_index, signal, tensor_path, metric, sample_id"
    return f"""
WITH r AS (SELECT {key}, rank, value FROM read_parquet('{files}') WHERE metric = 'std'),
m AS (SELECT {key}, median(value) median FROM r GROUP BY ALL),
d AS (SELECT r.*, median, abs(value - median) deviation FROM r JOIN m USING ({key}))
SELECT {key}, count(*) n_ranks, min(value), max(value), any_value(median),
  median(deviation) mad, list(rank ORDER BY rank), list(value ORDER BY rank)
FROM d GROUP BY ALL"""


def validate_reference(run: Path) -> list[str]:
    """pyarrow reading every page of every Parquet file of ``run`` once, checksums verified."""
    code = (
        "import sys, pathlib, pyarrow.parquet as pq\n"
        "for path in sorted(pathlib.Path(sys.argv[1]).rglob('*.parquet')):\n"
        "    f = pq.ParquetFile(path, page_checksum_verification=True)\n"
        "    for i in range(f.metadata.num_row_groups): f.read_row_group(i)\n"
    )
    return [sys.executable, "-c", code, str(run)]


def _measure(
    size: str,
    command: str,
    argv: list[str],
    reference: str = "",
    reference_argv: list[str] | None = None,
) -> Measured:
    seconds, peak, output, status = _run(argv)
    row = Measured(size, command, seconds, peak)
    if status:
        row.note = f"failed ({status}): {output.strip().splitlines()[-1] if output.strip() else ''}"
    if reference_argv is not None:
        ref_seconds, ref_peak, ref_output, ref_status = _run(reference_argv)
        row.reference = reference
        row.reference_seconds, row.reference_peak_mb = ref_seconds, ref_peak
        if ref_status:
            last = ref_output.strip().splitlines()
            row.note += f" reference failed ({ref_status}): {last[-1][:120] if last else ''}"
    _print_row(row)
    return row


def _print_row(row: Measured) -> None:
    ratio = (
        f"{row.seconds / row.reference_seconds:.2f}x"
        if row.seconds and row.reference_seconds and "reference failed" not in row.note
        else "-"
    )
    ref = (
        f"{row.reference} {row.reference_seconds:.2f} s {row.reference_peak_mb:.0f} MB"
        if row.reference_seconds is not None
        else "-"
    )
    seconds = f"{row.seconds:.2f} s" if row.seconds is not None else "-"
    peak = f"{row.peak_mb:.0f} MB" if row.peak_mb is not None else "-"
    print(
        f"| {row.size} | {row.command} | {seconds} | {peak} | {ref} | {ratio} | {row.note} |",
        flush=True,
    )


def one_rank(work: Path, label: str, rows: int) -> list[Measured]:
    run, killed = work / f"run-{label}", work / f"killed-{label}"
    consolidated = killed  # once `ti consolidate` finished it
    start = time.perf_counter()
    built = subprocess.run(
        [sys.executable, str(HERE), "_build", "run", str(run), str(rows), str(killed)],
        capture_output=True,
        text=True,
        check=True,
    )
    facts = json.loads(built.stdout.strip().splitlines()[-1])
    print(f"built {label} ({rows} rows) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    window = 20
    history = str(run / "history.parquet")
    # The reference reads its own links to the parts: `ti consolidate` retires them.
    shutil.copytree(killed, work / f"duck-{label}", copy_function=os.link)
    parts = str(work / f"duck-{label}" / "history.parts" / "*.parquet")
    measured = [
        Measured(
            label,
            "finalization (remove_observer: the sink's close())",
            facts["close_s"],
            facts["peak_mb"],
            note=f"whole writing process; {facts['peak_before_close_mb']:.0f} MB before close()",
        )
    ]
    _print_row(measured[0])
    measured.append(
        _measure(
            label,
            "ti consolidate (killed run)",
            _ti("consolidate", str(killed), "--no-progress"),
            "DuckDB COPY parts + summary",
            _duckdb(
                f"COPY (SELECT * FROM read_parquet('{parts}')) TO '{work}/duck-{label}.parquet' "
                "(FORMAT parquet, COMPRESSION zstd)",
                summary_query(f"{work}/duck-{label}.parquet", window),
            ),
        )
    )
    measured.append(
        _measure(
            label,
            "ti summary --csv",
            _ti("summary", str(run), "--csv"),
            "DuckDB summary",
            _duckdb(summary_query(history, window)),
        )
    )
    measured.append(
        _measure(
            label,
            "ti compare --csv (two runs)",
            _ti("compare", str(run), str(consolidated), "--csv"),
            "DuckDB compare",
            _duckdb(compare_query(history, str(consolidated / "history.parquet"), window)),
        )
    )
    page = work / f"report-{label}.html"
    measured.append(
        _measure(
            label,
            "ti report (one run)",
            _ti("report", str(run), "-o", str(page), "--no-progress"),
            "DuckDB heat-map cells",
            _duckdb(report_query(history)),
        )
    )
    measured[-1].note += f" page {page.stat().st_size / 1e6:.1f} MB" if page.is_file() else ""
    measured.append(
        _measure(
            label,
            "ti validate",
            _ti("validate", str(run)),
            "pyarrow, every page once",
            validate_reference(run),
        )
    )
    return measured


def all_ranks(work: Path, label: str, ranks: int, rows: int, reuse: bool) -> list[Measured]:
    run = work / f"ranks-{label}"
    if not (reuse and run.is_dir()):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, str(HERE), "_build", "ranks", str(run), str(ranks), str(rows)],
            check=True,
        )
        print(f"built {label} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    files = str(run / "rank-*" / "history.parquet")
    return [
        _measure(
            label, "ti drift", _ti("drift", str(run)), "DuckDB drift", _duckdb(drift_query(files))
        ),
        _measure(
            label,
            'compare_ranks(metric="std", only_standouts=True)',
            _python(
                "import sys; from ti_dist import compare_ranks; "
                f"print(compare_ranks({str(run)!r}, metric='std', only_standouts=True).height)"
            ),
            "DuckDB compare_ranks",
            _duckdb(ranks_query(files)),
        ),
        _measure(
            label,
            "combine_shards",
            _python(
                f"from ti_dist import combine_shards; print(combine_shards({str(run)!r}).height)"
            ),
        ),
    ]


def _count(text: str) -> int:
    scale = {"k": 1_000, "M": 1_000_000, "G": 1_000_000_000}
    suffix = text[-1]
    return int(float(text[:-1]) * scale[suffix]) if suffix in scale else int(text)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        kind, out, *rest = sys.argv[2:]
        if kind == "run":
            build_run(Path(out), int(rest[0]), Path(rest[1]))
        else:
            build_ranks(Path(out), int(rest[0]), int(rest[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="21.6M,216M", help="history rows of one rank")
    parser.add_argument("--ranks", default="64x3.4M", help="RANKSxROWS, or none")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: temporary)")
    parser.add_argument("--output", type=Path, help="also write the table as CSV")
    parser.add_argument(
        "--reuse", action="store_true", help="measure the runs --workdir holds instead of building"
    )
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ti-reading-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"reading.py: {platform.node()}, {THREADS} cores, Python {platform.python_version()}; "
        f"runs in {work}"
    )
    print("| size | command | time | peak RSS | reference | ratio | note |")
    print("|---|---|---|---|---|---|---|")
    rows: list[Measured] = []
    try:
        for size in [s for s in args.sizes.split(",") if s and s != "none"]:
            rows += one_rank(work, size, _count(size))
        if args.ranks != "none":
            count, per_rank = args.ranks.split("x")
            rows += all_ranks(work, args.ranks, int(count), _count(per_rank), args.reuse)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.output is not None:
        with args.output.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(Measured.__dataclass_fields__)
            writer.writerows([list(vars(row).values()) for row in rows])


if __name__ == "__main__":
    main()
