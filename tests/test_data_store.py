"""On-disk prepared dataset: round trip, atomic replacement, reader errors."""

import json

import numpy as np
import pytest
import torch

from longft.config.params import from_dict
from longft.data.errors import DataError
from longft.data.prepare import prepare
from longft.data.store import DatasetWriter, PreparedDataset, write_dataset

META = {"vocab_size": 300, "pad_token_id": 258, "source": "jsonl", "format": "text"}


def arrays(n=3, length=8, offset=0):
    ids = (np.arange(n * length, dtype=np.int32).reshape(n, length) + offset) % 300
    labels = np.where(ids % 2 == 0, ids, -100).astype(np.int32)
    pos = np.tile(np.arange(length, dtype=np.int32), (n, 1))
    return ids, labels, pos


def test_round_trip(tmp_path):
    ids, labels, pos = arrays()
    write_dataset(tmp_path / "prep", ids, labels, pos, META, extra={"stats.json": {"rows": 3}})
    ds = PreparedDataset(tmp_path / "prep")
    assert len(ds) == 3 and ds.max_seq_length == 8
    assert ds.meta == {"num_rows": 3, "max_seq_length": 8, **META,
                       "content_sha256": ds.meta["content_sha256"]}
    assert json.loads((tmp_path / "prep" / "stats.json").read_text()) == {"rows": 3}
    row = ds[1]
    assert set(row) == {"input_ids", "labels", "position_ids"}
    assert all(t.dtype == torch.long for t in row.values())
    assert row["input_ids"].tolist() == ids[1].tolist()
    assert row["labels"].tolist() == labels[1].tolist()
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert batch["position_ids"].shape == (2, 8)


def test_failed_write_keeps_the_old_dataset_and_leaves_no_temp(tmp_path):
    write_dataset(tmp_path / "prep", *arrays(), META)
    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter(tmp_path / "prep", 5, 8) as w:
            new_ids, new_labels, new_pos = arrays(5, 8, offset=7)
            w.write(0, new_ids[0], new_labels[0], new_pos[0])
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]
    ds = PreparedDataset(tmp_path / "prep")
    assert len(ds) == 3 and ds[0]["input_ids"].tolist() == arrays()[0][0].tolist()


def test_failed_prepare_keeps_the_old_dataset(tmp_path):
    cfg = from_dict({"data": {"source": "random", "num_samples": 2, "max_seq_length": 16}})
    prepare(cfg, tmp_path / "prep")
    before = np.load(tmp_path / "prep" / "input_ids.npy")
    broken = from_dict({"data": {"source": "jsonl", "path": str(tmp_path / "none.jsonl")}})
    with pytest.raises(DataError):
        prepare(broken, tmp_path / "prep")
    assert (np.load(tmp_path / "prep" / "input_ids.npy") == before).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]


def test_successful_write_replaces_the_old_dataset(tmp_path):
    write_dataset(tmp_path / "prep", *arrays(), META)
    write_dataset(tmp_path / "prep", *arrays(2, 4, offset=5), META)
    ds = PreparedDataset(tmp_path / "prep")
    assert len(ds) == 2 and ds[0]["input_ids"].tolist() == [5, 6, 7, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]


def test_reader_errors_say_how_to_fix(tmp_path):
    with pytest.raises(DataError, match=r"no prepared dataset here; run `dvc repro prepare`"):
        PreparedDataset(tmp_path / "absent")
    write_dataset(tmp_path / "prep", *arrays(), META)
    (tmp_path / "prep" / "labels.npy").unlink()
    with pytest.raises(DataError, match=r"incomplete prepared dataset \(missing labels.npy\)"):
        PreparedDataset(tmp_path / "prep")
    write_dataset(tmp_path / "prep", *arrays(), META)
    meta = json.loads((tmp_path / "prep" / "meta.json").read_text())
    (tmp_path / "prep" / "meta.json").write_text(json.dumps({**meta, "num_rows": 4}))
    with pytest.raises(DataError, match=r"do not match meta.json \(4, 8\)"):
        PreparedDataset(tmp_path / "prep")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_prepare_removes_what_a_killed_prepare_left_and_says_so(tmp_path, capsys):
    import os
    import time

    dead = tmp_path / f".prep.tmp-{_dead_pid()}-abc"  # kill -9 mid-write: the writer is gone
    (dead / "input_ids.npy").parent.mkdir()
    (dead / "input_ids.npy").write_bytes(b"\0" * 2**20)
    running = tmp_path / f".prep.tmp-{os.getppid()}-xyz"  # a prepare that still runs: kept
    running.mkdir()
    old_style = tmp_path / ".prep.tmp-q1w2e3"  # no pid in the name: by age
    old_style.mkdir()
    os.utime(old_style, (time.time() - 7200, time.time() - 7200))
    young = tmp_path / ".prep.tmp-r4t5y6"
    young.mkdir()
    write_dataset(tmp_path / "prep", *arrays(), META)
    err = capsys.readouterr().err
    assert not dead.exists() and not old_style.exists()
    assert running.is_dir() and young.is_dir()
    assert f"removed {dead}" in err and "no longer runs" in err and "1.0 MiB" in err
    assert f"removed {old_style}" in err and "2.0 h ago" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["prep", running.name, young.name])


def test_the_temporary_directory_names_its_writer(tmp_path):
    import os

    with DatasetWriter(tmp_path / "prep", 1, 4) as w:
        assert w.tmp.name.startswith(f".prep.tmp-{os.getpid()}-")
