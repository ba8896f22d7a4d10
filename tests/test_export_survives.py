"""Nothing lost: with real DVC, a typo that the train stage refuses (DVC runs only that stage
when only `output` changed, and used to delete export/ first) leaves the last finetuned model in
export/, loadable; `dvc status` still says train must run (issue 20)."""

from pathlib import Path

import pytest
import yaml

from checkout_copy import copy_checkout
from longft.config.params import Config, merge, to_dict
from venv_shell import run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def sh(*cmd, cwd, check=True):
    return run(*cmd, cwd=cwd, check=check)


def write_params(root, **over):
    params = merge(to_dict(Config()), merge({"data": {"num_samples": 4, "max_seq_length": 1024},
                                             "train": {"iterations": 2, "warmup_iterations": 1},
                                             "output": {"save_checkpoint": False}}, over))
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_a_refused_typo_keeps_the_last_export_and_dvc_status_stays_honest(tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "repo"
    copy_checkout(root)
    write_params(root)
    git = ("git", "-c", "user.email=t@t", "-c", "user.name=t")
    sh("git", "init", "-q", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh(*git, "commit", "-qm", "pipeline", cwd=root)
    sh("dvc", "repro", cwd=root)
    model = root / "export" / "model.safetensors"
    first = model.read_bytes()

    write_params(root, output={"save_checkpoint": False, "keep_last": 0})  # the typo
    p = sh("dvc", "repro", cwd=root, check=False)
    assert p.returncode != 0
    assert "output.keep_last: must be >= 1, got 0" in p.stdout + p.stderr
    assert "Running stage 'train'" in p.stdout and "Running stage 'patch'" not in p.stdout
    assert model.read_bytes() == first  # not deleted, not touched
    AutoModelForCausalLM.from_pretrained(root / "export")  # and loadable
    status = sh("dvc", "status", cwd=root).stdout
    assert "train:" in status and "changed" in status  # the refused run is not recorded

    # a finished run without an export leaves none behind (export/ persists across runs)
    write_params(root, output={"save_checkpoint": False, "export": False})
    sh("dvc", "repro", cwd=root)
    assert list((root / "export").iterdir()) == []
    assert "up to date" in sh("dvc", "status", cwd=root).stdout
