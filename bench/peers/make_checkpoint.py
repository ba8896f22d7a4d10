"""Write a random-init Hugging Face checkpoint of one of longft's architecture configs, with a
word-level tokenizer of the model's vocabulary (no hub), for longft and a peer to load the same
weights from (bench/peers/README.md):

    python3 bench/peers/make_checkpoint.py llama3.1-8b /tmp/llama3.1-8b [--device cuda] [--seed 1234]

The weights are drawn on --device (an 8B model in about 20 s on a GPU) in bf16 and written as
safetensors. Memory and speed do not depend on their values; the same file feeds both tools.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", help="a configs/models/<arch>.json name, e.g. llama3.1-8b")
    ap.add_argument("out", help="the directory to write (save_pretrained)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)

    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    spec = json.loads((REPO / "configs" / "models" / f"{args.arch}.json").read_text())
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    out = Path(args.out)
    if (out / "config.json").exists():
        print(f"make_checkpoint: {out} exists, kept")
        return 0
    t = time.time()
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                            eos_token=f"t{cfg.eos_token_id}", bos_token=f"t{cfg.bos_token_id}").save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"make_checkpoint: {args.arch} ({n / 1e9:.2f}B parameters) written to {out} in {time.time() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
