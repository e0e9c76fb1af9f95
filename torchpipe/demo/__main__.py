"""``make demo``: train small models with torchpipe on CPU and show the schedules."""
from __future__ import annotations

import argparse
import os

from ..checks import why_unwritable
from . import dlrm, mlp, unet


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m torchpipe.demo")
    parser.add_argument("--out", default="out", help="folder for Chrome traces (default: ./out)")
    parser.add_argument("--steps", type=int, default=60,
                        help="training steps of the MLP demo, half GPipe and half 1F1B, at least 2 "
                             "(default 60); the U-Net and DLRM demos run fixed counts")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (one GPipe and one 1F1B step), got {args.steps}")
    problem = why_unwritable(args.out, folder=True)
    if problem:  # now, not after the MLP demo trained
        parser.error(f"--out {args.out}: {problem}")
    os.makedirs(args.out, exist_ok=True)
    mlp.run(args.out, steps=args.steps)
    unet.run()
    dlrm.run()


if __name__ == "__main__":
    main()
