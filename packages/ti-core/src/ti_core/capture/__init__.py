"""Capture: what happens on the training thread while a sampled forward or its backward runs.

Knows nothing of sinks, of emission or of when sampling happens (that is the gate,
:mod:`ti_core.gate`). It fills the batches of :mod:`ti_core.reduction.batch` and hands each
ended signal over as :mod:`ti_core.reduction.ended` defines. Modules, from the hooks torch
calls down to the tensors they keep:

- :mod:`~ti_core.capture.hooks`: the hook objects (root, per-module, ``forward`` overrides),
  the small protocol they call (``CaptureTarget``), and what their copies become.
- :mod:`~ti_core.capture.sample`: one sampled root forward and the recording of each call.
- :mod:`~ti_core.capture.traced_calls`: the same recording, for a call in a compiled graph.
- :mod:`~ti_core.capture.gradients`: output gradients matched to their sample and call.
- :mod:`~ti_core.capture.attention`: the attention logits of a sampled forward's
  ``scaled_dot_product_attention`` calls.
- :mod:`~ti_core.capture.parameters`: the opt-in parameter signals of a sample (which
  parameters, their values), with :mod:`~ti_core.capture.parameter_gradients` (their ``.grad``
  after the sample's backward), :mod:`~ti_core.capture.updates` (what the next optimizer step
  changes) and :mod:`~ti_core.capture.measured` (an entry measured on a tensor).

Shared with the flight recorder, one floor down: :mod:`ti_core.tensor_paths` (the
``tensor_path`` of each tensor in an output), :mod:`ti_core.call_context` (time stamps,
backward and checkpoint detection), :mod:`ti_core.reduction.sharding` (DTensor and other
subclasses: what is measured).
"""
