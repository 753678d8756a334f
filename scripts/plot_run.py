"""Plot a training run: python scripts/plot_run.py RUN_DIR

Reads RUN_DIR/metrics.jsonl and writes PNGs (reward, kl, value, response, lr, accuracy, overview)
into RUN_DIR/plots/ (or --out_dir), printing each written path. With --keys K1 K2 ... --out FILE it
writes one PNG of just those metrics side by side (e.g. a figure for the docs). The plotting lives in
trainer/run/plots.py so the trainer can call it at the end of a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.run.plots import plot_keys, plot_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="directory holding metrics.jsonl")
    parser.add_argument("--out_dir", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    parser.add_argument("--keys", nargs="+", default=None,
                        help="only these metrics, in one PNG (needs --out), e.g. eval/ifeval_pass_rate reward/ifeval kl_ref")
    parser.add_argument("--out", type=Path, default=None, help="the PNG --keys writes")
    parser.add_argument("--title", default=None, help="title of the --keys figure (default: the run directory's name)")
    args = parser.parse_args(argv)
    if (args.keys is None) != (args.out is None):
        raise SystemExit("plot_run: --keys and --out go together (one PNG of the chosen metrics)")
    try:
        paths = [plot_keys(args.run_dir, args.keys, args.out, args.title)] if args.keys else plot_run(args.run_dir, args.out_dir)
    except ValueError as e:
        raise SystemExit(f"plot_run: {e}") from None
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
