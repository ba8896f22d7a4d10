"""train.json's predicted-against-measured parts: the peaks of memory (`memory_prediction`), the
tokens/s of a GPU run (`speed_prediction`) and, with offload_optimizer nvme, the swap files
(`peak_disk`), each from the plan's estimate beside what the run measured."""

from __future__ import annotations

from longft.config.plan import Plan
from longft.estimate.estimator import compare
from longft.estimate.speed import speed_prediction
from longft.metrics.peak_disk import peak_disk


def predictions(plan: Plan | None, gpu_name: str | None, train: dict, mon: dict) -> dict:
    """The keys to add to train.json (`train`: its measured numbers, `mon`: monitor.json); none
    of memory and speed without a plan or one older than the estimator."""
    est = plan.memory_estimate.estimate if plan is not None else None
    out: dict = {}
    if est is not None:
        out["memory_prediction"] = compare(est, train)  # predicted vs measured, relative error
        speed = speed_prediction(est, dict(plan.model_config), gpu_name, train["tokens_per_s"],
                                 train["attention_length"], train["padding_fraction"])
        if speed is not None:  # GPU runs: the speed heuristic at the run's own attention length
            out["speed_prediction"] = speed
    out.update(peak_disk(mon, est))
    return out
