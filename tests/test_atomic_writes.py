"""Every file longft writes goes through longft.atomic: whole or not at all, and a write that fails
names the path and the cause in one message (a UserError), leaving no partial file. The mechanism
is tested here with the failures simulated: a full disk (ENOSPC from write), a directory where the
file goes, a file where a folder goes, a folder that is not writable, and a writer (safetensors)
that reports a full disk in its own exception."""

import errno
import os

import pytest

from longft import atomic
from longft.errors import UserError


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_a_full_disk_names_the_path_keeps_the_old_file_and_leaves_no_temporary(tmp_path,
                                                                              monkeypatch):
    target = tmp_path / "report.md"
    atomic.write_text(target, "old\n")
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])  # a few bytes, as a real full disk does
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(atomic.WriteError) as e:
        atomic.write_text(target, "new and longer\n")
    assert isinstance(e.value, UserError) and isinstance(e.value, OSError)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == (f"cannot write {target}: disk full (no space left on device) (free "
                            f"space and run again); nothing was written there")
    assert target.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_a_directory_as_the_target_is_refused_by_name(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(atomic.WriteError, match=r"cannot write .*out: it is a directory; name a file"):
        atomic.write_json(tmp_path / "out", {"a": 1})
    assert list((tmp_path / "out").iterdir()) == []


def test_a_file_where_a_folder_goes_and_a_folder_that_is_not_writable(tmp_path, monkeypatch):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(atomic.WriteError, match=f"{tmp_path / 'plain'} is a file, not a directory"):
        atomic.write_text(tmp_path / "plain" / "sub" / "a.json", "{}")

    def refused(*a, **k):  # a read-only folder (simulated: the tests may run as root)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refused)
    with pytest.raises(atomic.WriteError,
                       match=f"cannot write {tmp_path / 'a.txt'}: permission denied"):
        atomic.write_text(tmp_path / "a.txt", "x")
    assert not (tmp_path / "a.txt").exists()


def test_a_folder_is_swapped_in_whole_or_the_old_one_stays(tmp_path):
    out = tmp_path / "export"
    with atomic.directory(out) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
    assert (out / "a.bin").read_bytes() == b"1" and _leftovers(tmp_path) == []

    from safetensors import SafetensorError

    with pytest.raises(atomic.WriteError) as e:
        with atomic.directory(out) as tmp:
            (tmp / "b.bin").write_bytes(b"half")
            # what safetensors raises when the disk fills up under save_pretrained
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                                  "StorageFull, message: \"No space left on device\" })")
    assert str(e.value).startswith(f"cannot write {out}: disk full (no space left on device)")
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in out.iterdir()) == ["a.bin"]  # the earlier folder, intact
    assert _leftovers(tmp_path) == []  # no half-written folder beside it

    with pytest.raises(ZeroDivisionError):  # not a write failure: kept as it is, still cleaned
        with atomic.directory(out) as tmp:
            raise ZeroDivisionError
    assert _leftovers(tmp_path) == [] and (out / "a.bin").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(atomic.WriteError, match="it is a file, not a directory"):
        with atomic.directory(tmp_path / "file"):
            pass


def test_the_write_failure_rule_is_the_checkpoints_too():
    from longft.engine import checkpoint

    assert checkpoint._write_failed is atomic.write_failed
    assert atomic.write_failed(RuntimeError("PytorchStreamWriter failed writing file data/3"))
    assert not atomic.write_failed(RuntimeError("shapes do not match"))
