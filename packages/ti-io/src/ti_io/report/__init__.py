"""``ti report``: a self-contained HTML page of one or more runs (needs the extra ``report``).

``grid`` reduces a run's history to cells a page can draw (bounded memory, no plotting
library); ``figures`` draws them with Plotly; ``page`` lays out the page and writes it.
Importing :func:`write_report` without plotly raises an ImportError naming the extra:
``pip install "ti-io[report]"``.
"""

from ti_io.report.page import DEFAULT_COLUMNS, write_report

__all__ = ["DEFAULT_COLUMNS", "write_report"]
