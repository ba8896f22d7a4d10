"""QLoRA and 8-bit AdamW on the GPU (`pytest -m gpu`; scripts/gpu_suite.sh runs them): the
combinations issue 31 names (Liger, packed attention, checkpoint offload, the tiled MLP, fp16 as on
a V100), each a whole run through the stages that must learn, beside plain LoRA."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(work, over: dict):
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_params

    base = {"data": {"num_samples": 8, "max_seq_length": 4096},
            "hardware": {"device": "cuda"},
            "train": {"global_batch_size": 1, "iterations": 6, "warmup_iterations": 1},
            "optim": {"lr": 1e-2},
            "lora": {"rank": 8, "alpha": 16},
            "output": {"save_checkpoint": False, "export": False}}
    r = run_params(merge(merge(to_dict(Config()), base), over), work)
    assert r.failed is None, r.log.read_text()[-4000:]
    rows = [json.loads(x) for x in (r.work / "run/rank0.jsonl").read_text().splitlines()]
    plan = json.loads((r.work / "artifacts/plan.json").read_text())
    return [x["loss"] for x in rows if x["type"] == "iter"], plan


COMBOS = {
    "liger-packed": {"kernels": {"liger": "on"}, "data": {"pack": True}},
    "cpu-offload-ckpt": {"checkpointing": {"mode": "cpu_offload"}},
    "tiled-mlp": {"kernels": {"tiled_mlp": "on", "tiled_mlp_tokens": 1024}},
    "fp16-v100": {"precision": "fp16", "kernels": {"liger": "off"}},
}


CASES = [(combo, "nf4") for combo in COMBOS] + [("liger-packed", "int8")]
_LORA: dict = {}


@pytest.mark.parametrize("combo, quantize", CASES)
def test_qlora_trains_on_cuda_with(combo, quantize, tmp_path):
    over = COMBOS[combo]
    if combo not in _LORA:  # plain LoRA on the same rows, run once per combination
        _LORA[combo] = _run(tmp_path / "lora", over)[0]
    lora = _LORA[combo]
    q, plan = _run(tmp_path / "q", {**over, "lora": {"quantize": quantize}, "zero": {"stage": 2}})
    assert plan["resolved"]["quantize"]["value"] == quantize
    assert plan["config"]["zero"]["stage"] == 2
    assert len(q) == 6 and q[-1] < q[0]            # it learns
    tol = 0.1 if quantize == "nf4" else 0.05
    assert q == pytest.approx(lora, abs=tol), (lora, q)  # and follows LoRA on the same rows
    print(f"{combo} {quantize}: LoRA {lora[0]:.3f}->{lora[-1]:.3f}, QLoRA {q[0]:.3f}->{q[-1]:.3f}")


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_adamw_on_cuda_follows_adamw(name, tmp_path):
    over = {"lora": {"rank": 0}, "zero": {"offload_optimizer": "none"}, "optim": {"lr": 1e-3}}
    if "adamw" not in _LORA:  # plain AdamW on the same rows, run once for both cases
        _LORA["adamw"] = _run(tmp_path / "adamw", over)[0]
    full = _LORA["adamw"]
    eight, _ = _run(tmp_path / name, {**over, "optim": {"lr": 1e-3, "name": name}})
    assert eight[0] == pytest.approx(full[0], rel=1e-3)
    assert eight != full and eight[-1] < eight[0]
    assert eight == pytest.approx(full, abs=0.1), (full, eight)
