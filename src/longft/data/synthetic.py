"""A generated long-context retrieval-with-citation task: deterministic, seeded, learnable.

Each sample is a chat: the user message holds many short documents, each stating facts about a
made-up entity ("[doc 17] Kestrel-Alder is an observatory near Vellmoor. The code of Kestrel-Alder
is 4821 [doc 17]. ..."), then asks for one fact; the assistant answers with the value and cites the
document ("The code of Kestrel-Alder is 4821 [doc 17]."). Only one document mentions the asked
entity, so the answer needs retrieval over the whole context. As in LongCite, whose context
sentences carry the citation markers its answers cite, each document's fact sentence carries its
own marker "[doc N]", so the answer is a sentence of the context copied verbatim (the pattern
induction heads learn) rather than a value joined to a header read tens of tokens earlier.
Documents are added until the tokenized sample is as long as fits in max_seq_length: the length is
measured with the real tokenizer (through `count_tokens`), guided by the tokens per document
measured so far, so a sample takes a few tokenizations. Sample i depends only on (seed, i): the same
seed gives identical data, and more samples extend the list without changing the first ones.

Sample lengths (`data.synthetic_lengths`): `full` fills every sample to max_seq_length (one
document a row); `mixed` (the default) draws each sample's length from `sample_length`: log-uniform
from MIN_MIXED_TOKENS (1,024, or max_seq_length / 2 when that is shorter) up to max_seq_length, so
there are as many samples between 1K and 2K tokens as between 8K and 16K, the shape of long chat
records such as LongCite-45K's (a thousand to tens of thousands of tokens each). Packed, a row then
holds several documents (1.8 on average at 4K, 2.9 at 16K, 4.8 at 128K, before packing losses).

Each record is a `SyntheticRecord`: a chat `Record` that also says which document the answer cites,
how many documents there are, and where in the answer text the cited number and the asked value
stand, so the held-out split can score retrieval (data/split.py turns these character spans into
token spans). Held-out samples are the indices after the training ones (`start`), so adding them
changes no training sample.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterator

from longft.data.errors import DataError
from longft.data.records import Record

_SYLLABLES = ("ka", "lo", "ven", "dra", "mi", "sor", "tal", "rin", "bek", "ul", "zan", "fe", "qui",
              "mor", "es", "tha", "gil", "pra", "nox", "ard", "vel", "cor", "isk", "bru")
_KINDS = ("observatory", "guild", "river ferry", "orchard", "archive", "foundry", "lighthouse",
          "bakery", "shipyard", "library", "glassworks", "monastery", "weather station", "mill")
_PLACES = ("Vellmoor", "Ostrand", "Quillhaven", "Marrowdale", "Tessgrove", "Brakkenford",
           "Sunmere", "Halvik", "Corrowby", "Ildenfell")
_FILLERS = (
    "It is busiest in the early morning.",
    "Visitors often mention the smell of cedar.",
    "Its records were moved twice during the floods.",
    "A small garden grows along the east wall.",
    "The staff rotate every third week.",
    "Nobody remembers who painted the front door blue.",
    "It closes for one day after each full moon.",
    "The roof was rebuilt with slate from the northern quarry.",
)
_ATTRIBUTES: tuple[tuple[str, Callable[[random.Random], str]], ...] = (
    ("code", lambda r: str(r.randint(1000, 9999))),
    ("room number", lambda r: str(r.randint(100, 999))),
    ("founding year", lambda r: str(r.randint(1650, 2020))),
    ("badge", lambda r: f"{r.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{r.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}"
                        f"-{r.randint(100, 999)}"),
)


@dataclass(frozen=True)
class SyntheticRecord(Record):
    """A synthetic chat record with what scoring its answer needs (the chat itself is unchanged)."""

    cited_doc: int = 0
    """The 1-based id of the document the answer cites (the one stating the fact)."""
    num_docs: int = 0
    cite_chars: tuple[int, int] = (0, 0)
    """[start, end) of the cited document's number N in the answer's text ("... [doc N].")."""
    value_chars: tuple[int, int] = (0, 0)
    """[start, end) of the asked value in the answer's text."""

    @property
    def relative_position(self) -> float:
        """Where the cited document stands among the documents: 0 = first, 1 = last."""
        return (self.cited_doc - 1) / (self.num_docs - 1) if self.num_docs > 1 else 0.0


@dataclass(frozen=True)
class Fact:
    entity: str
    attribute: str
    value: str


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


_MARK = "[doc #]"
"""Where a document's own citation marker goes in its text; build_messages writes its id there."""


def _document(rng: random.Random, used: set[str]) -> tuple[Fact, str]:
    entity = f"{_word(rng)}-{_word(rng)}"
    while entity in used:
        entity = f"{_word(rng)}-{_word(rng)}"
    used.add(entity)
    attribute, make = rng.choice(_ATTRIBUTES)
    fact = Fact(entity, attribute, make(rng))
    kind = rng.choice(_KINDS)
    article = "an" if kind[0] in "aeiou" else "a"
    text = (f"{entity} is {article} {kind} near {rng.choice(_PLACES)}. "
            f"The {attribute} of {entity} is {fact.value} {_MARK}. {rng.choice(_FILLERS)}")
    return fact, text


