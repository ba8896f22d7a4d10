"""Issue 19: a user's data file and local model / tokenizer directories are DVC dependencies of the
stages that read them (params.yaml track.*, interpolated into dvc.yaml's deps), and the prepare
stage refuses to run while one is not tracked. The DVC part runs the real `dvc` in a copy of the
repository: editing the data file makes `dvc status` report prepare changed."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from checkout_copy import copy_checkout
from longft.config.params import NOTHING_TO_TRACK, Config, ConfigError, from_dict, merge, to_dict
from longft.data.tracked import check_tracked, left_to_git, untracked
from venv_shell import run

REPO = Path(__file__).resolve().parents[1]


def records(n):
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                            {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                   for i in range(n))


def test_defaults_have_nothing_to_track_and_the_placeholder_is_shipped():
    cfg = Config()
    assert untracked(cfg) == []
    assert (REPO / NOTHING_TO_TRACK).is_file()
    assert cfg.track.data == cfg.track.model == cfg.track.tokenizer == NOTHING_TO_TRACK


def test_a_local_file_or_dir_must_be_covered_by_its_track_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(records(2))
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "tok").mkdir()
    raw = {"data": {"source": "jsonl", "path": "data/train.jsonl"},
           "model": {"source": "pretrained", "name": "mymodel", "tokenizer": "tok"}}
    problems = untracked(from_dict(raw))
    assert [p.split(":")[0] for p in problems] == ["track.data", "track.model", "track.tokenizer"]
    assert "set track.data: data/train.jsonl in params.yaml" in problems[0]
    with pytest.raises(ConfigError, match="track.model: model.name is the local path 'mymodel'"):
        check_tracked(from_dict(raw), {"DVC_ROOT": str(tmp_path)})  # inside a DVC stage
    assert check_tracked(from_dict(raw), {}) == problems  # run by hand: said, not refused
    # the path itself, or a directory above it, covers it (relative or absolute)
    ok = merge(raw, {"track": {"data": "data", "model": str(tmp_path / "mymodel"),
                               "tokenizer": "tok"}})
    assert untracked(from_dict(ok)) == []
    # not local: a hub id, a dataset name, the shipped configs
    hub = {"data": {"source": "hf", "path": "THUDM/LongCite-45k"},
           "model": {"source": "pretrained", "name": "meta-llama/Llama-3.2-1B"}}
    assert untracked(from_dict(hub)) == []
    monkeypatch.chdir(REPO)
    assert untracked(from_dict({"model": {"name": "configs/models/tiny-llama.json",
                                          "tokenizer": "configs/tokenizers/byte"}})) == []


def test_a_local_input_git_would_commit_is_refused_with_dvc_add(tmp_path, monkeypatch):
    """Issue 36: `dvc exp run` commits what git does not ignore; a local model or data file must be
    `dvc add`ed (git-ignored) or already in git, never committed by the experiment."""
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "train.jsonl").write_text(records(2))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "model.safetensors").write_bytes(b"x" * 10)
    raw = {"data": {"source": "jsonl", "path": "mydata/train.jsonl"},
           "model": {"source": "pretrained", "name": "models/m"},
           "track": {"data": "mydata/train.jsonl", "model": "models/m"}}
    cfg = from_dict(raw)
    assert untracked(cfg) == []
    problems = left_to_git(cfg)
    assert [p.split(":")[0] for p in problems] == ["data.path", "model.name"]
    assert "`dvc add models/m`" in problems[1] and "models/m/model.safetensors" in problems[1]
    with pytest.raises(ConfigError, match="dvc add mydata/train.jsonl"):
        check_tracked(cfg, {"DVC_ROOT": str(tmp_path)})
    (tmp_path / "models" / ".gitignore").write_text("/m\n")  # what `dvc add models/m` writes
    subprocess.run(["git", "add", "mydata"], check=True)  # a small file the user keeps in git
    assert left_to_git(cfg) == []
    monkeypatch.chdir(tmp_path / "models")  # not a problem of its own outside the tree
    assert left_to_git(from_dict({})) == []


def sh(*cmd, cwd, check=True):
    p = run(*cmd, cwd=cwd, check=check, timeout=600)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.slow
def test_editing_the_data_file_makes_dvc_rerun_prepare(tmp_path):
    root = tmp_path / "repo"
    copy_checkout(root, with_tests=False)
    (root / "mydata").mkdir()
    data = root / "mydata" / "train.jsonl"
    data.write_text(records(60))
    params = merge(to_dict(Config()), {"data": {"source": "jsonl", "path": "mydata/train.jsonl",
                                                "num_samples": None, "max_seq_length": 256}})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "init", "-q", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init", cwd=root)

    # not tracked: prepare refuses, naming the fix
    code, out = sh("dvc", "repro", "prepare", cwd=root, check=False)
    assert code != 0 and "set track.data: mydata/train.jsonl in params.yaml" in out

    params["track"]["data"] = "mydata/train.jsonl"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("dvc", "repro", "prepare", cwd=root)
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert "mydata/train.jsonl" in [d["path"] for d in lock["stages"]["prepare"]["deps"]]
    assert "changed" not in sh("dvc", "status", "prepare", cwd=root)[1]

    with data.open("a") as f:
        f.write(records(1))
    _, out = sh("dvc", "status", "prepare", cwd=root)
    assert "prepare:" in out and "modified:" in out and "mydata/train.jsonl" in out
