"""ti_examples: reproducible TorchInstruments debugging experiments and real-data runs.

Modules, each importable on its own so optional dependencies load only when used:

- ``problems``: the five faults (``PROBLEMS``), their fixes and evidence panels;
- ``training``: the deterministic matched-run harness (``ExperimentConfig``, ``run_variant``);
- ``evidence`` / ``plotting``: series, tables, ``comparison.csv`` and ``comparison.png`` read
  back from ``history.parquet``;
- ``experiments`` / ``cli``: ``run_problem`` and the ``find_problems`` command;
- ``lightning_digits`` (extra ``lightning``) and ``transformer_tiny`` (extra ``transformers``).
"""
