"""``make demo``: train small models with torchpipe on CPU and show the schedules."""
from __future__ import annotations

import argparse
import os

from . import dlrm, mlp, unet


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m torchpipe.demo")
    parser.add_argument("--out", default="out", help="folder for Chrome traces (default: ./out)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mlp.run(args.out, steps=args.steps)
    unet.run()
    dlrm.run()


if __name__ == "__main__":
    main()
