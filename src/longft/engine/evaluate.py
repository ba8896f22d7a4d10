"""Held-out evaluation inside the train stage: eval loss, perplexity and the retrieval score.

The held-out rows (data/prepared/eval, data/split.py) are evaluated every `train.eval_every` steps
and after the last step, on every rank: rank r takes rows r, r + world, ...; every rank runs the
same number of forwards (a rank out of rows repeats row 0 with weight 0), because under ZeRO-3
each forward gathers the parameters collectively. Sums are all-reduced (torch.distributed), so
every rank logs the same "eval" record.

The model runs under engine.eval() and torch.no_grad() (then back to train()) with the same
inputs as a training step: position ids, the packed rows' document boundaries, use_cache=False,
the pinned SDPA kernel order. No [seq x vocab] logits: the model's own head runs on the last
position only (`logits_to_keep=1`), a forward hook keeps the decoder's final hidden states, and
the loss is computed over the labelled positions alone (the answers, a small part of a
long-context row), `CHUNK_ELEMENTS` logits at a time, with lm_head's weight gathered once per
micro-batch under ZeRO-3. This one path serves CPU and GPU (with Liger the model's fused loss
needs labels and skip_logits in eval mode and gives no loss per token) and is tested on CPU.

Retrieval (synthetic task): teacher-forced accuracy on the citation. A held-out sample counts as
retrieved when the model, fed the reference answer up to each token, predicts (argmax) every
token of the cited document's number N in "[doc N]"; `value_correct` scores the asked value's
tokens the same way. Exact and cheap (one forward, no generation), and the same under ZeRO-3.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longft.data.store import PreparedDataset, held_out
from longft.errors import UserError
from longft.model import packed_attention

CHUNK_ELEMENTS = 1 << 25
"""Logits (positions x vocab) computed at once: 128 MiB in fp32 (256 positions of a 128K vocab)."""


class EvalError(UserError, RuntimeError):
    """The held-out evaluation cannot run; the message says what to change."""


def _causal_lm(model):
    """The transformers causal LM inside (a peft wrapper's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass
class Evaluator:
    data: PreparedDataset
    samples: list[dict]
    rank: int
    world: int
    micro: int
    pad_id: int
    packed: bool  # hand the packed rows' document boundaries to the attention
    every: int
    last_step: int | None = None  # the step last evaluated
    history: list[dict] = field(default_factory=list)

    @classmethod
    def open(cls, data_dir: Path, model, *, rank: int, world: int, micro: int, every: int,
             packed: bool) -> "Evaluator | None":
        """The evaluator of data_dir's held-out split, or None when the dataset has none."""
        found = held_out(data_dir)
        if found is None or len(found[0]) == 0:
            if rank == 0:
                print(f"longft: no held-out split in {data_dir} (data.eval_samples 0 or data.source "
                      f"random): no eval loss nor retrieval score", flush=True)
            return None
        head = _causal_lm(model).get_output_embeddings()
        import torch

        if not isinstance(head, torch.nn.Linear):
            raise EvalError(
                f"the held-out eval computes the loss from lm_head's weight, but lm_head is a "
                f"{type(head).__name__} (lora.target_modules or modules_to_save wrap it); leave "
                f"lm_head out of LoRA, or set data.eval_samples: 0")
        data, samples = found
        pad = data.meta.get("pad_token_id")
        return cls(data, samples, rank, world, micro, -1 if pad is None else int(pad), packed,
                   every)

    # -- when ---------------------------------------------------------------------------------

    def periodic(self, engine, step: int, log, stop=None) -> dict | None:
        """After step `step`: evaluate when train.eval_every divides it."""
        if self.due(step):
            return self.run(engine, step, log, stop)
        return None

    def due(self, step: int) -> bool:
        """Whether `periodic` evaluates after step `step`."""
        return bool(self.every and step % self.every == 0)

    def final(self, engine, step: int, log, stop=None) -> dict | None:
        """After the last step: evaluate unless `periodic` just did."""
        if step > 0 and self.last_step != step:
            return self.run(engine, step, log, stop)
        return None

    # -- how ----------------------------------------------------------------------------------

    def _batches(self) -> list[list[tuple[int, bool]]]:
        """This rank's micro-batches of (row, counts); as many on every rank."""
        n = len(self.data)
        mine = list(range(self.rank, n, self.world))
        per_rank = math.ceil(n / self.world)
        batches = []
        for b in range(math.ceil(per_rank / self.micro)):
            rows = [(r, True) for r in mine[b * self.micro:(b + 1) * self.micro]]
            batches.append(rows or [(0, False)])
        return batches

    def run(self, engine, step: int, log, stop=None) -> dict | None:
        """Evaluate every held-out row now; log and return the "eval" record. `stop` (a
        collective, called after every micro-batch on every rank: they run as many): a non-zero
        answer (a SIGINT/SIGTERM, stop.py) ends the evaluation there, and None is returned."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        if self.rank == 0:  # a notice: over many held-out rows this takes a while
            print(f"longft: evaluating {len(self.data)} held-out row(s) after step {step} ...",
                  flush=True)
        device = engine.device
        lm = _causal_lm(engine.module)
        spans = _span_index(self.samples)
        n = len(self.samples)
        # per sample: [cite correct, value correct, scored]; summed over ranks (one owner each)
        scores = torch.zeros(n, 3, dtype=torch.float64)
        loss_sum = torch.zeros((), dtype=torch.float64)
        tokens = torch.zeros((), dtype=torch.float64)
        captured: list = []
        handle = lm.get_decoder().register_forward_hook(
            lambda mod, args, out: captured.append(out[0] if isinstance(out, tuple) else
                                                   out.last_hidden_state))
        was_training = engine.training
        engine.eval()
        try:
            with torch.no_grad():
                for batch in self._batches():
                    rows = [self.data[r] for r, _ in batch]
                    b = {k: torch.stack([x[k] for x in rows]) for k in rows[0]}
                    kw = packed_attention.batch_kwargs(b["position_ids"]) if self.packed else {}
                    kw = {k: v.to(device) if hasattr(v, "to") else v for k, v in kw.items()}
                    captured.clear()
                    engine(input_ids=b["input_ids"].to(device),
                           position_ids=b["position_ids"].to(device), use_cache=False,
                           logits_to_keep=1, **kw)
                    hidden = captured[-1]
                    s, t, pred = _labelled_loss(hidden, b["labels"].to(device), lm)
                    for i, (r, counts) in enumerate(batch):
                        if not counts:
                            continue
                        loss_sum += s[i].double().cpu()
                        tokens += t[i].double().cpu()
                        for j, cite, value in spans.get(r, ()):
                            scores[j] = torch.tensor(
                                [_correct(pred[i], b["input_ids"][i], cite),
                                 _correct(pred[i], b["input_ids"][i], value), 1.0])
                    if stop is not None and stop():
                        if self.rank == 0:
                            print(f"longft: evaluation after step {step} stopped", flush=True)
                        return None
        finally:
            handle.remove()
            engine.train(was_training)
        if dist.is_initialized() and self.world > 1:
            packed_sums = torch.cat([loss_sum.view(1), tokens.view(1), scores.flatten()]).to(device)
            dist.all_reduce(packed_sums)
            packed_sums = packed_sums.cpu()
            loss_sum, tokens, scores = packed_sums[0], packed_sums[1], packed_sums[2:].view(n, 3)
        rec = self._record(step, float(loss_sum), float(tokens), scores,
                           time.perf_counter() - t0)
        log.write("eval", **rec)
        self.last_step = step
        self.history.append(rec)
        if self.rank == 0:
            acc = rec["retrieval_accuracy"]
            print(f"eval step {step}: loss {rec['loss']:.4f} ppl {rec['ppl']:.2f}"
                  + ("" if acc is None else f" retrieval {acc:.1%} of {rec['scored_samples']}")
                  + f" ({rec['time_s']:.1f} s)", flush=True)
        return rec

    def _record(self, step: int, loss_sum: float, tokens: float, scores, time_s: float) -> dict:
        loss = loss_sum / tokens if tokens else float("nan")
        scored = [i for i in range(len(self.samples)) if scores[i, 2] > 0]
        cite = [int(scores[i, 0] > 0.5) for i in scored]
        value = [int(scores[i, 1] > 0.5) for i in scored]
        meta = [self.samples[i] for i in scored]
        return {
            "step": step, "loss": loss,
            "ppl": math.exp(loss) if loss < 700 else None,  # exp overflows a float beyond ~709
            "tokens": int(tokens), "samples": len(self.samples), "rows": len(self.data),
            "time_s": round(time_s, 3),
            "scored_samples": len(scored),
            "retrieval_accuracy": sum(cite) / len(cite) if cite else None,
            "value_accuracy": sum(value) / len(value) if value else None,
            # per scored sample, for the metrics stage's bins (metrics/eval.py)
            "retrieval": {"length": [m["length"] for m in meta],
                          "position": [m["position"] for m in meta],
                          "num_docs": [m["num_docs"] for m in meta],
                          "cite_correct": cite, "value_correct": value},
        }


def _span_index(samples: list[dict]) -> dict[int, list[tuple[int, list[int], list[int]]]]:
    """row -> [(sample index, cite span, value span)] of the samples with a citation span."""
    out: dict[int, list] = {}
    for j, s in enumerate(samples):
        if s.get("cite") and s.get("value"):
            out.setdefault(int(s["row"]), []).append((j, s["cite"], s["value"]))
    return out


def _correct(pred, input_ids, span) -> float:
    """Whether the greedy next-token predictions give every token of input_ids[a:b] (the
    prediction for token t is made at position t - 1)."""
    a, b = span
    return float(bool((pred[a - 1:b - 1].cpu() == input_ids[a:b]).all()))


def _labelled_loss(hidden, labels, lm) -> tuple[Any, Any, Any]:
    """Per row: (sum of token losses, labelled tokens, argmax predictions [seq], -1 where
    unlabelled), over the positions whose next token has a label; the head's logits are made
    `CHUNK_ELEMENTS` at a time, never for the whole row."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    head = lm.get_output_embeddings()
    # Gemma 2 caps its final logits (cap x tanh(logits / cap)) before the loss: so does the eval
    cap = getattr(lm.config, "final_logit_softcapping", None)
    rows, seq = labels.shape
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]
    sel = target != -100
    r_idx, t_idx = sel.nonzero(as_tuple=True)
    sums = torch.zeros(rows, dtype=torch.float64, device=hidden.device)
    pred = torch.full((rows, seq), -1, dtype=torch.long, device=hidden.device)
    counts = sel.sum(dim=1)
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
        weight, bias = head.weight, head.bias
        chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
        for start in range(0, len(r_idx), chunk):
            r, t = r_idx[start:start + chunk], t_idx[start:start + chunk]
            logits = F.linear(hidden[r, t], weight, bias).float()
            if cap:
                logits = cap * torch.tanh(logits / cap)
            losses = F.cross_entropy(logits, target[r, t], reduction="none")
            sums.index_add_(0, r, losses.double())
            pred[r, t] = logits.argmax(dim=-1)
    return sums, counts, pred
