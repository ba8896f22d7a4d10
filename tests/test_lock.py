"""requirements/lock-cpu.txt, the lock that scripts/setup.sh installs: inside pyproject's ranges, the
same versions as the images' shared pins (requirements/common.txt), hashes for pip's
--require-hashes, and its hash in the run's environment record. Marked slow (the network, uv): both
images' pinned sets resolve together for Python 3.12 on x86_64 Linux."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from longft.engine import lockfile
from test_docker import project_requirements  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
LOCK = REQ / "lock-cpu.txt"
STALE = "out of date with pyproject.toml or requirements/: run `bash scripts/lock.sh` and commit the lock"


@pytest.fixture(scope="module")
def locked() -> dict[str, str]:
    return lockfile.pins(LOCK.read_text())


def test_the_lock_is_this_checkouts():
    assert lockfile.LOCK == LOCK and LOCK.is_file()
    assert "bash scripts/lock.sh" in LOCK.read_text().split("\n\n", 1)[0]  # the command that made it


def test_every_dependency_is_locked_inside_its_range(locked):
    deps = {**project_requirements(), **project_requirements("test")}
    missing = sorted(set(deps) - set(locked))
    assert not missing, f"pyproject dependencies the lock lacks: {missing}; {STALE}"
    outside = [f"{n}=={locked[n]} not in {r.specifier}" for n, r in deps.items()
               if not r.specifier.contains(Version(locked[n]), prereleases=True)]
    assert not outside, f"{outside}; {STALE}"


def test_the_lock_agrees_with_the_images_shared_pins(locked):
    common = lockfile.pins((REQ / "common.txt").read_text())
    assert set(common) <= set(locked)
    differ = {n: (locked[n], v) for n, v in common.items() if locked[n] != v}
    assert not differ, f"lock vs requirements/common.txt: {differ}; {STALE}"


def test_torch_is_the_cpu_build_that_requirements_cpu_names(locked):
    want = [Requirement(ln.split("#")[0]) for ln in (REQ / "cpu.txt").read_text().splitlines()
            if ln.split("#")[0].strip()]
    assert [str(r.specifier) for r in want if r.name == "torch"] == [f"=={locked['torch']}"]
    assert Version(locked["torch"]).local == "cpu"


def test_every_pin_has_a_hash():
    """pip --require-hashes refuses a lock with a pin that has none."""
    blocks = LOCK.read_text().split("\n")
    pins = [i for i, ln in enumerate(blocks) if "==" in ln and not ln.startswith((" ", "#"))]
    unhashed = [blocks[i].split()[0] for i in pins if "--hash=sha256:" not in blocks[i + 1]]
    assert not unhashed and len(pins) == len(lockfile.pins(LOCK.read_text()))


def test_names_compare_as_pip_compares_them():
    assert lockfile.canonical("Flufl.Lock") == lockfile.canonical("flufl-lock") == "flufl-lock"
    assert lockfile.canonical("typing_extensions") == canonicalize_name("typing_extensions")


def test_the_record_has_the_locks_hash_and_what_differs(tmp_path):
    import pytest as installed

    lock = tmp_path / "lock.txt"
    lock.write_text(f"pytest=={installed.__version__} \\\n    --hash=sha256:00\n"
                    "no-such-package-here==1.0 \\\n    --hash=sha256:00\n")
    rec = lockfile.record(lock)
    assert rec["env_lock"].startswith("sha256:") and len(rec["env_lock"]) == 7 + 16
    assert rec["env_lock_differs"] == ["no-such-package-here missing (lock 1.0)"]
    lock.write_text(lock.read_text().replace("1.0", "1.1"))
    assert lockfile.record(lock)["env_lock"] != rec["env_lock"]  # a new lock, a new hash
    assert lockfile.record(tmp_path / "none.txt") == {"env_lock": None, "env_lock_differs": []}


def test_many_differences_are_cut_short(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("".join(f"absent-{i}==1\n" for i in range(12)))
    assert lockfile.record(lock, limit=3)["env_lock_differs"][-1] == "... and 9 more"


def test_the_environment_record_carries_the_lock_fields():
    import inspect

    from longft.engine import environment

    assert "lockfile.record()" in inspect.getsource(environment.environment)


@pytest.mark.slow
def test_both_images_pins_resolve_together_for_python_312(tmp_path):
    """uv resolves common.txt with each image's own file (and pyproject's ranges) for CPython 3.12
    on x86_64 manylinux: metadata only, no CUDA wheel is downloaded."""
    uv = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(os.sys.executable))
    if uv is None:
        pytest.skip("uv not installed (the lock has it: bash scripts/setup.sh)")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "lock.sh"), "--images"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "UV": uv, "TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stdout + p.stderr
    for image in ("v100", "ampere"):
        resolved = lockfile.pins((tmp_path / f"longft-{image}-resolved.txt").read_text())
        pinned = {**lockfile.pins((REQ / "common.txt").read_text()),
                  **lockfile.pins((REQ / f"{image}.txt").read_text())}
        assert {n: resolved[n] for n in pinned} == pinned
        assert resolved["nvidia-cuda-runtime-cu12"].startswith("12.")  # torch's CUDA 12 build


def test_the_lock_is_sealed_and_whole():
    assert lockfile.problems(LOCK) == []
    assert LOCK.read_text().splitlines()[-1].startswith(lockfile.SEAL)


def _cut(after_pins: int) -> str:
    """The lock cut after its first `after_pins` pins (their hash lines kept)."""
    lines, kept, n = LOCK.read_text().splitlines(keepends=True), [], 0
    for ln in lines:
        if lockfile._PIN.match(ln) and not ln.startswith(" "):
            n += 1
            if n > after_pins:
                break
        kept.append(ln)
    return "".join(kept)


def test_a_lock_cut_short_or_edited_is_refused_before_any_package_is_compared(tmp_path, monkeypatch,
                                                                            capsys):
    cut = tmp_path / "lock-cpu.txt"
    cut.write_text(_cut(89))  # issue 49, L03: 89 of 163 pins, every one installed
    assert len(lockfile.pins(cut.read_text())) == 89
    assert "has no seal line" in lockfile.problems(cut)[0]
    monkeypatch.setattr(lockfile, "LOCK", cut)
    assert lockfile.main([]) == 1
    assert "environment matches" not in capsys.readouterr().out
    # the seal line kept at the end of the cut lock: its lines are not the sealed ones
    cut.write_text(_cut(89) + LOCK.read_text().splitlines(keepends=True)[-1])
    assert "is not the lock that was sealed" in lockfile.problems(cut)[0]
    assert "89 pins now, 163 sealed" in lockfile.problems(cut)[0]
    assert lockfile.main(["--check", str(cut)]) == 1
    # sealed again (what scripts/lock.sh does) it is a whole lock of its own
    lockfile.seal(cut)
    assert lockfile.problems(cut) == [] and lockfile.main(["--check", str(cut)]) == 0


def test_a_pin_without_a_hash_is_refused(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("a==1 \\\n    --hash=sha256:00\n    # via b\nb==2\n    # via c\n")
    lockfile.seal(lock)
    assert lockfile.problems(lock) == [f"{lock}: 1 pin(s) without a hash (b); write it again with "
                                       "`bash scripts/lock.sh` (or restore it from git)"]
