"""Issue 19 A, item 3: the numbers move when the model learns, and stay put when it does not.

A tiny random-init Llama (plain torch AdamW, no DeepSpeed: the train stage runs the same evaluator
under ZeRO-3) trains on the prepared synthetic rows; the held-out eval (engine/evaluate.py) must
see its loss fall well below the untrained model's. The retrieval score is then shown to detect
learned citations: the same model trained on the held-out samples themselves must cite most of
them, far above chance (1 / documents). That second part is a test of the score, not of
generalisation: no tiny model measured so far cites HELD-OUT samples above what the cited
document's position alone gives, within a test-sized budget.

Chance is the bar a held-out citation must clear, and it is honest: the generator puts the asked
document at a uniform place among its k + 1 documents, so no fixed guess of a place beats
1 / documents (checked against the generator below). Until 2026-12-01 it used round(u * k), whose
first and last places were half as likely, so always citing a middle document scored
1 / (documents - 1): the earlier "48 % against 40 % chance" was that position prior. Measured
with that generator on 100-200 held-out samples (2 CPU cores, shared), every held-out citation
score sat at the prior and the asked value (copied from the document, chance ~0) stayed at 0 %:
2-layer 64-wide at 768 byte tokens (3-4 documents, chance 31 %, prior 45 %): 41-50 % after
400-1000 steps of 8 rows (up to 3.3 min; with data.train_on_prompt too); a 4-layer 128-wide model:
39-47 % after 400 steps (7.4 min); with a BPE tokenizer trained on the generator's text (3.5x
shorter rows) at 256-320 tokens, 2-4 layers: 44-48 % against priors of 42-50 % after 300-400 steps
of 16-32 rows (1-3 min). The held-out citation needs the value copied from the right document
first (an induction over a multi-token entity) and then that document's header read: neither
formed.

Since 2026-12-01 each document's fact sentence carries its own marker ("The badge of X is FA-461
[doc 3]."), as LongCite's context sentences do, so the answer is a context sentence copied
verbatim and the cited number the continuation of a string that occurs once: an induction copy.
Measured with it (BPE 512 or 1024 trained on the generator's text, every training row a fresh
sample, 150-200 held-out samples, 2 shared CPU cores under load 2-4.5): 2x128 at 512 and 384
tokens (4-7 documents), 200-500 steps of 16, lr 3e-3: 11-29 % against chance 15-24 % and best
fixed guesses 21-30 %; 2x64 at lr 1e-2 with 5-6 documents in 320 tokens, 800-1200 steps of 8-16
(also with "[doc N]" one token, a one-step induction after the value): 11-25 % against 17-18 % /
20-25 %; 2x128 with it at 256 tokens (4-5 documents), 1000 steps of 16, lr 3e-3: 19-32 % against
25 / 31 %; 2x64 at 256 tokens (2 documents), 800 and 1400 steps of 16: 50-66 % against 51 / 53 %,
the one 66 % (best of eight evals) not repeated by the longer run. The asked value stayed at 0-0.7 %
throughout: no induction copy formed in 3-10 minutes of CPU.

Since 2026-12-02 also with word-level tokens (a WordLevel tokenizer fitted on the generator's word
lists: "[doc N]" one token, numbers in chunks of two or three digits, entity names in pieces of up
to three letters; a document ~28 tokens), so citing is a one-token induction: 2x64 and 2x128 at
192-256 tokens (3-5 documents), lr 3e-3 to 1e-2, loss on the prompt and/or the answer weighted
up to 10x, 300-1,250 steps of 16 rows (2-6 minutes on 2 shared cores): 17.5-40.5 % against
chance 20 / 33 % and best fixed guesses 21 / 41 %. The induction circuit did form on the entity
pieces the prompt trains it on (held-out accuracy on them 45-49 % -> 80-82 %; two layer-2 heads
attending ~60 % to the token after the earlier copy), but not on the numbers a citation must
match (0-1 % on the marker after the value's earlier copy). A random-init model is the wrong
stand-in: tests/test_retrieval_pretrained.py pretrains the model on generic copy rows first, and
the finetuned model then cites held-out samples far above chance (issue 19 item 3). The tables are in
bench/LOG.md, "Retrieval experiments on CPU".
Either part fails if training were broken (lr 0, labels lost, the eval reading the wrong tokens).
"""

