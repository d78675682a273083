"""ti_examples."""
