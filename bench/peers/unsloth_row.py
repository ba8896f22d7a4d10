"""One Unsloth QLoRA row, on the same checkpoint, token rows, LoRA, optimizer, steps and memory cap
as a longft row (bench/peers/README.md). Runs on the GPU machine, in Unsloth's own environment:

    HF_HUB_OFFLINE=1 python3 bench/peers/unsloth_row.py --model /tmp/llama3.1-8b \
        --rows /tmp/longft-bench/<row>/data/prepared --seq 32768 --steps 5 --warmup 2 \
        --vram-limit-gib 22.1 --out gpu-out/unsloth-32k.json

The timed steps are those after --warmup; tokens/s is seq / median step time (one row a step,
as longft's rows: micro-batch 1, global batch 1). Memory: torch's peak allocated and reserved,
NVML's peak used on the device (sampled at 20 Hz), the process's peak RSS (sampled at 20 Hz).
The result JSON holds the peer's version, every flag passed to it and each step's time and loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Peaks:
    """Peak process RSS and NVML device memory, sampled in a thread (both in bytes)."""

    def __init__(self, period_s: float = 0.05):
        import psutil
        self.proc, self.rss, self.nvml, self.period = psutil.Process(), 0, 0, period_s
        try:
            import pynvml
            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
            self._mem = lambda: pynvml.nvmlDeviceGetMemoryInfo(self._h).used
        except Exception:  # no NVML: the peak stays 0 and the JSON says so
            self._mem = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.rss = max(self.rss, self.proc.memory_info().rss)
                if self._mem:
                    self.nvml = max(self.nvml, self._mem())
            except Exception:
                pass
            time.sleep(self.period)

    def stop(self):
        self._stop.set()
        self._t.join()


def load_rows(prepared: str, n: int):
    """input_ids and labels of the first n rows of a longft data/prepared folder (numpy arrays)."""
    import numpy as np
    ids = np.load(os.path.join(prepared, "input_ids.npy"), mmap_mode="r")
    labels = np.load(os.path.join(prepared, "labels.npy"), mmap_mode="r")
    return [(np.array(ids[i % len(ids)]), np.array(labels[i % len(labels)])) for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a save_pretrained directory (with its tokenizer)")
    ap.add_argument("--rows", required=True, help="longft's data/prepared folder of the same row")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    ap.add_argument("--vram-limit-gib", type=float, default=None)
    ap.add_argument("--gradient-checkpointing", default="unsloth", help='"unsloth" (offloaded), true or false')
    ap.add_argument("--tiled-mlp", action="store_true", help="Unsloth's unsloth_tiled_mlp")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)

    result = {"name": args.name or os.path.splitext(os.path.basename(args.out))[0], "peer": "unsloth",
              "args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    peaks = Peaks()
    try:
        import torch
        if args.vram_limit_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(args.vram_limit_gib * 2**30 / total, 0)
        t0 = time.time()
        import unsloth  # noqa: F401  (must come before transformers and peft: it patches them)
        from unsloth import FastLanguageModel
        result["versions"] = {m: __import__(m).__version__ for m in
                              ("unsloth", "unsloth_zoo", "torch", "transformers", "peft", "bitsandbytes", "triton")}
        gc = {"true": True, "false": False}.get(args.gradient_checkpointing, args.gradient_checkpointing)
        model, _tok = FastLanguageModel.from_pretrained(
            model_name=args.model, max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=True,
            local_files_only=True, unsloth_tiled_mlp=args.tiled_mlp)
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none", target_modules=TARGETS,
            use_gradient_checkpointing=gc, random_state=1234, max_seq_length=args.seq)
        FastLanguageModel.for_training(model)
        result["load_s"] = round(time.time() - t0, 2)
        trainable = [p for p in model.parameters() if p.requires_grad]
        result["trainable_params"] = sum(p.numel() for p in trainable)
        opt = torch.optim.AdamW(trainable, lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay,
                                eps=1e-8)
        rows = load_rows(args.rows, args.steps)
        steps = []
        torch.cuda.reset_peak_memory_stats()
        for i, (ids, labels) in enumerate(rows):
            x = torch.as_tensor(ids[: args.seq], dtype=torch.long, device="cuda")[None]
            y = torch.as_tensor(labels[: args.seq], dtype=torch.long, device="cuda")[None]
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            steps.append({"step": i + 1, "time_s": round(dt, 4), "loss": float(loss)})
            print(f"[unsloth] step {i + 1}/{args.steps} {dt:.2f} s loss {float(loss):.4f} "
                  f"alloc {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        timed = [s["time_s"] for s in steps[args.warmup:]] or [s["time_s"] for s in steps]
        med = statistics.median(timed)
        result.update({
            "status": "ok", "steps": steps, "timed_steps": len(timed), "median_step_s": med,
            "step_spread_s": [min(timed), max(timed)], "tokens_per_s": round(args.seq / med, 1),
            "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        })
    except BaseException as e:  # an OOM is a result too: the row records it and the step it reached
        result.update({"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]})
        try:
            import torch
            result["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            result["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        except Exception:
            pass
        if "steps" in locals():
            result["steps"] = steps
    finally:
        peaks.stop()
        result["peak_rss_gib"] = round(peaks.rss / 2**30, 3)
        result["nvml_peak_gib"] = round(peaks.nvml / 2**30, 3)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[unsloth] {result['name']}: {result['status']} "
              f"{result.get('tokens_per_s', '-')} tok/s, alloc {result.get('max_allocated_gib')} GiB, "
              f"rss {result['peak_rss_gib']} GiB, nvml {result['nvml_peak_gib']} GiB", flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
