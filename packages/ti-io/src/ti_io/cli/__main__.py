"""``python -m ti_io.cli``: the ``ti`` command."""

from __future__ import annotations

import sys

from ti_io.cli import main

sys.exit(main())
