"""Lightning on scikit-learn's handwritten digits, observed with TorchInstruments.

    python examples/lightning_digits.py --output runs/digits
    tensorboard --logdir runs/digits/lightning

Needs the lightning extra: pip install "ti-examples[lightning]".
"""

import argparse
from pathlib import Path

from ti_examples.lightning_digits import run_lightning_digits

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/digits"))
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    result = run_lightning_digits(args.output, epochs=args.epochs, progress_bar=True)
    print(f"test accuracy {result.test_accuracy:.3f} on {result.test_size} held-out digits")
    print(f"artifacts: {result.stats_dir}\nTensorBoard logger: {result.logger_dir}")
