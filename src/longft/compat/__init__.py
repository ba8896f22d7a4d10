"""What longft takes from other libraries' private internals, one module per library, checked when
the patch stage plans.

longft's memory work patches internals of DeepSpeed, transformers, torch, Liger and bitsandbytes
that no release promises to keep. Each such access is declared once, as an `Access`, in the
library's module here (compat/deepspeed.py, transformers.py, torch.py, liger.py, bitsandbytes.py),
next to the helpers the rest of longft calls instead of touching the internal itself. The patch
stage runs `gate()` on the resolved knobs (compat/gate.py): a knob resolved `auto` whose internal is
missing is turned off with the reason, a knob set in params refuses with one clear message
(`PlanError`), and plan.json's `patches.compat` records every access as "ok" or why not. An
upgrade that moves an internal so never fails mid-run with a traceback, nor silently does nothing.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from longft.errors import UserError


class CompatError(UserError, RuntimeError):
    """An installed library lacks an internal longft relies on; the message names it and the fix."""


@dataclass(frozen=True)
class Access:
    """One private internal: `name` on `module` (or on `owner`, a dotted path in it: a class).

    kind "attr": the module (or class) has the attribute. kind "instance": instances get it in the
    class's own code (`self.<name>` in its source; DeepSpeed sets its state in `__init__`), so it is
    checked without building one. kind "source": the module's source uses `name` (transformers sets
    `_gradient_checkpointing_func` on layers it never declares)."""

    feature: str
    """What needs it: one of the FEATURES of compat/gate.py (a knob, or "always")."""
    module: str
    name: str
    owner: str = ""
    kind: str = "attr"

    @property
    def label(self) -> str:
        return f"{self.module}.{self.owner + '.' if self.owner else ''}{self.name}"

    def missing(self) -> str | None:
        """None where the internal is there; else why not (one line)."""
        try:
            mod = importlib.import_module(self.module)
        except Exception as e:  # noqa: BLE001 (a library that moved things can fail on import)
            return f"{self.module} cannot be imported ({type(e).__name__}: {e})"
        obj = mod
        for part in self.owner.split(".") if self.owner else ():
            obj = getattr(obj, part, None)
            if obj is None:
                return f"{self.module} has no {self.owner}"
        if self.kind == "attr":
            return None if hasattr(obj, self.name) else f"{self.label} is gone"
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return f"the source of {self.module}{'.' + self.owner if self.owner else ''} cannot be read"
        needle = f"self.{self.name}" if self.kind == "instance" else self.name
        return None if needle in source else f"{self.label} is gone"


def version(module: str) -> str:
    """The installed version of a library (for messages), or "not installed"."""
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"
