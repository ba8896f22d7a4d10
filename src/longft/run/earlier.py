"""What an earlier run left (checkpoints, measurements) is never destroyed by a new run.

checkpoints/ holds, at its top level, the checkpoints of one configuration (one training
trajectory, engine/trajectory.py): step-<N>/, final/, latest and TRAJECTORY.json, which names the
configuration (fingerprint and params). Before any rank starts, `Earlier.arrange`:
- moves the checkpoints of another configuration to checkpoints/other/<fingerprint>/, with its
  measurements (runs/train) as run/, and says so in one line that names the params that differ
  and how to resume it. Nothing else deletes them: `rm -r checkpoints/other/<fingerprint>`
  (or checkpoints/other) does, by hand. A move is a rename: it costs no disk space;
- brings this configuration's checkpoints (and measurements) back from
  checkpoints/other/<fingerprint>/ when its params were set back: the run resumes them (a
  completed run's final/ is not resumed: with no step-<N> beside it, the run retrains, and the
  lines, here and where it was parked, say so);
- moves runs/train of the run before aside (runs/.train.previous) when this run starts afresh;
- says in one line which checkpoint the run resumes and why, or why none.
A run that completed marks its configuration's record complete; a run of the same configuration
right after it, in place (`dvc repro -f`, `dvc exp run -f`), retrains from step 0 instead of
resuming the completed run's last periodic checkpoint (checkpoints brought back from other/, when
params were set back to theirs, are resumed): those checkpoints wait in checkpoints/other/<fingerprint>.completed/
until it completes (then they are deleted: it replaced them), and its measurements are its own.
After the run, `Earlier.finish`: a run that completed deletes runs/.train.previous; a run that
ended before its first step (refused or failed at start) puts everything back where it was, so a
refusal changes nothing; a run stopped or failed later keeps its own measurements in runs/train
(a re-run resumes them) and the previous run's in runs/.train.previous until a run completes.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from longft.atomic import write_json
from longft.engine.checkpoint import MARKER, OTHER, STEP_DIR, complete_steps, newest
from longft.engine.trajectory import differences

RECORD = "TRAJECTORY.json"  # {"fingerprint": ..., "params": trajectory}, in checkpoints/ and runs/train
RUN = "run"  # the measurements (runs/train) of a configuration kept in checkpoints/other/<fp>/


def _read_record(d: Path) -> dict:
    try:
        rec = json.loads((d / RECORD).read_text())
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def _step_fingerprints(ckpt_dir: Path) -> dict[str, str]:
    """step-<N> folder name -> the fingerprint in its COMPLETE (complete checkpoints only)."""
    out = {}
    for d in ckpt_dir.iterdir():
        if STEP_DIR.match(d.name) and (d / MARKER).is_file():
            try:
                out[d.name] = json.loads((d / MARKER).read_text())["fingerprint"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return out


def _gib(paths: list[Path]) -> float:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*"))
               if f.is_file()) / 2**30


def _step_key(name: str) -> int:
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else -1


def _on_set_back(complete: bool, steps: list[str]) -> str:
    """What setting a parked configuration's params back does (the parking line's last words):
    an unfinished run resumes; a completed run's final/ is not resumed (engine/checkpoint.py
    final_step), its newest periodic checkpoint is."""
    if not complete:
        return "Set them back to resume it"
    if steps:
        return f"Its run completed: set back, a run resumes its {steps[0]} and trains the steps after it again"
    return ("Its run completed: set back, a run retrains it from step 0 (a completed run's final/ "
            "is not resumed)")


@dataclass
class Earlier:
    """The moves made before a run (undone when it makes no step) and what to say about them."""

    ckpt_dir: Path | None
    run_dir: Path
    fingerprint: str
    moves: list[tuple[Path, Path]] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)  # files made here, removed by an undo
    lines: list[str] = field(default_factory=list)
    resumable: int = 0  # the newest complete checkpoint of this configuration (0: none)
    resumable_tag: str = ""  # its folder: step-<N> or final
    started: float = 0.0
    undone: bool = False  # finish() put everything back: the run made no step
    completed: int = -1  # a completed run of this configuration retrained: its newest step (0: none)
    brought_back: Path | None = None  # checkpoints/other/<fp>/ this configuration came back from
    brought_back_completed: bool = False  # and its run had completed

    @property
    def previous(self) -> Path:
        """Where the measurements of the run before this one wait until this one completes."""
        return self.run_dir.parent / f".{self.run_dir.name}.previous"

    def _move(self, src: Path, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while dst.exists():  # never over something kept: a second copy gets a suffix
            dst = dst.with_name(f"{dst.name.split('~')[0]}~{n}")
            n += 1
        shutil.move(str(src), str(dst))
        self.moves.append((src, dst))

    # -- before the run ----------------------------------------------------------------------

    def arrange(self, traj: dict, resume: bool) -> None:
        """Park other configurations' checkpoints, bring this one's back, set runs/train aside
        for a fresh run; `lines` then say what was done and which checkpoint is resumed."""
        run_owner = _read_record(self.run_dir).get("fingerprint") if self.run_dir.is_dir() else None
        if self.ckpt_dir is not None:
            self._park(traj, run_owner)
            # before _bring_back: only a run that completed in place is retrained (a forced
            # re-run); checkpoints brought back from other/ (params set back) are resumed
            self._retire_completed()
            self._bring_back()
            self.resumable, self.resumable_tag = newest(self.ckpt_dir, self.fingerprint) \
                if resume else (0, "")
        run_owner = _read_record(self.run_dir).get("fingerprint") if self.run_dir.is_dir() else None
        here = self.run_dir.is_dir() and any(self.run_dir.iterdir())
        aside = any(dst == self.previous for _, dst in self.moves)  # already, by _bring_back
        other = run_owner is not None and run_owner != self.fingerprint
        if here and not aside and (not self.resumable or other):
            # the run before this one (a finished run, or another configuration's): kept aside.
            # Records without an owner (a rank run on its own, an older longft) beside a
            # resumable checkpoint of this configuration are the steps the resumed run continues
            self._set_aside()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._record(self.run_dir, {"fingerprint": self.fingerprint})
        if self.ckpt_dir is not None:
            self._record(self.ckpt_dir, {"fingerprint": self.fingerprint, "params": traj})
        self.lines.append(self._why(resume))
        self.started = time.time()

    @property
    def retired(self) -> Path:
        """Where a completed run's checkpoints of this configuration wait while it is re-run."""
        return self.ckpt_dir / OTHER / f"{self.fingerprint}.completed"

    def _retire_completed(self) -> None:
        """A completed run of this configuration is not resumed (a forced re-run retrains): its
        checkpoints move aside, to be deleted once this run completes."""
        ckpt = self.ckpt_dir
        record = _read_record(ckpt)
        if record.get("fingerprint") != self.fingerprint or not record.get("complete"):
            return
        steps = complete_steps(ckpt, self.fingerprint)
        self.completed = steps[0] if steps else 0
        for name in [f"step-{n}" for n in steps] + ["final", "latest"]:
            if (ckpt / name).exists():
                self._move(ckpt / name, self.retired / name)

    def _record(self, d: Path, rec: dict) -> None:
        if not (d / RECORD).exists():
            self.created.append(d / RECORD)
        write_json(d / RECORD, rec)

    def _set_aside(self) -> None:
        if self.previous.exists():
            shutil.rmtree(self.previous)  # the run before that one
        self._move(self.run_dir, self.previous)

    def _park(self, traj: dict, run_owner: str | None) -> None:
        """Move the top level's checkpoints of other configurations to other/<fp>/ (runs/train
        with them when it is their measurements)."""
        ckpt = self.ckpt_dir
        ckpt.mkdir(parents=True, exist_ok=True)
        record = _read_record(ckpt)
        steps = _step_fingerprints(ckpt)
        owner = record.get("fingerprint") or (
            steps[max(steps, key=_step_key)] if steps else None)
        groups: dict[str, list[str]] = {}
        for name, fp in steps.items():
            if fp != self.fingerprint:
                groups.setdefault(fp, []).append(name)
        if owner is not None and owner != self.fingerprint:
            groups.setdefault(owner, []).extend(
                n for n in ("final", "latest", RECORD) if (ckpt / n).exists())
        for fp, names in groups.items():
            if not any(STEP_DIR.match(n) or n == "final" for n in names):
                continue  # nothing but a record: nothing to keep
            dest = ckpt / OTHER / fp
            size = _gib([ckpt / n for n in names])
            for n in names:
                self._move(ckpt / n, dest / n)
            if fp == owner and run_owner == owner and self.run_dir.is_dir():
                self._move(self.run_dir, dest / RUN)
            shown = sorted((n for n in names if n not in (RECORD, "latest")), key=_step_key,
                           reverse=True)
            diff = differences(record["params"], traj) if fp == owner and record.get("params") \
                else None
            if diff:
                steps = [n for n in shown if STEP_DIR.match(n)]
                what = ("params that differ from this run's: " + "; ".join(diff[:6])
                        + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
                        + ". " + _on_set_back(bool(record.get("complete")), steps))
            elif diff is not None:
                what = ("the same params, fingerprinted by another longft version: it is not "
                        "resumed")
            else:
                what = ("its params were not recorded (written by an earlier longft); "
                        "params set back to its values resume it")
            self.lines.append(
                f"train: checkpoints of another configuration ({', '.join(shown)}; "
                f"{size:.2f} GiB) kept in {dest}/: {what}; `rm -r {dest}` deletes them")

    def _bring_back(self) -> None:
        """This configuration's checkpoints (and measurements), parked by an earlier run."""
        ckpt = self.ckpt_dir
        back = ckpt / OTHER / self.fingerprint
        if not back.is_dir():
            return
        self.brought_back, self.brought_back_completed = back, bool(_read_record(back).get("complete"))
        for item in sorted(back.iterdir()):
            if item.name == RUN:
                if self.run_dir.exists():
                    self._set_aside()
                self._move(item, self.run_dir)
            elif not (ckpt / item.name).exists():
                self._move(item, ckpt / item.name)
        if not any(back.iterdir()):
            back.rmdir()
        done = "; its run completed" if self.brought_back_completed else ""
        self.lines.append(f"train: checkpoints of this configuration brought back from {back}/ "
                          f"(its params were set back{done})")

    def _why(self, resume: bool) -> str:
        """The one line: which checkpoint this run resumes and why, or why none."""
        if self.ckpt_dir is None:
            return ("train: starting at step 0: this run writes no checkpoints "
                    "(output.save_checkpoint false, output.checkpoint_every 0) and resumes none")
        if self.completed >= 0:
            newest = f", step-{self.completed} its newest checkpoint" if self.completed else ""
            return (f"train: starting at step 0: the run of this configuration in "
                    f"{self.ckpt_dir} completed{newest}; a re-run (dvc repro -f) retrains and "
                    f"measures itself (its checkpoints wait in {self.retired}/ until it completes)")
        if self.resumable:
            return (f"train: resuming from {self.ckpt_dir}/{self.resumable_tag}: a checkpoint "
                    f"of this configuration (same training params, fingerprint "
                    f"{self.fingerprint}; output.resume)")
        mine = complete_steps(self.ckpt_dir, self.fingerprint)
        if self.brought_back_completed and not mine:   # final/ of a finished run: not resumed
            return (f"train: starting at step 0: the run of this configuration brought back from "
                    f"{self.brought_back}/ completed (a completed run's final/ is not resumed); "
                    f"this run retrains and measures itself")
        if mine and not resume:
            return (f"train: starting at step 0: output.resume is false (this configuration's "
                    f"checkpoints in {self.ckpt_dir}, step-{mine[0]} the newest, are not resumed; "
                    "keep_last of them stay as this run saves its own)")
        return (f"train: starting at step 0: no checkpoint of this configuration (fingerprint "
                f"{self.fingerprint}) in {self.ckpt_dir}")

    # -- after the run -----------------------------------------------------------------------

    def made_a_step(self) -> bool:
        """Whether the ranks logged an optimizer step since `arrange` (rank files of this node)."""
        for f in self.run_dir.glob("rank*.jsonl"):
            try:
                for line in f.read_text().splitlines():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("type") == "iter" and rec.get("t", 0) >= self.started:
                        return True
            except OSError:
                continue
        return False

    def finish(self, code: int) -> str | None:
        """After the run with exit status `code`: a line to print, or None."""
        if code == 0:
            shutil.rmtree(self.previous, ignore_errors=True)
            if self.ckpt_dir is not None:
                shutil.rmtree(self.retired, ignore_errors=True)   # this run replaced them
                other = self.ckpt_dir / OTHER
                if other.is_dir() and not any(other.iterdir()):
                    other.rmdir()
                write_json(self.ckpt_dir / RECORD, {**_read_record(self.ckpt_dir), "complete": True})
            return None
        if not self.made_a_step():
            if not self.moves:
                return None  # nothing was moved: what the failed run wrote is all there is
            self.undo()
            self.undone = True
            return ("train: the run ended before its first step: runs/train and checkpoints/ "
                    "are as they were before it")
        if self.previous.exists():
            return (f"train: the measurements of the run before this one are kept in "
                    f"{self.previous} until a run completes")
        return None

    def undo(self) -> None:
        """Put back what `arrange` moved; remove what this run created in their place."""
        for f in self.created:
            f.unlink(missing_ok=True)
        if any(src == self.run_dir for src, _ in self.moves) and self.run_dir.exists():
            shutil.rmtree(self.run_dir)  # what the refused run wrote (memory.csv, ...)
        other = self.ckpt_dir / OTHER if self.ckpt_dir is not None else None
        for src, dst in reversed(self.moves):
            if not src.exists():
                src.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(dst), str(src))
            for d in (dst.parent, src.parent):  # a folder under other/ left empty
                if other is not None and d.parent == other and d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
        if other is not None and other.is_dir() and not any(other.iterdir()):
            other.rmdir()
        if self.completed >= 0:   # still the completed run's checkpoints: not to be resumed
            write_json(self.ckpt_dir / RECORD, {**_read_record(self.ckpt_dir), "complete": True})
        self.moves.clear()
