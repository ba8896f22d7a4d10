"""`longft estimate | placement | max-context` (longft.cli.estimate) on CPU with faked hardware."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from longft.cli import estimate as estimate_cli
from longft.cli.estimate import best, candidates_for_confirmation, main, max_context, search, tokens_per_second
from longft.config.params import from_dict, merge
from longft.estimate.estimator import GIB, Setup, estimate, fits
from longft.hardware import Hardware

H200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                gpu_mem_gib=139.8, host_mem_gib=125.9, cpu_count=16, flash_attn=False, liger=True)
CPU = Hardware(device="cpu", host_mem_gib=24, cpu_count=2)
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                tie_word_embeddings=True, max_position_embeddings=131072)


@pytest.fixture
def on(monkeypatch):
    """Pretend to run on the given hardware."""
    def use(hw):
        monkeypatch.setattr("longft.hardware.detect", lambda: hw)
    return use


def write_params(tmp_path, **over):
    raw = {"model": {"source": "random", "name": "llama3.2-1b"},
           "data": {"source": "random", "pack": False, "max_seq_length": 16384},
           "checkpointing": {"mode": "gpu"},
           "zero": {"stage": 3, "offload_optimizer": "none", "offload_param": "none"},
           "train": {"micro_batch_size": 4, "global_batch_size": 4}}
    raw = merge(raw, over)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_candidates_for_confirmation():
    # 65536 x (0.9, 0.95, 1, 1.05, 1.1) / 1024 = 57.6, 60.8, 64, 67.2, 70.4 -> rounded x 1024
    assert candidates_for_confirmation(65536) == [58 * 1024, 61 * 1024, 65536, 67 * 1024, 70 * 1024]
    assert candidates_for_confirmation(1024) == [1024]
    assert candidates_for_confirmation(10240, rel_error=0.2, n=1) == [8192, 10240, 12288]
    assert candidates_for_confirmation(131072, limit=131072) == [115 * 1024, 122 * 1024, 131072]


def test_max_context_is_the_boundary():
    base = Setup(micro_batch=1, seq_len=1024)
    seq = max_context(LLAMA_1B, base, gpu_mem_gib=40, host_mem_gib=128)
    assert seq % 1024 == 0 and seq > 0
    at = estimate(LLAMA_1B, dataclasses.replace(base, seq_len=seq))
    over = estimate(LLAMA_1B, dataclasses.replace(base, seq_len=seq + 1024))
    assert fits(at, 40, 128).ok and not fits(over, 40, 128).ok
    assert max_context(LLAMA_1B, base, gpu_mem_gib=4, host_mem_gib=128) == 0
    assert max_context(LLAMA_1B, base, gpu_mem_gib=1000, host_mem_gib=1000, max_seq=8192) == 8192


def test_speed_heuristic_prefers_less_offload_and_no_recompute():
    s = Setup(micro_batch=4, seq_len=16384)
    t = {name: tokens_per_second(LLAMA_1B, dataclasses.replace(s, **kw), "NVIDIA H200")
         for name, kw in {"plain": {}, "opt": {"offload_optimizer": True},
                          "all": {"offload_optimizer": True, "offload_param": True},
                          "nockpt": {"checkpointing": "none"}}.items()}
    assert t["nockpt"] > t["plain"] > t["opt"] > t["all"]
    # larger micro-batches help, less and less
    g = [tokens_per_second(LLAMA_1B, dataclasses.replace(s, micro_batch=m), "NVIDIA H200")
         for m in (1, 2, 4, 8)]
    assert g[0] < g[1] < g[2] < g[3] and g[3] / g[2] < g[1] / g[0]
    # H200 row (a) measured 36,487 tok/s; the heuristic is a ranking, within ~10 % here
    assert 0.85 < t["plain"] / 36487 < 1.15


def test_search_and_best_on_a_small_card():
    base = Setup(micro_batch=1, seq_len=16384)
    cands = search(LLAMA_1B, base, gpu_mem_gib=24, host_mem_gib=128, gpu_name="NVIDIA A100",
                   max_micro=8, modes=("none", "gpu"))
    ok = [c for c in cands if c.fit.ok]
    assert ok and all(c.est.gpu_nvml <= 24 * GIB for c in ok)
    choice = best(cands)
    # 18.4 GiB of model states alone: the optimizer has to leave the GPU
    assert choice.offload != "none"
    assert choice.tokens_per_s >= 0.98 * max(c.tokens_per_s for c in ok)
    assert best(search(LLAMA_1B, base, gpu_mem_gib=2, host_mem_gib=4, gpu_name=None, max_micro=2)) is None


def test_search_keeps_as_many_checkpoints_on_the_gpu_as_fit():
    """Llama-3.1-8B at 128,000 tokens in 40 GiB of VRAM and 174 GiB of host RAM (BENCHMARKS rows c,
    d): all 32 checkpoints on the host do not fit the host, all on the GPU do not fit the GPU; the
    search keeps attention outputs and checkpoints on the GPU until one more would not fit it."""
    import json

    from longft.estimate.placement import keep_on_gpu
    from longft.estimate.placement_overlay import overlay
    from longft.run.pipeline import REPO

    arch = json.loads((REPO / "configs/models/llama3.1-8b.json").read_text())
    base = Setup(micro_batch=1, seq_len=128000, tiled_mlp=True, offload_optimizer=True,
                 offload_param=True, checkpointing="cpu_offload")
    assert not fits(estimate(arch, base), 40, 174).host_ok          # gpu_layers 0: host too small
    kept = keep_on_gpu(arch, base, 40, 174)
    assert 0 < kept.gpu_layers < 32 and kept.keep_attention > 0
    assert fits(estimate(arch, kept), 40, 174).ok
    for more in ({"gpu_layers": kept.gpu_layers + 1}, {"keep_attention": kept.keep_attention + 1}):
        # what is kept for speed leaves 3 % of the card free (placement.NEAR_BUDGET)
        assert not fits(estimate(arch, dataclasses.replace(kept, **more)), 0.97 * 40, None).gpu_ok
    choice = best(search(arch, base, gpu_mem_gib=40, host_mem_gib=174, gpu_name="NVIDIA H200", max_micro=2))
    assert choice is not None and choice.setup.checkpointing == "cpu_offload"
    assert choice.setup.gpu_layers > 0
    ov = overlay(choice, 1)
    assert ov["checkpointing"] == {"mode": "cpu_offload", "gpu_layers": choice.setup.gpu_layers,
                                   "keep_attention": choice.setup.keep_attention}
    assert ov["data"] == {"max_seq_length": 128000}  # packed rows need no mask: no pack: false


def test_estimate_command_fits_and_does_not_fit(tmp_path, on, capsys):
    on(H200)
    p = write_params(tmp_path)
    assert main("estimate", ["--params", str(p)]) == 0
    out = capsys.readouterr().out
    assert "peak VRAM (torch max allocated)" in out and "28.594" in out
    assert "sdpa(cudnn)" in out and "verdict: GPU fits, host fits" in out
    assert main("estimate", ["--params", str(p), "--gpu-mem", "24"]) == 1
    assert "GPU does NOT fit" in capsys.readouterr().out


def test_estimate_command_without_gpu_assumes_one(tmp_path, on, capsys):
    on(CPU)
    p = write_params(tmp_path, checkpointing={"mode": "cpu_offload"})
    assert main("estimate", ["--params", str(p), "--gpu-mem", "80", "--host-mem", "64"]) == 0
    out = capsys.readouterr().out
    assert "Ampere-or-newer GPU" in out and "Liger on" in out
    assert "activation checkpoints (pinned)" in out


def test_estimate_command_reports_bad_params(tmp_path, on, capsys):
    on(H200)
    p = write_params(tmp_path, train={"micro_batch_size": 3})
    assert main("estimate", ["--params", str(p)]) == 2
    assert "global_batch_size" in capsys.readouterr().err
    assert main("nonsense", []) == 2
    assert main("estimate", ["--no-such-flag"]) == 2


def test_placement_writes_an_overlay_that_validates(tmp_path, on, capsys):
    on(H200)
    base = write_params(tmp_path)
    out = tmp_path / "overlay.yaml"
    rc = main("placement", ["--gpu-mem", "80", "--host-mem", "256", "--gpus", "1", "--model",
                       "llama3.1-8b", "--seq", "65536", "--out", str(out), "--params", str(base),
                       "--max-micro", "4"])
    assert rc == 0
    text = out.read_text()
    assert text.startswith("# longft placement:")
    ov = yaml.safe_load(text)
    assert ov["model"] == {"name": "llama3.1-8b", "source": "random"}
    assert ov["data"]["max_seq_length"] == 65536
    cfg = from_dict(merge(yaml.safe_load(base.read_text()), ov))
    # an 8B model's 16 B/param states do not fit in 80 GiB next to 64K activations
    assert ov["zero"]["offload_optimizer"] == "cpu"
    out = capsys.readouterr().out
    assert "chosen:" in out
    # walkthrough finding 4: the params' global batch (4) is kept, the rest accumulated (was
    # micro-batch x GPUs: comparing overlays mixed placement with batch size), and the prediction
    # is the merged params' own: accumulation's host memory (no shared gradient slot) and speed
    assert cfg.train.global_batch_size == 4 and cfg.grad_accum_steps == 4 // cfg.train.micro_batch_size
    assert cfg.grad_accum_steps > 1 and ov["zero"]["host_grad_buffer"] == "full"
    assert (f"batch: micro-batch {cfg.train.micro_batch_size} x 1 GPU(s) x {cfg.grad_accum_steps} "
            "accumulation step(s) = global batch 4, the params' train.global_batch_size") in out
    assert "global batch changed" not in text
    from longft.cli.target import architecture_of, resolve_on_gpu
    from longft.estimate.estimator import setup_from_config

    arch = architecture_of(cfg.model)
    setup = setup_from_config(cfg, resolve_on_gpu(cfg, H200, arch["model_type"])[0])
    again = estimate(arch, setup)
    assert f"host {again.host_rss / GIB:.2f} GiB; ~{tokens_per_second(arch, setup, 'NVIDIA H200'):,.0f} tok/s" \
        in text


def test_placement_keeps_the_params_global_batch(tmp_path, on, capsys):
    """Walkthrough finding 4 (2 became 12 or 18): with params, only the micro-batches that divide
    their global batch are searched; where the GPUs cannot keep it, the nearest multiple, said in
    a note and in the overlay's header; without params, micro-batch x GPUs as before."""
    on(H200)

    def place(params: list[str], gpus: int = 1) -> dict:
        out = tmp_path / "ov.yaml"
        assert main("placement", ["--gpu-mem", "80", "--host-mem", "256", "--gpus", str(gpus),
                                  "--model", "llama3.2-1b", "--seq", "4096", "--out", str(out),
                                  "--max-micro", "16", *params]) == 0
        return yaml.safe_load(out.read_text())["train"]

    p = write_params(tmp_path, train={"micro_batch_size": 1, "global_batch_size": 2})
    assert place(["--params", str(p)]) == {"micro_batch_size": 2, "global_batch_size": 2}
    out = capsys.readouterr().out
    assert "global batch changed" not in out
    # what keeping it costs is said, with how to plan the larger batch instead
    assert re.search(r"note: a larger global batch trains faster here: micro-batch (\d+) x 1 GPU\(s\) = "
                     r"global batch \1, .* set train.global_batch_size: \1 and run this again", out)
    assert place(["--params", "absent.yaml"])["global_batch_size"] > 2   # no params: as before
    t = place(["--params", str(p)], gpus=3)
    out = capsys.readouterr().out
    assert t["global_batch_size"] == 3 and "note: global batch changed from 2 to 3: " in out
    assert "# note: global batch changed from 2 to 3 (" in (tmp_path / "ov.yaml").read_text()
    # two nodes of --gpus each: the batch counts every rank, and the merged params load
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")
    two = write_params(tmp_path, train={"micro_batch_size": 1, "global_batch_size": 4},
                       hardware={"num_nodes": 2, "num_gpus": 2,
                                 "hostfile": str(tmp_path / "hostfile")})
    t = place(["--params", str(two)], gpus=3)
    assert t["global_batch_size"] == 6 and "changed from 4 to 6 (train.global_batch_size: " \
        "micro-batch 1 x 6 GPU(s) x 1 accumulation" in (tmp_path / "ov.yaml").read_text()
    merged = merge(yaml.safe_load(two.read_text()), yaml.safe_load((tmp_path / "ov.yaml").read_text()))
    assert from_dict(merged).world_size == 6