def answer_spans(fact: Fact, target: int) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """The answer text, the span of its cited number and the span of its value."""
    head = f"The {fact.attribute} of {fact.entity} is "
    cite = f"{target + 1}"
    answer = f"{head}{fact.value} [doc {cite}]."
    v0 = len(head)
    c0 = v0 + len(fact.value) + len(" [doc ")
    return answer, (c0, c0 + len(cite)), (v0, v0 + len(fact.value))


def build_messages(docs: list[str], target: int, fact: Fact) -> list[dict]:
    """The chat for documents `docs` where docs[target] states `fact` (ids count from 1)."""
    body = "\n".join(f"[doc {i + 1}] {d.replace(_MARK, f'[doc {i + 1}]')}"
                     for i, d in enumerate(docs))
    question = f"What is the {fact.attribute} of {fact.entity}?"
    user = (f"Read the {len(docs)} documents below, then answer the question. Cite the document "
            f"you used as [doc N].\n\n{body}\n\nQuestion: {question}")
    answer = answer_spans(fact, target)[0]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def synthetic_sample(index: int, seed: int, max_len: int,
                     count_tokens: Callable[[list[dict]], int]) -> Record:
    """Sample `index`: as many documents as fit in max_len tokens as measured by count_tokens."""
    rng = random.Random(f"longft-synthetic:{seed}:{index}")
    used: set[str] = set()
    fact, target_text = _document(rng, used)
    where_frac = rng.random()  # the asked document's relative position in the context
    distractors: list[str] = []

    def messages(k: int) -> list[dict]:
        while len(distractors) < k:
            distractors.append(_document(rng, used)[1])
        docs = distractors[:k]
        docs.insert(target_index(k), target_text)
        return build_messages(docs, target_index(k), fact)

    def target_index(k: int) -> int:
        # uniform over the k + 1 places (round(u * k) made the first and last half as likely, so
        # always citing a middle document beat the 1 / documents chance the retrieval score reports)
        return min(k, int(where_frac * (k + 1)))

    n0 = count_tokens(messages(0))
    if n0 > max_len:
        raise DataError(f"data.max_seq_length {max_len} is too small for the synthetic task: one "
                        f"document with its question and answer takes {n0} tokens; raise it")
    # Search the number of distractors k: `lo` fits, `hi` does not; stop when they are adjacent.
    chars0 = sum(len(m["content"]) for m in messages(0))
    per_doc = (len(target_text) + 10) * n0 / chars0  # tokens per document, refined below
    lo, hi = 0, None
    k = max(1, int((max_len - n0) / per_doc))
    while hi is None or hi - lo > 1:
        msgs = messages(k)
        n = count_tokens(msgs)
        if n <= max_len:
            lo = k
        else:
            hi = k
        if hi is not None and hi - lo <= 1:
            break
        per_doc = max((n - n0) / k, 1.0)
        if n <= max_len:
            k += max(1, int((max_len - n) / per_doc))
        else:
            k -= max(1, math.ceil((n - max_len) / per_doc))
        k = max(k, lo + 1) if hi is None else min(max(k, lo + 1), hi - 1)
    _, cite, value = answer_spans(fact, target_index(lo))
    return SyntheticRecord(f"synthetic sample {index}", "messages", messages=tuple(messages(lo)),
                           cited_doc=target_index(lo) + 1, num_docs=lo + 1, cite_chars=cite,
                           value_chars=value)


MIN_MIXED_TOKENS = 1024
LENGTHS = ("full", "mixed")


def sample_length(index: int, seed: int, max_len: int) -> int:
    """Sample `index`'s target length under `mixed`: log-uniform on [min(1024, max_len / 2),
    max_len], drawn from (seed, index) alone."""
    lo = min(MIN_MIXED_TOKENS, max_len // 2)
    u = random.Random(f"longft-synthetic-length:{seed}:{index}").random()
    return min(max_len, int(round(lo * (max_len / lo) ** u)))


def synthetic_records(num_samples: int, max_len: int, seed: int,
                      count_tokens: Callable[[list[dict]], int],
                      lengths: str = "full", start: int = 0) -> Iterator[SyntheticRecord]:
    """num_samples chat records of the retrieval-with-citation task (see the module docstring),
    samples start .. start + num_samples - 1, each filled to max_len (`full`) or to its own
    `sample_length` (`mixed`)."""
    if lengths not in LENGTHS:
        raise ValueError(f"synthetic lengths must be one of {LENGTHS}, got {lengths!r}")
    for i in range(start, start + num_samples):
        n = max_len if lengths == "full" else sample_length(i, seed, max_len)
        yield synthetic_sample(i, seed, n, count_tokens)
