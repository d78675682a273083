"""A tiny GPT-2 (built from a config, no download) trained a few steps under TorchInstruments.

    python examples/transformer_tiny.py --output runs/transformer

Needs the transformers extra: pip install "ti-examples[transformers]".
"""

import argparse
from pathlib import Path

import polars as pl

from ti_examples.transformer_tiny import run_transformer_tiny
from ti_io import scan_history

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/transformer"))
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    result = run_transformer_tiny(args.output, steps=args.steps)
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} over {args.steps} steps")
    paths = (
        scan_history(result.stats_dir)
        .filter(pl.col("metric") == "std")
        .group_by("layer", "module_type", "signal", "tensor_path")
        .agg(samples=pl.col("sample_id").n_unique())
        .sort("layer", "signal", "tensor_path")
        .collect()
    )
    with pl.Config(tbl_rows=100, fmt_str_lengths=60):
        print(paths)
