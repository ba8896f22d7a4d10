"""A few steps of DeepSpeed's own ZeRO-3 with CPU Adam, in a subprocess on the CPU (gloo), with
longft's optimizer patches on or off: the losses, the final weights' bits and what the patches
counted. Shared by tests/test_param_copy_back.py, tests/test_clip_scale.py and
tests/test_overlap_step.py."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import longft
from longft.run.launch import free_port

SRC = Path(longft.__file__).parents[1]
"""The src/ this process imports longft from, first on the worker's path: the worker runs the same
code as the test (a mutant in scripts/mutants.py's copy of src/, not the working tree's)."""

WORKER = textwrap.dedent('''
    import json, sys
    import torch, deepspeed
    from longft.engine import clip_scale, overlap_step, param_copy_back
    copy_back, clip_mode, clipping = sys.argv[1], sys.argv[2], float(sys.argv[3])
    extra = json.loads(sys.argv[4])     # overlap, offload_param, persistence, schedule, evaluate
    param_copy_back.CHUNK_ELEMENTS = 1000            # several chunks a sub-group
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(4, 64)
    for layer in model[:extra.get("freeze", 0)]:      # frozen weights, as LoRA's base model
        layer.requires_grad_(False)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "gradient_clipping": clipping,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "sub_group_size": 5000,
                                "offload_optimizer": {"device": "cpu"}}}
    if extra.get("offload_param"):
        ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if extra.get("persistence") is not None:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = extra["persistence"]
    if extra.get("schedule"):                       # the lr moves every step
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 10}}
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    # on the CPU the partitions are on the host too: let the chunked path take them
    copier = param_copy_back.install(engine.optimizer, devices=("cpu",)) if copy_back == "chunked" else None
    calls = []      # DeepSpeed's step, as it ran: [method, sub-group or None], in order
    for name in ("_pre_step", "_partition_all_parameters", "_prepare_sub_group", "_optimizer_step",
                 "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group", "_post_step"):
        def traced(*args, _name=name, _method=getattr(engine.optimizer, name)):
            calls.append([_name, args[0] if args and isinstance(args[0], int) else None])
            return _method(*args)
        setattr(engine.optimizer, name, traced)
    gathers = []    # parameters all-gathered outside a fetch (DeepSpeed's end of step: the persistent ones)
    for p in model.parameters():
        def all_gather(param_list=None, *args, _gather=p.all_gather, _p=p, **kwargs):
            gathers.extend(param_list or [_p])
            return _gather(param_list, *args, **kwargs)
        p.all_gather = all_gather
    own, passes = engine.optimizer.unscale_and_clip_grads, []
    def counted(*args):                              # DeepSpeed's own rescaling pass, counted
        passes.append(1)
        return own(*args)
    engine.optimizer.unscale_and_clip_grads = counted
    if clip_mode == "skip":
        assert clip_scale.install(engine.optimizer)
    deferred = overlap_step.install(engine) if extra.get("overlap") else None
    losses, pending, evals, norms = [], [], [], []
    for step in range(3):
        loss = engine(x.bfloat16()).float().pow(2).mean()
        if extra.get("nan_at") == step:              # a NaN gradient (a bad batch, an overflow)
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))   # what the trainer logs
        pending.append(len(deferred.pending) if deferred else 0)
        if extra.get("evaluate"):                    # a forward without gradients between steps
            with torch.no_grad():
                evals.append(engine(x.bfloat16()).float().pow(2).mean().item())
    if deferred is not None:
        deferred.finish()
    # what the step left: persistent parameters gathered (DeepSpeed's _post_step), the rest released
    after = [[p.ds_status.name, p.detach().view(torch.int16).view(-1).tolist()] for p in model.parameters()]
    gathered = len(gathers)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        bits = [p.detach().view(torch.int16).view(-1).tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"losses": losses, "bits": bits, "passes": len(passes), "calls": calls,
                                  "after": after, "gathered": gathered, "copied": copier.copied if copier else 0,
                                  "pending": pending, "evals": evals, "norms": norms,
                                  "deferred": deferred.deferred if deferred else 0,
                                  "lrs": [g["lr"] for g in engine.optimizer.param_groups]}))
''')


def run_zero3(tmp_path, copy_back: str = "deepspeed", clip: str = "own", clipping: float = 1.0,
              **extra) -> dict:
    """copy_back: deepspeed | chunked; clip: own (DeepSpeed's rescaling pass always) | skip
    (engine/clip_scale.py); clipping: DeepSpeed's gradient_clipping. extra: overlap (True:
    engine/overlap_step.py), offload_param (True: parameters on the host), persistence
    (stage3_param_persistence_threshold), schedule (True: a warm-up lr that moves every step),
    evaluate (True: a forward without gradients after each step), freeze (the first N layers
    frozen), nan_at (the step whose loss, and so gradients, are NaN). Besides the losses and
    weights: "calls", the methods of DeepSpeed's step as they ran (its start, the sub-group loop,
    its end: [name, sub-group or None], in order); "after", each parameter's status and local bits
    once the last step is done, before anything gathers (a persistent parameter stays gathered);
    "gathered", the parameters all-gathered by then outside the forward's fetches."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(script), copy_back, clip, str(clipping), json.dumps(extra)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
