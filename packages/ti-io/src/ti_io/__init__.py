"""ti_io."""
