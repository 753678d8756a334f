"""Plot a training run: python scripts/plot_run.py RUN_DIR

Reads RUN_DIR/metrics.jsonl and writes PNGs (reward, kl, value, response, lr, accuracy, overview)
into RUN_DIR/plots/ (or --out_dir), printing each written path. The plotting lives in
trainer/run/plots.py so the trainer can call it at the end of a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.run.plots import plot_run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="directory holding metrics.jsonl")
    parser.add_argument("--out_dir", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out_dir)
    except ValueError as e:
        raise SystemExit(f"plot_run: {e}") from None
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
