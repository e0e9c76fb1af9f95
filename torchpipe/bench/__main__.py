"""Command line: ``python -m torchpipe.bench {overhead,gpipe,...,all} [--repeats N] [--json PATH] [--quick] [--stage-ms MS]``."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from ..checks import why_unwritable
from .registry import STAGE_MS_SUITES, SUITES, Options
from .report import SuiteResult, environment, print_suite, results_document, write_json


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchpipe.bench",
        description="torchpipe benchmarks: every figure is a ratio against a baseline timed in the same run.",
    )
    parser.add_argument("suite", choices=[*SUITES, "all"], help="which suite to run ('all' runs every suite)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per case; the median is quoted (default 7, or 3 with --quick)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write machine-readable results here")
    parser.add_argument("--quick", action="store_true", help="a small, fast run (for tests); figures are indicative")
    parser.add_argument("--stage-ms", type=float, default=None, metavar="MS",
                        help="latency t of the simulated stages in the gpipe and schedules suites "
                             "(default 2 ms, or less with --quick)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.stage_ms is not None and not (args.stage_ms > 0 and math.isfinite(args.stage_ms)):
        parser.error(f"--stage-ms must be a positive, finite number of milliseconds, got {args.stage_ms}")
    if args.stage_ms is not None and args.suite not in (*STAGE_MS_SUITES, "all"):
        parser.error(f"--stage-ms applies to the {' and '.join(STAGE_MS_SUITES)} suites only, not to {args.suite!r}")
    if args.json is not None:
        problem = why_unwritable(args.json, folder=False)
        if problem:  # now, not after the first suite has run for minutes
            parser.error(f"--json {args.json}: {problem}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the suites, print their tables, write ``--json``; returns the JSON document."""
    args = parse_args(argv)
    options = Options(repeats=args.repeats, quick=args.quick, stage_ms=args.stage_ms)
    names: List[str] = list(SUITES) if args.suite == "all" else [args.suite]
    command = "python -m torchpipe.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    meta: Dict[str, Any] = {"command": command, "suites": names, "quick": args.quick,
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment()}
    print(f"# {command}")
    env = meta["environment"]
    print(f"# torchpipe {env.get('torchpipe_commit', '?')} from {env['torchpipe_path']}, torch {env['torch']}, "
          f"python {env['python']}, {env['cpu_count']} CPUs, load average {env.get('load_average', '?')}\n")
    results: List[SuiteResult] = []
    started = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        result = SUITES[name](options)
        result.config["seconds"] = round(time.perf_counter() - t0, 1)
        if args.stage_ms is not None and name in STAGE_MS_SUITES:
            result.config["stage_ms_option"] = args.stage_ms
        print_suite(result)
        results.append(result)
        meta["seconds"] = round(time.perf_counter() - started, 1)
        if args.json:  # after every suite, so that a later suite's failure loses nothing
            write_json(args.json, results, meta)
    if args.json:
        print(f"# wrote {args.json}")
    return results_document(results, meta)


if __name__ == "__main__":
    main()
