"""compat/deepspeed.py is the one place longft names DeepSpeed's internals: the engine modules that
patch its ZeRO-3 optimizer reach them only through its names and helpers, and every private name
those helpers use is declared (an Access the patch stage checks)."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from longft.compat import deepspeed as ds
from longft.engine import (
    clip_scale,
    grad_buffer,
    optimizer_patches,
    overlap_step,
    param_copy_back,
    partial_offload,
)

PATCHING = (overlap_step, param_copy_back, clip_scale, grad_buffer, partial_offload, optimizer_patches)
"""The modules that patch DeepSpeed's ZeRO-3 optimizer after deepspeed.initialize."""

PRIVATE = re.compile(r"_[A-Za-z]\w*")
SHARED = {"dtype"}
"""Declared names torch's objects have too (a tensor's dtype): the scan cannot tell whose they are."""


def declared() -> set[str]:
    """Every name compat/deepspeed.py declares (SHARED aside), name-mangled ones also as Python
    spells them."""
    out = set()
    for a in ds.ACCESSES:
        out.add(a.name)
        if a.name.startswith("__") and a.owner:
            out.add(f"_{a.owner.split('.')[-1]}{a.name}")
    return out - SHARED


def _private(name: str) -> bool:
    return bool(PRIVATE.fullmatch(name)) and not (name.startswith("__") and name.endswith("__"))


def names_used(source: str) -> list[tuple[int, str]]:
    """(line, name) of every attribute read or written on something other than `self` (longft's own
    objects' state), and of every string constant that could name an attribute (getattr's)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name)
                                                    and node.value.id == "self"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"\w+", node.value):
            out.append((node.lineno, node.value))
    return out


def by_hand(source: str, names: set[str]) -> list[str]:
    """What `source` touches of DeepSpeed without compat/deepspeed.py: a declared name spelled out,
    or a private name (declared or not)."""
    return [f"line {line}: {name}" for line, name in names_used(source)
            if name in names or _private(name)]


@pytest.mark.parametrize("module", PATCHING, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_patching_modules_name_no_deepspeed_internal_by_hand(module):
    found = by_hand(inspect.getsource(module), declared())
    assert not found, (f"{module.__name__} reaches DeepSpeed's internals by hand: {found}; take the "
                       "name or a helper from longft.compat.deepspeed (declared in its ACCESSES)")


def test_every_private_name_compat_deepspeed_uses_is_declared():
    """Its helpers call DeepSpeed's private methods: each must be an Access the gate checks."""
    known = declared()
    source = inspect.getsource(ds)
    undeclared = sorted({name for _, name in names_used(source) if _private(name) and name not in known})
    assert undeclared == [], f"compat/deepspeed.py uses undeclared private names: {undeclared}"
    used = {n for _, n in names_used(source)}
    for name in ("_release_sub_group", "_prepare_sub_group", "_post_step", "_global_grad_norm"):
        assert name in used and name in known       # the helpers are there and their names declared


def test_the_scan_catches_an_undeclared_private_call_and_a_declared_name_spelled_out():
    """The mutants the rule is for: a new `o._foo()` in a patching module, an attribute the
    compat module declares written by hand, and a private name given to getattr."""
    known = declared()
    clean = inspect.getsource(overlap_step)
    assert by_hand(clean, known) == []
    mutant = clean.replace("ds.release_sub_group(o, i)", "o._foo(i)")
    assert mutant != clean and [h.split(": ")[1] for h in by_hand(mutant, known)] == ["_foo"]
    assert by_hand("n = len(self.opt.fp16_groups)\n", known) == ["line 1: fp16_groups"]
    assert by_hand("f = getattr(o, '_post_step')\n", known) == ["line 1: _post_step"]
    assert by_hand("self._update(i)\nx.__class__\n", known) == []   # longft's own, and dunders
