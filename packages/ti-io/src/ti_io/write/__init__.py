"""Writing a run: what a training process runs, without Polars.

``directory_sink`` (the ``ti.sinks`` ``directory`` entry point) checks batches and hands them
to ``parts`` (the background part writer), which publishes Parquet parts and TensorBoard events
(``tensorboard_sink``, ``tags``). Closing the sink finalizes through :mod:`ti_io.finish`,
imported only then. What both sides share sits at the top of the package: ``config``,
``errors``, ``facts`` (run.json and the catalog), ``publishing`` (atomic files) and
``encoding`` (how Parquet files store strings).
"""
