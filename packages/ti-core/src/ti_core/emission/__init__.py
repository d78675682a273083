"""Emission: from an ended signal to records in every sink, inline or on a worker thread.

Knows nothing of hooks, sampling or capture: what it receives is defined one floor down
(:mod:`ti_core.reduction.ended`). Modules, in the order a signal passes through them:

- :mod:`~ti_core.emission.emitters`: ``Emitter`` and its two implementations, inline and
  background (which one an observer uses is decided once, at attach).
- :mod:`~ti_core.emission.worker`: the background thread, its bounded queue, fork handling.
- :mod:`~ti_core.emission.writer`: ``SignalWriter`` (reduce an ended signal, build the record
  batches, write).
- :mod:`~ti_core.emission.records`: the ``ti.history`` / ``ti.histograms`` record batches.
- :mod:`~ti_core.emission.sinks`: ``SinkFanout`` (every write and the one close of each sink)
  and ``read_capabilities`` (what each sink declares through ti-schema's
  ``SinkCapabilities``, read once per run).
"""
