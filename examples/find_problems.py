"""Reproduce six training faults and find them in TorchInstruments artifacts.

    python examples/find_problems.py --output runs/demo

See examples/README.md for what each experiment breaks, what shows it and what fixes it.
"""

from ti_examples.cli import main

if __name__ == "__main__":
    main()
