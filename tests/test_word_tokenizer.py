"""tests/word_tokenizer.py (the word-level tokenizer of the held-out retrieval experiments in bench/LOG.md):
citation markers are one token, numbers come in right-aligned two-digit chunks, held-out samples
(other seeds than the one its own check uses) have no unknown token, and the chat template marks
the answer as the trained tokens in longft's tokenization."""

from longft.data import synthetic
from longft.data.tokenize import tokenize_messages
from word_tokenizer import UNK, word_tokenizer

TOK = word_tokenizer()


def test_markers_are_one_token_and_numbers_two_digit_chunks():
    assert TOK.tokenize("FA-4821 [doc 3].") == ["F", "A", "-", "48", "21", "[doc 3]", "."]
    assert TOK.tokenize("461 [doc 17]") == ["4", "61", "[doc 17]"]
    assert TOK.tokenize("Ardlo-Quiven") == ["Ard", "lo", "-", "Qui", "ven"]


def test_held_out_samples_have_no_unknown_token_and_their_answer_is_what_is_trained():
    unk = TOK.convert_tokens_to_ids(UNK)
    def count(messages):
        return len(TOK.apply_chat_template(list(messages), tokenize=True, return_dict=True)["input_ids"])

    for rec in synthetic.synthetic_records(12, 256, 777, count):
        ids, labels = tokenize_messages(rec.messages, TOK)
        assert unk not in ids.tolist()
        marker = f"[doc {rec.cited_doc}]"  # cited_doc is 1-based
        assert marker in rec.messages[-1]["content"]
        trained = [int(i) for i, lab in zip(ids, labels) if lab != -100]
        assert TOK.convert_tokens_to_ids(marker) in trained
