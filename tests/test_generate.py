"""`longft generate` (issue 36): samples from the exported model, a full one or a LoRA adapter on its
base, on prompts (through the chat template) or held-out records, greedy by default, on the CPU; a
clear error without export/. Tiny models saved with save_pretrained, as engine/export.py does."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from longft.cli import main as cli
from longft.config.params import Config, from_dict
from longft.generate import ExportMissingError, chat_prompt, held_out_prompts, load_export
from longft.model.loading import ModelError

REPO = Path(__file__).resolve().parents[1]


def tiny_model(byte_tokenizer, out: Path, kind="full", **info):
    """A random tiny Llama and the byte tokenizer saved like an export (kind: full)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "configs/models/tiny-llama.json")
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    byte_tokenizer.save_pretrained(out)
    (out / "longft_export.json").write_text(json.dumps(
        {"model": "tiny", "source": "pretrained", "steps": 3, "lora_rank": 0, "kind": kind, **info}))
    return model


def test_prompt_goes_through_the_chat_template_and_greedy_is_repeatable(tmp_path, byte_tokenizer,
                                                                          capsys):
    tiny_model(byte_tokenizer, tmp_path / "export")
    p = chat_prompt(byte_tokenizer, "Where is doc 3?")
    text = byte_tokenizer.decode(p.ids)
    assert "<|start_header_id|>user<|end_header_id|>" in text and "Where is doc 3?" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")  # the answer is next

    args = ["generate", "--export", str(tmp_path / "export"), "--prompt", "Where is doc 3?",
            "--max-new-tokens", "5", "--device", "cpu"]
    outs = []
    for i in range(2):
        assert cli.main(args + ["--json", str(tmp_path / f"out{i}.json")]) == 0
        outs.append(json.loads((tmp_path / f"out{i}.json").read_text()))
    assert outs[0] == outs[1] and outs[0][0]["name"] == "prompt 0"  # greedy: the same text twice
    assert outs[0][0]["reference"] is None and "Where is doc 3?" in outs[0][0]["prompt"]
    printed = capsys.readouterr().out
    assert "(full, tiny, step 3) on cpu, greedy" in printed and "--- generated (" in printed


def test_an_export_of_other_params_than_params_yamls_is_said(tmp_path, byte_tokenizer, monkeypatch,
                                                             capsys):
    """Walkthrough (2026-12-05): after `dvc exp apply` of a LoRA experiment, export/ still held the
    baseline's full model (it is not cached) and generate answered with it silently."""
    from longft.config.params import from_dict, section_digests

    monkeypatch.chdir(tmp_path)
    trained = {"model": {"source": "random", "name": "tiny-llama"}, "lora": {"rank": 0}}
    tiny_model(byte_tokenizer, Path("export"), params_digests=section_digests(from_dict(trained)))
    args = ["generate", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]
    Path("params.yaml").write_text(yaml.safe_dump(trained))
    assert cli.main(args) == 0 and "note:" not in capsys.readouterr().err
    Path("params.yaml").write_text(yaml.safe_dump({**trained, "lora": {"rank": 16},
                                                   "train": {"iterations": 6}}))
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "note: export/ was trained with other params than params.yaml's (section(s) train, " \
           "lora differ): it is the model of an earlier run" in err and "dvc repro" in err
    # an export elsewhere is not compared with the workspace's params
    import shutil

    shutil.copytree("export", "elsewhere")
    assert cli.main(args + ["--export", "elsewhere"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_held_out_records_are_cut_before_the_answer(tmp_path, byte_tokenizer, monkeypatch):
    from longft.data.prepare import prepare

    monkeypatch.chdir(REPO)  # configs/ of the default tiny model and byte tokenizer
    cfg = from_dict({"data": {"num_samples": 2, "eval_samples": 2, "max_seq_length": 1024}})
    prepare(cfg, tmp_path / "prepared")
    prompts = held_out_prompts(tmp_path / "prepared", 5)
    assert [p.name for p in prompts] == ["held-out 0", "held-out 1"]
    for p in prompts:
        prompt, ref = byte_tokenizer.decode(p.ids), byte_tokenizer.decode(p.reference)
        assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert ref.startswith("The ") and "[doc " in ref  # the synthetic task's answer
    tiny_model(byte_tokenizer, tmp_path / "export")
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--data",
                     str(tmp_path / "prepared"), "--held-out", "1", "--max-new-tokens", "3",
                     "--json", str(tmp_path / "o.json")]) == 0
    got = json.loads((tmp_path / "o.json").read_text())
    assert len(got) == 1 and got[0]["reference"].startswith("The ")


