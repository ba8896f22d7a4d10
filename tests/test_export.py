"""Export round trip on CPU: train the tiny model under ZeRO-3 for a few steps, export, load the
export with from_pretrained and check it equals the weights DeepSpeed saved in its checkpoint."""

import json

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_all

    work = tmp_path_factory.mktemp("export")
    params = merge(to_dict(Config()),
                   {"data": {"num_samples": 6}, "train": {"iterations": 3, "warmup_iterations": 1},
                    "output": {"save_checkpoint": True, "export": True}})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    return work


def test_export_loads_with_from_pretrained_and_matches_the_checkpoint(trained):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = trained / "export"
    assert (export / "model.safetensors").is_file()
    meta = json.loads((export / "longft_export.json").read_text())
    assert meta["steps"] == 3 and meta["kind"] == "full"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template  # the tokenizer travels with the weights

    # The bf16 weights DeepSpeed trained are the fp32 master weights rounded: same model.
    master = get_fp32_state_dict_from_zero_checkpoint(str(trained / "checkpoints"), tag="final")
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in master.items()}, strict=False)
    ids = torch.randint(1, 300, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)

