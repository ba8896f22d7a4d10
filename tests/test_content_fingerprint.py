"""Checkpoints are keyed by what the run trains on, not by counts (issue 49, R22): the prepared
data's content, the model's and the tokenizer's files. A change in any of them, at the same sizes,
is another trajectory (never resumed), and `differences` names it."""

import json

import numpy as np

from longft import content
from longft.config.params import from_dict
from longft.data.store import write_dataset
from longft.engine.trajectory import differences, fingerprint, trajectory

META = {"vocab_size": 300, "pad_token_id": 0, "source": "jsonl", "format": "messages"}


def prepared(path, answer: int):
    """A prepared dataset whose trained tokens (the "answers") are `answer`: same rows, tokens and
    trainable tokens whatever the answer."""
    ids = np.full((3, 8), 7, np.int32)
    ids[:, 5:] = answer
    labels = np.full((3, 8), -100, np.int32)
    labels[:, 5:] = answer
    pos = np.tile(np.arange(8, dtype=np.int32), (3, 1))
    stats = {"rows": 3, "tokens": 24, "trainable_tokens": 9}
    write_dataset(path, ids, labels, pos, META, extra={"stats.json": stats})
    return path


def test_other_answers_at_the_same_counts_are_another_trajectory(tmp_path):
    cfg = from_dict({})
    a, b = prepared(tmp_path / "a", 11), prepared(tmp_path / "b", 12)
    assert json.loads((a / "stats.json").read_text()) == json.loads((b / "stats.json").read_text())
    assert fingerprint(cfg, a) != fingerprint(cfg, b)
    diff = differences(trajectory(cfg, a), trajectory(cfg, b))
    assert len(diff) == 1 and diff[0].startswith("prepared.content ")
    # the same content prepared again: the same trajectory (a resume)
    assert fingerprint(cfg, prepared(tmp_path / "a2", 11)) == fingerprint(cfg, a)


def test_the_digest_is_stored_at_prepare_time_and_hashed_from_the_arrays_where_it_is_not(tmp_path):
    a = prepared(tmp_path / "a", 11)
    meta = json.loads((a / "meta.json").read_text())
    assert meta[content.DATA_KEY] == content.arrays_digest(a)
    before = fingerprint(from_dict({}), a)
    del meta[content.DATA_KEY]  # prepared by an older longft
    (a / "meta.json").write_text(json.dumps(meta))
    assert content.data_digest(a) == content.arrays_digest(a)
    assert fingerprint(from_dict({}), a) == before


def test_the_model_and_the_tokenizer_are_keyed_by_their_files(tmp_path):
    shipped_file = content.Path(__file__).parents[1] / "configs/models/tiny-llama.json"
    shipped = json.loads(shipped_file.read_text())
    arch = tmp_path / "arch.json"
    arch.write_bytes(shipped_file.read_bytes())
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"v": 1}')
    cfg = from_dict({"model": {"name": str(arch), "tokenizer": str(tok)}})
    fp = fingerprint(cfg)
    by_name = trajectory(from_dict({"model": {"name": "tiny-llama", "tokenizer": str(tok)}}))
    assert by_name["inputs"] == trajectory(cfg)["inputs"]  # a configs/models name: its file
    arch.write_text(json.dumps(shipped))
    fp = fingerprint(cfg)

    arch.write_text(json.dumps({**shipped, "rms_norm_eps": 1e-5 + 1e-9}))
    assert fingerprint(cfg) != fp
    arch.write_text(json.dumps(shipped))
    assert fingerprint(cfg) == fp
    (tok / ".cache").mkdir()  # hidden entries (hub download caches, .git) are not content
    (tok / ".cache" / "x").write_text("y")
    assert fingerprint(cfg) == fp
    before = trajectory(cfg)
    (tok / "tokenizer.json").write_text('{"v": 2}')
    assert fingerprint(cfg) != fp
    assert [d.split()[0] for d in differences(before, trajectory(cfg))] == ["inputs.tokenizer"]
    (tok / "tokenizer.json").write_text('{"v": 1}')
    assert fingerprint(cfg) == fp


def test_pretrained_weights_changed_under_the_same_name(tmp_path, monkeypatch):
    monkeypatch.setattr(content, "CACHE", tmp_path / "cache" / "digests.json")
    monkeypatch.setattr(content, "_CACHED_FROM", 4)  # the weights file counts as big
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights-1")
    cfg = from_dict({"model": {"source": "pretrained", "name": str(model)}})
    old = trajectory(cfg)
    assert old["inputs"]["model"].startswith("sha256:")
    assert content.CACHE.is_file()  # hashed once per path, size and mtime
    (model / "model.safetensors").write_bytes(b"weights-2")  # same size, another mtime
    new = trajectory(cfg)
    # the model's own tokenizer (model.tokenizer: null) lies in the same folder
    assert sorted(d.split()[0] for d in differences(old, new)) == ["inputs.model",
                                                                   "inputs.tokenizer"]


def test_a_hub_id_is_keyed_by_its_cached_commit(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    assert content.source_digest("org/model") == "hub:org/model"
    ref = tmp_path / "models--org--model" / "refs"
    ref.mkdir(parents=True)
    (ref / "main").write_text("abc123\n")
    assert content.source_digest("org/model") == "hub:org/model@abc123"
