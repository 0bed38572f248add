"""What a benchmark prints and writes: markdown tables, the report header, JSON, RESULTS.md.

- `md_table()` builds a markdown table; `Table` prints one row at a time (long runs).
- `report_header()`: the lines every recorded run starts with: date and title, the command,
  the machine (`machine.machine_line`) and the load (`load.load_line`).
- `write_outputs()`: the JSON report (`--out`) and the markdown section (`--results-md`). A
  noisy run, or one with a blocker such as a token mismatch in a posted row, is not recorded
  unless `--force-results` is given (then it says so).
- `record_run()`: RESULTS.md is a page of current figures, one section per benchmark. A new
  run goes in at the top of its benchmark's section, under the line
  `<!-- new runs of NAME land here -->`, newest first; the figures it supersedes are then
  condensed into the page's history by hand. A page without the marker gets a new section
  before `## History` (or at the end).
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .load import load_line
from .machine import machine_line

HISTORY_HEADING = "## History"


def md_table(headers: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool] | None = None) -> str:
    right = right or [i > 0 for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Table:
    """A markdown table printed row by row as results come in (`row()` flushes)."""

    def __init__(self, headers: Sequence[str], right: Sequence[bool] | None = None) -> None:
        self.headers, self.rows = list(headers), []
        print(md_table(headers, [], right), flush=True)

    def row(self, *cells) -> None:
        self.rows.append(list(cells))
        print("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |", flush=True)


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def benchmark_name() -> str:
    """The running script's file name ('offline.py'): the key of its section in RESULTS.md."""
    return Path(sys.argv[0]).name


def report_header(title: str, machine: dict | None, load: dict | None, threshold: float | None = None) -> list[str]:
    """`threshold` is accepted for callers that pass it; the noisy rule is stated once, at the
    top of RESULTS.md and in benchmarks/README.md."""
    lines = [f"\n### {datetime.date.today().isoformat()}: {title}\n",
             f"Command: `{command_line()}`  ",
             f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}  "]
    if machine is not None:
        lines.append(f"Machine: {machine_line(machine)}  ")
    if load is not None:
        lines.append(f"Load: {load_line(load)}  ")
    lines[-1] = lines[-1].rstrip()
    lines.append("")
    return lines


def record_run(path: Path, markdown: str, benchmark: str | None = None) -> None:
    """Put `markdown` (one run's section) at the top of its benchmark's section of `path`."""
    benchmark = benchmark or benchmark_name()
    marker = f"<!-- new runs of {benchmark} land here -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = markdown.strip("\n") + "\n"
    if marker in text:
        head, tail = text.split(marker, 1)
        text = head + marker + "\n\n" + block + ("\n" + tail.lstrip("\n") if tail.strip() else "")
    else:
        section = f"## {benchmark}\n\n{marker}\n\n{block}\n"
        if f"\n{HISTORY_HEADING}" in text:
            head, tail = text.split(f"\n{HISTORY_HEADING}", 1)
            text = head.rstrip("\n") + "\n\n" + section + HISTORY_HEADING + tail
        else:
            text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def write_outputs(args, report: dict, markdown: str, blockers: Sequence[str] = ()) -> None:
    """JSON always (when asked); the markdown goes to --results-md unless the run was noisy (or a
    blocker such as a token mismatch is named), where --force-results overrides."""
    report = {**report, "markdown": markdown}
    if getattr(args, "out", None):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    if getattr(args, "results_md", None):
        load = report.get("load") or {}
        reasons = ["noisy run: " + "; ".join(load.get("noisy_reasons", []))] if load.get("noisy") else []
        reasons += list(blockers)
        if reasons and not getattr(args, "force_results", False):
            print(f"NOT recorded in {args.results_md}: " + " / ".join(reasons)
                  + " (--force-results to record it anyway)")
            return
        if reasons:
            markdown += "\n\n**Recorded with --force-results despite: " + " / ".join(reasons) + ".**\n"
        record_run(args.results_md, markdown)
        print(f"recorded in {args.results_md}")


def strip_private(obj):
    """A report without its `_`-prefixed working keys (Spread objects kept for the tables)."""
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def log(message: str) -> None:
    print(message, flush=True)
