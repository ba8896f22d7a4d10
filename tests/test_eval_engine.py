"""Issue 19 A, the engine side: the held-out eval's loss equals the model's own loss without
making [seq x vocab] logits, the retrieval score reads the right tokens, every rank runs as many
forwards, and the model is back in train mode afterwards (no DeepSpeed needed here; the train
stage runs it under ZeRO-3 in the default pipeline; two ranks' all-reduce is emulated below)."""

import copy
import json

import pytest
import torch

from longft.config.params import from_dict
from longft.data.prepare import prepare
from longft.engine import evaluate
from longft.engine.evaluate import EvalError, Evaluator, _correct, _labelled_loss
from longft.model.loading import build_model


class PlainEngine(torch.nn.Module):
    """What the evaluator uses of a DeepSpeed engine: module, device, forward, eval/train."""

    def __init__(self, model):
        super().__init__()
        self.module, self.device = model, torch.device("cpu")
        self.forwards = 0
        self.max_logits_positions = 0

    def forward(self, **kw):
        self.forwards += 1
        out = self.module(**kw)
        self.max_logits_positions = max(self.max_logits_positions, out.logits.shape[1])
        return out


class Log:
    def __init__(self):
        self.records = []

    def write(self, kind, **fields):
        self.records.append({"type": kind, **fields})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "prepared"
    cfg = from_dict({"data": {"num_samples": 2, "eval_samples": 5, "max_seq_length": 1024}})
    prepare(cfg, out)
    torch.manual_seed(0)
    model = build_model(cfg.model, "sdpa", torch.float32)
    model.config.use_cache = False
    return out, model


def reference(model, data, rows):
    """Sum of token losses and labelled tokens by the model's own loss (full logits)."""
    total = count = 0.0
    for r in rows:
        b = {k: v[None] for k, v in data[r].items()}
        n = int((b["labels"][:, 1:] != -100).sum())
        with torch.no_grad():
            loss = model(input_ids=b["input_ids"], labels=b["labels"],
                         position_ids=b["position_ids"]).loss
        total, count = total + float(loss) * n, count + n
    return total, count


