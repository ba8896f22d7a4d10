"""One-line mutation testing: does a test file fail when a module's code is broken?

    python scripts/mutants.py src/longft/data/packing.py tests/test_data_packing.py --budget 300
    python scripts/mutants.py src/longft/engine/export.py tests/test_lora_merge.py \
        tests/test_qlora.py --budget 600 --sample 40 -- -k "merge or export"

Each mutant changes one line of MODULE: a comparison flipped (== and !=, < and >=, ...), a
boolean constant negated, a number changed (n -> n + 1, x -> x * 2), `and`/`or` swapped, or a
one-line statement dropped (replaced by `pass`). The mutants are written into a copy of src/ in a
temporary folder beside links to the rest of the repository (configs/, tests/, ...), first on
PYTHONPATH, so the working tree is never changed (other runs may read it meanwhile); the tests run
there in a fresh `python -m pytest -x -q` (the fast tier unless pytest args after `--` say
otherwise). Tests that start subprocesses with the tree's own src/ on their path do
not see the mutant: choose tests that run the module in-process. A mutant is killed when the tests
fail or time out, and survives when they pass. Survivors are printed with their line: each is
either a test to write or a change that does not matter (an equivalent mutant, a log message).
Stops at --budget seconds; untested mutants are counted as such, never as killed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
        ast.LtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


@dataclass
class Mutant:
    line: int
    kind: str
    before: str
    after: str
    result: str = "untested"
    """killed | survived | timeout | untested"""


def _segment_mutants(src_lines: list[str], node: ast.AST, mutated: ast.AST, kind: str):
    """A mutant replacing node's text (on one line) with the unparsed mutated node."""
    if node.lineno != node.end_lineno:
        return None
    line = src_lines[node.lineno - 1]
    new = line[:node.col_offset] + ast.unparse(mutated) + line[node.end_col_offset:]
    return Mutant(node.lineno, kind, line, new) if new != line else None


def _docstring_lines(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.update(range(body[0].lineno, body[0].end_lineno + 1))
    return out


def mutants(source: str) -> list[Mutant]:
    """Every one-line mutant of `source`, in line order (at most one of each kind per node)."""
    import copy

    tree = ast.parse(source)
    lines = source.splitlines()
    skip = _docstring_lines(tree)
    found: list[Mutant] = []

    def add(m):
        if m is not None and m.line not in skip:
            found.append(m)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in FLIP:
            m = copy.deepcopy(node)
            m.ops[0] = FLIP[type(node.ops[0])]()
            add(_segment_mutants(lines, node, m, "flip comparison"))
        elif isinstance(node, ast.BoolOp):
            m = copy.deepcopy(node)
            m.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            add(_segment_mutants(lines, node, m, "and/or"))
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            v = node.value
            new = (not v) if isinstance(v, bool) else v + 1 if isinstance(v, int) else v * 2
            add(_segment_mutants(lines, node, ast.Constant(new), "constant"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return,
                               ast.Raise, ast.Assert, ast.Delete)) \
                and node.lineno == node.end_lineno and hasattr(node, "col_offset"):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            line = lines[node.lineno - 1]
            if line.strip() != ast.get_source_segment(source, node) or line.strip() == "pass":
                continue  # a statement sharing its line, or a line continued
            indent = line[:len(line) - len(line.lstrip())]
            add(Mutant(node.lineno, "drop statement", line, indent + "pass"))
    return sorted(found, key=lambda m: (m.line, m.kind))


def run_tests(tests: list[str], pytest_args: list[str], timeout: float, src: Path) -> str:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests, *pytest_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=src.parent)
    except subprocess.TimeoutExpired:
        return "timeout"
    if p.returncode == 5:
        raise SystemExit(f"no tests collected: {' '.join(cmd)}")
    return "survived" if p.returncode == 0 else "killed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", type=Path)
    ap.add_argument("tests", nargs="+")
    ap.add_argument("--budget", type=float, default=600, help="seconds for all mutants")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per mutant (default: 3x the clean run, at least 30)")
    ap.add_argument("--sample", type=int, default=None, help="test N mutants drawn at random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lines", default=None, metavar="A-B", help="mutate only these lines")
    ap.add_argument("--json", type=Path, default=None, help="write every mutant and its result")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)

    original = args.module.read_text()
    rel = args.module.resolve().relative_to(Path("src").resolve())  # run from the repository root
    work = Path(tempfile.mkdtemp(prefix="mutants-"))
    shutil.copytree("src", work / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for entry in Path(".").iterdir():  # the package finds configs/ etc. beside its src/
        if entry.name not in ("src", ".git"):
            (work / entry.name).symlink_to(entry.resolve())
    target = work / "src" / rel
    todo = mutants(original)
    if args.lines:
        a, b = (int(x) for x in args.lines.split("-"))
        todo = [m for m in todo if a <= m.line <= b]
    if args.sample is not None and args.sample < len(todo):
        todo = sorted(random.Random(args.seed).sample(todo, args.sample), key=lambda m: m.line)
    start = time.monotonic()
    if run_tests(args.tests, pytest_args, 3600, work / "src") != "survived":
        raise SystemExit("the tests fail on the unmutated module: fix that first")
    clean = time.monotonic() - start
    timeout = args.timeout or max(30.0, 3 * clean)
    print(f"{args.module}: {len(todo)} mutants; clean run {clean:.0f} s, budget {args.budget:.0f} s",
          flush=True)

    try:
        for m in todo:
            if time.monotonic() - start > args.budget:
                break
            lines = original.splitlines(keepends=True)
            lines[m.line - 1] = m.after + "\n"
            target.write_text("".join(lines))
            m.result = run_tests(args.tests, pytest_args, timeout, work / "src")
            if m.result == "survived":
                print(f"  SURVIVED line {m.line} ({m.kind}): {m.after.strip()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tested = [m for m in todo if m.result != "untested"]
    killed = sum(m.result in ("killed", "timeout") for m in tested)
    rate = f"{100 * killed / len(tested):.0f} %" if tested else "n/a"
    print(f"{args.module}: killed {killed} of {len(tested)} tested ({rate}); "
          f"{len(todo) - len(tested)} untested (budget); {time.monotonic() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in todo], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
