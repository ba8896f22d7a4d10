"""`data.source: text_dir`: a user's folder of long documents, one text record per file (walkthrough
finding 1: `source: hf` on such a folder made one record per LINE). Real files in tmp_path, the
shipped byte tokenizer (one token a byte, plus bos and eos)."""

import re

import pytest

from longft.config.params import ConfigError, from_dict
from longft.data.errors import BadRecords, DataError
from longft.data.prepare import prepare
from longft.data.records import RecordReader
from longft.data.tracked import untracked

LATIN1 = "Résumé du rapport: café.\n".encode("latin-1")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % 10] for i in range(n_words)) + "\n"


def folder(root, files: dict):
    for name, content in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    return root


def cfg_for(path, **data):
    return from_dict({"data": {"source": "text_dir", "path": str(path), "num_samples": None,
                               "max_seq_length": 256, "eval_samples": 0, **data}})


def reader(path, mode="error", **data):
    return RecordReader(cfg_for(path, on_bad_record=mode, **data).data, BadRecords(mode))


def test_each_txt_or_md_file_is_one_text_record_sorted_and_recursive(tmp_path):
    d = folder(tmp_path / "docs", {"b.txt": "second\n", "a.md": "first\n", "sub/c.TXT": "third\n",
                                   "notes.pdf": b"%PDF", ".hidden.txt": "no", ".git/x.txt": "no",
                                   "bom.txt": "\ufeffwith a BOM".encode("utf-8")})
    r = reader(d)
    recs = list(r)
    assert [x.where for x in recs] == [str(d / n) for n in ("a.md", "b.txt", "bom.txt", "sub/c.TXT")]
    assert [x.text for x in recs] == ["first\n", "second\n", "with a BOM", "third\n"]
    assert {x.format for x in recs} == {"text"} and r.format == "text" and r.records_read == 4
    # a symlinked folder is read like a real one, and a link back up makes no loop
    linked = folder(tmp_path / "elsewhere", {"d.txt": "fourth\n"})
    (d / "more").symlink_to(linked, target_is_directory=True)
    (linked / "up").symlink_to(d, target_is_directory=True)
    assert [x.text for x in reader(d)][-2:] == ["fourth\n", "third\n"]


