"""ti_dist."""