def test_held_out_text_records_are_continued_from_their_first_part(tmp_path, byte_tokenizer,
                                                                   monkeypatch, capsys):
    from longft.data.prepare import prepare
    from longft.generate.prompts import continuation_cut

    assert continuation_cut(100, 64) == 50 and continuation_cut(101, 64) == 51  # the first half
    assert continuation_cut(12079, 64) == 12015   # a long record: the reference is 64 tokens
    assert continuation_cut(2, 64) == 1
    monkeypatch.chdir(REPO)  # configs/ of the default tiny model and byte tokenizer
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Report {i}. " + "Sales rose in March. " * (5 + i)})
                            + "\n" for i in range(10)))
    cfg = from_dict({"data": {"source": "jsonl", "path": str(docs), "num_samples": None,
                              "eval_samples": 1, "max_seq_length": 1024}})
    prepare(cfg, tmp_path / "prepared")
    (p,) = held_out_prompts(tmp_path / "prepared", 5, max_new_tokens=40)
    whole = p.ids + p.reference
    assert p.continued == len(whole) > 80 and len(p.reference) == 40   # capped at --max-new-tokens
    assert byte_tokenizer.decode(whole, skip_special_tokens=True).startswith("Report ")
    (short,) = held_out_prompts(tmp_path / "prepared", 5, max_new_tokens=1000)
    assert len(short.ids) == (len(whole) + 1) // 2 and short.ids + short.reference == whole  # halves
    tiny_model(byte_tokenizer, tmp_path / "export")
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--data",
                     str(tmp_path / "prepared"), "--max-new-tokens", "40", "--show-prompt-chars", "0",
                     "--json", str(tmp_path / "o.json")]) == 0
    assert (f"### held-out 0 ({len(p.ids)} prompt tokens: the start of a {len(whole)}-token record "
            "trained whole (text), continued; reference: its last 40 tokens)") in capsys.readouterr().out
    got = json.loads((tmp_path / "o.json").read_text())
    assert got[0]["reference"] == byte_tokenizer.decode(p.reference, skip_special_tokens=True)


def test_lora_adapter_is_loaded_on_its_base(tmp_path, byte_tokenizer):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    tiny_model(byte_tokenizer, tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # a pretrained run's base
    ids = torch.randint(1, 250, (1, 24))
    with torch.no_grad():
        plain = base(ids).logits
    # init_lora_weights=False: B is random, not zero, so the adapter changes what the model computes
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False)).eval()
    with torch.no_grad():
        adapted = peft_model(ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapter is visible in the logits
    peft_model.save_pretrained(tmp_path / "export")  # adapter_config names tmp_path/base
    byte_tokenizer.save_pretrained(tmp_path / "export")
    (tmp_path / "export" / "longft_export.json").write_text(json.dumps(
        {"model": str(tmp_path / "base"), "source": "pretrained", "steps": 1, "lora_rank": 4,
         "kind": "lora_adapter"}))
    export = load_export(tmp_path / "export")
    assert isinstance(export.model, PeftModel) and export.kind == "lora_adapter"
    with torch.no_grad():  # the loaded model is the base with this adapter applied
        torch.testing.assert_close(export.model(ids).logits, adapted)
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "hi",
                     "--max-new-tokens", "2"]) == 0
    # its base moved since training: said at once, naming the folder, never asking the hub
    (tmp_path / "base").rename(tmp_path / "base-moved")
    with pytest.raises(ModelError, match=r"no directory .*base \(.* holds: .*base-moved"):
        load_export(tmp_path / "export")
    (tmp_path / "base-moved").rename(tmp_path / "base")
    # an adapter of a random-init base cannot be loaded: its base weights were never saved
    info = json.loads((tmp_path / "export" / "longft_export.json").read_text())
    (tmp_path / "export" / "longft_export.json").write_text(json.dumps({**info, "source": "random"}))
    with pytest.raises(ExportMissingError, match="output.export_lora: merged"):
        load_export(tmp_path / "export")


