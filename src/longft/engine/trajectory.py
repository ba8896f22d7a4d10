"""The training trajectory a checkpoint belongs to: every param (and derived number) that changes
what the steps compute, its fingerprint (written into every checkpoint's COMPLETE), and the
differences between two of them, named by their param keys.

In the trajectory (a change means a fresh run, never a resume):
- model, data, kernels, precision, lora, optim: every key; sparse: every key when sparse.blocks > 0;
- zero: every key but host_grad_buffer, nvme_path, copy_back and overlap_step (where gradients are
  staged on the host, where NVMe swap files live, how the updated weights are copied and when the
  update runs change no result; the checkpoint holds the states);
- train: every key but warmup_iterations (steps left out of the timing), log_every and eval_every
  (what is printed and when the held-out loss is measured); iterations and epochs enter as
  `total_steps`, the number of optimizer steps the LR schedule spans (steps or epochs alike);
- hardware: the world size (num_gpus x num_nodes) and sequence_parallel; the rest (port, launcher,
  core binding, memory checks) changes no step's result;
- prepared: rows, tokens and trainable tokens of data/prepared (stats.json) and the sha256 of its
  arrays (`content`, content.py), so that a changed data file under the same params is a new
  trajectory too, even where every count stays the same;
- inputs: the model's and the tokenizer's content (sha256 of the local files, the config file of a
  configs/models name, or a hub id's cached commit; content.py): new weights under the same
  model.name are a new trajectory.
Left out on purpose: checkpointing.* (recompute gives the same gradients), output.* (what is
written and kept), track.* (the paths DVC watches; their content shows in `prepared`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from longft import content
from longft.config.params import Config, to_dict
from longft.engine.batches import steps_for_epochs

# The LR schedule is torch's LambdaLR over ds_config.lr_factor since this version; DeepSpeed's
# WarmupCosineLR state of older checkpoints does not load into it.
LR_SCHEDULE = "lambda-1"
_NOT_ZERO = ("host_grad_buffer", "nvme_path", "copy_back", "overlap_step")
_NOT_TRAIN = ("iterations", "epochs", "warmup_iterations", "log_every", "eval_every")


def _prepared(data_dir: Path | None) -> dict | None:
    """Rows, tokens and the content digest of the prepared training data (None: no data_dir, or
    not prepared)."""
    if data_dir is None:
        return None
    try:
        stats = json.loads((Path(data_dir) / "stats.json").read_text())
        out = {k: stats.get(k) for k in ("rows", "tokens", "trainable_tokens")}
    except (OSError, ValueError, AttributeError):
        return None
    out["content"] = content.data_digest(Path(data_dir))
    return out


def inputs(cfg: Config) -> dict:
    """The model's and the tokenizer's content digests (content.source_digest)."""
    from longft.model.loading import MODELS_DIR, tokenizer_path

    mc = cfg.model
    shipped = MODELS_DIR / f"{mc.name}.json" if mc.source == "random" else None
    return {"model": content.source_digest(mc.name, shipped),
            "tokenizer": content.source_digest(tokenizer_path(mc))}


def _rows(data_dir: Path | None) -> int | None:
    try:
        return int(json.loads((Path(data_dir) / "meta.json").read_text())["num_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def total_steps(cfg: Config, data_dir: Path | None = None) -> int | float | None:
    """Optimizer steps of the run: train.iterations, or train.epochs over the prepared rows (as
    trainer.with_steps works it out). Without the rows, the epochs themselves stand in."""
    t = cfg.train
    if t.iterations is not None:
        return t.iterations
    rows = _rows(data_dir)
    if rows is None:
        return t.epochs
    return steps_for_epochs(t.epochs, rows, cfg.world_size, t.micro_batch_size,
                            cfg.grad_accum_steps)


def trajectory(cfg: Config, data_dir: Path | None = None) -> dict:
    """The params (section -> key -> value) that define the training trajectory; see the module
    docstring for what is in and what is left out, and why."""
    d = to_dict(cfg)
    out = {k: d[k] for k in ("model", "data", "kernels", "precision", "lora", "optim")}
    if cfg.sparse.blocks:  # only when on: the fingerprints of other runs stay as they were
        out["sparse"] = d["sparse"]
    out["zero"] = {k: v for k, v in d["zero"].items() if k not in _NOT_ZERO}
    out["train"] = {k: v for k, v in d["train"].items() if k not in _NOT_TRAIN}
    out["train"]["total_steps"] = total_steps(cfg, data_dir)
    out["hardware"] = {"world_size": cfg.world_size,
                       "sequence_parallel": cfg.hardware.sequence_parallel}
    out["prepared"] = _prepared(data_dir)
    out["inputs"] = inputs(cfg)
    out["lr_schedule"] = LR_SCHEDULE
    return out


def fingerprint_of(traj: dict) -> str:
    return hashlib.sha256(json.dumps(traj, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(cfg: Config, data_dir: Path | None = None) -> str:
    """Hash of `trajectory(cfg, data_dir)`: checkpoints of another one are never resumed."""
    return fingerprint_of(trajectory(cfg, data_dir))


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def differences(old: dict, new: dict) -> list[str]:
    """'key old -> new' for every param of trajectory `new` that differs from `old`."""
    a, b = _flat(old), _flat(new)
    return [f"{k} {a.get(k, '-')} -> {b.get(k, '-')}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
