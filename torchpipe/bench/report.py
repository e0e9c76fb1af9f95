"""Results of a suite, and the one printer (text table) and writer (JSON) they all share.

A suite returns a ``SuiteResult``: tables for people, ``ratios`` for machines (every
quoted figure is a ratio of two things measured in the same run, so it stays comparable
across noisy machines), ``goals`` checked against targets (reported, never asserted) and
free-form notes (shims applied, peers unavailable, caveats).
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, TextIO

from .stats import MedianInterval

__all__ = ["Column", "Table", "Goal", "SuiteResult", "format_table", "format_suite", "print_suite", "results_document", "write_json", "environment"]

SCHEMA = "torchpipe.bench/1"


@dataclass(frozen=True)
class Column:
    """A table column: ``key`` in each row dict, its header, and a format for the text table."""

    key: str
    header: str
    fmt: str = "{}"
    align: str = ">"

    def render(self, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        try:
            return self.fmt.format(value)
        except (ValueError, TypeError):
            return str(value)


@dataclass
class Table:
    """Rows of raw values (seconds, ratios, strings); only the printer formats them."""

    title: str
    columns: List[Column]
    rows: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def to_json(self) -> Dict[str, Any]:
        return {
            "title": self.title,
            "columns": [{"key": c.key, "header": c.header} for c in self.columns],
            "rows": [dict(r) for r in self.rows],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Goal:
    """A target from an issue: ``value`` ``op`` ``target`` (op is '<=' or '>=').

    ``interval``, where the suite has repeats to build it from, brackets the true median of
    the figure (``stats.median_interval``, from paired repeats). The status then says PASS
    or MISS only when the whole interval lies on one side of the target, and UNSURE when it
    straddles it: a noisy machine does not get to decide a goal by the luck of one run.
    """

    name: str
    value: Optional[float]
    op: str
    target: float
    interval: Optional[MedianInterval] = None

    def _meets(self, value: float) -> bool:
        return value <= self.target if self.op == "<=" else value >= self.target

    @property
    def met(self) -> Optional[bool]:
        """Whether the point figure meets the target (None: no figure)."""
        if self.value is None or not math.isfinite(self.value):
            return None
        return self._meets(self.value)

    @property
    def status(self) -> str:
        if self.met is None:
            return "n/a"
        if self.interval is None:
            return "PASS" if self.met else "MISS"
        low, high = self._meets(self.interval.low), self._meets(self.interval.high)
        if low and high:
            return "PASS"
        return "MISS" if not (low or high) else "UNSURE"

    def describe(self) -> str:
        """One line: status, figure, interval (if any) and target."""
        value = "-" if self.value is None else f"{self.value:.3g}"
        if self.interval is not None:
            i = self.interval
            value += f" (repeats: median {i.median:.3g}, {i.coverage:.1%} interval {i.low:.3g}..{i.high:.3g})"
        return f"[{self.status}] {self.name}: {value} {self.op} {self.target:g}"

    def to_json(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {"name": self.name, "value": self.value, "op": self.op, "target": self.target,
                               "met": self.met, "status": self.status}
        if self.interval is not None:
            doc["interval"] = {"median": self.interval.median, "low": self.interval.low, "high": self.interval.high,
                               "coverage": self.interval.coverage}
        return doc


@dataclass
class SuiteResult:
    """What one suite measured. ``ratios`` holds only well-defined (positive, finite) ratios;
    anything that could not be computed goes into ``notes`` with the reason."""

    name: str
    description: str
    tables: List[Table] = field(default_factory=list)
    ratios: Dict[str, float] = field(default_factory=dict)
    goals: List[Goal] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    config: Dict[str, Any] = field(default_factory=dict)
    measurements: Dict[str, Any] = field(default_factory=dict)
    """Raw timings behind the tables (per-call seconds of every repeat), for re-analysis."""

    def ratio(self, name: str, numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
        """Record ``numerator / denominator`` under ``name`` if it is a positive finite number."""
        if numerator is None or denominator is None or denominator == 0:
            self.notes.append(f"ratio {name!r} undefined ({numerator!r} / {denominator!r})")
            return None
        value = numerator / denominator
        if not (math.isfinite(value) and value > 0):
            self.notes.append(f"ratio {name!r} undefined ({numerator!r} / {denominator!r} = {value!r})")
            return None
        self.ratios[name] = value
        return value

    def to_json(self) -> Dict[str, Any]:
        return {
            "description": self.description,
            "config": dict(self.config),
            "tables": [t.to_json() for t in self.tables],
            "ratios": dict(self.ratios),
            "goals": [g.to_json() for g in self.goals],
            "notes": list(self.notes),
            "measurements": dict(self.measurements),
        }


def format_table(table: Table) -> str:
    cells = [[c.header for c in table.columns]]
    for row in table.rows:
        cells.append([c.render(row.get(c.key)) for c in table.columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(table.columns))]
    lines = [table.title]

    def line(values: Sequence[str]) -> str:
        return "  ".join(f"{v:{c.align}{w}}" for v, c, w in zip(values, table.columns, widths)).rstrip()

    lines.append(line(cells[0]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells[1:])
    lines.extend(f"  * {note}" for note in table.notes)
    return "\n".join(lines)


def format_suite(result: SuiteResult) -> str:
    parts = [f"== {result.name}: {result.description}"]
    if result.config:
        parts.append("   " + ", ".join(f"{k}={v}" for k, v in result.config.items()))
    for table in result.tables:
        parts.append("")
        parts.append(format_table(table))
    if result.goals:
        parts.append("")
        parts.append("Goals (reported, never asserted):")
        parts.extend(f"  {g.describe()}" for g in result.goals)
    if result.notes:
        parts.append("")
        parts.append("Notes:")
        parts.extend(f"  - {n}" for n in result.notes)
    return "\n".join(parts)


def print_suite(result: SuiteResult, stream: Optional[TextIO] = None) -> None:
    stream = stream if stream is not None else sys.stdout
    stream.write(format_suite(result) + "\n\n")
    stream.flush()


def environment() -> Dict[str, Any]:
    """Where the numbers come from: versions, cores, threads."""
    import torch

    env: Dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    env.update(_measured_code())
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        pass
    return env


def _measured_code() -> Dict[str, Any]:
    """Which torchpipe ran: its directory and, in a git checkout, the commit (dirty or not).

    Comparing two trees means putting one first on ``sys.path``; ``python -m`` puts the
    current directory before ``PYTHONPATH``, so a run from the wrong directory measures the
    other tree. The JSON says which one it was.
    """
    import subprocess

    import torchpipe

    root = os.path.dirname(os.path.dirname(os.path.abspath(torchpipe.__file__)))
    code: Dict[str, Any] = {"torchpipe_path": root}
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return code
    if commit.returncode == 0:
        code["torchpipe_commit"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    return code


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so the file stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def results_document(results: Sequence[SuiteResult], meta: Dict[str, Any]) -> Dict[str, Any]:
    """The machine-readable form of a run (what ``--json`` writes)."""
    return _finite({"schema": SCHEMA, "meta": meta, "suites": {r.name: r.to_json() for r in results}})


def write_json(path: str, results: Sequence[SuiteResult], meta: Dict[str, Any]) -> Dict[str, Any]:
    doc = results_document(results, meta)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, allow_nan=False, default=str)
        f.write("\n")
    return doc
