"""`longft sweep`: grid validation (every problem of every row, before anything is queued), the
exact `dvc exp run --queue` commands, bench overlays, the shipped reference grid, and one real
queue in a throwaway git + DVC repository (a few seconds; nothing is run)."""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from longft.cli import main as cli
from longft.config.params import Config, TrainConfig, from_dict, merge, to_dict
from longft.run import sweep

REPO = Path(__file__).resolve().parents[1]
# the train section's keys as the strict loader lists them (its sorted field names)
TRAIN_KEYS = ", ".join(sorted(f.name for f in dataclasses.fields(TrainConfig)))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with the shipped params.yaml (the dataclass defaults, not the workspace's edits),
    as the current directory."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(to_dict(Config()), sort_keys=False))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def no_subprocess(monkeypatch):
    def fail(*a, **k):
        raise AssertionError(f"subprocess started: {a}")
    monkeypatch.setattr(sweep.subprocess, "run", fail)


GRID = """\
- name: 8b-128k-2gpu
  model.name: llama3.1-8b
  data.max_seq_length: 128000
  hardware.num_gpus: 2
  train.global_batch_size: 2
  zero: {offload_param: cpu}
- {model.name: Qwen/Qwen2.5-14B, model.source: pretrained, precision: bf16,
   optim.betas: [0.9, 0.99]}
"""


def test_dry_run_prints_exact_commands(workdir, monkeypatch, capsys):
    no_subprocess(monkeypatch)
    grid = write(workdir / "grid.yaml", GRID)
    assert cli.main(["sweep", str(grid), "--dry-run", "--run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dvc exp run --queue -S 'model.name=llama3.1-8b' -S 'data.max_seq_length=128000'"
        " -S 'hardware.num_gpus=2' -S 'train.global_batch_size=2' -S 'zero.offload_param=cpu'"
        " -n 8b-128k-2gpu",
        "dvc exp run --queue -S 'model.name=Qwen/Qwen2.5-14B' -S 'model.source=pretrained'"
        " -S 'precision=bf16' -S 'optim.betas=[0.9,0.99]'",
        "dvc queue start --jobs 1",
    ]
    assert cli.main(["sweep", str(grid), "--dry-run"]) == 0  # without --run: queue only
    assert "queue start" not in capsys.readouterr().out


def test_every_problem_listed_before_anything_is_queued(workdir, monkeypatch, capsys):
    no_subprocess(monkeypatch)
    grid = write(workdir / "grid.yaml", """\
- {name: a, zero.offload_param: gpu, train.foo: 1}
- just a string
- {name: a, hardware.num_gpus: 4, train.global_batch_size: 6}
- {name: "bad name!", optim.lr: -1}
- {name: c}
- {name: d, zero: 3, zero.stage: 2}
""")
    with pytest.raises(sweep.SweepError) as e:
        sweep.load(grid)
    assert e.value.problems == [
        "row 2: expected a mapping of dotted param keys, got 'just a string'",
        "row 3: name 'a' is used by an earlier row",
        "row 4: name 'bad name!' must match [A-Za-z0-9][A-Za-z0-9._-]*",
        "row 5: no params to set",
        "row 6: zero is set both as a value and as a section",
        f"row 1 (a): train.foo: unknown key (known: {TRAIN_KEYS})",
        "row 1 (a): zero.offload_param: 'gpu' is not one of 'none' | 'cpu'",
        "row 3 (a): train.global_batch_size (6) must be a multiple of train.micro_batch_size x"
        " GPUs (1 x 4 = 4); e.g. set it to 4",
        "row 4: optim.lr: must be > 0, got -1.0",
    ]
    assert cli.main(["sweep", str(grid), "--run"]) == 2
    err = capsys.readouterr().err
    assert "9 problem(s) in" in err and "Nothing was run or queued." in err


def test_not_a_list_and_only_filter(workdir):
    with pytest.raises(sweep.SweepError, match="expected a non-empty YAML list"):
        sweep.load(write(workdir / "g.yaml", "just text\n"))
    grid = write(workdir / "grid.yaml", GRID)
    assert [r.name for r in sweep.load(grid, only=("8b-*",))] == ["8b-128k-2gpu"]
    with pytest.raises(sweep.SweepError, match="no row name matches 1b-"):
        sweep.load(grid, only=("1b-*",))


def test_hydra_values_read_back_unchanged():
    hydra = pytest.importorskip("hydra.core.override_parser.overrides_parser")
    parser = hydra.OverridesParser.create()
    values = ["llama3.1-8b", "meta-llama/Llama-3.1-8B", "configs/models/x.json", "on", "null",
              "True", "16384", "it's", "a b", "back\\slash", "end\\", "q\\'x", "",
              16384, -1, 1e-4, 1.0e-8, 0.95,
              True, False, None, [0.9, 0.95], ["q_proj", "v_proj"]]
    for v in values:
        got = parser.parse_overrides([f"k={sweep.hydra_value(v)}"])[0].value()
        assert got == v and type(got) is type(v), (v, sweep.hydra_value(v), got)


def test_shell_line_reads_back_as_the_arguments():
    row = sweep.GridRow("x", {"model.name": "it's", "data.path": "/data/a b.jsonl"})
    args = sweep.queue_args(row)
    assert args == ["exp", "run", "--queue", "-S", "model.name='it\\'s'",
                    "-S", "data.path='/data/a b.jsonl'", "-n", "x"]
    assert shlex.split(sweep.shell_line(args)) == ["dvc", *args]


def test_reference_grid_is_valid(workdir):
    rows = sweep.load(REPO / "bench" / "grids" / "reference.yaml")
    base = to_dict(Config())
    got = {}
    for row in rows:
        cfg = from_dict(merge(base, sweep._nest(row.overrides)))
        assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.world_size
        assert cfg.zero.offload_optimizer == cfg.zero.offload_param == "cpu"
        assert cfg.data.source == "random" and not cfg.output.save_checkpoint
        got.setdefault((cfg.model.name, cfg.data.max_seq_length, cfg.train.micro_batch_size),
                       []).append(cfg.hardware.num_gpus)
    assert got == {("llama3.2-1b", 16384, 20): [1, 2, 4, 8],
                   ("llama3.1-8b", 128000, 1): [1, 2, 4, 7, 8],
                   ("qwen2.5-14b", 128000, 1): [4, 7]}


def test_overlays_for_bench(workdir, capsys):
    grid = write(workdir / "grid.yaml", GRID)
    assert cli.main(["sweep", str(grid), "--overlays", "ov"]) == 0
    assert sorted(p.name for p in (workdir / "ov").iterdir()) == ["8b-128k-2gpu.yaml", "row2.yaml"]
    doc = yaml.safe_load((workdir / "ov" / "8b-128k-2gpu.yaml").read_text())
    assert doc.pop("bench_note").endswith("row 1 (8b-128k-2gpu)")
    assert doc == {"model": {"name": "llama3.1-8b"}, "data": {"max_seq_length": 128000},
                   "hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2},
                   "zero": {"offload_param": "cpu"}}


def test_report_item_is_skipped_by_sweep(workdir, capsys):
    """A grid's optional first item `report:` (plot axes for `longft report --grid`) is not a
    row: not validated against params, not queued, not counted in row numbers."""
    grid = write(workdir / "grid.yaml", "- report: {x: train.micro_batch_size}\n" + GRID)
    assert [r.number for r in sweep.load(grid)] == [1, 2]
    assert cli.main(["sweep", str(grid), "--overlays", "ov"]) == 0
    assert sorted(p.name for p in (workdir / "ov").iterdir()) == ["8b-128k-2gpu.yaml", "row2.yaml"]
    assert cli.main(["sweep", str(grid), "--dry-run"]) == 0
    assert "report" not in capsys.readouterr().out
    late = write(workdir / "late.yaml", GRID + "- report: {x: train.micro_batch_size}\n")
    with pytest.raises(sweep.SweepError, match="row 3: the report: item must come first"):
        sweep.load(late)
    bad = write(workdir / "bad.yaml", "- report: {x: 3, colour: red}\n" + GRID)
    with pytest.raises(sweep.SweepError) as e:
        sweep.load(bad)
    assert e.value.problems == [
        "the report: item: unknown key(s) colour (known: x, series)",
        "the report: item: x must be a dotted param key or `name`, got 3"]


def dvc(*args, cwd):
    p = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.slow  # real `dvc exp run --queue` processes: 34-42 s on 2 busy cores
def test_queue_for_real(workdir, monkeypatch, capsys):
    """Queue two rows in a throwaway repository and read them back from `dvc exp show`; then the
    names of existing experiments, as DVC itself lists them: a row queued again is left out, and
    two placement overlays of one file name run one after the other (walkthrough finding 3)."""
    for k, v in (("GIT_AUTHOR_NAME", "t"), ("GIT_AUTHOR_EMAIL", "t@t"), ("GIT_COMMITTER_NAME", "t"),
                 ("GIT_COMMITTER_EMAIL", "t@t")):
        monkeypatch.setenv(k, v)
    write(workdir / "dvc.yaml", "stages:\n  train:\n    cmd: python -c 'print(1)'\n"
                                "    params: [model, data, hardware, train]\n")
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    dvc("init", "-q", cwd=workdir)
    subprocess.run(["git", "add", "-A"], cwd=workdir, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=workdir, check=True)
    grid = write(workdir / "grid.yaml", GRID)
    assert cli.main(["sweep", str(grid)]) == 0
    exps = json.loads(dvc("exp", "show", "--json", cwd=workdir))[1]["experiments"]
    assert all(e["executor"]["state"] == "queued" for e in exps)  # never started here
    queued = {e["name"]: e["revs"][0]["data"]["params"]["params.yaml"]["data"] for e in exps}
    assert len(queued) == 2
    p = queued.pop("8b-128k-2gpu")
    assert (p["model"]["name"], p["data"]["max_seq_length"], p["hardware"]["num_gpus"],
            p["train"]["global_batch_size"], p["zero"]["offload_param"]) == \
        ("llama3.1-8b", 128000, 2, 2, "cpu")
    (p,) = queued.values()  # no name in the grid: DVC made one up
    assert (p["model"]["name"], p["model"]["source"], p["precision"], p["optim"]["betas"]) == \
        ("Qwen/Qwen2.5-14B", "pretrained", "bf16", [0.9, 0.99])
    capsys.readouterr()
    assert cli.main(["sweep", str(grid), "--only", "8b-*"]) == 0   # queued: not queued again
    assert "row 1 (8b-128k-2gpu): already queued with these params" in capsys.readouterr().out
    ov = write(workdir / "overlay.yaml", "data: {max_seq_length: 8192}\n")
    first = sweep.load(ov)[0].name
    assert cli.main(["sweep", str(ov), "--temp"]) == 0
    write(ov, "data: {max_seq_length: 4096}\n")                  # another answer, same file name
    assert cli.main(["sweep", str(ov), "--temp"]) == 0
    assert cli.main(["sweep", str(ov), "--temp"]) == 0            # the same again: left out
    assert "already ran with these params" in capsys.readouterr().out
    assert cli.main(["sweep", str(ov), "--temp", "-n", first]) == 2   # caught before DVC runs
    assert "data.max_seq_length: 8192 -> 4096" in capsys.readouterr().err
    ran = dvc("exp", "list", "--name-only", cwd=workdir).split()
    assert first in ran and sweep.load(ov)[0].name in ran


def test_one_overlay_runs_now_in_a_temporary_copy(workdir, monkeypatch, capsys):
    """Issue 48: a `longft placement --out` overlay (one nested mapping, with its comment header) is
    one row named after its file, run with `dvc exp run --temp` (the workspace's params.yaml is not
    changed, so the next experiment does not inherit it); its problems are refused like a row's."""
    ov = write(workdir / "overlay.lora-r-16.yaml", "# longft placement: ...\n"
               "data: {max_seq_length: 8192}\nzero: {stage: 3, offload_param: cpu}\n"
               "lora: {rank: 16, quantize: none}\n")
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run",
                        lambda cmd: calls.append(cmd) or sweep.subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(sweep.sweep_names, "existing", dict)   # no experiment yet
    before = (workdir / "params.yaml").read_text()
    assert cli.main(["sweep", str(ov), "--temp"]) == 0
    assert calls == [[sweep.sys.executable, "-m", "dvc", "exp", "run", "--temp",
                      "-S", "data.max_seq_length=8192", "-S", "zero.stage=3",
                      "-S", "zero.offload_param=cpu", "-S", "lora.rank=16",
                      "-S", "lora.quantize=none", "-n",
                      sweep.sweep_names.overlay_experiment(ov, sweep.load(ov)[0].overrides)]]
    assert calls[0][-1].startswith("overlay.lora-r-16-")
    assert (workdir / "params.yaml").read_text() == before
    assert "1 experiment(s) ran" in capsys.readouterr().out
    bad = write(workdir / "q.yaml", "lora: {rank: 16, quantize: nf4}\n")
    assert cli.main(["sweep", str(bad), "--temp"]) == 2
    assert "zero.stage: 3, but lora.quantize nf4 runs on ZeRO-2" in capsys.readouterr().err
    assert len(calls) == 1


OVERLAY = "# longft placement: ...\ndata: {max_seq_length: 8192}\nlora: {rank: 16, quantize: none}\n"


def test_an_overlay_is_named_by_its_file_and_params(workdir):
    """Walkthrough finding 3: two placement overlays written to one file name, run one after the
    other, got one experiment name (DVC: `Experiment conflicts`, exit 255). The name carries a hash
    of the params: the same overlay (comments, key order aside) is the same name, another is not;
    -n names it instead, and only a one-overlay file."""
    ov = write(workdir / "overlay.yaml", OVERLAY)
    (row,) = sweep.load(ov)
    assert re.fullmatch(r"overlay-[0-9a-f]{6}", row.name)
    write(ov, "lora: {quantize: none, rank: 16}\ndata: {max_seq_length: 8192}  # same params\n")
    assert sweep.load(ov)[0].name == row.name
    write(ov, OVERLAY.replace("8192", "16384"))
    other = sweep.load(ov)[0].name
    assert other != row.name and other.startswith("overlay-")
    assert sweep.load(ov, name="lora-16k")[0].name == "lora-16k"
    with pytest.raises(sweep.SweepError, match="-n 'a b' must match"):
        sweep.load(ov, name="a b")
    with pytest.raises(sweep.SweepError, match="-n names the experiment of one overlay"):
        sweep.load(write(workdir / "grid.yaml", GRID), name="x")


def test_a_failed_experiment_does_not_hold_its_name(monkeypatch):
    """A row that failed (out of memory, say) left no experiment: running the sweep again runs it."""
    import dvc.api

    rows = [{"Experiment": None, "rev": "head", "typ": "baseline"},
            {"Experiment": "oom-row", "rev": "r1", "typ": "branch_commit", "State": "Failed"},
            {"Experiment": "done-row", "rev": "r2", "typ": "branch_commit", "State": "Success"},
            {"Experiment": "queued-row", "rev": "r3", "typ": "branch_commit", "State": "Queued"}]
    monkeypatch.setattr(dvc.api, "exp_show", lambda: rows)
    assert sorted(sweep.sweep_names.existing()) == ["done-row", "queued-row"]


def taken(monkeypatch, name: str, params: dict | None, state: str | None = None):
    """Fake one experiment of this commit: `name`, with these params (None: unreadable)."""
    ex = sweep.sweep_names.Existing(name, "abc1234", state)
    monkeypatch.setattr(sweep.sweep_names, "existing", lambda: {name: ex})
    monkeypatch.setattr(sweep.sweep_names, "params_of",
                        lambda rev, path: None if params is None else json.loads(json.dumps(params)))


def test_an_existing_experiment_name_is_checked_before_dvc_runs(workdir, monkeypatch, capsys):
    """The same overlay again is the experiment that exists (left out, said so, nothing runs);
    a name held by an experiment of other params is refused before DVC runs anything, with the
    params that differ and both fixes."""
    no_subprocess(monkeypatch)
    ov = write(workdir / "overlay.yaml", OVERLAY)
    (row,) = sweep.load(ov)
    base = yaml.safe_load((workdir / "params.yaml").read_text())
    taken(monkeypatch, row.name, merge(base, sweep._nest(row.overrides)))
    assert cli.main(["sweep", str(ov), "--temp"]) == 0
    out = capsys.readouterr().out
    assert f"row 1 ({row.name}): already ran with these params on this commit" in out
    assert f"dvc exp remove {row.name}" in out and "nothing to run" in out
    # the same params written differently (a key left at its default) are the same params
    same = merge(base, sweep._nest(row.overrides))
    del same["train"]["seed"]
    taken(monkeypatch, row.name, same)
    assert cli.main(["sweep", str(ov), "--temp"]) == 0
    for theirs in (merge(base, {"data": {"max_seq_length": 4096}}), None):
        taken(monkeypatch, row.name, theirs)
        assert cli.main(["sweep", str(ov), "--temp"]) == 2
        err = capsys.readouterr().err
        assert f"experiment {row.name!r} exists on this commit (already ran) with" in err
        assert ("data.max_seq_length: 4096 -> 8192" in err) == (theirs is not None)
        assert f"`dvc exp remove {row.name}`" in err and "`-n NAME`" in err
        assert "Nothing was run or queued." in err
    # a grid: the row queued with its params is left out, the others are queued
    grid = write(workdir / "grid.yaml", GRID)
    first = sweep.load(grid)[0]
    taken(monkeypatch, first.name, merge(base, sweep._nest(first.overrides)), "Queued")
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run",
                        lambda cmd: calls.append(cmd) or sweep.subprocess.CompletedProcess(cmd, 0))
    assert cli.main(["sweep", str(grid)]) == 0
    assert "row 1 (8b-128k-2gpu): already queued with these params" in capsys.readouterr().out
    assert len(calls) == 1 and "model.name=Qwen/Qwen2.5-14B" in calls[0]
