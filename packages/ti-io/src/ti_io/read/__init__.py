"""Reading and comparing runs (Polars).

``history`` opens a run's rows (``scan_history``), ``frames`` turns a path or a frame into a
LazyFrame of plain strings, ``ordering`` and ``filters`` are the one row order and the one
layer/signal/metric selection every reader uses, ``aggregates`` computes result.json's
statistics from rows, ``summary`` and ``compare`` answer ``ti summary`` and ``ti compare``,
``plot`` draws compared series, ``legacy_layout`` recognizes a torchinstruments 0.8.0 run.
"""