def test_eval_loss_is_the_models_own_loss_in_chunks(prepared, monkeypatch):
    out, model = prepared
    monkeypatch.setattr(evaluate, "CHUNK_ELEMENTS", 384 * 7)  # 7 positions a chunk: many chunks
    engine = PlainEngine(model)
    engine.train()
    ev = Evaluator.open(out, model, rank=0, world=1, micro=2, every=0, packed=False)
    log = Log()
    rec = ev.run(engine, 3, log)
    total, count = reference(model, ev.data, range(len(ev.data)))
    assert rec["tokens"] == count and rec["loss"] == pytest.approx(total / count, rel=1e-5)
    assert rec["ppl"] == pytest.approx(torch.tensor(rec["loss"]).exp().item(), rel=1e-6)
    assert engine.training and model.training  # back to train mode
    assert engine.max_logits_positions == 1  # the head ran on the last position only
    assert engine.forwards == -(-len(ev.data) // 2)
    assert log.records == [{"type": "eval", **rec}] and rec["step"] == 3
    assert rec["samples"] == 5 and rec["scored_samples"] == 5
    assert len(rec["retrieval"]["cite_correct"]) == 5
    assert rec["retrieval"]["length"] == [s["length"] for s in ev.samples]
    assert ev.final(engine, 3, log) is None  # step 3 was just evaluated
    assert ev.periodic(engine, 4, log) is None  # eval_every 0: only the final eval


def test_predictions_are_the_argmax_of_the_full_logits(prepared):
    out, model = prepared
    ev = Evaluator.open(out, model, rank=0, world=1, micro=1, every=0, packed=False)
    b = {k: v[None] for k, v in ev.data[0].items()}
    captured = []
    h = model.get_decoder().register_forward_hook(lambda m, a, o: captured.append(o[0]))
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    h.remove()
    sums, counts, pred = _labelled_loss(captured[0], b["labels"], model)
    labelled = torch.zeros_like(b["labels"], dtype=torch.bool)
    labelled[:, :-1] = b["labels"][:, 1:] != -100
    assert (pred[labelled] == logits.argmax(-1)[labelled]).all()
    assert (pred[~labelled] == -1).all() and counts.item() == labelled.sum().item()


def test_a_citation_counts_only_when_every_token_is_predicted():
    ids = torch.tensor([5, 6, 7, 8, 9])
    pred = torch.tensor([6, 7, 8, 9, -1])  # pred[t] is the guess for ids[t + 1]
    assert _correct(pred, ids, (2, 4)) == 1.0
    pred[2] = 0  # the guess for ids[3]
    assert _correct(pred, ids, (2, 4)) == 0.0 and _correct(pred, ids, (1, 3)) == 1.0


def test_every_rank_runs_as_many_forwards_and_each_row_counts_once(prepared):
    out, model = prepared
    evs = [Evaluator.open(out, model, rank=r, world=2, micro=2, every=0, packed=False) for r in (0, 1)]
    n = len(evs[0].data)
    batches = [ev._batches() for ev in evs]
    assert len(batches[0]) == len(batches[1])
    counted = sorted(r for b in batches for batch in b for r, counts in batch if counts)
    assert counted == list(range(n))


def test_ranks_sum_to_the_single_process_eval(prepared, monkeypatch):
    """Two ranks' shares, summed as the all-reduce does, give the one-rank numbers."""
    out, model = prepared
    one = Evaluator.open(out, model, rank=0, world=1, micro=1, every=0, packed=False).run(PlainEngine(model), 1, Log())
    parts = []
    monkeypatch.setattr(evaluate.Evaluator, "_record",
                        lambda self, step, loss_sum, tokens, scores, t: parts.append(
                            (loss_sum, tokens, scores.clone())) or {"retrieval_accuracy": None,
                                                                     "loss": 0, "ppl": 0,
                                                                     "scored_samples": 0,
                                                                     "time_s": 0})
    for r in (0, 1):
        Evaluator.open(out, model, rank=r, world=2, micro=1, every=0, packed=False).run(PlainEngine(model), 1, Log())
    loss_sum = parts[0][0] + parts[1][0]
    tokens = parts[0][1] + parts[1][1]
    scores = parts[0][2] + parts[1][2]
    assert tokens == one["tokens"] and loss_sum / tokens == pytest.approx(one["loss"], rel=1e-6)
    assert (scores[:, 2] == 1).all()  # every sample scored exactly once
    assert [int(x) for x in scores[:, 0]] == one["retrieval"]["cite_correct"]


def test_no_held_out_split_means_no_evaluator(tmp_path, prepared, capsys):
    _, model = prepared
    cfg = from_dict({"data": {"num_samples": 2, "eval_samples": 0, "max_seq_length": 1024}})
    prepare(cfg, tmp_path / "p")
    assert Evaluator.open(tmp_path / "p", model, rank=0, world=1, micro=1, every=0, packed=False) is None
    assert "no held-out split" in capsys.readouterr().out


def test_a_wrapped_lm_head_is_refused_before_training(prepared):
    from peft import LoraConfig, get_peft_model

    out, model = prepared
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(EvalError, match="lm_head is a .*leave lm_head out of LoRA"):
        Evaluator.open(out, lora, rank=0, world=1, micro=1, every=0, packed=False)
    # LoRA on the attention leaves lm_head a Linear: fine
    ok = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert Evaluator.open(out, ok, rank=0, world=1, micro=1, every=0, packed=False) is not None


def test_samples_json_is_what_the_evaluator_reads(prepared):
    out, _ = prepared
    samples = json.loads((out / "eval" / "samples.json").read_text())["samples"]
    assert len(samples) == 5 and all(s["cite"] for s in samples)


def test_gemma2_final_logit_softcap_is_applied_like_the_model_does():
    """Gemma 2 caps its final logits (final_logit_softcapping 30 by default): the eval loss is the
    model's own loss with the cap, not the uncapped one (issue 20 made Gemma 2 trainable; its
    default eval must not refuse it)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       final_logit_softcapping=2.0, attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():   # weights large enough that the cap matters
        model.lm_head.weight.mul_(50)
    ids = torch.randint(0, 97, (1, 24))
    captured = []
    h = model.get_decoder().register_forward_hook(lambda m, a, o: captured.append(o[0]))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    h.remove()
    sums, counts, _ = _labelled_loss(captured[0], ids, model)
    assert float(sums[0] / counts[0]) == pytest.approx(float(want), rel=1e-5)
    model.config.final_logit_softcapping = None          # without the cap: a different loss
    sums2, _, _ = _labelled_loss(captured[0], ids, model)
    assert float(sums2[0] / counts[0]) != pytest.approx(float(want), rel=1e-3)


def test_a_stop_request_ends_the_evaluation_after_the_micro_batch(prepared):
    """Issue 35.3: Ctrl-C during the (final) evaluation ends it; every rank asks after every
    micro-batch (a collective), and nothing is logged as an eval of that step."""
    out, model = prepared
    engine = PlainEngine(model)
    engine.train()
    ev = Evaluator.open(out, model, rank=0, world=1, micro=1, every=0, packed=False)
    assert len(ev.data) > 2
    asked = []

    def stop():
        asked.append(1)
        return 2 if len(asked) == 2 else 0  # SIGINT arrives during the second micro-batch

    log = Log()
    assert ev.final(engine, 5, log, stop) is None
    assert engine.forwards == 2 and asked == [1, 1]
    assert log.records == [] and ev.last_step is None
    assert engine.training and model.training  # back to train mode
