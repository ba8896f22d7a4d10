"""Tokenization masks and packing: positions, labels, padding, truncation, document isolation."""

import numpy as np
import pytest
import torch

from longft.data.errors import BadRecords, DataError
from longft.data.packing import build_row, fit_length, pack_samples, plan_rows, trainable_tokens
from longft.data.records import Record
from longft.data.tokenize import IGNORE_INDEX, Sample, tokenize_record

PAD = 258


def sample(ids, trained_from=0, where="s"):
    ids = np.asarray(ids, dtype=np.int32)
    labels = np.where(np.arange(len(ids)) >= trained_from, ids, IGNORE_INDEX).astype(np.int32)
    return Sample(ids, labels, where)


def test_packed_row_restarts_positions_masks_doc_starts_and_pads():
    a, b = sample([10, 11, 12]), sample([20, 21, 22, 23], trained_from=2)
    ids, labels, pos = build_row([a, b], 10, PAD)
    assert ids.tolist() == [10, 11, 12, 20, 21, 22, 23, PAD, PAD, PAD]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]  # padding continues the last doc
    # first token of each document never trained; b's prompt (first 2 tokens) masked; padding masked
    assert labels.tolist() == [-100, 11, 12, -100, -100, 22, 23, -100, -100, -100]
    assert ids.dtype == labels.dtype == pos.dtype == np.int32


def test_transformers_sees_each_packed_document_as_a_separate_sequence():
    from transformers.masking_utils import find_packed_sequence_indices

    _, _, pos = build_row([sample([1, 2, 3]), sample([4, 5, 6, 7])], 10, PAD)
    seq = find_packed_sequence_indices(torch.from_numpy(pos).long()[None])
    assert seq.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]


def test_single_document_row_with_padding_needs_no_mask():
    # One document + tail padding: no packed mask, so SDPA keeps its is_causal fast path.
    from transformers.masking_utils import find_packed_sequence_indices

    _, _, pos = build_row([sample([1, 2, 3, 4])], 10, PAD)
    assert find_packed_sequence_indices(torch.from_numpy(pos).long()[None]) is None


def test_packed_documents_do_not_attend_to_each_other_in_a_model():
    """Logits of doc 2 in a packed row equal doc 2 alone, with use_cache=False only."""
    from transformers import AutoModelForCausalLM

    from longft.config.params import ModelConfig
    from longft.model.loading import load_model_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    a, b = sample(np.arange(1, 6)), sample(np.arange(30, 37))
    ids, _, pos = (torch.from_numpy(x).long()[None] for x in build_row([a, b], 16, PAD))
    with torch.no_grad():
        alone = model(input_ids=ids[:, 5:12], use_cache=False).logits
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, 5:12]
        cached = model(input_ids=ids, position_ids=pos).logits[:, 5:12]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert (cached - alone).abs().max() > 1e-2  # with a cache the packed mask is not derived


def test_first_fit_decreasing_packs_every_sample_once():
    lengths = [2, 6, 3, 5, 4]
    plan = plan_rows(lengths, 10, pack=True)
    assert sorted(i for row in plan for i in row) == [0, 1, 2, 3, 4]
    assert all(sum(lengths[i] for i in row) <= 10 for row in plan)
    assert len(plan) == 2  # 6+4 and 5+3+2
    assert plan_rows(lengths, 10, pack=False) == [[0], [1], [2], [3], [4]]
    assert plan_rows([1, 10], 10, pack=True) == [[1], [0]]  # both ends of [1, max_len] fit
    for bad in ([11], [0], [3, 0]):  # longer than a row, or empty: cut earlier (fit_length)
        with pytest.raises(ValueError, match="every length must be in"):
            plan_rows(bad, 10, pack=True)


def test_pack_false_one_sample_per_row_with_padding():
    samples = [sample([1, 2, 3]), sample([4, 5])]
    ids, labels, pos = pack_samples(samples, 4, PAD, pack=False)
    assert ids.tolist() == [[1, 2, 3, PAD], [4, 5, PAD, PAD]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert labels.tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100]]
    ids, _, _ = pack_samples(samples, 8, PAD, pack=True)
    assert ids.tolist() == [[1, 2, 3, 4, 5, PAD, PAD, PAD]]


def test_truncation_on_cuts_and_off_refuses_or_skips():
    long = sample(range(1, 13), where="data.jsonl:7")
    cut = fit_length(long, 8, truncate=True, bad=BadRecords("error"))
    assert cut.input_ids.tolist() == list(range(1, 9)) and cut.where == "data.jsonl:7"
    with pytest.raises(DataError, match=r"data.jsonl:7: 12 tokens, longer than data.max_seq_length 8"):
        fit_length(long, 8, truncate=False, bad=BadRecords("error"))
    bad = BadRecords("skip")
    assert fit_length(long, 8, truncate=False, bad=bad) is None
    assert bad.counts == {"too_long": 1}
    short = sample([1, 2])
    assert fit_length(short, 8, truncate=False, bad=bad) is short


def test_trainable_tokens_excludes_the_document_start():
    assert trainable_tokens(sample([1, 2, 3])) == 2
    assert trainable_tokens(sample([1, 2, 3], trained_from=3)) == 0


def _decoded_labels(tok, s):
    return tok.decode([t for t in s.labels.tolist() if t != IGNORE_INDEX])


def test_prompt_completion_masks_bos_and_prompt(byte_tokenizer):
    tok = byte_tokenizer
    s = tokenize_record(Record("r", "prompt_completion", prompt="Q: 2+2?", completion=" A: 4"), tok)
    assert s.input_ids[0] == tok.bos_token_id and s.input_ids[-1] == tok.eos_token_id
    assert len(s) == 1 + 7 + 5 + 1
    assert (s.labels[:8] == IGNORE_INDEX).all()
    assert _decoded_labels(tok, s) == " A: 4<|end_of_text|>"
    s_all = tokenize_record(Record("r", "prompt_completion", prompt="Q", completion="A"), tok,
                            train_on_prompt=True)
    assert s_all.labels.tolist() == s_all.input_ids.tolist()


def test_text_trains_on_everything(byte_tokenizer):
    s = tokenize_record(Record("r", "text", text="hello"), byte_tokenizer)
    assert s.labels.tolist() == s.input_ids.tolist()
    assert byte_tokenizer.decode(s.input_ids) == "<|begin_of_text|>hello<|end_of_text|>"


CHAT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name?"},
        {"role": "assistant", "content": "Kes."})


def test_messages_train_only_on_assistant_turns(byte_tokenizer):
    s = tokenize_record(Record("r", "messages", messages=CHAT), byte_tokenizer)
    assert _decoded_labels(byte_tokenizer, s) == "Hello.<|eot_id|>Kes.<|eot_id|>"
    s_all = tokenize_record(Record("r", "messages", messages=CHAT), byte_tokenizer,
                            train_on_prompt=True)
    assert s_all.labels.tolist() == s.input_ids.tolist()


def test_template_without_generation_markers_gives_the_same_mask(byte_tokenizer):
    import copy

    tok = copy.deepcopy(byte_tokenizer)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    assert "generation %}" not in tok.chat_template
    marked = tokenize_record(Record("r", "messages", messages=CHAT), byte_tokenizer)
    fallback = tokenize_record(Record("r", "messages", messages=CHAT), tok)
    assert fallback.input_ids.tolist() == marked.input_ids.tolist()
    assert fallback.labels.tolist() == marked.labels.tolist()
