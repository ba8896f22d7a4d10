"""The data error type and the `data.on_bad_record` policy (stop, or skip and count)."""

from __future__ import annotations

from collections import Counter

from longft.errors import UserError


class DataError(UserError, ValueError):
    """Data that cannot be prepared or read; the message names where (file:line) and the fix.

    `reason` is a short key (bad_json, missing_key, ...) under which a skipped record is counted
    in stats.json; None for problems that skipping cannot fix (a missing file, no chat template).
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class BadRecords:
    """Applies `data.on_bad_record`: `error` raises the DataError, `skip` counts it by reason."""

    def __init__(self, mode: str):
        if mode not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip', got {mode!r}")
        self.mode = mode
        self.counts: Counter[str] = Counter()

    def handle(self, err: DataError) -> None:
        if self.mode == "error":
            raise DataError(f"{err} (or set data.on_bad_record: skip to skip and count such "
                            f"records)", err.reason) from None
        self.counts[err.reason or "other"] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())
