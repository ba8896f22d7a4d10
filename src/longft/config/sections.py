"""The sections of params.yaml as frozen, typed dataclasses, one per concern, and `Config`, the whole.

Each field's docstring says what it does, its unit and its values; the dataclass default is the
shipped value (the committed params.yaml equals these defaults). `params` reads params.yaml into
them and `checks` holds the rules that types alone cannot say; code reads the config only through
these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass(frozen=True)
class ModelConfig:
    source: Literal["random", "pretrained"] = "random"
    """random: build an untrained model from an architecture config (memory/speed studies only);
    pretrained: load weights with from_pretrained."""
    name: str = "tiny-llama"
    """random: a name in configs/models (without .json) or a path to a config.json;
    pretrained: a Hugging Face hub id or a local directory written by save_pretrained."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or hub id; null = the model's own (pretrained) or configs/tokenizers/byte."""
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "random", "jsonl", "parquet", "hf", "text_dir"] = "synthetic"
    """synthetic: generated retrieval-with-citation task; random: random token ids (benchmarks);
    jsonl/parquet: a local file; hf: a `datasets` name or a directory written by save_to_disk;
    text_dir: a directory of .txt/.md documents, each file one `text` record (data/text_dir.py)."""
    path: Union[str, tuple[str, ...], None] = None
    """File for jsonl/parquet, dataset name or path for hf, directory for text_dir; unused for
    synthetic/random. One path: a list is read only to be refused with the fix (checks.py)."""
    split: str = "train"
    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    """Record layout; auto picks from the keys of the first record, and a file holds one layout.
    text_dir: text (auto means text)."""
    num_samples: Optional[int] = 48
    """synthetic / random: how many samples to generate (required). Files and datasets: null =
    every record; a number caps the records read, and prepare then says how many were left out
    (stats.json: records_total, dropped.num_samples)."""
    max_seq_length: int = 4096
    pack: bool = True
    """Pack several samples into one sequence; position ids restart per document and attention runs
    per document (kernels.packed_attention), so packed documents do not attend to each other."""
    synthetic_lengths: Literal["full", "mixed"] = "mixed"
    """synthetic only: mixed = each sample's length log-uniform from 1,024 tokens to max_seq_length
    (several documents a packed row, like real long chat records); full = every sample fills a row."""
    truncate: bool = True
    """Cut samples longer than max_seq_length; false makes such a sample an error (or a skip).
    Text records are split instead while split_text is true."""
    split_text: bool = True
    """format text: a record longer than max_seq_length becomes several documents of
    max_seq_length tokens (the last one shorter; only the first starts with bos, only the last
    ends with eos), so no text is lost; false = cut or refused by truncate, like chat records.
    Chat and prompt/completion records are never split (an answer must not lose its question)."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A malformed record: stop with its file and line, or skip it and count it in stats.json."""
    train_on_prompt: bool = False
    """Also compute the loss on non-assistant tokens."""
    eval_samples: int = 32
    """Held-out samples for evaluation (data/prepared/eval; 0 = none), never trained on nor packed
    with training samples. synthetic: samples num_samples .. num_samples + eval_samples - 1 of the
    same generator (the training samples stay those of num_samples alone); files and datasets:
    this many of the samples read (at most a tenth of them), picked by train.seed, the rest
    train; random: none (random ids have nothing to learn). A count, not a fraction: one eval
    costs the same whatever the size of the dataset, and the retrieval score's bins need a few
    dozen samples even from a small one."""


PATH_SOURCES = ("jsonl", "parquet", "hf", "text_dir")
"""The data.source values that read data.path."""
GENERATED_SOURCES = ("synthetic", "random")
"""The data.source values that generate their samples, as many as data.num_samples asks for."""


LONGFT_PACKED_KERNELS = ("varlen", "per_document", "flash_attn_4")
"""kernels.packed_attention values that run longft's attention function (model/packed_attention.py);
defined once here for the policy, the patches and the batches."""


