"""A tiny GPT-2 (built from a config, no download) trained by transformers.Trainer, observed by
ti-trainers' HFObserverCallback.

    python examples/hf_trainer_tiny.py --output runs/hf_trainer

Needs the transformers extra: pip install "ti-examples[transformers]".
"""

import argparse
from pathlib import Path

import polars as pl

from ti_examples.hf_trainer_tiny import run_hf_trainer_tiny
from ti_io import scan_history

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/hf_trainer"))
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    result = run_hf_trainer_tiny(args.output, steps=args.steps)
    print(
        f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}; artifacts in {result.stats_dir}"
    )
    per_layer = (
        scan_history(result.stats_dir)
        .filter(pl.col("metric") == "std", pl.col("tensor_path") == "")
        .group_by("layer", "signal")
        .agg(samples=pl.col("sample_id").n_unique(), last_std=pl.col("value").last())
        .sort("layer", "signal")
        .collect()
    )
    with pl.Config(tbl_rows=100, fmt_str_lengths=60):
        print(per_layer)
