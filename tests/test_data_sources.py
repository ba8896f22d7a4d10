"""Record sources (jsonl, parquet, datasets, synthetic, random) and the prepare stage end to end."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from longft.config.params import ConfigError, from_dict
from longft.data.errors import BadRecords, DataError
from longft.data.prepare import length_histogram, prepare
from longft.data.records import RecordReader
from longft.data.store import PreparedDataset
from longft.data.synthetic import synthetic_records
from longft.data.tokenize import chat_token_count
from longft.model.loading import ModelError

REPO = Path(__file__).resolve().parents[1]

CHAT = {"idx": 3, "dataset": "longcite",  # LongCite-45k layout: extra keys next to messages
        "messages": [{"role": "user", "content": "Where?"},
                     {"role": "assistant", "content": "Here [doc 1]."}]}


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def reader(path, source="jsonl", mode="error", **data):
    cfg = from_dict({"data": {"source": source, "path": str(path), "on_bad_record": mode, **data}})
    return RecordReader(cfg.data, BadRecords(mode))


def test_jsonl_formats_are_detected_and_tagged_with_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "chat.jsonl", [CHAT, "", CHAT])
    r = reader(p)
    recs = list(r)
    assert r.format == "messages" and r.records_read == 2
    assert [x.where for x in recs] == [f"{p}:1", f"{p}:3"]
    assert recs[0].messages[1] == {"role": "assistant", "content": "Here [doc 1]."}

    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    (rec,) = reader(p)
    assert (rec.format, rec.prompt, rec.completion) == ("prompt_completion", "a", "b")

    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}, {"text": "y"}, {"text": "z"}])
    assert [x.text for x in reader(p, num_samples=2)] == ["x", "y"]


def test_bad_json_line_error_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [CHAT, '{"messages": [', CHAT])
    with pytest.raises(DataError, match=rf"{re.escape(str(p))}:2: not valid JSON.*on_bad_record: skip"):
        list(reader(p))


@pytest.mark.parametrize("bad,reason", [
    ({"messages": []}, "empty_messages"),
    ({"messages": "hi"}, "wrong_type"),
    ({"messages": [{"role": "user"}]}, "missing_key"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no_assistant"),
    ({"prompt": "only"}, "missing_key"),
    ({"prompt": 1, "completion": "x"}, "wrong_type"),
])
def test_malformed_records_name_the_problem(tmp_path, bad, reason):
    fmt = "messages" if "messages" in bad else "prompt_completion"
    p = write_jsonl(tmp_path / "d.jsonl", [bad])
    with pytest.raises(DataError, match=r"d.jsonl:1: ") as e:
        list(reader(p, format=fmt))
    assert e.value.reason == reason


def test_unknown_role_is_refused_with_the_known_roles(tmp_path):
    typo = {"messages": [{"role": "user", "content": "q"}, {"role": "asistant", "content": "a"}]}
    p = write_jsonl(tmp_path / "d.jsonl", [CHAT, typo])
    with pytest.raises(DataError) as e:
        list(reader(p))
    assert str(e.value) == (
        f"{p}:2: messages[1]: unknown role 'asistant'; did you mean 'assistant'? known roles: "
        "system, user, assistant, tool; fix the record's role (or set data.on_bad_record: skip "
        "to skip and count such records)")
    r = reader(p, mode="skip")
    assert len(list(r)) == 1 and r.bad.counts == {"unknown_role": 1}


def test_prepare_refuses_rows_longer_than_the_positions_before_generating(tmp_path):
    from longft.model.loading import MODELS_DIR
    arch = json.loads((MODELS_DIR / "tiny-llama.json").read_text())
    arch["max_position_embeddings"] = 1024
    (tmp_path / "short.json").write_text(json.dumps(arch))
    cfg = from_dict({"model": {"name": str(tmp_path / "short.json")},
                     "data": {"max_seq_length": 10_000_000, "num_samples": 1}})
    with pytest.raises(ModelError, match=r"data.max_seq_length \(10000000\) is longer than the 1024 "
                                         r"positions .*lower data.max_seq_length to at most 1024"):
        prepare(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_skip_mode_counts_bad_records_by_reason(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", ["not json", CHAT, {"messages": []}, {"other": 1}, CHAT])
    r = reader(p, mode="skip")
    assert len(list(r)) == 2
    assert r.records_read == 5
    assert r.bad.counts == {"bad_json": 1, "empty_messages": 1, "missing_key": 1}


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_file_mixing_layouts_says_where_the_layout_came_from_not_skip(tmp_path, mode):
    """Walkthrough finding 11: `text` first, `messages` later. Skipping would drop every chat
    record, so neither mode skips it, and the error does not suggest it."""
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "a document"}, CHAT])
    with pytest.raises(DataError) as e:
        list(reader(p, mode=mode))
    assert str(e.value) == (
        f"{p}:2: a 'messages' record, but data.format auto took the layout 'text' from the first "
        f"record ({p}:1), and one file holds one layout; split the file into one file per layout, "
        f"or set data.format to the layout to train on")
    # a layout set by hand: the other records are ordinary bad records (skip drops them, counted)
    r = reader(p, mode="skip", format="text")
    assert [x.text for x in r] == ["a document"] and r.bad.counts == {"missing_key": 1}


def test_data_path_given_as_a_list_is_one_problem_with_the_fix():
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"source": "jsonl", "path": ["a.jsonl", "b.jsonl"]}})
    assert e.value.problems == [
        "data.path: one path, got a list of 2 (['a.jsonl', 'b.jsonl']); a run reads one file "
        "(concatenate jsonl files into one: `cat a.jsonl b.jsonl > all.jsonl`), or one directory "
        "of .txt/.md documents with data.source: text_dir"]
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"source": "jsonl", "path": ["a.jsonl"]}})
    assert e.value.problems == [
        "data.path: one path, got a list (['a.jsonl']); write it without brackets: data.path: a.jsonl"]


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataError, match=r"nope.jsonl not found.*set data.path"):
        list(reader(tmp_path / "nope.jsonl"))
    p = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="has no records"):
        list(reader(p))


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [CHAT, {**CHAT, "idx": 4, "messages": CHAT["messages"][:1] + [
        {"role": "assistant", "content": "There."}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    recs = list(reader(tmp_path / "d.parquet", source="parquet"))
    assert [r.where for r in recs] == [f"{tmp_path / 'd.parquet'} row 0", f"{tmp_path / 'd.parquet'} row 1"]
    assert [r.messages[-1]["content"] for r in recs] == ["Here [doc 1].", "There."]


def test_hf_save_to_disk_directory_and_split(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)])
    ds.save_to_disk(str(tmp_path / "single"))
    assert [r.completion for r in reader(tmp_path / "single", source="hf")] == ["c0", "c1", "c2"]
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(list(reader(tmp_path / "dd", source="hf", split="test"))) == 1
    with pytest.raises(DataError, match="no split 'valid'"):
        list(reader(tmp_path / "dd", source="hf", split="valid"))


def test_synthetic_is_deterministic_fills_the_context_and_cites_the_right_doc(byte_tokenizer):
    count = lambda m: chat_token_count(m, byte_tokenizer)  # noqa: E731
    first = list(synthetic_records(3, 1024, seed=7, count_tokens=count))
    assert first == list(synthetic_records(3, 1024, seed=7, count_tokens=count))
    assert first[0] != next(synthetic_records(1, 1024, seed=8, count_tokens=count))
    for rec in first:
        user, answer = rec.messages[0]["content"], rec.messages[1]["content"]
        n = count(list(rec.messages))
        assert 1024 - 200 < n <= 1024  # as full as fits; one more document (~150 tokens) would not
        m = re.fullmatch(r"The (.+) of (\S+) is (\S+) \[doc (\d+)\]\.", answer)
        attribute, entity, value, doc = m.groups()
        docs = dict(re.findall(r"^\[doc (\d+)\] (.*)$", user, flags=re.M))
        # the cited document states the answer verbatim, its own marker included (LongCite-shaped)
        assert f"The {attribute} of {entity} is {value} [doc {doc}]." in docs[doc] and \
            answer in docs[doc]
        assert all(f"[doc {i}]." in d for i, d in docs.items())  # every document carries its marker
        assert sum(entity in d for d in docs.values()) == 1  # only the cited doc mentions it
        assert user.endswith(f"Question: What is the {attribute} of {entity}?")


def test_synthetic_refuses_a_context_too_short(byte_tokenizer):
    with pytest.raises(DataError, match="too small for the synthetic task"):
        next(synthetic_records(1, 64, 0, lambda m: chat_token_count(m, byte_tokenizer)))


def test_random_source_shape_range_and_seed(tmp_path):
    cfg = from_dict({"data": {"source": "random", "num_samples": 5, "max_seq_length": 64}})
    stats = prepare(cfg, tmp_path / "a")
    ds = PreparedDataset(tmp_path / "a")
    ids = np.load(tmp_path / "a" / "input_ids.npy")
    assert ids.shape == (5, 64) and len(ds) == 5
    assert ids.min() >= 1 and ids.max() < 384  # tiny-llama vocab_size
    assert len(np.unique(ids)) > 100
    row = ds[2]
    assert row["labels"].tolist() == row["input_ids"].tolist()
    assert row["position_ids"].tolist() == list(range(64))
    assert stats["rows"] == 5 and stats["padding_tokens"] == 0 and stats["trainable_tokens"] == 5 * 63
    prepare(cfg, tmp_path / "b")
    assert (np.load(tmp_path / "b" / "input_ids.npy") == ids).all()


def test_prepare_jsonl_packs_and_writes_stats(tmp_path):
    lines = [{"prompt": "q" * n, "completion": "a" * 5} for n in (10, 30, 50, 200)]
    p = write_jsonl(tmp_path / "d.jsonl", lines + ["{broken"])
    cfg = from_dict({"data": {"source": "jsonl", "path": str(p), "max_seq_length": 128,
                              "on_bad_record": "skip"}})
    stats = prepare(cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == stats
    assert stats["records"] == 5 and stats["skipped"] == {"bad_json": 1}
    # the 200-char prompt is cut to 128 tokens, which removes its whole completion: dropped
    assert stats["truncated_samples"] == 1 and stats["dropped_untrainable_samples"] == 1
    assert stats["samples"] == 3 and stats["rows"] == 1  # 17 + 37 + 57 tokens in one row
    assert stats["tokens"] == 111 and stats["padding_tokens"] == 128 - 111
    assert stats["trainable_tokens"] == 3 * 6  # completion + eos of each
    assert stats["packing_efficiency"] == round(111 / 128, 4)
    assert stats["sample_length_histogram"] == {"17-32": 1, "33-64": 2, "129-256": 1}
    row = PreparedDataset(tmp_path / "out")[0]
    assert (row["labels"] != -100).sum().item() == 18


def test_prepare_error_mode_stops_at_the_bad_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": 5}])
    cfg = from_dict({"data": {"source": "jsonl", "path": str(p)}})
    with pytest.raises(DataError, match=r"d.jsonl:2: 'text' must be a string"):
        prepare(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_chat_data_with_a_tokenizer_without_chat_template(tmp_path, byte_tokenizer):
    import copy

    tok = copy.deepcopy(byte_tokenizer)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    assert not (tmp_path / "tok" / "chat_template.jinja").exists()
    cfg = from_dict({"model": {"tokenizer": str(tmp_path / "tok")},
                     "data": {"num_samples": 2, "max_seq_length": 512, "on_bad_record": "skip"}})
    with pytest.raises(DataError, match="has no chat template.*set model.tokenizer.*prompt_completion"):
        prepare(cfg, tmp_path / "out")


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    arch = json.loads((REPO / "configs/models/tiny-llama.json").read_text())
    (tmp_path / "small.json").write_text(json.dumps({**arch, "vocab_size": 200}))
    cfg = from_dict({"model": {"name": str(tmp_path / "small.json")},
                     "data": {"num_samples": 1, "max_seq_length": 512}})
    with pytest.raises(ModelError, match="262 tokens but the model's vocab_size is 200"):
        prepare(cfg, tmp_path / "out")


def test_length_histogram_power_of_two_bins():
    assert length_histogram([1, 2, 3, 4, 5, 4096, 4097]) == {
        "1": 1, "2-2": 1, "3-4": 2, "5-8": 1, "2049-4096": 1, "4097-8192": 1}


def test_stage_exits_2_with_the_message(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage_prepare", REPO / "stages/prepare.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    params = tmp_path / "params.yaml"
    params.write_text(f"data:\n  source: jsonl\n  path: {tmp_path / 'missing.jsonl'}\n")
    assert stage.main(["--params", str(params), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl not found" in err and "Traceback" not in err
    params.write_text("data:\n  source: random\n  num_samples: 2\n  max_seq_length: 16\n")
    assert stage.main(["--params", str(params), "--out", str(tmp_path / "out")]) == 0
    assert "2 rows x 16 tokens" in capsys.readouterr().out
