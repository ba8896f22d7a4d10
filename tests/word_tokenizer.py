"""A word-level tokenizer for the synthetic task (experiments only): short rows, one-token
citations. It made the word-level rows of the tables in bench/LOG.md, "Retrieval experiments on CPU".

With byte or BPE tokens a value such as "FA-461" is several tokens whose pieces occur all over
the context, so citing the document after it needs a multi-token match. Here the pieces that
matter are single tokens:

- "[doc 3]" (and the prompt's "[doc N]") is one token, so the cited number N is that token;
- a number is cut into right-aligned chunks of two digits ("4821" -> "48" "21", "461" -> "4"
  "61"; the log's three-digit rows used chunks of three), so the citation is a one-token
  induction: find the earlier copy of the token before the marker and copy the token after it;
- the generator's fixed English words (its templates, kinds, places, fillers, attribute names)
  are whole words; anything else (the made-up entity names, the badges' letters) is cut into
  pieces of at most three letters, a capital starting a piece ("Ardlo" -> "Ard" "lo").

The vocabulary is fitted on the generator's word lists, not on samples: the pieces of every
entity word its syllables can make (every 2- and 3-syllable word), every number chunk and
one-digit number, the capital letters, the punctuation and "[doc 1]" .. "[doc MAX_DOCS]". So a
held-out sample has no unknown token, and nothing of a held-out sample (which entity, which
value, which document) went into the vocabulary. `word_tokenizer` checks that the text of a few
generated samples has no [UNK]; tests/test_word_tokenizer.py checks the rest.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from transformers import AutoTokenizer

from longft.data import synthetic

REPO = Path(__file__).resolve().parents[1]
_BYTE = AutoTokenizer.from_pretrained(REPO / "configs/tokenizers/byte")
SPECIALS = [t.content for _, t in sorted(_BYTE.added_tokens_decoder.items())]
"""configs/tokenizers/byte's special tokens, in its order (bos, eos, pad, the chat markers)."""
CHAT_TEMPLATE = _BYTE.chat_template  # with its generation markers
UNK = "[UNK]"
MAX_DOCS = 200
_CHUNK = r"[A-Z][a-z]{0,2}|[a-z]{1,3}"
_PUNCT = r"[^\sA-Za-z0-9]"


def _fixed_text() -> str:
    """Every fixed string the generator writes: a sample built from placeholders, the lists."""
    fact = synthetic.Fact("Qqq-Qqq", "code", "1")
    msgs = synthetic.build_messages(["Qqq-Qqq is a mill near Ostrand. [doc #]"], 0, fact)
    return " ".join([m["content"] for m in msgs] + list(synthetic._KINDS) + list(synthetic._PLACES)
                    + list(synthetic._FILLERS) + [a for a, _ in synthetic._ATTRIBUTES]
                    + [m["role"] for m in msgs])  # the chat template writes the roles


def fixed_words() -> list[str]:
    words = set(re.findall(r"[A-Za-z]+", _fixed_text())) - {"Qqq", "doc", "N"}
    return sorted(words, key=lambda w: (-len(w), w))  # longest first: no word eats a longer one


def pattern() -> str:
    words = "|".join(fixed_words())
    return (r"\[doc (?:\d+|N)\]"          # a citation marker, whole
            r"|\d(?=(?:\d\d)+\b)|\d\d?"   # numbers: right-aligned two-digit chunks
            rf"|\b(?:{words})\b"          # the generator's fixed words, whole
            rf"|{_CHUNK}|{_PUNCT}")       # anything else: pieces of <= 3 letters, punctuation


def _pieces(word: str) -> list[str]:
    return re.findall(_CHUNK, word)


def vocabulary() -> list[str]:
    """The tokens (specials first), from the generator's word lists alone (module docstring)."""
    entity_words = {"".join(p).capitalize() for n in (2, 3)
                    for p in itertools.product(synthetic._SYLLABLES, repeat=n)}
    pieces = {c for w in entity_words for c in _pieces(w)}
    numbers = {str(i) for i in range(10)} | {f"{i:02d}" for i in range(100)}
    letters = {chr(c) for c in range(ord("A"), ord("Z") + 1)}
    punct = set(re.findall(_PUNCT, _fixed_text())) | set("-.,:?")
    markers = {"[doc N]"} | {f"[doc {i}]" for i in range(1, MAX_DOCS + 1)}
    rest = (set(fixed_words()) | pieces | numbers | letters | punct | markers) - set(SPECIALS)
    return SPECIALS + [UNK] + sorted(rest)


def word_tokenizer():
    """A transformers fast tokenizer: WordLevel over `vocabulary()`, split by `pattern()`, with
    the byte tokenizer's specials and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern()), behavior="removed", invert=True)
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the tokens with spaces
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[1], pad_token=SPECIALS[2], unk_token=UNK)
    fast.chat_template = CHAT_TEMPLATE
    unk = vocab[UNK]
    for rec in synthetic.synthetic_records(20, 4000, 12345, lambda m: sum(len(x["content"]) for x in m)):
        ids = fast.apply_chat_template(list(rec.messages), tokenize=True, return_dict=True)["input_ids"]
        assert unk not in ids, "the word tokenizer gave [UNK] on a generated sample"
    return fast
