"""The `longft` command: results tables, sweeps, samples of the finetuned model and memory estimates.

    longft report [--from-json DIR | --exp-json FILE] [-A] [--names] [--out FILE] [--plots DIR]
    longft report --from-json DIR --grid GRID.yaml [--grid ...] [--out FILE] [--plots DIR]
    longft sweep GRID.yaml [--only GLOB ...] [--dry-run] [--run | --overlays DIR]
    longft generate [--prompt TEXT ...] [--held-out N] [--max-new-tokens N] [--export DIR]
    longft estimate | placement | max-context ...   (longft.cli.estimate; `longft placement --help`)

The modules of report, sweep and generate each give `add_arguments(parser)` and `main(args)`;
estimate, placement and max-context parse their own arguments (longft.cli.estimate). `longft plan`
is an old name of `longft placement`: it says so on stderr and runs it.

Installed as a console script by `pip install -e .`; `python -m longft.cli ...` works too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

ESTIMATE_COMMANDS = {
    "estimate": "itemised peak VRAM / DRAM prediction for a params file",
    "placement": "the fastest placement that fits, as a params overlay",
    "max-context": "the longest sequence that fits",
}
"""Handed, with the rest of the command line, to longft.cli.estimate.main(command, argv)."""

ALIASES = {"plan": "placement"}
"""Old command names: each says, in one line on stderr, what it is now, and runs that."""


def _estimate(command: str, argv: list[str]) -> int:
    try:
        from longft.cli.estimate import main as estimate_main
    except ImportError as e:
        print(f"longft {command}: not available in this installation "
              f"(longft.cli.estimate cannot be imported: {e})", file=sys.stderr)
        return 2
    return int(estimate_main(command, argv) or 0)


def _report(args: argparse.Namespace) -> int:
    """`longft report`: BENCHMARKS.md's table (--benchmarks), a sweep grid's findings (--grid), else
    the table over runs. The three modules share the runs' rows (metrics/report.py), so the choice
    between them is made here, above all three."""
    if args.benchmarks:
        from longft.metrics import results_table
        return results_table.main(args)
    if args.grid:
        from longft.metrics import grid_report
        return grid_report.main(args)
    from longft.metrics import report
    return report.main(args)


def _parser() -> argparse.ArgumentParser:
    from longft.generate import command as generate
    from longft.metrics import report
    from longft.run import sweep

    p = argparse.ArgumentParser(prog="longft", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, handler, summary in (
            ("report", report, _report, "results table and plots over DVC experiments or bench results"),
            ("sweep", sweep, sweep.main, "queue a grid of runs as DVC experiments"),
            ("generate", generate, generate.main,
             "sample from the exported model on prompts or held-out records")):
        sp = sub.add_parser(name, help=summary, description=module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(handler=handler)
    for name, summary in ESTIMATE_COMMANDS.items():  # parsed by longft.cli.estimate itself
        sub.add_parser(name, help=summary, add_help=False,
                       aliases=[old for old, new in ALIASES.items() if new == name])
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ALIASES:
        print(f"longft {argv[0]} is now longft {ALIASES[argv[0]]}", file=sys.stderr)
        argv[0] = ALIASES[argv[0]]
    if argv and argv[0] in ESTIMATE_COMMANDS:
        return _estimate(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
