"""Time one Llama-3.2-1B forward+backward at 16K under each SDPA kernel order (GPU probe).

    PYTHONPATH=src python3 scripts/sdpa_probe.py
"""
import time

import torch

from longft.config.params import ModelConfig
from longft.model import attention
from longft.model.loading import build_model
from longft.model.patches import apply

model = build_model(ModelConfig(name="llama3.2-1b"), "sdpa", torch.bfloat16).cuda()
apply(model, liger=True, checkpointing="gpu")
ids = torch.randint(1, 128000, (1, 16384), device="cuda")
for name in ["default", "cudnn", "flash", "default", "cudnn"]:
    with attention.context(name):
        ts = []
        for i in range(4):
            torch.cuda.synchronize(); t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    print(name, [round(x, 3) for x in ts], flush=True)
