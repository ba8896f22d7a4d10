"""Imports point one way: each sub-package of longft imports only packages above it in LAYERS
(lazy, function-level imports included), so there is no import cycle between concerns and a
newcomer can read the library bottom-up (docs/contributing.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "longft"
LAYERS = ["errors", "atomic", "argtypes", "content", "config", "hardware", "compat", "model", "data", "measure",
          "engine", "estimate", "metrics", "run", "generate", "cli"]
"""Lowest first: a module may import its own package and those before it."""


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, longft sub-package) of every longft import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "longft":
                names = [f"longft.{a.name}" for a in node.names]
            elif node.module.startswith("longft."):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("longft.")]
        out += [(node.lineno, n.split(".")[1]) for n in names]
    return out


def modules():
    return sorted(p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "__init__.py")


def test_every_module_belongs_to_a_layer():
    for p in modules():
        top = p.relative_to(SRC).parts[0].removesuffix(".py")
        assert top in LAYERS, f"{p}: add its package to LAYERS (docs/contributing.md Layout too)"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_one_way(path):
    me = LAYERS.index(path.relative_to(SRC).parts[0].removesuffix(".py"))
    up = [f"line {n}: longft.{pkg}" for n, pkg in imports(path)
          if pkg in LAYERS and LAYERS.index(pkg) > me]
    assert not up, f"{path.relative_to(SRC)} imports a higher layer: {up}"


def test_relative_imports_are_not_used():
    """Absolute imports only: the layer check above reads them."""
    for p in modules():
        rel = [n.lineno for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.ImportFrom) and n.level]
        assert not rel, f"{p}: relative imports at lines {rel}"
