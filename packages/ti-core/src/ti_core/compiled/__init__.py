"""Capture inside ``torch.compile`` graphs (``fullgraph=True`` included), without graph breaks.

Compiled code runs no Python between kernels, so the hooks of :mod:`ti_core.capture.hooks` have
two paths: eager (the gate's own capture) and *traced*, which Dynamo inlines into the graph it
builds. Modules, from trace time to run time:

- :mod:`~ti_core.compiled.operators`: the runtime protocol between a compiled graph and its
  observer: five effectful custom operators (namespace ``ti``), the :class:`Tap` autograd
  function that reports an output's gradient, and the registry through which traced code
  reaches an observer's gate by integer key.
- :mod:`~ti_core.compiled.traced`: what the hooks do while Dynamo traces them: read the
  sampling decision (Dynamo guards on it: one cached graph per decision), walk the output's
  tensors and put the operators into the graph.
- :mod:`~ti_core.compiled.sites`: the tensor paths of each traced output, numbered at trace
  time.

Below :mod:`ti_core.capture` (whose hooks take the traced path), it imports nothing of it:
what ``record_call`` does at run time (the same entries, snapshots, gradient bookkeeping and
coverage gaps as eager capture, in the running sample) is :mod:`ti_core.capture.traced_calls`.
The gate (:mod:`ti_core.gate`) owns the decision and every hook; docs/capture.md
("torch.compile") says what is supported and what it costs.
"""
