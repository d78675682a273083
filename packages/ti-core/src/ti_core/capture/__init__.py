"""Capture: what happens on the training thread while a sampled forward or its backward runs.

Knows nothing of sinks or of when sampling happens (that is the gate, :mod:`ti_core.gate`).
Modules, from the hooks torch calls down to the tensors they keep:

- :mod:`~ti_core.capture.hooks`: the hook objects (root, per-module, ``forward`` overrides),
  the small protocol they call (``CaptureTarget``), and what their copies become.
- :mod:`~ti_core.capture.sample`: one sampled root forward and the recording of each call.
- :mod:`~ti_core.capture.traced_calls`: the same recording, for a call in a compiled graph.
- :mod:`~ti_core.capture.ended`: the one hand-over of what capture measured: an
  ``EndedSignal`` given to a ``SignalTarget`` (the observer).
- :mod:`~ti_core.capture.gradients`: output gradients matched to their sample and call.
- :mod:`~ti_core.capture.paths`: the ``tensor_path`` of each tensor in an output.
- :mod:`~ti_core.capture.batch`: a signal's snapshots, reduced in batches (``TensorBatch``).
- :mod:`~ti_core.capture.snapshots`: recycled snapshot buffers.
- :mod:`~ti_core.capture.context`: time stamps, backward and checkpoint detection.
- :mod:`~ti_core.capture.parameters`: the opt-in parameter signals of a sample (which
  parameters, their values), with :mod:`~ti_core.capture.parameter_gradients` (their ``.grad``
  after the sample's backward), :mod:`~ti_core.capture.updates` (what the next optimizer step
  changes), :mod:`~ti_core.capture.measured` (an entry measured on a tensor) and
  :mod:`~ti_core.capture.sharding` (DTensor parameters: the local shard).
"""
