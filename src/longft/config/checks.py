"""The checks of params that types alone cannot make: ranges, and combinations of keys.

`problems(cfg)` returns every problem at once, each message naming its key and the fix;
`params.from_dict` raises them together as one ConfigError, before any model, data or GPU work.
"""

from __future__ import annotations

from longft.config import block_sparse, cpu_rules, qlora
from longft.config.sections import GENERATED_SOURCES, PATH_SOURCES, Config


def problems(cfg: Config) -> list[str]:
    """Ranges and combinations, section by section. Each message names the key and what to do."""
    return [msg for section in SECTIONS for msg in section(cfg)]


def notes(cfg: Config) -> list[str]:
    """What the params allow but a user would not want without knowing (the patch stage prints
    them): each says what happens and the setting that avoids it."""
    n = []
    if (cfg.model.source == "random" and cfg.lora.rank > 0 and cfg.output.export
            and cfg.output.export_lora == "adapter"):
        n.append("output.export_lora: adapter over a random-init model (model.source random): the "
                 "adapter's base weights are never saved, so `longft generate` cannot load it; set "
                 "output.export_lora: merged for a model it loads")
    return n


def _positive(key: str, v) -> list[str]:
    return [f"{key}: must be > 0, got {v}"] if v <= 0 else []


def _data(cfg: Config) -> list[str]:
    """Lengths, counts and where the records come from."""
    d = cfg.data
    p = _positive("data.max_seq_length", d.max_seq_length)
    if d.num_samples is None:
        if d.source in GENERATED_SOURCES:
            p.append(f"data.num_samples: required for source {d.source!r} (how many samples to "
                     f"generate), got null")
    elif d.num_samples <= 0:
        p.append(f"data.num_samples: must be > 0, got {d.num_samples}"
                 + ("" if d.source in GENERATED_SOURCES else "; null reads every record"))
    if d.eval_samples < 0:
        p.append(f"data.eval_samples: must be >= 0 (0 = no held-out split), got {d.eval_samples}")
    if isinstance(d.path, tuple) and len(d.path) == 1:
        p.append(f"data.path: one path, got a list ({list(d.path)}); write it without brackets: "
                 f"data.path: {d.path[0]}")
    elif isinstance(d.path, tuple):
        p.append(f"data.path: one path, got a list of {len(d.path)} ({list(d.path)}); a run reads "
                 f"one file (concatenate jsonl files into one: `cat a.jsonl b.jsonl > "
                 f"all.jsonl`), or one directory of .txt/.md documents with data.source: text_dir")
    elif d.source in PATH_SOURCES and not d.path:
        what = "a directory of .txt/.md files" if d.source == "text_dir" else \
            "a file or dataset name"
        p.append(f"data.path: required for source {d.source!r} ({what})")
    if d.source == "text_dir" and d.format not in ("auto", "text"):
        p.append(f"data.format: {d.format!r}, but source 'text_dir' reads each file as one text "
                 f"record; set data.format: auto (or text), or give {d.format} records in a jsonl "
                 f"with data.source: jsonl")
    return p


