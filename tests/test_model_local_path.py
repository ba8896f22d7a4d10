"""A mistyped local model path fails at once, naming what its folder holds (walk finding 6): it
was read as a hub id, retried huggingface.co for ~25 s and blamed the network. Hub ids still go to
from_pretrained. No test here reaches the network: from_pretrained of anything but a local folder
is replaced by a recorder that raises."""

import shutil
import time
from pathlib import Path

import pytest
import yaml

from longft.config.params import ModelConfig
from longft.model.loading import MODELS_DIR, ModelError, build_model, load_model_config, load_tokenizer

HUB = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Work in tmp_path with models/my-llama (a config.json); record every from_pretrained of a
    name that is no local folder (a hub call) and fail it as an unreachable hub would."""
    import transformers

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "my-llama").mkdir(parents=True)
    shutil.copy(MODELS_DIR / "tiny-llama.json", tmp_path / "models" / "my-llama" / "config.json")
    calls = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained

        def guarded(name, *a, _real=real, _cls=cls, **k):
            if Path(name).is_dir():
                return _real(name, *a, **k)
            calls.append((_cls.__name__, name))
            raise OSError("We couldn't connect to 'https://huggingface.co' (test: no network)")
        monkeypatch.setattr(cls, "from_pretrained", guarded)
    return calls


def test_a_mistyped_local_path_fails_at_once_with_the_close_name_and_no_hub_call(hub):
    mc = ModelConfig(source="pretrained", name="models/my-lama")
    for load in (load_model_config, load_tokenizer, lambda m: build_model(m, "sdpa", None)):
        t = time.monotonic()
        with pytest.raises(ModelError) as e:
            load(mc)
        assert time.monotonic() - t < 1
        assert str(e.value).startswith("model.name: no directory models/my-lama (models/ holds: "
                                       "my-llama); did you mean models/my-llama? (read as a local "
                                       "path: models/ exists here and holds a near twin; for "
                                       "the hub model of that name, run from another directory)")
    with pytest.raises(ModelError, match=r"model.tokenizer: no directory \./toks \(\./ holds: models\)"):
        load_tokenizer(ModelConfig(source="random", tokenizer="./toks"))
    assert hub == []  # huggingface.co never asked


def test_a_hub_id_without_such_a_local_folder_still_goes_to_the_hub(hub):
    with pytest.raises(ModelError, match=r"cannot load a config for 'meta-llama/Llama-3.1-8B' "
                                         r"\(OSError: We couldn't connect"):
        load_model_config(ModelConfig(source="pretrained", name=HUB))
    assert hub == [("AutoConfig", HUB)]
    assert load_model_config(ModelConfig(source="pretrained", name="models/my-llama")).hidden_size == 64
    # one model of an owner downloaded here (meta-llama/Llama-3.1-8B): another of its hub ids is
    # no typo of it, and still goes to the hub
    shutil.copytree("models/my-llama", HUB)
    with pytest.raises(ModelError, match="cannot load a config for 'meta-llama/Llama-3.2-1B'"):
        load_model_config(ModelConfig(source="pretrained", name="meta-llama/Llama-3.2-1B"))
    assert hub[-1] == ("AutoConfig", "meta-llama/Llama-3.2-1B")
    # a sibling that differs in its numbers only (another size of one family) is no typo either
    shutil.copytree("models/my-llama", "meta-llama/Llama-3.2-3B")
    with pytest.raises(ModelError, match="cannot load a config for 'meta-llama/Llama-3.2-1B'"):
        load_model_config(ModelConfig(source="pretrained", name="meta-llama/Llama-3.2-1B"))
    assert hub[-1] == ("AutoConfig", "meta-llama/Llama-3.2-1B")
    with pytest.raises(ModelError, match="did you mean meta-llama/Llama-3.2-3B"):  # letters differ
        load_model_config(ModelConfig(source="pretrained", name="meta-llama/Lama-3.2-3B"))


def test_placement_model_goes_through_the_same_rule(hub, monkeypatch, capsys):
    from longft.cli.estimate import main
    from longft.hardware import Hardware

    monkeypatch.setattr("longft.hardware.detect", lambda: Hardware(device="cpu", host_mem_gib=24, cpu_count=2))
    Path("params.yaml").write_text(yaml.safe_dump({"model": {"source": "pretrained",
                                                             "name": "models/my-llama"}}))
    assert main("placement", ["--gpu-mem", "24", "--host-mem", "64", "--seq", "4096",
                              "--model", "models/my-lama"]) == 2
    assert "no directory models/my-lama (models/ holds: my-llama)" in capsys.readouterr().err
    assert hub == []
