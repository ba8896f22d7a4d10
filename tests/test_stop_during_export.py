"""A signal during the final checkpoint or the export (issue 49's final/ and issue 48's completed
record together): the stage exits 130/143, so DVC runs it again; that re-run must resume the final
checkpoint and train no step again, so final/ is not marked finished."""

import json
import signal
from types import SimpleNamespace

import pytest
import torch

from longft.config.params import from_dict
from longft.engine import checkpoint, stop, trainer


class Log:
    def __init__(self):
        self.records = []

    def write(self, kind, **fields):
        self.records.append({"type": kind, **fields})

    def close(self):
        pass


class Stopper:
    """No signal after the last step (nor during the final evaluation); one during the final
    checkpoint or the export."""

    def __init__(self):
        self.calls = 0

    def agreed(self, device):
        self.calls += 1
        return signal.SIGINT if self.calls > 1 else 0


def test_a_signal_during_the_export_leaves_final_unfinished(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    cfg = from_dict({"train": {"iterations": 3}})
    assert cfg.output.save_checkpoint
    (tmp_path / "final").mkdir()   # resumed from the final checkpoint of a run whose export failed
    (tmp_path / "final" / checkpoint.MARKER).write_text(json.dumps({"fingerprint": "fp", "step": 3}))
    s = trainer.Session(engine=SimpleNamespace(device="cpu"), model=torch.nn.Linear(2, 2), keep=None,
                        offloader=None, batches=iter(()), pad_id=0, fingerprint="fp", start=3,
                        rank=0, world=1, cuda=False)
    plan = SimpleNamespace(resolved=SimpleNamespace(sdpa_backend=SimpleNamespace(value="default")))
    log = Log()
    with pytest.raises(stop.Stopped):
        trainer.loop(s, cfg, plan, log=log, ckpt_dir=tmp_path, stopper=Stopper())
    assert log.records[-1]["status"] == "complete"
    # the stage exits 130: its re-run resumes final/ (step 3) instead of retraining
    assert checkpoint.newest(tmp_path, "fp") == (3, "final")
