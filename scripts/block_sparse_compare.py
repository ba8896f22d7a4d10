"""Block-sparse finetuning against LoRA and full finetuning on the synthetic retrieval task, on CPU,
at equal trainable parameters (LoRA r=4 and 11 blocks of 8 x 8 per matrix train 9,856 parameters
of the tiny Llama's 14 decoder linears). Issue 51, item 2; the numbers go to docs/models-and-lora.md.

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python scripts/block_sparse_compare.py --out /tmp/cmp

The tiny Llama is first pretrained on generic copy rows (tests/test_retrieval_pretrained.py: an
induction head forms, which a random-init model never gets in a CPU budget), saved, and then
finetuned from the same weights by each method with plain torch AdamW (no DeepSpeed: the same
model code and the same evaluator as the train stage), on the same rows in the same order. The
block-sparse warm-up (engine/block_warmup.choose) runs first on 4 micro-batches. The held-out loss
and the retrieval (citation) score of longft's Evaluator are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def finetune(kind: str, pre: Path, data: Path, *, steps: int, lr: float, seed: int) -> dict:
    import torch

    from longft.config.params import from_dict
    from longft.data.store import PreparedDataset
    from longft.engine import block_warmup
    from longft.engine.evaluate import Evaluator
    from longft.model import block_sparse
    from longft.model.loading import build_model
    from test_retrieval_learns import Log, PlainEngine, train

    sparse = {"blocks": 11, "block_size": 8, "warmup_steps": 4} if kind == "sparse" else {}
    cfg = from_dict({"model": {"source": "pretrained", "name": str(pre)},
                     "train": {"seed": seed, "micro_batch_size": 8, "global_batch_size": 8},
                     "sparse": sparse})
    torch.manual_seed(seed)
    model = build_model(cfg.model, "sdpa", torch.float32)
    model.config.use_cache = False
    if kind == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(
            cfg.lora.target_modules), task_type="CAUSAL_LM"))
    engine = PlainEngine(model)
    rows = PreparedDataset(data)
    t0 = time.perf_counter()
    if kind == "sparse":
        block_sparse.attach(model, cfg.sparse.target_modules, 11, 8, torch.float32)
        block_warmup.choose(engine, cfg, rows, rank=0, world=1, pad_id=-1, packed=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ev = Evaluator.open(data, model, rank=0, world=1, micro=16, every=0, packed=False)
    before = ev.run(engine, 0, Log())
    params = [p for p in model.parameters() if p.requires_grad]
    train(_Only(model, params), list(rows), steps=steps, lr=lr, seed=seed + 1, batch=8)
    after = ev.run(engine, steps, Log())
    out = {"kind": kind, "lr": lr, "steps": steps, "trainable": trainable,
           "loss_before": before["loss"], "loss_after": after["loss"],
           "citation_before": before["retrieval_accuracy"],
           "citation_after": after["retrieval_accuracy"],
           "value_after": after["value_accuracy"], "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out), flush=True)
    return out


class _Only:
    """The model, whose parameters() are only the trainable ones (train() builds its AdamW from
    model.parameters())."""

    def __init__(self, model, params):
        self._m, self._p = model, params

    def parameters(self):
        return iter(self._p)

    def __getattr__(self, name):
        return getattr(self._m, name)

    def __call__(self, *a, **k):
        return self._m(*a, **k)


def main() -> None:
    import torch

    from longft.config.params import from_dict
    from longft.data.prepare import prepare
    from test_retrieval_pretrained import SEQ, copy_accuracy, pretrain, tiny_llama
    from word_tokenizer import word_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lrs", default="1e-3,3e-3")
    a = ap.parse_args()
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    pre, data = a.out / "pretrained", a.out / "p"
    tok = word_tokenizer()
    if not (pre / "config.json").is_file():
        torch.manual_seed(a.seed)
        model = tiny_llama(tok)
        pretrain(model, len(tok), tok.bos_token_id, a.seed)
        print(f"copy accuracy {copy_accuracy(model, len(tok), tok.bos_token_id):.2f}", flush=True)
        model.save_pretrained(pre)
        tok.save_pretrained(pre)
    if not (data / "stats.json").is_file():
        cfg = from_dict({"model": {"source": "pretrained", "name": str(pre)},
                         "data": {"num_samples": 800, "eval_samples": 150, "max_seq_length": SEQ,
                                  "synthetic_lengths": "full", "pack": False},
                         "train": {"seed": a.seed}})
        prepare(cfg, data)
    results = [finetune(kind, pre, data, steps=a.steps, lr=float(lr), seed=a.seed)
               for lr in a.lrs.split(",") for kind in ("sparse", "lora", "full")]
    (a.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