def test_a_qlora_adapter_is_applied_to_the_quantized_base_it_was_trained_on(tmp_path, byte_tokenizer,
                                                                          capsys):
    """A QLoRA run's adapter export records its base (engine/export.py base_record): generate
    quantizes the base as training did before applying the adapter, and says so. The same adapter
    on the unquantized base computes something else."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from longft.engine.export import base_record
    from longft.model.quantize import quantize_linears

    tiny_model(byte_tokenizer, tmp_path / "base")
    cfg = from_dict({"model": {"source": "pretrained", "name": str(tmp_path / "base")},
                     "lora": {"rank": 4, "quantize": "nf4", "target_modules": ["q_proj", "v_proj"]},
                     "zero": {"stage": 2}})
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    quantize_linears(base, cfg.lora.target_modules, "nf4", torch.bfloat16, "cpu")
    trained = get_peft_model(base, LoraConfig(r=4, target_modules=list(cfg.lora.target_modules),
                                              init_lora_weights=False),
                             autocast_adapter_dtype=False).eval()
    ids = torch.randint(1, 250, (1, 24))
    with torch.no_grad():
        want = trained(ids).logits
    trained.save_pretrained(tmp_path / "export")
    byte_tokenizer.save_pretrained(tmp_path / "export")
    info = {"model": cfg.model.name, "source": "pretrained", "steps": 1, "lora_rank": 4,
            "quantize": "nf4", "kind": "lora_adapter", "base": base_record(cfg, torch.bfloat16)}
    assert info["base"]["quantize"] == "nf4" and info["base"]["dtype"] == "bfloat16"
    (tmp_path / "export" / "longft_export.json").write_text(json.dumps(info))

    export = load_export(tmp_path / "export")
    assert "quantized to nf4 (the base it was trained on)" in export.base
    assert any(type(m).__name__ == "Linear4bit" for m in export.model.modules())
    with torch.no_grad():
        torch.testing.assert_close(export.model(ids).logits, want)  # what the run trained
    plain = {**info, "base": {**info["base"], "quantize": "none"}}
    (tmp_path / "export" / "longft_export.json").write_text(json.dumps(plain))
    with torch.no_grad():  # the unquantized base: another model
        other = load_export(tmp_path / "export").model.to(torch.bfloat16)(ids).logits
    assert (other.float() - want.float()).abs().max() > 1e-2
    (tmp_path / "export" / "longft_export.json").write_text(json.dumps(info))
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "hi",
                     "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "quantized to nf4 (the base it was trained on)" in capsys.readouterr().out


def test_missing_export_and_bad_options_are_clear_errors(tmp_path, capsys):
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "export/ does not exist: no exported model" in err and "output.export: true" in err
    assert "Traceback" not in err
    (tmp_path / "export").mkdir()
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "x"]) == 2
    assert "is not a longft export (no readable longft_export.json" in capsys.readouterr().err
    assert Config().output.export  # the default pipeline exports what this reads


@pytest.mark.parametrize("args, said", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be a whole number >= 1 (tokens)"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["--top-p", "0"], "argument --top-p: must be a finite number > 0 and <= 1, got 0"),
    (["--held-out", "-2"], "argument --held-out: must be a whole number >= 1"),
    (["--json", "."], "argument --json: . is a directory; name a file to write"),
])
def test_bad_options_are_refused_as_they_are_parsed(args, said, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x", *args])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_cut_export_a_missing_gpu_and_an_unwritable_json_are_messages(tmp_path, byte_tokenizer,
                                                                        capsys):
    tiny_model(byte_tokenizer, tmp_path / "export")
    run = ["generate", "--export", str(tmp_path / "export"), "--prompt", "hi",
           "--max-new-tokens", "2", "--show-prompt-chars", "0"]
    (tmp_path / "plain").write_text("x")
    with pytest.raises(SystemExit):  # a file where the JSON's folder goes
        cli.main([*run, "--json", str(tmp_path / "plain" / "out.json")])
    assert "plain is a file, not a directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main([*run, "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "--device cuda: this torch is a CPU build" in err or "no CUDA GPU" in err
    assert cli.main([*run, "--device", "tpu"]) == 2
    assert "give auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    weights = tmp_path / "export" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert "holds weights that cannot be read (safetensors files: model.safetensors;" in err
    assert "cut short or damaged" in err and "Traceback" not in err
