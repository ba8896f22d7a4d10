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


def _bounded(convert, kind: str, name: str, *, above, least, most, what: str):
    """An argparse type: `convert(text)` (None when it does not parse) within the bounds
    (`above` exclusive, `least`/`most` inclusive), else the refusal with the range."""
    rng = _range(above, least, most)
    unit = f" ({what})" if what else ""

    def parse(text: str):
        x = convert(text)
        if x is None or (above is not None and not x > above) or (least is not None and not x >= least) \
                or (most is not None and not x <= most):
            raise argparse.ArgumentTypeError(f"must be {kind}{' ' + rng if rng else ''}{unit}, got {text}")
        return x
    parse.__name__ = name
    return parse


def _float(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def number(*, above: float | None = None, least: float | None = None, most: float | None = None,
           what: str = ""):
    """A finite float within the bounds (`above` exclusive, `least`/`most` inclusive)."""
    return _bounded(_float, "a finite number", "number", above=above, least=least, most=most, what=what)


def integer(*, least: int | None = None, most: int | None = None, what: str = ""):
    """A whole number within [least, most]."""
    return _bounded(_int, "a whole number", "integer", above=None, least=least, most=most, what=what)


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