@dataclass(frozen=True)
class KernelsConfig:
    liger: Literal["auto", "on", "off"] = "auto"
    """Liger fused kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); auto = on with CUDA."""
    attention: Literal["auto", "flash_attention_2", "sdpa", "flash_attn_4", "eager"] = "auto"
    """auto = flash_attn_4 where flash-attn-4 is installed on Hopper (bf16 / fp16; not with a pinned
    sdpa_backend, another pinned packed kernel or a sliding window shorter than a row), else
    flash_attention_2 when installed on compute capability >= 8.0, else sdpa.
    flash_attn_4 = flash-attn-4's causal kernels for every row (pip install flash-attn-4; Hopper and
    Blackwell, bf16 / fp16): its dense kernel for rows of one document, its varlen kernel for packed
    rows; checkpointing.keep_attention keeps its outputs."""
    packed_attention: Literal["auto", "varlen", "per_document", "flash_attn_4", "mask"] = "auto"
    """Attention over rows that pack several documents (model/packed_attention.py): varlen = torch's
    varlen_attn (CUDA, compute capability >= 8.0, torch >= 2.10); per_document = SDPA once per
    document; flash_attn_4 = flash-attn-4's varlen kernel (pip install flash-attn-4; Hopper and
    Blackwell); mask = transformers' dense [seq x seq]
    block mask (slow; for comparison). auto picks per GPU generation by measurement (docs/memory.md);
    flash_attention_2 reads the document boundaries itself. Rows of one document always take
    the single-sequence kernel."""
    sdpa_backend: Literal["auto", "default", "flash", "cudnn", "efficient", "math"] = "auto"
    """With attention sdpa: the kernel SDPA tries first (fallbacks: efficient, math). auto = cudnn on
    compute capability >= 9.0, flash on 8.x, efficient on 7.x, PyTorch's default on CPU."""
    tiled_mlp: Literal["auto", "on", "off"] = "auto"
    """Run each MLP over 8K-token tiles (DeepSpeed's TiledMLP), so its intermediates never exist for
    the whole sequence: ~10 GiB less VRAM for an 8B model at 128K, ~5% more compute. auto = on from
    data.max_seq_length 65536."""
    tiled_mlp_tokens: int = 8192
    """Tokens per MLP tile with tiled_mlp (smaller: less memory, less efficient matmuls)."""


@dataclass(frozen=True)
class CheckpointingConfig:
    mode: Literal["auto", "none", "gpu", "cpu_offload"] = "auto"
    """Activation checkpointing per decoder layer. none: keep all activations; gpu: recompute, keep
    layer inputs on the GPU; cpu_offload: layer inputs in pinned host memory. auto = gpu."""
    gpu_layers: int = 0
    """cpu_offload only: the last N decoder layers keep their checkpoints on the GPU (each costs
    micro x seq x hidden x 2 B of VRAM and saves as much host RAM and two copies per step)."""
    keep_attention: int = 0
    """gpu / cpu_offload: the last N decoder layers keep their attention output from the forward,
    so the backward's recompute skips the attention forward (a quarter of the attention time; each
    layer costs micro x seq x heads x head_dim x 2 B of VRAM until its backward)."""
    prefetch: bool = True
    """cpu_offload only: in backward, start copying the previous layer's checkpoint back to the GPU
    while the current layer recomputes (one more checkpoint on the GPU at a time). false: each
    checkpoint is copied back when its layer's backward needs it (the copy is not overlapped)."""


