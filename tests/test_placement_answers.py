"""`longft placement` as the 2026-12-05 walkthroughs used it: the speed it assumes for a GPU it
does not know, a toy model's speed, the global batch kept by the "nothing fits" overlays, and
block-sparse flags and shapes refused before any search."""

import re
from pathlib import Path

import pytest
import yaml

from longft.cli.estimate import main
from test_estimate_cli import CPU, H200, write_params  # tests/ is on sys.path under pytest


@pytest.fixture
def on(monkeypatch):
    """Pretend to run on the given hardware."""
    def use(hw):
        monkeypatch.setattr("longft.hardware.detect", lambda: hw)
    return use


def test_placement_says_what_speed_it_assumes_for_a_gpu_it_does_not_know(tmp_path, on, capsys):
    """Walkthrough (2026-12-05): an RTX 4090 was ranked at an A100's peak without a word."""
    on(H200)
    args = ["--gpu-mem", "24", "--host-mem", "60", "--model", "llama3.1-8b", "--seq", "32768",
            "--lora", "16", "--params", str(tmp_path / "absent.yaml")]

    def run(name):
        assert main("placement", args + ["--gpu-name", name]) == 0
        out = capsys.readouterr().out
        return out, float(re.search(r"~([\d,]+) tok/s predicted", out).group(1).replace(",", ""))
    unknown, guessed = run("NVIDIA GeForce RTX 5090")
    assert "note: 'NVIDIA GeForce RTX 5090' is not a GPU whose peak longft knows: tokens/s " \
           "assume an A100's 312 TFLOP/s bf16" in unknown
    known, speed = run("NVIDIA GeForce RTX 4090")
    assert "peak longft knows" not in known and speed < 0.7 * guessed   # 165 against 312 TFLOP/s


def test_a_tiny_model_is_not_predicted_a_speed_no_gpu_reaches(tmp_path, on, capsys):
    """Walkthrough (2026-12-05): a 2-layer model of width 64 was predicted at 26 million tok/s
    (2,048 tokens a micro-step in 80 us, less than its kernel launches take), and LoRA's 2 % edge
    at that speed chose it over full finetuning. Each layer now takes a least time a micro-step."""
    on(H200)
    Path(tmp_path / "p.yaml").write_text(yaml.safe_dump({
        "model": {"source": "random", "name": "tiny-llama"},
        "train": {"micro_batch_size": 1, "global_batch_size": 2}}))
    assert main("placement", ["--gpu-mem", "24", "--host-mem", "60", "--seq", "1024",
                              "--lora", "any", "--gpu-name", "NVIDIA RTX A6000",
                              "--params", str(tmp_path / "p.yaml")]) == 0
    chosen = re.search(r"^chosen: (.*) \(~([\d,]+) tok/s predicted", capsys.readouterr().out, re.M)
    assert chosen.group(1).startswith("full-parameter")
    assert float(chosen.group(2).replace(",", "")) < 2e6  # 2 x 1,024 tokens in >= 2 layers x 1 ms


def test_nothing_fits_overlays_keep_the_params_global_batch(tmp_path, on, capsys):
    """Walkthrough (2026-12-05): "nothing fits" wrote a LoRA overlay at global batch 1 (one
    micro-step a step, "global batch changed from 2 to 1"), while `--lora 16` kept the params' 2
    with another placement and speed. Both now search the same way and agree."""
    on(H200)
    p = write_params(tmp_path, model={"source": "random", "name": "llama3.1-8b"},
                     data={"max_seq_length": 32768},
                     train={"micro_batch_size": 1, "global_batch_size": 4})
    args = ["--gpu-mem", "24", "--host-mem", "60", "--seq", "32768", "--params", str(p)]
    assert main("placement", args + ["--out", str(tmp_path / "o.yaml")]) == 1
    out = capsys.readouterr().out
    alt = (tmp_path / "o.lora-r-16.yaml").read_text()
    assert "changed from" not in alt and yaml.safe_load(alt)["train"]["global_batch_size"] == 4
    said = re.search(r"^  LoRA r=16 +~ ?([\d,]+) tok/s", out, re.M).group(1)
    assert main("placement", args + ["--lora", "16"]) == 0
    assert f"(~{said} tok/s predicted)" in capsys.readouterr().out


def test_blocks_placement_cannot_plan_are_refused_before_the_search(tmp_path, monkeypatch, on,
                                                                     capsys):
    """Walkthrough (2026-12-05): --sparse-blocks beside --lora was dropped without a word, and a
    block size that divides no projection was planned, written, and refused by the patch stage."""
    from longft.cli.estimate import main as est_main

    monkeypatch.chdir(tmp_path)
    on(CPU)
    asked = ["--gpu-mem", "24", "--host-mem", "60", "--model", "llama3.1-8b", "--seq", "32768",
             "--params", "absent.yaml", "--out", "ov.yaml"]
    for lora in ("16", "any", "none"):
        assert main("placement", asked + ["--sparse-blocks", "46", "--lora", lora]) == 2
        assert f"--sparse-blocks 46 searches block-sparse finetuning and --lora {lora}" in \
            capsys.readouterr().err
    assert main("placement", asked + ["--sparse-blocks", "46", "--sparse-block-size", "48"]) == 2
    assert "sparse.block_size: 48 does not divide the shape of down_proj [4096 x 14336]" in \
        capsys.readouterr().err
    assert main("placement", asked + ["--sparse-blocks", "100000"]) == 2
    assert "exceeds the 1024 blocks of 64 x 64 of the smallest target, k_proj" in capsys.readouterr().err
    assert not Path("ov.yaml").exists()
    Path("p.yaml").write_text(yaml.safe_dump({"model": {"source": "random", "name": "llama3.1-8b"},
                                              "sparse": {"blocks": 46, "block_size": 48}}))
    assert est_main("estimate", ["--params", "p.yaml", "--gpu-mem", "24", "--host-mem", "60"]) == 2
    assert "sparse.block_size: 48 does not divide" in capsys.readouterr().err
