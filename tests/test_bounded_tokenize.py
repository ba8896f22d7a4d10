"""A text record far longer than a row is tokenized only as far as the row needs (issue 20: one
50 MB record took 87 s and 9.9 GiB to tokenize whole before it was cut to max_seq_length)."""

import random
import time

import pytest

from longft.data.records import Record
from longft.data.tokenize import text_ids, tokenize_record


def words(n_words, seed=0):
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 9))) for _ in range(500)]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


@pytest.fixture(scope="module")
def bpe():
    """A real byte-level BPE tokenizer with merges, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([words(20_000, seed=1)],
                            trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class Spy:
    """Counts the characters a tokenizer is handed."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kw):
        self.chars += len(text)
        return self.tok(text, **kw)


@pytest.mark.parametrize("max_tokens", [1, 100, 1000, 4096])
def test_the_first_tokens_are_those_of_the_whole_text(bpe, max_tokens):
    text = words(30_000)
    full = bpe(text, add_special_tokens=False)["input_ids"]
    spy = Spy(bpe)
    ids, complete = text_ids(spy, text, max_tokens)
    assert not complete and ids == full[:max_tokens]
    assert spy.chars < 2 * 16 * (max_tokens + 16)  # a prefix, not the text
    # a short text comes back whole
    assert text_ids(bpe, "abc def", max_tokens) == (bpe("abc def", add_special_tokens=False)
                                                    ["input_ids"][:max_tokens], max_tokens >= 2)


def test_a_prefix_that_gives_too_few_tokens_is_doubled(bpe):
    text = words(30_000)
    full = bpe(text, add_special_tokens=False)["input_ids"]
    spy = Spy(bpe)
    ids, complete = text_ids(spy, text, 2000, chars_per_token=1)  # far too few chars at first
    assert not complete and ids == full[:2000]
    assert spy.chars < len(text) / 2
    assert text_ids(bpe, text, None) == (full, True)


def test_a_50_mb_record_costs_what_a_row_costs(byte_tokenizer):
    text = words(9_000_000)  # ~50 MB
    assert len(text) > 45e6
    start = time.perf_counter()
    s = tokenize_record(Record(where="big.jsonl:1", format="text", text=text), byte_tokenizer,
                        max_tokens=4096)
    took = time.perf_counter() - start
    # one token more than the row, so the length check still counts it as truncated
    assert len(s) == 4097 and took < 5.0
    small = tokenize_record(Record(where="big.jsonl:1", format="text", text=text[:100_000]), byte_tokenizer)
    assert s.input_ids.tolist() == small.input_ids[:4097].tolist()
    assert s.labels.tolist() == small.labels[:4097].tolist()
