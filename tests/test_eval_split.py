"""Issue 19 A, the data side: the held-out split (data.eval_samples) in data/prepared/eval, never
packed with nor taken from the training rows, and what the retrieval score needs per sample."""

import json

import numpy as np
import pytest

from longft.config.params import ConfigError, from_dict
from longft.data.errors import DataError
from longft.data.prepare import prepare
from longft.data.split import pick_eval
from longft.data.store import PreparedDataset, held_out


def synthetic(**data):
    return from_dict({"data": {"num_samples": 6, "max_seq_length": 1024, **data}})


def arrays(path):
    return [np.load(path / f"{a}.npy") for a in ("input_ids", "labels", "position_ids")]


def test_held_out_synthetic_samples_leave_the_training_rows_as_they_were(tmp_path):
    prepare(synthetic(eval_samples=0), tmp_path / "none")
    stats = prepare(synthetic(eval_samples=5), tmp_path / "five")
    assert held_out(tmp_path / "none") is None and stats["eval"]["samples"] == 5
    for a, b in zip(arrays(tmp_path / "none"), arrays(tmp_path / "five")):
        assert (a == b).all()  # the training rows are those of num_samples alone
    data, samples = held_out(tmp_path / "five")
    assert len(data) == stats["eval"]["rows"] and data.meta["format"] == "held-out"
    assert [s["where"] for s in samples] == [f"synthetic sample {i}" for i in range(6, 11)]
    assert len(PreparedDataset(tmp_path / "five")) == stats["rows"]  # train rows only
    # the same seed gives the same held-out rows
    prepare(synthetic(eval_samples=5), tmp_path / "again")
    for a, b in zip(arrays(tmp_path / "five" / "eval"), arrays(tmp_path / "again" / "eval")):
        assert (a == b).all()


def test_samples_json_spans_hold_the_cited_number_and_the_value(tmp_path, byte_tokenizer):
    stats = prepare(synthetic(eval_samples=6), tmp_path / "p")
    data, samples = held_out(tmp_path / "p")
    assert stats["eval"]["scored_samples"] == 6
    for s in samples:
        row = data[s["row"]]
        ids, labels = row["input_ids"], row["labels"]
        a, b = s["cite"]
        c, d = s["value"]
        assert byte_tokenizer.decode(ids[a:b]) == str(s["cited_doc"])
        answer = byte_tokenizer.decode(ids[c - 20:b + 1])
        assert answer.endswith(f" is {byte_tokenizer.decode(ids[c:d])} [doc {s['cited_doc']}]")
        assert (labels[a:b] != -100).all() and (labels[c:d] != -100).all()
        # the document it cites holds the value with its marker: "[doc N] ... is VALUE [doc N]."
        text = byte_tokenizer.decode(ids[s["offset"]:s["offset"] + s["length"]])
        doc = text.split(f"[doc {s['cited_doc']}] ")[1].split("\n")[0]
        assert f" is {byte_tokenizer.decode(ids[c:d])} [doc {s['cited_doc']}]." in doc
        assert 1 <= s["cited_doc"] <= s["num_docs"]
        assert s["position"] == pytest.approx((s["cited_doc"] - 1) / max(1, s["num_docs"] - 1),
                                              abs=1e-4)
        pos = row["position_ids"]  # the sample is one document of its row
        assert pos[s["offset"]] == 0 and pos[s["offset"] + s["length"] - 1] == s["length"] - 1


def chats(n):
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]


def jsonl(tmp_path, n):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in chats(n)))
    return p


def row_answers(path, tok) -> list[str]:
    out = []
    for row in PreparedDataset(path):
        text = tok.decode(row["input_ids"][row["labels"] != -100])
        out += [w for w in text.replace("<|eot_id|>", " ").split() if w.isdigit()]
    return out


