"""ti_core."""