def test_placement_says_what_is_closest_when_nothing_fits(tmp_path, on, capsys):
    on(H200)
    rc = main("placement", ["--gpu-mem", "8", "--host-mem", "16", "--model", "llama3.1-8b", "--seq",
                       "131072", "--params", str(write_params(tmp_path)), "--max-micro", "2"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "nothing fits. Closest:" in out and "does NOT fit" in out


def test_max_context_command(tmp_path, on, capsys):
    on(H200)
    p = write_params(tmp_path, train={"micro_batch_size": 1, "global_batch_size": 1},
                     zero={"offload_optimizer": "cpu", "offload_param": "cpu"})
    assert main("max-context", ["--params", str(p), "--gpu-mem", "40", "--host-mem", "120"]) == 0
    out = capsys.readouterr().out
    assert "longest context that fits:" in out and "confirm on the GPU" in out
    assert main("max-context", ["--params", str(p), "--gpu-mem", "2"]) == 1


def test_max_context_says_whether_the_search_cap_is_also_the_memory_limit(tmp_path, on, capsys):
    """A --max-seq at exactly the longest length that fits is not "memory is not the limit"."""
    on(H200)
    p = write_params(tmp_path, train={"micro_batch_size": 1, "global_batch_size": 1},
                     zero={"offload_optimizer": "cpu", "offload_param": "cpu"})
    args = ["--params", str(p), "--gpu-mem", "12", "--host-mem", "120"]
    assert main("max-context", args) == 0
    limit = int(capsys.readouterr().out.split("longest context that fits: ")[1].split()[0].replace(",", ""))
    assert main("max-context", args + ["--max-seq", str(limit)]) == 0
    out = capsys.readouterr().out
    assert "the upper end of the search and the limit of memory too" in out
    assert "memory is not the limit" not in out
    assert main("max-context", args + ["--max-seq", str(limit - 8192)]) == 0
    assert "memory is not the limit (--max-seq to go on)" in capsys.readouterr().out


def test_cli_dispatches_here(on, tmp_path, capsys):
    """The `longft` console script (another module) hands these commands to main()."""
    cli = pytest.importorskip("longft.cli.main")
    on(H200)
    assert cli.main(["estimate", "--params", str(write_params(tmp_path))]) == 0
    assert "peak DRAM" in capsys.readouterr().out


def test_module_docstring_shows_the_commands():
    for cmd in ("longft estimate", "longft placement", "longft max-context"):
        assert cmd in estimate_cli.__doc__


def test_near_ties_go_to_the_placement_using_less_of_the_machine():
    """Llama-3.1-8B at 128,000 tokens on 8 x 139 GiB with 504 GiB of host RAM: offloading the
    optimizer is within 2 % of keeping everything on the GPUs, and would spare GPU memory nothing
    needs by filling ~170 GiB of host RAM; the chosen placement keeps everything on the GPUs."""
    import json

    from longft.estimate.placement_overlay import overlay
    from longft.run.pipeline import REPO

    arch = json.loads((REPO / "configs/models/llama3.1-8b.json").read_text())
    base = Setup(micro_batch=1, seq_len=128000, tiled_mlp=True, world_size=8, ranks_per_node=8)
    cands = search(arch, base, gpu_mem_gib=139, host_mem_gib=504, gpu_name="NVIDIA H200", max_micro=2)
    choice = best(cands, gpu_mem_gib=139, host_mem_gib=504)
    assert choice.offload == "none" and choice.est.host_rss < 40 * GIB
    # the overlay writes both knobs even where the placement keeps none: merged onto a params file that
    # sets them, the params' values must not survive
    ov = overlay(choice, 8)["checkpointing"]
    assert ov["gpu_layers"] == 0 and "keep_attention" in ov
    # without the machine's sizes the old rule (least GPU memory) takes an offloading one
    assert best(cands).offload != "none"


REPO = Path(__file__).resolve().parents[1]


def paste_docs_placement(prefix, tmp_path, on, capsys, monkeypatch):
    """Run docs/memory.md's `longft placement` line that starts with `prefix`, as a user pastes
    it, in tmp_path on a machine without a GPU; its "chosen:" line."""
    import shlex

    docs = (REPO / "docs" / "memory.md").read_text()
    line = next(x for x in docs.splitlines() if x.startswith(prefix))
    on(CPU)
    monkeypatch.chdir(tmp_path)
    assert main("placement", shlex.split(line)[2:]) == 0
    return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("chosen:"))


def test_the_24gb_recipe_in_the_docs_answers_as_the_docs_say(tmp_path, on, capsys, monkeypatch):
    """docs/memory.md's placement command for Llama-3.2-1B on a 24 GB card, as a user pastes it."""
    chosen = paste_docs_placement("longft placement --gpu-mem 24 ", tmp_path, on, capsys, monkeypatch)
    assert "full-parameter, ZeRO-3 offload opt," in chosen
    assert "checkpointing cpu_offload (8 on GPU, 16 attention kept)" in chosen
    overlay = yaml.safe_load((tmp_path / "1b.yaml").read_text())
    assert overlay["data"]["max_seq_length"] == 131072
    assert overlay["zero"]["offload_optimizer"] == "cpu" and overlay["checkpointing"]["gpu_layers"] == 8


def test_the_512k_recipe_in_the_docs_answers_as_the_docs_say(tmp_path, on, capsys, monkeypatch):
    """docs/memory.md's placement command for Llama-3.1-8B at 524,288 tokens on one H200, as a user
    pastes it: the placement confirmed on the H200 (bench/configs/maxctx-8b-512k-bf16.yaml)."""
    chosen = paste_docs_placement("longft placement --gpu-mem 139 ", tmp_path, on, capsys,
                                  monkeypatch)
    assert "ZeRO-3 offload none bf16-states" in chosen
    assert "checkpointing cpu_offload (4 on GPU, 2 attention kept)" in chosen
    overlay = yaml.safe_load((tmp_path / "8b-512k.yaml").read_text())
    confirmed = yaml.safe_load((REPO / "bench/configs/maxctx-8b-512k-bf16.yaml").read_text())
    assert overlay["data"]["max_seq_length"] == 524288
    for section in ("checkpointing", "zero"):
        for k, v in confirmed[section].items():
            assert overlay[section][k] == v, (section, k)


def test_estimate_refuses_a_length_past_the_models_positions_as_prepare_and_patch_do(tmp_path, on,
                                                                                      capsys):
    """Walk finding 5: estimate said `GPU fits, host fits` (exit 0) for data.max_seq_length 32768
    on a model of 16,384 positions, which prepare and patch refuse."""
    on(H200)
    arch = tmp_path / "short.json"
    arch.write_text(json.dumps({**LLAMA_1B, "max_position_embeddings": 16384}))
    p = write_params(tmp_path, model={"name": str(arch)}, data={"max_seq_length": 32768})
    assert main("estimate", ["--params", str(p), "--gpu-mem", "24", "--host-mem", "64"]) == 2
    out, err = capsys.readouterr()
    assert "verdict" not in out
    assert "data.max_seq_length (32768) is longer than the 16384 positions model" in err
    assert "lower data.max_seq_length to at most 16384" in err
    p = write_params(tmp_path, model={"name": str(arch)}, data={"max_seq_length": 16384})
    assert main("estimate", ["--params", str(p), "--gpu-mem", "80", "--host-mem", "64"]) == 0


def test_search_at_a_global_batch_accumulates_the_rest():
    """With a global batch, each micro-batch that divides it, and no other, accumulates the rest:
    4 = 1 x 4 = 2 x 2 = 4 x 1. Accumulating under ZeRO-3 with the optimizer on the CPU has no
    shared gradient slot (hardware.policy), so it needs more host RAM than one micro-step a step."""
    base = Setup(micro_batch=1, seq_len=4096, tiled_mlp=False)
    cands = search(LLAMA_1B, base, gpu_mem_gib=80, host_mem_gib=256, gpu_name=None, max_micro=8,
                   global_batch=4)
    assert {(c.setup.micro_batch, c.setup.grad_accum) for c in cands} == {(1, 4), (2, 2), (4, 1)}
    opt = {c.setup.micro_batch: c for c in cands if c.offload == "opt" and c.setup.offload_ratio == 1
           and c.setup.checkpointing == "none"}
    assert (opt[1].setup.host_grad_buffer, opt[4].setup.host_grad_buffer) == ("full", "shared")
    assert opt[1].est.host_rss > opt[4].est.host_rss
    # the optimizer step is amortised over the same 4 rows whatever the micro-batch
    assert opt[4].tokens_per_s < 1.3 * opt[1].tokens_per_s
    one = search(LLAMA_1B, base, gpu_mem_gib=80, host_mem_gib=256, gpu_name=None, max_micro=4)
    assert {c.setup.grad_accum for c in one} == {1} and max(c.setup.micro_batch for c in one) == 4