@dataclass(frozen=True)
class HardwareConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto = cuda when a GPU is visible, else cpu (DeepSpeed's CPU accelerator, gloo)."""
    num_gpus: int = 1
    """Processes (GPUs) per node; on CPU the number of worker processes."""
    num_nodes: int = 1
    sequence_parallel: int = 1
    """N > 1: DeepSpeed Ulysses sequence parallelism. Each sequence is split over N ranks of a
    node (N divides num_gpus and the model's attention heads); attention all-to-alls the heads so
    each rank attends over the whole sequence with heads / N heads; the loss is the exact mean
    over the whole sequence's tokens. Activations per GPU are about 1/N. 1 = off (each rank
    trains its own sequences)."""
    hostfile: Optional[str] = None
    """DeepSpeed hostfile for multi-node runs (`host slots=N` lines)."""
    launcher: Literal["deepspeed", "torchrun"] = "deepspeed"
    master_port: Union[int, Literal["auto"]] = "auto"
    """The ranks' rendezvous port (torch.distributed's MASTER_PORT). auto = a port that is free on
    this machine at launch, so two runs on one machine (a second experiment, the tests beside a
    run) never collide; an int pins it, and the train stage refuses to start while it is in use."""
    vram_limit_gib: Optional[float] = None
    """Cap this process's GPU memory to emulate a smaller card (torch's per-process fraction)."""
    host_mem_check: bool = True
    """Before any rank starts, the train stage compares the estimator's predicted peak host memory
    (artifacts/plan.json, process-tree RSS of this node) with the RAM available now and refuses to
    start when it does not fit. false skips the check (e.g. when the estimate is known to be too
    high for this machine)."""
    gpu_mem_check: bool = True
    """Before any rank starts, the train stage refuses to start when another process (a second
    job) holds memory on a GPU this run will use and what is free there is below one rank's
    predicted need (artifacts/plan.json). false skips the check."""
    bind_cores: bool = False
    """Bind each rank to its own share of the CPU cores and their NUMA memory (DeepSpeed launcher's
    --bind_cores_to_rank, through numactl; sets OMP_NUM_THREADS): CPU Adam's threads stop
    migrating. Needs launcher deepspeed and numactl."""
    expandable_segments: bool = True
    """Run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (unless that variable is set):
    freed blocks are remapped instead of fragmenting, so reserved VRAM stays close to allocated."""


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 1
    """Sequences per GPU per forward/backward."""
    global_batch_size: int = 2
    """Sequences per optimizer step over all GPUs; accumulation = global / (micro x world)."""
    iterations: Optional[int] = 12
    """Optimizer steps to run; null = derived from epochs. Exactly one of iterations and epochs is
    set."""
    epochs: Optional[float] = None
    """Passes over the prepared rows instead of a step count (fractional allowed, e.g. 0.5 or 3):
    steps = ceil(epochs x ceil((rows // GPUs) / micro_batch_size) / accumulation), worked out by
    the train stage from data/prepared (engine/batches.steps_for_epochs). Each epoch reshuffles."""
    warmup_iterations: int = 2
    """First steps left out of timing (compilation, allocator warm-up)."""
    max_grad_norm: float = 1.0
    seed: int = 1234
    log_every: int = 1
    eval_every: int = 0
    """Evaluate the held-out split (data.eval_samples) every N optimizer steps; 0 = only after the
    last step (which is always evaluated)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1.0e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 1
    """LR warm-up steps: step i < N applies lr x (i + 1) / N (1 = no warm-up; the first step
    already applies lr). engine/ds_config.lr_factor."""
    min_lr_ratio: float = 0.1
    """cosine / linear: the lr of the last step, as a fraction of lr."""
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """adamw = DeepSpeed's Adam (CPU Adam with offload_optimizer cpu). adamw_8bit = bitsandbytes'
    8-bit AdamW: Adam's m and v in 8-bit blocks on the GPU (2 instead of 8 B per parameter), an
    alternative to CPU offload (needs zero.offload_optimizer none; it also trains on the CPU,
    config/cpu_rules.py). paged_adamw_8bit = the same in paged memory that spills to the host under
    memory pressure (CUDA unified memory: a CUDA GPU only)."""


@dataclass(frozen=True)
class ZeroConfig:
    stage: Literal[2, 3] = 3
    offload_optimizer: Literal["none", "cpu", "nvme"] = "cpu"
    """Optimizer states and the Adam step on the host (DeepSpeedCPUAdam). nvme = ZeRO-Infinity: the
    states live in files under zero.nvme_path and stream through host RAM sub-group by sub-group
    (ZeRO-3 only; DeepSpeed's async_io op, which needs libaio)."""
    offload_ratio: float = 1.0
    """offload_optimizer cpu, ZeRO-3: the share of the optimizer states (master weights, Adam m and
    v, the optimizer's gradient copy) that goes to the host and steps with CPU Adam; the rest stays
    on the GPU and steps there (DeepSpeed's offload_optimizer.ratio, ZeRO-Offload++). DeepSpeed
    splits by optimizer sub-groups (zero.sub_group_size elements each, in parameter order): the
    first int((1 - ratio) x groups) stay on the GPU. 1.0 = all on the host."""
    optimizer_states: Literal["fp32", "bf16"] = "fp32"
    """bf16 = master weights, their gradients and Adam's m and v in bf16 (DeepSpeed's
    bf16_master_weights_and_grads + bf16_optimizer_states): 8 instead of 16 B per parameter, on
    the host or the GPU. It changes numerics (an update below bf16's resolution of the weight is
    lost), so it is opt-in; needs precision bf16."""
    nvme_path: Optional[str] = None
    """offload_optimizer nvme: an existing, writable directory on a fast local disk with room for
    the states (16 B per parameter, 8 with optimizer_states bf16); longft writes under it."""
    sub_group_size: int = 1_000_000_000
    """Elements per optimizer sub-group (DeepSpeed's zero_optimization.sub_group_size): the unit
    that CPU Adam steps, NVMe swaps and offload_ratio splits by. Smaller groups split the ratio
    finer and shrink the per-group step buffers."""
    offload_param: Literal["none", "cpu"] = "none"
    """Parameters on the host, fetched per layer (ZeRO-3 only)."""
    reduce_bucket_size: Optional[int] = None
    """Gradient elements reduced (and, with offload, copied to the host) per bucket: DeepSpeed's
    zero_optimization.reduce_bucket_size. null = hidden_size^2 (as HF Trainer's `auto`)."""
    prefetch_bucket_size: Optional[int] = None
    """ZeRO-3: parameter elements fetched ahead of use (stage3_prefetch_bucket_size).
    null = 0.9 x hidden_size^2."""
    param_persistence_threshold: Optional[int] = None
    """ZeRO-3: parameters of at most this many elements stay gathered on every GPU instead of being
    fetched per use (stage3_param_persistence_threshold). null = 10 x hidden_size."""
    max_live_parameters: Optional[int] = None
    """ZeRO-3: at most this many gathered parameter elements at a time (stage3_max_live_parameters).
    null = 1e9."""
    overlap_comm: bool = True
    host_grad_buffer: Literal["auto", "full", "shared"] = "auto"
    """With offload_optimizer (ZeRO-3), DeepSpeed keeps a host copy of every gradient partition in
    the training dtype (2 B x parameters: 15 GiB for 8B) to accumulate over micro-steps. Without
    accumulation it is only a staging area: `shared` points every partition at one buffer of the
    largest partition's size (grad_buffer.py). auto = shared where that is exact (ZeRO-3,
    offload_optimizer cpu, one micro-step per step, not fp16), else full (DeepSpeed's own)."""
    copy_back: Literal["auto", "deepspeed", "chunked"] = "auto"
    """With offload_optimizer cpu (ZeRO-3, parameters on the GPU, fp32 states), how the step puts
    the updated fp32 master weights into the GPU's 16-bit partitions: `deepspeed` (its blocking
    copy_, through a pageable temporary of a whole sub-group) or `chunked` (three pinned 64 MiB
    chunks, copied while the next is converted: param_copy_back.py; the same bits). auto =
    chunked wherever it applies (a GPU, ZeRO-3, optimizer on the CPU, parameters on the GPU, 16-bit
    training with fp32 states), else deepspeed."""
    overlap_step: Literal["auto", "off", "on"] = "auto"
    """With offload_optimizer cpu (ZeRO-3, one process): `on` runs each step's CPU Adam during the
    next forward, sub-group by sub-group, each one just before its parameters are fetched
    (engine/overlap_step.py: DeepSpeed's own update, the same bits); the GPU computes meanwhile
    instead of waiting for the whole update. It overlaps as many sub-groups as the model has:
    zero.sub_group_size 1e9 gives a 1B model 2, 1e8 gives it 11. ZeRO-3 then fetches every
    parameter (param_persistence_threshold null means 0). auto = on wherever it applies on a GPU,
    off elsewhere; `off` = DeepSpeed's step as it is."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """0 = full-parameter finetuning; > 0 = LoRA adapters of this rank (peft)."""
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantize: Literal["none", "nf4", "int8"] = "none"
    """With LoRA (lora.rank > 0: QLoRA) or block-sparse finetuning (sparse.blocks > 0): the frozen
    base weights of the targeted linears (lora.target_modules, or sparse.target_modules) in
    bitsandbytes' 4-bit NF4 with double quantization or 8-bit, computing in the training dtype;
    the adapters or blocks stay in the training dtype. A quantized base runs on ZeRO-2: it needs
    zero.stage 2 (stage 3 is refused with the fix, so params say what runs). none = base weights
    in the training dtype."""


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse finetuning (model/block_sparse.py): each target matrix trains only its `blocks`
    block_size x block_size blocks of largest gradient mass, picked by a warm-up of full gradients;
    the rest of the weight stays frozen and the optimizer holds states for the blocks alone."""

    blocks: int = 0
    """Blocks trained per target matrix; 0 = off. Trainable parameters = blocks x block_size^2 x
    target matrices (LoRA's rank r on an [out x in] matrix trains r x (in + out))."""
    block_size: int = 64
    """Rows and columns of a block; it divides the in- and out-features of every target."""
    warmup_steps: int = 4
    """Micro-batches of full gradients (no update) before the first step: each block's summed
    |gradient| over them picks the blocks (ties to the lower index; all ranks pick the same)."""
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class OutputConfig:
    save_checkpoint: bool = True
    """Write a DeepSpeed checkpoint at the end of training (checkpoints/)."""
    export: bool = True
    """Write the finetuned model as a Hugging Face checkpoint (export/, safetensors) at the end."""
    export_lora: Literal["adapter", "merged"] = "adapter"
    """With LoRA (lora.rank > 0): adapter = export/ holds the peft adapter (load it on the base
    model with PeftModel.from_pretrained); merged = export/ holds the full model with the LoRA
    deltas merged into the base weights (W + alpha/r * B @ A, in the weights' dtype), which
    AutoModelForCausalLM.from_pretrained loads without peft, and export/adapter/ the adapter."""
    checkpoint_every: int = 0
    """Also write a resumable checkpoint every N optimizer steps (0 = none)."""
    keep_last: int = 2
    """How many periodic checkpoints to keep."""
    resume: bool = True
    """Resume from the newest complete checkpoint of the same configuration, if there is one."""
    tensorboard: bool = False
    """Also write loss, lr, grad_norm and tokens/s per step as TensorBoard events in
    runs/train/tensorboard (`tensorboard --logdir runs/train/tensorboard`; needs the tensorboard
    package). dvclive's runs/train/live is always written."""
    profile_steps: int = 0
    """Profile this many optimizer steps with torch.profiler (0 = off): the ones right after the
    warm-up, train.warmup_iterations + 1 .. + N. Each rank writes a Chrome trace
    (runs/train/profile/rank{r}.trace.json.gz, for https://ui.perfetto.dev) and the time split of
    those steps (rank{r}.split.json: forward, backward, optimizer, the inner optimizer's update and,
    on CUDA, compute, host<->device copies and GPU idle time); rank 0 prints the split. The
    profiled steps train as usual but are left out of the speed metrics (docs/measurements.md)."""


NOTHING_TO_TRACK = "configs/nothing-to-track"
"""The placeholder dependency of track.*: a shipped file that never changes."""


@dataclass(frozen=True)
class TrackConfig:
    """Local inputs tracked as DVC dependencies: dvc.yaml interpolates these paths into the deps of
    the stages that read them (`${track.data}` ...), so editing the file or directory re-runs them.
    DVC cannot make a dep of a null param, hence these separate fields; the placeholder (nothing
    to track) is a shipped file. The prepare stage refuses to run while a local data.path,
    model.name or model.tokenizer is not covered by its entry, or has files git would commit
    (`dvc add PATH` first; data/tracked.py)."""

    data: str = NOTHING_TO_TRACK
    """data.path when it is a local file or directory (jsonl, parquet, a save_to_disk dataset, a
    text_dir folder), or a directory above it. Deps of: prepare."""
    model: str = NOTHING_TO_TRACK
    """model.name when it is a local directory (pretrained) or a config.json outside
    configs/models (random). Deps of: prepare, patch, train."""
    tokenizer: str = NOTHING_TO_TRACK
    """model.tokenizer when it is a local directory outside configs/tokenizers. Deps of: prepare,
    train (the export saves it)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto = bf16 on compute capability >= 8.0 and on CPU, fp16 on 7.x (V100)."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    track: TrackConfig = field(default_factory=TrackConfig)

    @property
    def world_size(self) -> int:
        return self.hardware.num_gpus * self.hardware.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """Groups of ranks that train different sequences (world / hardware.sequence_parallel)."""
        return self.world_size // self.hardware.sequence_parallel

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.world_size)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.max_seq_length
