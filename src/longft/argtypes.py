"""Argument types for the `longft` commands: every number and path is checked when the command
line is parsed, before any work, and a bad one is refused with the range it must be in
("argument --gpu-mem: must be a finite number > 0 (GiB of one GPU), got -8").

    ap.add_argument("--gpu-mem", type=number(above=0, what="GiB of one GPU"))
    ap.add_argument("--seq", type=integer(least=1, what="tokens"))
    ap.add_argument("--out", type=out_file)     # a file to write: not a directory
    ap.add_argument("--work", type=out_dir)     # a folder to write in: not a file
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _range(above, least, most) -> str:
    parts = ([f"> {above:g}"] if above is not None else []) + \
        ([f">= {least:g}"] if least is not None else []) + \
        ([f"<= {most:g}"] if most is not None else [])
    return " and ".join(parts)


def number(*, above: float | None = None, least: float | None = None, most: float | None = None,
           what: str = ""):
    """A finite float within the bounds (`above` exclusive, `least`/`most` inclusive)."""
    rng = _range(above, least, most)
    unit = f" ({what})" if what else ""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        ok = (math.isfinite(x) and (above is None or x > above) and (least is None or x >= least)
              and (most is None or x <= most))
        if not ok:
            raise argparse.ArgumentTypeError(
                f"must be a finite number{' ' + rng if rng else ''}{unit}, got {text}")
        return x
    parse.__name__ = "number"
    return parse


def integer(*, least: int | None = None, most: int | None = None, what: str = ""):
    """A whole number within [least, most]."""
    rng = _range(None, least, most)
    unit = f" ({what})" if what else ""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or (least is not None and n < least) or (most is not None and n > most):
            raise argparse.ArgumentTypeError(
                f"must be a whole number{' ' + rng if rng else ''}{unit}, got {text}")
        return n
    parse.__name__ = "integer"
    return parse


def _file_above(p: Path) -> Path | None:
    """The nearest existing path above p when it is a file (so p cannot be created), else None."""
    above = next((q for q in p.parents if q.exists()), None)
    return above if above is not None and not above.is_dir() else None


def out_file(text: str) -> Path:
    """A file to write: not an existing directory, and no file where one of its folders goes."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file to write")
    blocker = _file_above(p)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{text}: {blocker} is a file, not a directory")
    return p


def out_dir(text: str) -> Path:
    """A folder to write in: not an existing file, and no file where one of its folders goes."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; name a folder")
    blocker = _file_above(p)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{text}: {blocker} is a file, not a directory")
    return p
