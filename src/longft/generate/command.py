"""`longft generate`: sample from the exported model (export/) to see what the finetune learned.

    longft generate                                  # 3 held-out records of data/prepared
    longft generate --prompt "Summarise: ..." --prompt "..."
    longft generate --held-out 5 --max-new-tokens 64 --device cpu
    longft generate --export export --temperature 0.7 --seed 1

Each prompt goes through the model's chat template (a user turn and the assistant's generation
prompt), as in training. Held-out records (data.eval_samples, never trained on) are cut where
their trained answer starts and printed with that answer as the reference; a record trained whole
(`text`) is continued: its first part (half, or all but the last --max-new-tokens) is the prompt,
the rest the reference (generate/prompts.py). Greedy decoding unless --temperature > 0. Runs on
the GPU when there is one, else on the CPU (--device picks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longft.argtypes import integer, number, out_file
from longft.atomic import write_json
from longft.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--export", type=Path, default=Path("export"), metavar="DIR",
                   help="the exported model (default: export, the train stage's output)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a user message to answer; repeat for several (default: held-out records)")
    p.add_argument("--held-out", type=integer(least=1, what="records"), default=None, metavar="N",
                   help="answer the first N held-out records of --data (default 3 without --prompt)")
    p.add_argument("--data", type=Path, default=Path("data/prepared"), metavar="DIR",
                   help="the prepared dataset whose eval/ split --held-out reads")
    p.add_argument("--max-new-tokens", type=integer(least=1, what="tokens"), default=128, metavar="N")
    p.add_argument("--temperature", type=number(least=0, what="0: greedy"), default=0.0,
                   help="0 (default): greedy; > 0: sample at this temperature")
    p.add_argument("--top-p", type=number(above=0, most=1), default=1.0,
                   help="with --temperature > 0")
    p.add_argument("--seed", type=int, default=0, help="with --temperature > 0")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--show-prompt-chars", type=integer(least=0, what="characters"), default=300,
                   metavar="N",
                   help="print the last N characters of each prompt (0: none)")
    p.add_argument("--json", type=out_file, metavar="FILE",
                   help="also write [{name, prompt, reference, output}] here")


def _device(name: str) -> str:
    """--device as torch takes it; a CUDA device this torch build or machine does not have is
    refused (UserError) before the model is loaded."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r}: give auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise UserError(f"--device {name}: {why}; use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                            f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise UserError(f"--device {name!r}: give auto, cpu, cuda or cuda:N")
    return name


def generate(export, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0) -> list[int]:
    """The new token ids the model writes after prompt_ids (stops at the end-of-turn token)."""
    import torch

    model, tok = export.model, export.tokenizer
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, **kw)
    return out[0, len(prompt_ids):].tolist()


def _continued(p) -> str:
    """The header's words for a held-out record trained whole (text), which is continued."""
    if p.continued is None:
        return ""
    return (f": the start of a {p.continued}-token record trained whole (text), continued; "
            f"reference: its last {len(p.reference)} tokens")


def _trained_with_other_params(export_dir: Path, info: dict) -> str | None:
    """Where the train stage's own export/ was trained with other params than params.yaml's
    today (an experiment applied, params edited since): which sections differ and why. Exports
    elsewhere (--export DIR) and exports written before the digests are not compared."""
    from longft.config.params import ConfigError, load, sections_changed

    if Path(export_dir).resolve() != Path("export").resolve() or not Path("params.yaml").is_file():
        return None
    try:
        changed = sections_changed(info.get("params_digests"), load("params.yaml"))
    except ConfigError:
        return None
    if not changed:
        return None
    return (f"{export_dir}/ was trained with other params than params.yaml's (section(s) "
            f"{', '.join(changed)} differ): it is the model of an earlier run, not of these "
            "params. export/ is not cached, so `dvc exp apply NAME` does not bring an experiment's "
            "model back: `dvc repro` trains these params (or run the experiment in the workspace, "
            "`dvc exp run -n NAME ...` without --temp)")


def main(args: argparse.Namespace) -> int:
    from longft.engine.harmless_warnings import quiet
    from longft.generate.loading import load_export

    quiet()   # before peft imports bitsandbytes
    from longft.generate.prompts import chat_prompt, held_out_prompts

    try:  # the options' ranges were checked as they were parsed (longft/argtypes.py)
        export = load_export(args.export, _device(args.device))
        tok = export.tokenizer
        prompts = [chat_prompt(tok, text, f"prompt {i}") for i, text in enumerate(args.prompt)]
        if args.held_out or not prompts:
            prompts += held_out_prompts(args.data, args.held_out or 3, args.max_new_tokens)
        if not prompts:
            raise UserError(f"{args.data}/eval: no held-out record has a trained token to answer "
                            "or continue; give prompts with --prompt")
    except UserError as e:
        print(f"longft generate: {e}", file=sys.stderr)
        return 2
    if args.temperature > 0:
        import torch

        torch.manual_seed(args.seed)
    info = export.info
    print(f"longft generate: {args.export}/ ({export.kind}, {info.get('model')}, step "
          f"{info.get('steps')}) on {export.model.device}, "
          + ("greedy" if args.temperature == 0 else f"temperature {args.temperature}"), flush=True)
    if export.base:
        print(f"longft generate: {export.base}", flush=True)
    stale = _trained_with_other_params(args.export, info)
    if stale:
        print(f"longft generate: note: {stale}", file=sys.stderr, flush=True)
    results = []
    for p in prompts:
        new = generate(export, p.ids, args.max_new_tokens, args.temperature, args.top_p)
        res = {"name": p.name, "prompt": tok.decode(p.ids),
               "reference": None if p.reference is None
               else tok.decode(p.reference, skip_special_tokens=True),
               "output": tok.decode(new, skip_special_tokens=True)}
        results.append(res)
        print(f"\n### {p.name} ({len(p.ids)} prompt tokens{_continued(p)})")
        if args.show_prompt_chars:
            print("... " + res["prompt"][-args.show_prompt_chars:])
        if res["reference"] is not None:
            print(f"--- reference\n{res['reference']}")
        print(f"--- generated ({len(new)} tokens)\n{res['output']}", flush=True)
    if args.json:
        try:
            write_json(args.json, results)  # whole or not at all; a failure names path and cause
        except UserError as e:
            print(f"longft generate: {e}", file=sys.stderr)
            return 2
    return 0
