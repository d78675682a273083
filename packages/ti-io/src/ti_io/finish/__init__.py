"""Finishing runs: the final files, written by the sink's close and by ``ti consolidate``.

``consolidate`` merges the parts into ``history.parquet`` / ``histograms.parquet`` under the
crash-safe protocol of ``journal``, from the ``digest`` built while streaming; it renders
``result_json`` (its statistics in ``statistics``) and ``index_md``. ``upgrade`` converts a run
written by torchinstruments 0.8.0 into a finished run of today's contract.
"""