def test_a_file_is_split_by_seed_and_no_row_mixes_train_and_held_out(tmp_path, byte_tokenizer):
    p = jsonl(tmp_path, 60)

    def cfg(seed, k=4):
        return from_dict({"data": {"source": "jsonl", "path": str(p), "max_seq_length": 256,
                                   "num_samples": None, "eval_samples": k},
                          "train": {"seed": seed}})

    stats = prepare(cfg(1), tmp_path / "a")
    assert stats["samples"] == 56 and stats["eval"]["samples"] == 4
    assert stats["eval"]["scored_samples"] == 0 and stats["eval"]["note"] is None
    train = row_answers(tmp_path / "a", byte_tokenizer)
    held = row_answers(tmp_path / "a" / "eval", byte_tokenizer)
    assert sorted(train + held, key=int) == [str(i) for i in range(60)]  # nothing lost
    assert not set(train) & set(held)  # no held-out document in a training row
    assert held == [str(i) for i in pick_eval(60, 4, 1)]
    prepare(cfg(1), tmp_path / "b")
    assert row_answers(tmp_path / "b" / "eval", byte_tokenizer) == held  # same seed, same split
    prepare(cfg(2), tmp_path / "c")
    assert row_answers(tmp_path / "c" / "eval", byte_tokenizer) != held


def test_a_small_file_keeps_nine_tenths_for_training_and_says_so(tmp_path, capsys):
    p = jsonl(tmp_path, 25)
    cfg = from_dict({"data": {"source": "jsonl", "path": str(p), "max_seq_length": 256,
                              "num_samples": None, "eval_samples": 32}})
    stats = prepare(cfg, tmp_path / "a")
    assert stats["eval"]["samples"] == 2 and stats["samples"] == 23
    assert "held out 2 of 25 records for evaluation, not data.eval_samples 32" in \
        capsys.readouterr().out
    assert stats["eval"]["note"].startswith("held out 2 of 25")
    stats = prepare(from_dict({"data": {"source": "jsonl", "path": str(jsonl(tmp_path, 5)),
                                        "num_samples": None, "max_seq_length": 256}}),
                    tmp_path / "b")
    assert stats["eval"]["samples"] == 0 and stats["samples"] == 5
    assert held_out(tmp_path / "b") is None and "no eval loss" in stats["eval"]["note"]


def test_pick_eval_refuses_to_take_every_sample():
    assert pick_eval(10, 0, 1) == []
    assert pick_eval(10, 3, 1) == pick_eval(10, 3, 1) and len(set(pick_eval(10, 3, 1))) == 3
    with pytest.raises(DataError, match="data.eval_samples 10 leaves no training sample"):
        pick_eval(10, 10, 1)


def test_random_source_has_no_held_out_split(tmp_path):
    stats = prepare(from_dict({"data": {"source": "random", "num_samples": 2,
                                        "max_seq_length": 32}}), tmp_path / "r")
    assert stats["eval"]["samples"] == 0 and held_out(tmp_path / "r") is None


def test_negative_eval_knobs_are_refused():
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"eval_samples": -1}, "train": {"eval_every": -2}})
    assert "data.eval_samples: must be >= 0" in str(e.value)
    assert "train.eval_every: must be >= 0" in str(e.value)


def test_unreadable_samples_json_names_the_fix(tmp_path):
    prepare(synthetic(eval_samples=2), tmp_path / "p")
    (tmp_path / "p" / "eval" / "samples.json").write_text("{")
    with pytest.raises(DataError, match="unreadable samples.json.*dvc repro prepare"):
        held_out(tmp_path / "p")


def test_pieces_of_a_split_text_record_stay_on_one_side():
    """A long text record split over rows (data.split_text) is held out whole or trained whole:
    no held-out piece continues a document the model trained on."""
    import numpy as np

    from longft.data.split import split_samples
    from longft.data.tokenize import Sample

    samples, origin = [], []
    for rec in range(40):
        for piece in range(rec % 4 + 1):       # records of 1 to 4 pieces
            ids = np.arange(8) + 100 * rec + 10 * piece
            samples.append(Sample(ids, ids.copy(), f"rec{rec} part {piece}"))
            origin.append(rec)
    train, held, note = split_samples(samples, 4, 1234, origin)
    rec_of = lambda s: s.where.split()[0]  # noqa: E731
    assert note is None and held
    assert {rec_of(s) for s in held}.isdisjoint({rec_of(s) for s in train})
    assert len({rec_of(s) for s in held}) == 4            # 4 records, with all their pieces
    assert len(train) + len(held) == len(samples)
