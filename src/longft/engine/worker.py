"""One training rank, started by the deepspeed launcher (or torchrun) from `stages/train.py`.

    deepspeed --num_gpus 1 --no_local_rank --module longft.engine.worker --params params.yaml \
        --plan artifacts/plan.json --ds-config artifacts/ds_config.json \
        --data data/prepared --run runs/train --checkpoints checkpoints
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from longft.config.params import load
from longft.config.plan import Plan
from longft.engine import harmless_warnings
from longft.engine.checkpoint import disk_full_message
from longft.engine.opbuild import diagnose, watch_build_locks
from longft.engine.stop import Stopped, StopRequest
from longft.engine.trainer import train
from longft.errors import UserError


def _port_taken(e: BaseException) -> bool:
    """torch's rendezvous store could not listen on MASTER_PORT: another process holds it."""
    from torch.distributed import DistNetworkError

    return isinstance(e, DistNetworkError) and "EADDRINUSE" in str(e)


def main(argv: list[str] | None = None) -> int:
    # SIGINT/SIGTERM: finish the step, checkpoint, exit 130/143 (stop.py); a second one force-quits.
    with StopRequest() as stopper:
        return _main(argv, stopper)


def _main(argv: list[str] | None, stopper: StopRequest) -> int:
    ap = argparse.ArgumentParser(prog="longft.engine.worker")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--plan", default="artifacts/plan.json")
    ap.add_argument("--ds-config", default="artifacts/ds_config.json")
    ap.add_argument("--data", default="data/prepared")
    ap.add_argument("--run", default="runs/train")
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--export", default=None)
    a = ap.parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    harmless_warnings.quiet()   # third-party lines that say nothing to a user (their reasons there)
    try:
        cfg = load(a.params)
        plan = Plan.read(a.plan)
        ds = json.loads(Path(a.ds_config).read_text())
        watch_build_locks()  # a lock a killed build left: removed, not waited on forever
        train(cfg, plan, ds, data_dir=Path(a.data), run_dir=Path(a.run),
              ckpt_dir=Path(a.checkpoints) if a.checkpoints else None,
              export_dir=Path(a.export) if a.export else None, stopper=stopper)
    except Stopped as e:
        return e.exit_code  # 130 (SIGINT) / 143 (SIGTERM); rank 0 said where the checkpoint is
    except UserError as e:  # params, data, model, hardware: the message says what to change
        print(f"longft train: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        if _port_taken(e):  # the stage says what to do (launch.launch_ranks); a traceback would bury it
            print(f"longft train: rank {os.environ.get('RANK', '?')} could not listen on master "
                  f"port {os.environ.get('MASTER_PORT', '?')}: address already in use (EADDRINUSE)",
                  file=sys.stderr, flush=True)
            return 2
        failure = diagnose(e)  # a DeepSpeed op that could not be compiled or loaded?
        if failure is not None:
            print(f"longft train: {failure.message()}", file=sys.stderr, flush=True)
            return 2
        full = disk_full_message(e, [a.checkpoints, a.export, a.run])  # final checkpoint, export
        if full is None:
            raise
        print(f"longft train: {full}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
