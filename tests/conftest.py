"""Shared pytest fixtures, and the test tiers.

Bare `python -m pytest` runs the fast tier (every test not marked `slow`: minutes on 2 cores);
`python -m pytest -m slow` the slow tier; CI runs both. A test that launches a stage or the ranks
(through the helpers in LAUNCHERS, or a stage script by path) is marked `slow` here, whatever its
file says; one that reaches them some other way and is not marked fails at the launch
(`_launches_only_when_slow`). Unmarked tests that took longer than FAST_LIMIT_S are listed at the end
of the run, to be marked.
"""

import ast
import inspect
import os
import textwrap

import pytest

LAUNCHERS = frozenset({"run_all", "run_stage", "run_params", "stage_commands", "longft.run.launch.launch_ranks"})
"""longft.run.pipeline's ways to start stage processes (the train stage starts the ranks) and the
launcher runner: a test that calls one (by name, or launch.launch_ranks under any name) is `slow`."""
FAST_LIMIT_S = float(os.environ.get("LONGFT_FAST_LIMIT_S", "20"))
"""An unmarked test slower than this (2 cores) belongs in the slow tier."""


def _launches(fn, module, seen=None) -> bool:
    """Whether fn's body (or a function of its own test module that it calls, to any depth) calls
    a LAUNCHER or names a stage script (`REPO / "stages" / ...`)."""
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) \
                and isinstance(node.right, ast.Constant) and node.right.value == "stages":
            return True  # REPO / "stages" / "<stage>.py"
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            helper = getattr(module, name, None) if name else None
            if name in LAUNCHERS or f"{getattr(helper, '__module__', '')}.{name}" in LAUNCHERS \
                    or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                        and f"{getattr(getattr(module, f.value.id, None), '__name__', '')}.{name}" in LAUNCHERS):
                return True
            if inspect.isfunction(helper) and helper.__module__ == module.__name__ \
                    and _launches(helper, module, seen):
                return True
    return False


def pytest_configure(config):
    # In-process DeepSpeed ops load from the folder set-up built them into (the ranks' folder),
    # rather than compiling them again into torch's default one in the first test that needs them.
    from longft.engine.opbuild import extensions_dir

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None or item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
            continue  # (the GPU suite is a tier of its own: `-m slow` does not take it)
        funcs = [fn] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
                        if inspect.getmodule(d.func) is item.module]
        if any(_launches(f, item.module) for f in funcs):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _launches_only_when_slow(request, monkeypatch):
    """In a test not marked slow, starting a stage process fails at once (with what to do). GPU
    tests are a tier of their own (scripts/gpu_suite.sh) and may start stages."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("gpu"):
        return
    from longft.run import pipeline

    def refuse(name, *a, **k):
        raise AssertionError(f"{request.node.nodeid} starts the {name} stage but is not marked slow: "
                             "mark it @pytest.mark.slow (or call a LAUNCHER of tests/conftest.py "
                             "from the test's own module, which marks it)")

    monkeypatch.setattr(pipeline, "run_stage", refuse)


_too_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > FAST_LIMIT_S \
            and "slow" not in report.keywords:
        _too_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _too_slow:
        terminalreporter.section(f"unmarked tests over {FAST_LIMIT_S:.0f} s: mark them slow")
        for nodeid, s in _too_slow:
            terminalreporter.write_line(f"{s:6.1f} s  {nodeid}")


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The shipped byte tokenizer (configs/tokenizers/byte), loaded once per session."""
    from longft.config.params import ModelConfig
    from longft.model.loading import load_tokenizer

    return load_tokenizer(ModelConfig())


@pytest.fixture(autouse=True)
def _restore_liger_globals(monkeypatch):
    """Liger's instance patching also swaps module-level classes/functions of the modeling files
    (process-wide); a plan made for faked GPU hardware must not leak Liger into later CPU tests."""
    import importlib

    for mod, names in {"llama": ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"),
                       "qwen2": ("Qwen2RMSNorm", "Qwen2MLP", "apply_rotary_pos_emb")}.items():
        m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        for n in names:
            monkeypatch.setattr(m, n, getattr(m, n))
    from transformers.integrations import sdpa_attention
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)
