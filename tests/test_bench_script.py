"""scripts/bench.py's overlays: every shipped overlay merges onto the shipped params (the dataclass
defaults, which the committed params.yaml sets) into valid params, and --write-params writes exactly
that merge (scripts/gpu_suite.sh --max-context runs from it)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from longft.config.params import Config, from_dict, merge, to_dict
from longft.model.loading import check_context_length, load_model_config
from longft.run.pipeline import REPO

OVERLAYS = sorted((REPO / "bench" / "configs").glob("*.yaml"))
PEER_CHECKPOINTS = "/tmp/"
"""Where bench/peers/side_by_side.sh writes the checkpoint that longft and a peer share."""


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_every_overlay_gives_valid_params(overlay):
    over = yaml.safe_load(overlay.read_text())
    assert over.pop("bench_note"), "each row says what it is"
    cfg = from_dict(merge(to_dict(Config()), over), str(overlay))
    model = cfg.model
    if model.source == "pretrained" and model.name.startswith(PEER_CHECKPOINTS) and not Path(model.name).exists():
        # a peer row's checkpoint, written on the GPU machine by bench/peers/make_checkpoint.py
        # ARCH /tmp/ARCH: its architecture is configs/models/ARCH.json
        arch = REPO / "configs" / "models" / f"{Path(model.name).name}.json"
        assert arch.exists(), f"{model.name}: name the directory after a configs/models architecture"
        model = replace(model, source="random", name=Path(model.name).name)
    # the model's positions cover the row length (patch and prepare refuse it otherwise)
    check_context_length(load_model_config(model), cfg.data.max_seq_length, cfg.model.name)


def test_write_params_writes_the_merge(tmp_path):
    overlay = REPO / "bench" / "configs" / "maxctx-1b.yaml"
    base = tmp_path / "base.yaml"  # not the workspace's params.yaml, which a user may have edited
    base.write_text(yaml.safe_dump(to_dict(Config())))
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), str(overlay),
                    "--write-params", str(tmp_path), "--base", str(base)], check=True, cwd=tmp_path)
    written = yaml.safe_load((tmp_path / "maxctx-1b.yaml").read_text())
    over = yaml.safe_load(overlay.read_text())
    del over["bench_note"]
    assert written == merge(to_dict(Config()), over)
    cfg = from_dict(written, "written")
    assert cfg.model.name == "llama3.2-1b" and cfg.zero.offload_optimizer == "cpu"
    assert cfg.checkpointing.mode == "gpu" and "bench_note" not in written
    assert not list((tmp_path).glob("*.json")), "nothing was run"


def test_poll_batch_prints_the_log_and_packs_what_the_batch_wrote(tmp_path):
    """bench/poll_batch.sh, the `wait` of the GPU machine's background batches: it returns at the
    "== done" line, prints the log's tail and packs the named paths into $OUT."""
    import tarfile

    batch, out = tmp_path / "batch", tmp_path / "out"
    (batch / "out" / "results").mkdir(parents=True)
    out.mkdir()
    (batch / "out" / "results" / "row.json").write_text("{}")
    (batch / "log").write_text("== start\n" + "x" * 100 + "\n== done (12:00:00)\n")
    got = subprocess.run(["bash", str(REPO / "bench" / "poll_batch.sh"), str(batch), "30", "b.tgz",
                          "out", "log"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out), "POLL_S": "600"})  # returns at "== done"
    assert got.returncode == 0 and got.stdout.endswith("== done (12:00:00)\n")
    assert len(got.stdout) == 30
    with tarfile.open(out / "b.tgz") as t:
        assert {"out/results/row.json", "log"} <= set(t.getnames())
