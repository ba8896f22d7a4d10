"""A broken pretrained model directory is refused with the file's name when its config is read
(prepare and patch), not found as a traceback on rank 0 once training starts (issue 20)."""

import json

import pytest

from longft.config.params import ModelConfig, from_dict
from longft.model.loading import ModelError, check_weights, load_model_config

SMALL = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048}


@pytest.fixture
def saved(tmp_path):
    """A tiny Llama saved in several safetensors shards with an index."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    d = tmp_path / "model"
    model.save_pretrained(d, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file()
    return d


def pretrained(d):
    return ModelConfig(source="pretrained", name=str(d))


def test_an_intact_model_directory_passes(saved):
    assert load_model_config(pretrained(saved)).model_type == "llama"


def test_a_shard_cut_short_is_named_when_the_config_is_read(saved):
    shard = sorted(saved.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ModelError, match=rf"model.name: {shard} is not a readable safetensors "
                                         r"file \(.*incomplete metadata.*\); download or save"):
        load_model_config(pretrained(saved))


def test_an_html_page_saved_as_weights_is_named(saved):
    shard = sorted(saved.glob("*.safetensors"))[0]
    shard.write_text("<html>404</html>")
    with pytest.raises(ModelError, match=rf"{shard} is not a readable safetensors file"):
        check_weights(str(saved))


def test_the_index_must_match_the_shards(saved):
    index = saved / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    gone = sorted(saved.glob("*.safetensors"))[-1]
    gone.rename(gone.with_suffix(".bak"))
    with pytest.raises(ModelError, match=rf"names shards that are not in {saved}: {gone.name}"):
        check_weights(str(saved))
    gone.with_suffix(".bak").rename(gone)
    first = next(iter(good["weight_map"]))
    other = next(s for s in set(good["weight_map"].values()) if s != good["weight_map"][first])
    index.write_text(json.dumps({**good, "weight_map": {**good["weight_map"], first: other}}))
    with pytest.raises(ModelError, match=rf"{saved / other} lacks 1 tensor\(s\) .*\(e.g. {first}\)"):
        check_weights(str(saved))
    index.write_text("{not json")
    with pytest.raises(ModelError, match="is not a valid safetensors index"):
        check_weights(str(saved))


def test_a_single_file_model_is_checked_too(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path / "one"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).save_pretrained(d)
    check_weights(str(d))
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelError, match=rf"{f} is not a readable safetensors file"):
        check_weights(str(d))


def test_the_patch_stage_refuses_it_before_planning(saved, byte_tokenizer):
    from longft.hardware import detect
    from longft.run.patch_stage import make_plan

    shard = sorted(saved.glob("*.safetensors"))[0]
    shard.write_bytes(b"\0" * 7)
    cfg = from_dict({"model": {"source": "pretrained", "name": str(saved)},
                     "data": {"max_seq_length": 1024}})
    with pytest.raises(ModelError, match=rf"{shard} is not a readable safetensors file"):
        make_plan(cfg, detect())
