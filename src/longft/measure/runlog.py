"""Raw per-rank measurements: runs/train/rank{r}.jsonl, one JSON object per line, flushed each step.

Line types: "env" (rank 0, once), "iter" (one per optimizer step), "eval" (held-out loss and
retrieval score after a step, engine/evaluate.py), "end" (status). The metrics stage
reads them; a run that dies leaves no "end" line and is reported as incomplete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from longft.atomic import write_text


class RunLog:
    """`with RunLog(run_dir, rank) as log:` - the file is flushed, synced and closed when the block
    ends, also when it ends in an exception (the "end" record written before it is kept)."""

    def __init__(self, run_dir: Path, rank: int, resume_step: int = 0):
        """A fresh log, or (resume_step > 0) the old one cut back to its steps <= resume_step."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = run_dir / f"rank{rank}.jsonl"
        kept = []
        if resume_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # the line a kill cut in half
                if rec.get("type") == "env" or (rec.get("type") in ("iter", "eval")
                                                and rec.get("step", 0) <= resume_step):
                    kept.append(line)
        if resume_step > 0:  # cut back atomically: a kill now must not lose the steps kept
            write_text(self.path, "".join(line + "\n" for line in kept))
        self._f = open(self.path, "a" if resume_step > 0 else "w", buffering=1)

    def write(self, kind: str, **fields) -> None:
        rec = {"type": kind, "rank": self.rank, "t": time.time(), **fields}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Flush, sync and close; closing again does nothing."""
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
