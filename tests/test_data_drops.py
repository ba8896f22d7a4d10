"""Issue 19: nothing is dropped in silence. data.num_samples caps a file only when set (null = every
record), and says so; records skipped or cut are counted in stats.json and printed with the fix;
long `text` records are split into documents (data.split_text) instead of cut."""

import json

import numpy as np
import pytest

from longft.config.params import Config, ConfigError, from_dict, to_dict
from longft.data.errors import BadRecords, DataError
from longft.data.packing import fit_sample, split_sample
from longft.data.prepare import prepare
from longft.data.store import PreparedDataset
from longft.data.tokenize import IGNORE_INDEX, Sample

# no held-out split (data.eval_samples, where it exists): every sample of these files trains
NO_EVAL = {"eval_samples": 0} if "eval_samples" in to_dict(Config())["data"] else {}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cfg_for(path, **data):
    return from_dict({"data": {"source": "jsonl", "path": str(path), "max_seq_length": 256,
                               **NO_EVAL, **data}})


def chats(n):
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} " + WORDS[i % 10]}]}
            for i in range(n)]


def test_null_reads_every_record_and_a_cap_says_what_it_left_out(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", chats(120))
    stats = prepare(cfg_for(path, num_samples=None), tmp_path / "all")
    assert stats["records"] == stats["records_total"] == 120 and stats["samples"] == 120
    assert stats["records_capped"] == 0 and stats["dropped"] == {} and stats["notes"] == []
    assert "note" not in capsys.readouterr().out

    stats = prepare(cfg_for(path, num_samples=48), tmp_path / "capped")
    assert (stats["records"], stats["records_total"], stats["records_capped"]) == (48, 120, 72)
    assert stats["samples"] == 48 and stats["dropped"] == {"num_samples": 72}
    out = capsys.readouterr().out
    assert ("prepare: note: data.num_samples is 48: read the first 48 of the 120 records of "
            f"{path} and dropped the other 72; set data.num_samples: null") in out
    assert stats["notes"][0] in out


def test_generated_sources_need_num_samples_and_zero_is_refused():
    with pytest.raises(ConfigError, match="required for source 'synthetic'"):
        from_dict({"data": {"num_samples": None}})
    with pytest.raises(ConfigError, match="must be > 0, got 0; null reads every record"):
        from_dict({"data": {"source": "jsonl", "path": "x.jsonl", "num_samples": 0}})


def test_skipped_and_cut_records_are_counted_and_told(tmp_path, capsys):
    long_chat = {"messages": [{"role": "user", "content": "q " * 90},
                              {"role": "assistant", "content": "a " * 50}]}
    recs = chats(4) + [long_chat, {"nope": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    stats = prepare(cfg_for(path, num_samples=None, truncate=False, on_bad_record="skip"),
                    tmp_path / "skip")
    assert stats["dropped"] == {"too_long": 1, "missing_key": 1} and stats["samples"] == 4
    out = capsys.readouterr().out
    assert "1 record(s) skipped as longer than data.max_seq_length 256" in out
    assert "1 malformed record(s) skipped (data.on_bad_record: skip): missing_key 1" in out

    stats = prepare(cfg_for(path, num_samples=None, on_bad_record="skip"), tmp_path / "cut")
    assert stats["truncated_samples"] == 1 and stats["dropped"] == {"missing_key": 1}
    assert "1 sample(s) cut to data.max_seq_length 256" in capsys.readouterr().out


def test_split_sample_keeps_every_token_in_order():
    ids = np.arange(1, 11, dtype=np.int32)
    s = Sample(ids, ids.copy(), "f.jsonl:3")
    parts = split_sample(s, 4)
    assert [p.input_ids.tolist() for p in parts] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [p.where for p in parts] == ["f.jsonl:3 part 1/3", "f.jsonl:3 part 2/3",
                                        "f.jsonl:3 part 3/3"]
    bad = BadRecords("error")
    assert len(fit_sample(s, "text", 4, True, True, bad)) == 3
    assert [len(p) for p in fit_sample(s, "text", 4, True, False, bad)] == [4]  # split_text false
    assert [len(p) for p in fit_sample(s, "messages", 4, True, True, bad)] == [4]  # chat: cut
    assert fit_sample(s, "text", 10, True, True, bad) == [s]


def test_a_long_text_record_becomes_several_documents_with_all_its_tokens(tmp_path, capsys):
    text = " ".join(WORDS[i % 10] for i in range(300))  # ~1,900 bytes: the byte tokenizer's tokens
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": text}, {"text": "short one"}])
    out_dir = tmp_path / "split"
    stats = prepare(cfg_for(path, num_samples=None), out_dir)
    n = len(text.encode()) + 2  # bos + bytes + eos
    assert stats["split_text_records"] == 1 and stats["truncated_samples"] == 0
    assert stats["samples"] == -(-n // 256) + 1
    assert "1 text record(s) longer than data.max_seq_length split into documents of 256" \
        in capsys.readouterr().out
    data = PreparedDataset(out_dir)
    rows = [data[i] for i in range(len(data))]
    ids = np.concatenate([r["input_ids"].numpy() for r in rows])
    labels = np.concatenate([r["labels"].numpy() for r in rows])
    # every token of the text is in the rows; all but each piece's first one are trained on
    pieces = -(-n // 256)
    assert stats["trainable_tokens"] == (n - pieces) + (len("short one") + 2 - 1)
    assert int(np.count_nonzero(labels != IGNORE_INDEX)) == stats["trainable_tokens"]
    assert stats["tokens"] == n + len("short one") + 2 and len(ids) == len(data) * 256

    # split_text false: the same record is cut to one row, as before
    stats = prepare(cfg_for(path, num_samples=None, split_text=False), tmp_path / "cut")
    assert stats["split_text_records"] == 0 and stats["truncated_samples"] == 1
    assert stats["samples"] == 2


def test_a_capped_parquet_file_is_counted_from_its_footer_not_read(tmp_path, monkeypatch):
    """The records a cap leaves out of a parquet file are counted from its metadata: reading
    stops at the cap (a cap of 10 on a large file costs 10 records, not the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from longft.data import records as rec_mod

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(chats(1000)), path, row_group_size=100)
    read = []
    real = rec_mod._parquet

    def counting(p):
        for item in real(p):
            read.append(item[0])
            yield item

    monkeypatch.setattr(rec_mod, "_parquet", counting)
    stats = prepare(from_dict({"data": {"source": "parquet", "path": str(path), "max_seq_length": 256,
                                        "num_samples": 10, **NO_EVAL}}), tmp_path / "out")
    assert (stats["records"], stats["records_total"], stats["records_capped"]) == (10, 1000, 990)
    assert len(read) == 11          # the cap's 10 and the one that found the cap reached


def test_empty_answers_are_counted_like_bad_records_and_refused_when_nothing_is_left(tmp_path,
                                                                                      capsys):
    """Issue 35.5: records whose assistant answers are all empty used to be prepared as trainable
    (the end-of-turn tokens), with no note."""
    empty = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": ""}]} for i in range(3)]
    path = write_jsonl(tmp_path / "empty.jsonl", empty)
    with pytest.raises(DataError, match="every assistant answer is empty"):
        prepare(cfg_for(path, num_samples=None), tmp_path / "error")
    with pytest.raises(DataError, match="no trainable samples"):
        prepare(cfg_for(path, num_samples=None, on_bad_record="skip"), tmp_path / "none")
    assert not (tmp_path / "none").exists()

    path = write_jsonl(tmp_path / "some.jsonl", chats(2) + empty)
    stats = prepare(cfg_for(path, num_samples=None, on_bad_record="skip"), tmp_path / "skip")
    assert stats["samples"] == 2 and stats["dropped"] == {"empty_answer": 3}
    assert "3 malformed record(s) skipped (data.on_bad_record: skip): empty_answer 3" in \
        capsys.readouterr().out

    blank = [{"prompt": "question", "completion": " "}, {"prompt": "q", "completion": "answer"}]
    path = write_jsonl(tmp_path / "pc.jsonl", blank)
    stats = prepare(cfg_for(path, num_samples=None, on_bad_record="skip"), tmp_path / "pc")
    assert stats["samples"] == 1 and stats["dropped"] == {"empty_answer": 1}


@pytest.mark.parametrize("pack", [True, False])
def test_rows_mostly_padding_are_said_with_the_fix(tmp_path, capsys, pack):
    """Three short chats in rows of 1,024 tokens: most of what the model would compute is padding
    (the 352K-token H200 row of 2026-12-03 was 83 % padding and took 226 s a step)."""
    path = write_jsonl(tmp_path / "d.jsonl", chats(3))
    stats = prepare(cfg_for(path, num_samples=None, pack=pack, max_seq_length=1024), tmp_path / "out")
    assert stats["packing_efficiency"] < 0.5
    note = next(n for n in stats["notes"] if "padding" in n)
    assert note.startswith(f"{1 - stats['packing_efficiency']:.0%} of the rows' tokens are padding")
    assert ("more documents" if pack else "set data.pack: true") in note
    assert f"prepare: note: {note}" in capsys.readouterr().out
