"""Command lines: the flags every benchmark shares, and the parsing of lists and names.

`parser(__doc__)` makes a script's parser (its docstring as the description),
`add_common_args` the flags of the comparative benchmarks (`--repeats`, `--no-warmup`,
`--noise-threshold`, `--out`, `--results-md`, `--force-results`, optionally `--quick`),
`add_model_args` `--model` / `--dtype`; `parse()` applies the rules they share (a `--quick`
smoke run does 1 repeat unless `--repeats` is given; `--repeats` >= 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from .load import NOISE_THRESHOLD


def parser(doc: str, *, whole_doc: bool = False, show_defaults: bool = False, **kwargs) -> argparse.ArgumentParser:
    """The script's parser: its docstring's first line as the description (`whole_doc`: all of
    it, kept as written)."""
    formatter = (argparse.RawDescriptionHelpFormatter if whole_doc else
                 argparse.ArgumentDefaultsHelpFormatter if show_defaults else argparse.HelpFormatter)
    return argparse.ArgumentParser(description=doc if whole_doc else doc.strip().split("\n")[0],
                                   formatter_class=formatter, **kwargs)


def add_common_args(p: argparse.ArgumentParser, repeats: int = 3, quick: str | None = None) -> None:
    """The comparative benchmarks' flags. `quick`: the help of a `--quick` smoke flag, which
    also makes the default `--repeats` 1."""
    default = f"{repeats}; 1 with --quick" if quick else f"{repeats}"
    p.add_argument("--repeats", type=int, default=argparse.SUPPRESS,
                   help=f"timed runs per system, interleaved (default {default})")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each system")
    p.add_argument("--noise-threshold", type=float, default=NOISE_THRESHOLD,
                   help="foreign load above which a run is labelled noisy (default %(default)s)")
    p.add_argument("--out", type=Path, help="write the full report as JSON here")
    p.add_argument("--results-md", type=Path, help="record the markdown section here (e.g. benchmarks/RESULTS.md), "
                                                   "unless the run is noisy")
    p.add_argument("--force-results", action="store_true", help="record in --results-md even when the run is noisy")
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    p.set_defaults(_repeats_default=repeats, _quick_sets_repeats=bool(quick))


def add_model_args(p: argparse.ArgumentParser, dtype: str | None = "float32", model: bool = True) -> None:
    """`--model` (default: the embedded SmolLM2-135M) and `--dtype`."""
    if model:
        p.add_argument("--model", default=None, help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    if dtype is not None:
        p.add_argument("--dtype", default=dtype, help="float32, bfloat16 or float16 (default %(default)s)")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if hasattr(args, "_repeats_default"):
        if not hasattr(args, "repeats"):
            args.repeats = 1 if args._quick_sets_repeats and args.quick else args._repeats_default
        del args._repeats_default, args._quick_sets_repeats
        if args.repeats < 1:
            p.error("--repeats must be >= 1")
    return args


def comma_list(text: str, cast: Callable = str, allowed: Sequence | None = None,
               p: argparse.ArgumentParser | None = None, what: str = "values") -> list:
    """'a,b,,c' -> [a, b, c] (cast each); anything outside `allowed` is an error."""
    items = [cast(x) for x in text.split(",") if x]
    if allowed is not None and (bad := [x for x in items if x not in allowed]):
        message = f"unknown {what} {bad} (choose from {', '.join(map(str, allowed))})"
        if p is None:
            raise SystemExit(message)
        p.error(message)
    return items