import time
from collections import Counter

import pytest
import torch

from longft.config.params import from_dict
from longft.data.prepare import prepare
from longft.data.store import PreparedDataset
from longft.data.synthetic import synthetic_records
from longft.engine.evaluate import Evaluator
from longft.model.loading import build_model


def best_fixed_guess(records) -> float:
    """The best citation score without reading the documents: per number of documents, always
    naming the place the cited document takes most often (read off the records themselves)."""
    by_docs: dict[int, Counter] = {}
    for r in records:
        by_docs.setdefault(r.num_docs, Counter())[r.cited_doc] += 1
    return sum(c.most_common(1)[0][1] for c in by_docs.values()) / len(records)


class PlainEngine(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module, self.device = model, torch.device("cpu")

    def forward(self, **kw):
        return self.module(**kw)


class Log:
    def write(self, kind, **fields):
        pass


def train(model, rows, steps, lr, seed=0, batch=4):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch,), generator=g).tolist()
        b = {k: torch.stack([rows[i][k] for i in idx]) for k in rows[0]}
        loss = model(input_ids=b["input_ids"], labels=b["labels"],
                     position_ids=b["position_ids"]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


@pytest.mark.slow
def test_eval_loss_falls_and_the_retrieval_score_sees_learned_citations(tmp_path):
    t0 = time.perf_counter()
    cfg = from_dict({"data": {"num_samples": 48, "eval_samples": 6, "max_seq_length": 1024,
                              "synthetic_lengths": "full", "pack": False}})
    prepare(cfg, tmp_path / "p")
    torch.manual_seed(0)
    model = build_model(cfg.model, "sdpa", torch.float32)
    model.config.use_cache = False
    engine = PlainEngine(model)
    ev = Evaluator.open(tmp_path / "p", model, rank=0, world=1, micro=6, every=0, packed=False)
    chance = sum(1 / s["num_docs"] for s in ev.samples) / len(ev.samples)
    assert chance < 0.25  # five documents and more a sample
    before = ev.run(engine, 0, Log())

    train(model, [r for r in PreparedDataset(tmp_path / "p")], steps=40, lr=3e-3)
    after = ev.run(engine, 40, Log())
    held = [ev.data[i] for i in range(len(ev.data))]
    # memorising the 6 held-out samples: 80 steps cited 6 of 6 with the unmarked documents and 5
    # of 6 with the marked ones (one short of the bar); 160 leave a margin
    train(model, held, steps=160, lr=3e-3, seed=1, batch=6)
    learned = ev.run(engine, 200, Log())
    print(f"eval loss {before['loss']:.3f} -> {after['loss']:.3f}; citation "
          f"{before['retrieval_accuracy']:.2f} -> {learned['retrieval_accuracy']:.2f} "
          f"(chance {chance:.2f}); {time.perf_counter() - t0:.0f} s")
    assert after["loss"] < 0.5 * before["loss"]  # held-out: ~6 (ln 384) -> under 3
    assert learned["retrieval_accuracy"] >= max(0.8, 3 * chance)
    assert before["retrieval_accuracy"] <= 2 * chance


def test_no_fixed_place_beats_chance_the_cited_document_is_placed_uniformly():
    # a character count stands in for the tokenizer: 700 characters hold three documents (a few
    # samples four); with round(u * k) the best fixed guess scored ~0.50 against chance ~0.33
    recs = list(synthetic_records(3000, 700, 7, lambda m: sum(len(x["content"]) for x in m)))
    chance = sum(1 / r.num_docs for r in recs) / len(recs)
    assert 0.25 < chance < 0.34
    assert best_fixed_guess(recs) < chance + 0.03  # 3000 samples: 1 sd ~ 0.009
    places = Counter(r.cited_doc for r in recs if r.num_docs == 3)
    assert min(places.values()) > 0.8 * max(places.values())  # first, middle and last alike