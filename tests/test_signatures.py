"""No wide positional interfaces in longft (issue 32): a function takes at most MAX_POSITIONAL
parameters by position (self and cls not counted); past that they are keyword-only (`*`), or the
values travel as the typed objects that exist for them (plan.resolved, a Config section,
train_step.StepRecord). A call such as `search(arch, base, 24, 60, None)` reads as nothing, and
swapping two of its numbers raises no error.

Two exceptions: transformers' attention interface (an attention function is called by the model
as `fn(module, query, key, value, attention_mask, ...)`, so longft's kernels keep that order), and
torch ops (`torch.library.custom_op` and their fake kernels: an op's schema takes its tensors by
position; custom_op refuses keyword-only tensors)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "longft"
MAX_POSITIONAL = 6
ATTENTION_INTERFACE = ["module", "query", "key", "value"]


def wide(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, positional parameters) of each function over MAX_POSITIONAL."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = [a.arg for a in node.args.posonlyargs + node.args.args]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if len(names) > MAX_POSITIONAL and names[:4] != ATTENTION_INTERFACE and not torch_op(node):
            out.append((node.lineno, node.name, len(names)))
    return out


def torch_op(node) -> bool:
    """Whether `node` is a torch op's function: `@torch.library.custom_op(...)` or `@op.register_fake`."""
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and d.attr in ("custom_op", "register_fake"):
            return True
    return False


def test_no_function_takes_more_than_six_positional_parameters():
    found = [f"{path.relative_to(SRC.parent)}:{line} {name}() takes {n} positional parameters"
             for path in sorted(SRC.rglob("*.py"))
             for line, name, n in wide(ast.parse(path.read_text(), str(path)))]
    assert not found, ("make the parameters past the first few keyword-only (`*`) or pass a typed "
                       "object:\n  " + "\n  ".join(found))


def test_the_rule_sees_wide_functions_and_spares_keyword_only_and_attention_ones():
    src = ("def a(p1, p2, p3, p4, p5, p6, p7): pass\n"
           "def b(p1, p2, p3, *, p4, p5, p6, p7, p8): pass\n"
           "class C:\n    def m(self, p1, p2, p3, p4, p5, p6): pass\n"
           "    def n(self, p1, p2, p3, p4, p5, p6, p7=0): pass\n"
           "def attn(module, query, key, value, mask, dropout, scaling, causal): pass\n"
           "@torch.library.custom_op('x::op', mutates_args=())\ndef op(p1, p2, p3, p4, p5, p6, p7): pass\n"
           "@op.register_fake\ndef _(p1, p2, p3, p4, p5, p6, p7): pass\n"
           "@functools.cache\ndef d(p1, p2, p3, p4, p5, p6, p7): pass\n")
    assert sorted((name, n) for _, name, n in wide(ast.parse(src))) == [("a", 7), ("d", 7), ("n", 7)]
