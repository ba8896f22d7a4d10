"""Turn a completed run into the one a kill after its last periodic checkpoint leaves, for tests of
resume that start from a run of the stages (a completed run in place is retrained, not resumed:
run/earlier.py). A killed run never writes checkpoints/final/ (written after the last step), and its
configuration's record is never marked complete (only a train stage that exits 0 marks it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from longft.run.earlier import RECORD


def as_killed_after_last_checkpoint(ckpt_dir: Path) -> None:
    ckpt_dir = Path(ckpt_dir)
    shutil.rmtree(ckpt_dir / "final", ignore_errors=True)
    record = ckpt_dir / RECORD
    rec = json.loads(record.read_text())
    assert rec.pop("complete", None), f"{record}: the run was meant to have completed"
    record.write_text(json.dumps(rec))