def _train(cfg: Config) -> list[str]:
    """Batch sizes (the global batch against micro batch x GPUs), length of the run, seed."""
    t, p = cfg.train, []
    if t.eval_every < 0:
        p.append(f"train.eval_every: must be >= 0 (0 = evaluate after the last step only), got "
                 f"{t.eval_every}")
    for k in ("micro_batch_size", "global_batch_size", "log_every"):
        p += _positive(f"train.{k}", getattr(t, k))
    if (t.iterations is None) == (t.epochs is None):
        p.append(f"train.iterations ({t.iterations}) and train.epochs ({t.epochs}): set exactly one "
                 f"of them and the other to null (iterations = optimizer steps, epochs = passes over "
                 f"the prepared rows); e.g. -S train.iterations=null -S train.epochs=2")
    if t.iterations is not None:
        p += _positive("train.iterations", t.iterations)
    if t.epochs is not None:
        p += _positive("train.epochs", t.epochs)
    if t.warmup_iterations < 0:
        p.append(f"train.warmup_iterations: must be >= 0, got {t.warmup_iterations}")
    elif t.iterations is not None and t.iterations > 0 and t.warmup_iterations >= t.iterations:
        p.append(f"train.warmup_iterations ({t.warmup_iterations}) must be < train.iterations "
                 f"({t.iterations}), or no iteration is timed")
    if t.max_grad_norm < 0:
        p.append(f"train.max_grad_norm: must be >= 0 (0 disables clipping), got {t.max_grad_norm}")
    h = cfg.hardware
    if t.micro_batch_size > 0 and t.global_batch_size > 0 and h.num_gpus > 0 and h.num_nodes > 0:
        per_step = t.micro_batch_size * cfg.world_size
        if t.global_batch_size % per_step:
            p.append(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                     f"train.micro_batch_size x GPUs ({t.micro_batch_size} x {cfg.world_size} = "
                     f"{per_step}); e.g. set it to {max(per_step, t.global_batch_size // per_step * per_step)}")
    if not 0 <= t.seed < 2**32:
        p.append(f"train.seed: must be in 0 .. {2**32 - 1} (numpy and DeepSpeed take an unsigned "
                 f"32-bit seed), got {t.seed}; set a seed in that range")
    return p


def _hardware(cfg: Config) -> list[str]:
    """Process counts, sequence parallelism (it divides the GPUs and the row), the launcher's knobs.
    What the machine has is hardware.policy's (auto, device cpu: `_cpu_device`)."""
    h, p = cfg.hardware, []
    p += _positive("hardware.num_gpus", h.num_gpus)
    p += _positive("hardware.num_nodes", h.num_nodes)
    p += _positive("hardware.sequence_parallel", h.sequence_parallel)
    if h.sequence_parallel > 1 and h.num_gpus > 0 and h.num_gpus % h.sequence_parallel:
        p.append(f"hardware.sequence_parallel ({h.sequence_parallel}) must divide hardware.num_gpus "
                 f"({h.num_gpus}): a sequence is split over ranks of one node; e.g. set "
                 f"sequence_parallel to a divisor of num_gpus")
    seq = cfg.data.max_seq_length
    if h.sequence_parallel > 1 and seq > 0 and seq % h.sequence_parallel:
        p.append(f"data.max_seq_length ({seq}) must be a multiple of "
                 f"hardware.sequence_parallel ({h.sequence_parallel}): each rank takes an equal "
                 f"slice of the row; e.g. {seq // h.sequence_parallel * h.sequence_parallel}")
    if h.num_nodes > 1 and not h.hostfile:
        p.append("hardware.hostfile: required when hardware.num_nodes > 1 (lines `host slots=N`)")
    if h.vram_limit_gib is not None and h.vram_limit_gib <= 0:
        p.append(f"hardware.vram_limit_gib: must be > 0 or null, got {h.vram_limit_gib}")
    if h.master_port != "auto" and not 1024 <= h.master_port <= 65535:
        p.append(f"hardware.master_port: must be auto or a TCP port in 1024-65535 (below 1024 needs "
                 f"root), got {h.master_port}")
    if h.bind_cores and h.launcher != "deepspeed":
        p.append("hardware.bind_cores: true needs hardware.launcher deepspeed (its "
                 "--bind_cores_to_rank); set launcher: deepspeed or bind_cores: false")
    return p


