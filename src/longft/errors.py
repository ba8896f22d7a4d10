"""The one base class of the errors a user can fix."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix: params, data, the model path, or hardware that cannot do what
    was asked. The message says what is wrong and what to change.

    Stages, the rank worker and the `longft` commands print its message (no traceback) and exit 2;
    any other exception is a bug or an environment failure and keeps its traceback. Each subclass
    also keeps the builtin base it had before (ValueError, RuntimeError), so older `except` clauses
    still catch it.
    """


class ProblemsError(UserError):
    """A UserError that lists every problem found in one source (a params or grid file)."""

    def __init__(self, problems: list[str], source: str):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in {source}:\n{lines}")


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (engine/); the message says at which step and what to change."""