def test_a_folder_of_documents_prepares_one_document_per_file(tmp_path, capsys):
    """Varied lengths, one file longer than a row (split into documents), one empty, one
    Latin-1: skipped and counted; every token of the UTF-8 files reaches the rows."""
    short = {f"r{i}.txt": text(n, i) for i, n in enumerate((5, 20, 40))}
    long = text(300)  # ~1,900 bytes: several documents of 256 tokens
    d = folder(tmp_path / "docs", {**short, "long.md": long, "empty.txt": "",
                                   "latin1.txt": LATIN1, "image.png": b"\x89PNG"})
    stats = prepare(cfg_for(d, on_bad_record="skip"), tmp_path / "out")
    n_long = len(long.encode()) + 2  # bos + bytes + eos
    pieces = -(-n_long // 256)
    assert (stats["source"], stats["format"]) == ("text_dir", "text")
    assert stats["records"] == stats["records_total"] == 6  # the .png is not a record
    assert stats["skipped"] == {"empty_text": 1, "not_utf8": 1}
    assert stats["dropped"] == {"empty_text": 1, "not_utf8": 1}
    assert stats["split_text_records"] == 1 and stats["truncated_samples"] == 0
    assert stats["samples"] == 3 + pieces
    assert stats["tokens"] == sum(len(t.encode()) + 2 for t in short.values()) + n_long
    out = capsys.readouterr().out
    assert "2 malformed record(s) skipped (data.on_bad_record: skip): empty_text 1, not_utf8 1" in out
    assert "1 other file(s) left out (e.g. image.png); rename or convert" in out


def test_a_latin1_file_is_named_with_the_byte_and_the_fix(tmp_path):
    d = folder(tmp_path / "docs", {"a.txt": text(10), "latin1.txt": LATIN1})
    with pytest.raises(DataError) as e:
        prepare(cfg_for(d), tmp_path / "out")
    f = d / "latin1.txt"
    assert str(e.value) == (
        f"{f}: not UTF-8 text: byte 0xe9 at offset 1 (line 1): invalid continuation byte; convert "
        f"the file to UTF-8, e.g. from Latin-1 / Windows-1252: `iconv -f latin1 -t utf-8 -o "
        f"{f}.utf8 {f} && mv {f}.utf8 {f}` (or set data.on_bad_record: skip to skip and count "
        f"such records)")
    assert e.value.reason == "not_utf8" and not (tmp_path / "out").exists()
    (d / "latin1.txt").write_bytes(b"\xff\xfe" + "hi".encode("utf-16-le"))
    with pytest.raises(DataError, match="starts with a UTF-16 byte-order mark.*iconv -f utf-16"):
        list(reader(d))
    (d / "latin1.txt").write_bytes("hi".encode("utf-16-le"))  # no BOM: valid UTF-8 with NULs
    with pytest.raises(DataError, match="not text: a NUL byte at offset 1") as e:
        list(reader(d))
    assert e.value.reason == "not_text"


def test_the_fix_command_quotes_names_with_spaces_and_a_bom_file_names_its_own_bytes(tmp_path):
    """A document named "My Report.txt" gets an iconv line a shell runs as printed; a UTF-8 file
    with a byte-order mark and a Latin-1 byte names that byte where it is in the file."""
    import subprocess

    d = folder(tmp_path / "docs", {"My Report.txt": LATIN1})
    with pytest.raises(DataError) as e:
        list(reader(d))
    cmd = re.search(r"`(iconv .*)`", str(e.value)).group(1)
    subprocess.run(["bash", "-c", cmd], check=True)
    assert (d / "My Report.txt").read_text(encoding="utf-8") == LATIN1.decode("latin-1")
    (d / "My Report.txt").write_bytes(b"\xef\xbb\xbfhello\nw\xe9rld")
    with pytest.raises(DataError, match=r"byte 0xe9 at offset 10 \(line 2\)"):
        list(reader(d))


def test_a_folder_linked_twice_is_read_by_its_first_path_in_name_order(tmp_path, monkeypatch):
    """Which path reaches a folder that two links point at does not depend on the order the
    filesystem lists them; a link into a hidden folder is read through its visible name."""
    import os

    d = folder(tmp_path / "docs", {"z_real/a.txt": "a\n", ".store/doc.txt": "doc\n"})
    (d / "a_link").symlink_to(d / "z_real", target_is_directory=True)
    (d / "docs").symlink_to(d / ".store", target_is_directory=True)
    real_walk = os.walk

    def walk(top, **kw):  # the filesystem lists sub-folders in reverse name order
        for folder_, subs, files in real_walk(top, **kw):
            subs.sort(reverse=True)
            yield folder_, subs, files
    for w in (real_walk, walk):
        monkeypatch.setattr(os, "walk", w)
        assert [x.where for x in reader(d)] == [str(d / "a_link/a.txt"), str(d / "docs/doc.txt")]


@pytest.mark.parametrize("content", ["", " \n\n"])
def test_an_empty_file_is_a_bad_record_named(tmp_path, content):
    d = folder(tmp_path / "docs", {"a.txt": text(10), "empty.txt": content})
    with pytest.raises(DataError, match=re.escape(f"{d / 'empty.txt'}: the file is empty")) as e:
        list(reader(d))
    assert e.value.reason == "empty_text"


def test_missing_path_a_file_and_a_folder_without_documents_stop_with_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"nope not found \(data.source: text_dir\); set data.path"):
        list(reader(tmp_path / "nope"))
    f = folder(tmp_path, {"one.txt": "x", "d.jsonl": "{}\n"})
    with pytest.raises(DataError, match="is a file.*put it in a directory of its own"):
        list(reader(f / "one.txt"))
    with pytest.raises(DataError, match="is a file.*set data.source: jsonl"):
        list(reader(f / "d.jsonl"))
    d = folder(tmp_path / "pdfs", {"a.pdf": b"%PDF", "sub/b.docx": b"PK"})
    with pytest.raises(DataError, match=r"has no .txt or .md file \(sub-directories searched; 2 "
                                        r"other file\(s\), e.g. a.pdf\)"):
        list(reader(d))
    (tmp_path / "void").mkdir()
    with pytest.raises(DataError, match="void has no .txt or .md file .*; no files\\)"):
        list(reader(tmp_path / "void"))


def test_num_samples_caps_files_counted_not_read(tmp_path):
    d = folder(tmp_path / "docs", {f"{i}.txt": text(5, i) for i in range(4)})
    (d / "4.txt").write_bytes(LATIN1)  # past the cap: counted, never read
    r = reader(d, num_samples=2)
    assert len(list(r)) == 2
    assert (r.records_read, r.records_capped) == (2, 3)
    assert "read the first 2 of the 5 records" in r.cap_message()


def test_config_rules_for_text_dir():
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"source": "text_dir", "format": "messages", "num_samples": None}})
    assert e.value.problems == [
        "data.path: required for source 'text_dir' (a directory of .txt/.md files)",
        "data.format: 'messages', but source 'text_dir' reads each file as one text record; set "
        "data.format: auto (or text), or give messages records in a jsonl with data.source: jsonl"]


def test_the_folder_is_a_local_input_tracked_like_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder(tmp_path / "mydocs", {"a.txt": "x"})
    raw = {"data": {"source": "text_dir", "path": "mydocs", "num_samples": None}}
    (problem,) = untracked(from_dict(raw))
    assert "set track.data: mydocs in params.yaml" in problem
    assert untracked(from_dict({**raw, "track": {"data": "mydocs"}})) == []


def test_hf_on_a_plain_folder_of_text_files_is_refused_with_the_fix(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    d = folder(tmp_path / "docs", {"a.txt": "line one\nline two\n", "b.txt": "three\n"})
    cfg = from_dict({"data": {"source": "hf", "path": str(d)}})
    with pytest.raises(DataError, match=r"is a plain directory of text files, which data.source hf "
                                        r"would read one line per record; .*data.source: text_dir"):
        list(RecordReader(cfg.data, BadRecords("error")))
    # a plain folder of jsonl files (a cloned hub dataset) still loads as a dataset
    j = folder(tmp_path / "hub", {"train.jsonl": '{"text": "a"}\n{"text": "b"}\n'})
    cfg = from_dict({"data": {"source": "hf", "path": str(j)}})
    assert [r.text for r in RecordReader(cfg.data, BadRecords("error"))] == ["a", "b"]