def _optim(cfg: Config) -> list[str]:
    """AdamW's numbers, the LR schedule, and the 8-bit optimizers' rules (config/qlora.py)."""
    o = cfg.optim
    p = _positive("optim.lr", o.lr)
    if o.weight_decay < 0:
        p.append(f"optim.weight_decay: must be >= 0, got {o.weight_decay}")
    for i, b in enumerate(o.betas):
        if b is not None and not 0 <= b < 1:
            p.append(f"optim.betas[{i}]: must be in [0, 1), got {b}")
    p += _positive("optim.eps", o.eps)
    if o.warmup_steps < 1:
        p.append(f"optim.warmup_steps: must be >= 1, got {o.warmup_steps} (1 = no warm-up: "
                 "the first step applies optim.lr)")
    if not 0 <= o.min_lr_ratio <= 1:
        p.append(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
    return p + qlora.eight_bit(cfg)


def _zero(cfg: Config) -> list[str]:
    """Where the parameters and optimizer states live (offload, ratio, bf16 states, NVMe) and the
    ZeRO-3-only buckets."""
    z, p = cfg.zero, []
    # over a quantized base, ZeRO-2 is required: qlora.quantize names each ZeRO-3-only knob with
    # the one fix (not "set zero.stage: 3", which its rule refuses)
    zero2 = z.stage != 3 and not qlora.quantized(cfg)
    if z.offload_param == "cpu" and zero2:
        p.append("zero.offload_param: 'cpu' needs zero.stage 3 (ZeRO-2 keeps parameters on the GPU);"
                 " set zero.stage: 3 or zero.offload_param: none")
    if not 0 < z.offload_ratio <= 1:
        p.append(f"zero.offload_ratio: must be in (0, 1], got {z.offload_ratio} (for none on the host "
                 "set zero.offload_optimizer: none)")
    elif z.offload_ratio < 1:
        if z.offload_optimizer != "cpu":
            p.append(f"zero.offload_ratio: {z.offload_ratio} splits the states between the GPU and CPU "
                     f"Adam and needs zero.offload_optimizer: cpu (it is {z.offload_optimizer}); set "
                     "offload_optimizer: cpu or offload_ratio: 1.0")
        if zero2:
            p.append(f"zero.offload_ratio: {z.offload_ratio} needs zero.stage 3 (DeepSpeed's partial "
                     "offload exists only in ZeRO-3); set zero.stage: 3 or offload_ratio: 1.0")
        if z.offload_param != "none":
            p.append(f"zero.offload_ratio: {z.offload_ratio} with zero.offload_param: cpu is not "
                     "supported (DeepSpeed's partial offload steps the GPU share against GPU weight "
                     "partitions; untested with offloaded ones); use one or the other")
    if z.offload_optimizer == "nvme":
        if zero2:
            p.append("zero.offload_optimizer: nvme needs zero.stage 3 (ZeRO-Infinity); set zero.stage: 3")
        if not z.nvme_path:
            p.append("zero.nvme_path: required with zero.offload_optimizer nvme (a directory on a "
                     "fast local disk)")
    elif z.nvme_path:
        p.append(f"zero.nvme_path: {z.nvme_path!r} is used only with zero.offload_optimizer: nvme "
                 f"(it is {z.offload_optimizer}); set it to null or offload_optimizer: nvme")
    if z.optimizer_states == "bf16" and cfg.precision not in ("auto", "bf16"):
        p.append(f"zero.optimizer_states: bf16 needs precision bf16 (it is {cfg.precision}); set "
                 "precision: bf16 or optimizer_states: fp32")
    if z.sub_group_size < 1:
        p.append(f"zero.sub_group_size: must be >= 1, got {z.sub_group_size}")
    for name in ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters"):
        v = getattr(z, name)
        if v is not None and v < 1:
            p.append(f"zero.{name}: must be >= 1 element, or null for longft's default, got {v}")
    if zero2:
        for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters"):
            if getattr(z, name) is not None:
                p.append(f"zero.{name}: a ZeRO-3 setting (stage3_{name}); zero.stage 2 would ignore "
                         f"it: set it to null or zero.stage: 3")
    if z.param_persistence_threshold is not None and z.param_persistence_threshold < 0:
        p.append(f"zero.param_persistence_threshold: must be >= 0 elements (0: nothing persists), "
                 f"or null for longft's default, got {z.param_persistence_threshold}")
    return p


def _kernels(cfg: Config) -> list[str]:
    k = cfg.kernels
    if k.tiled_mlp_tokens < 1:
        return [f"kernels.tiled_mlp_tokens: must be >= 1, got {k.tiled_mlp_tokens}"]
    return []


def _checkpointing(cfg: Config) -> list[str]:
    """The knobs that only apply to some checkpointing modes."""
    c, p = cfg.checkpointing, []
    if c.gpu_layers < 0:
        p.append(f"checkpointing.gpu_layers: must be >= 0, got {c.gpu_layers}")
    elif c.gpu_layers > 0 and c.mode != "cpu_offload":
        p.append(f"checkpointing.gpu_layers: {c.gpu_layers} only applies to checkpointing.mode "
                 f"cpu_offload (mode is {c.mode}); set it to 0 or use cpu_offload")
    if c.keep_attention < 0:
        p.append(f"checkpointing.keep_attention: must be >= 0, got {c.keep_attention}")
    elif c.keep_attention > 0 and c.mode == "none":
        p.append(f"checkpointing.keep_attention: {c.keep_attention} needs checkpointing (mode auto, "
                 "gpu or cpu_offload): with mode none nothing is recomputed; set it to 0")
    if not c.prefetch and c.mode != "cpu_offload":
        p.append(f"checkpointing.prefetch: false applies only to checkpointing.mode cpu_offload "
                 f"(it is {c.mode}: no checkpoint comes back from the host); "
                 "set prefetch: true or mode: cpu_offload")
    return p


def _output(cfg: Config) -> list[str]:
    o, p = cfg.output, []
    if o.checkpoint_every < 0:
        p.append(f"output.checkpoint_every: must be >= 0 (0 = off), got {o.checkpoint_every}")
    if o.keep_last < 1:
        p.append(f"output.keep_last: must be >= 1, got {o.keep_last}")
    return p + _profile_steps(cfg)


def _profile_steps(cfg: Config) -> list[str]:
    """output.profile_steps profiles steps warmup+1 .. warmup+N: they must exist (with
    train.epochs the step count is known only to the train stage, which profiles those there are)."""
    n, w, it = cfg.output.profile_steps, cfg.train.warmup_iterations, cfg.train.iterations
    if n < 0:
        return [f"output.profile_steps: must be >= 0 (0 = off), got {n}"]
    if n and it is not None and 0 <= w < it <= w + n:
        return [f"output.profile_steps ({n}) would profile steps {w + 1}..{w + n} (after "
                f"train.warmup_iterations {w}) and leave no timed step of train.iterations {it}: set "
                f"output.profile_steps to at most {it - w - 1} or train.iterations to at least "
                f"{w + n + 1}"]
    return []


def _lora(cfg: Config) -> list[str]:
    """Adapter rank, alpha, targets, dropout; QLoRA's rules (config/qlora.py)."""
    lo, p = cfg.lora, []
    if lo.rank < 0:
        p.append(f"lora.rank: must be >= 0 (0 = full finetuning), got {lo.rank}")
    if lo.rank > 0:
        p += _positive("lora.alpha", lo.alpha)
        if not lo.target_modules:
            p.append("lora.target_modules: must name at least one module when lora.rank > 0")
    if not 0 <= lo.dropout < 1:
        p.append(f"lora.dropout: must be in [0, 1), got {lo.dropout}")
    return p + qlora.quantize(cfg)


def _cpu_device(cfg: Config) -> list[str]:
    """hardware.device cpu: what the CPU cannot run (config/cpu_rules.py; device auto resolving to
    cpu gets the same rules in hardware.policy)."""
    if cfg.hardware.device != "cpu":
        return []
    return (cpu_rules.precision(cfg.precision) + cpu_rules.checkpointing(cfg.checkpointing.mode)
            + cpu_rules.attention(cfg.kernels.attention) + cpu_rules.liger(cfg.kernels.liger)
            + cpu_rules.vram_limit(cfg.hardware.vram_limit_gib)
            + cpu_rules.offload_ratio(cfg.zero.offload_ratio) + cpu_rules.optimizer(cfg.optim.name))


SECTIONS = (_data, _train, _hardware, _optim, _zero, _kernels, _checkpointing, _output, _lora,
            block_sparse.problems, _cpu_device)
"""The rule functions `problems` runs, in this order: one per params.yaml section (model, precision
and track have none of their own), then the CPU device's rules across sections."""
