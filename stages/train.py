"""DVC stage `train`: launch the ranks through the deepspeed launcher (or torchrun) and watch the
host memory of the whole process tree.

    python stages/train.py [--params params.yaml] [--plan artifacts/plan.json] \
        [--ds-config artifacts/ds_config.json] [--data data/prepared] [--run runs/train] \
        [--checkpoints checkpoints] [--export export] [--metrics metrics]

Writes runs/train/rank{r}.jsonl (per-step measurements), runs/train/memory.csv and
runs/train/monitor.json (host/GPU memory timeline and peaks; with offload_optimizer nvme also
the swap directory's peak bytes and the disk's free space), checkpoints/ when
output.save_checkpoint is true, and export/ (a Hugging Face checkpoint) when output.export is true.
Checkpoints of another configuration are moved to checkpoints/other/<fingerprint>/ (with their
runs/train), never overwritten; a run that ends before its first step leaves runs/train and
checkpoints/ as they were (src/longft/run/earlier.py).

Ctrl-C / SIGTERM: the ranks finish the current step, write checkpoints/step-<N> and exit; the stage
exits 130 (SIGINT) or 143 (SIGTERM). After a stopped or failed run, --metrics DIR gets the metrics
stage's outputs marked incomplete (DVC does not run the metrics stage after a failed stage).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from longft.config.params import ConfigError, load
from longft.config.plan import Plan
from longft.engine.ds_config import nvme_swap_root
from longft.engine.trajectory import fingerprint, trajectory
from longft.errors import UserError
from longft.run.coverage import coverage_note
from longft.run.earlier import Earlier
from longft.run.launch import command, environment, launch_ranks, master_port
from longft.run.preflight import gpu_memory, host_memory, writable


def partial_metrics(run_dir: Path, plan_path: Path, out: Path) -> None:
    """The metrics stage's outputs, marked incomplete, from what the ranks of a stopped or failed
    run wrote."""
    from longft.metrics.summary import load_plan, write_run_metrics

    if not any(run_dir.glob("rank*.jsonl")):
        return
    try:
        train = write_run_metrics(run_dir, load_plan(plan_path)[0], out)
    except Exception as e:  # noqa: BLE001 - the run's own exit status matters more
        print(f"train: note: no partial metrics ({type(e).__name__}: {e})", file=sys.stderr)
        return
    print(f"train: partial metrics in {out}/: status {train['status']} ({train['end_status']}), "
          f"{train['steps']} steps", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--plan", default="artifacts/plan.json")
    ap.add_argument("--ds-config", default="artifacts/ds_config.json")
    ap.add_argument("--data", default="data/prepared")
    ap.add_argument("--run", default="runs/train")
    ap.add_argument("--checkpoints", default="checkpoints")
    ap.add_argument("--export", default="export")
    ap.add_argument("--metrics", default=None,
                    help="after a stopped or failed run: partial metrics (status incomplete) here")
    a = ap.parse_args()
    try:
        cfg = load(a.params)
        plan = Plan.read(a.plan)
        meta = json.loads((Path(a.data) / "meta.json").read_text())
        if meta["max_seq_length"] != cfg.data.max_seq_length:
            raise ConfigError([f"data.max_seq_length is {cfg.data.max_seq_length} but {a.data} was "
                               f"prepared at {meta['max_seq_length']}; run `dvc repro` (prepare)"])
        note = coverage_note(cfg, meta)  # a step count that leaves most of the user's rows out
        if note:
            print(note, flush=True)
        device = plan.resolved.device.value
        worker = ["--params", a.params, "--plan", a.plan, "--ds-config", a.ds_config,
                  "--data", a.data, "--run", a.run]
        if cfg.output.save_checkpoint or cfg.output.checkpoint_every:
            worker += ["--checkpoints", a.checkpoints]
        if cfg.output.export:
            worker += ["--export", a.export]
        port, why = master_port(cfg)  # a pinned port that is taken: LaunchError, exit 2
        print(f"train: master port {port} ({why})")
        cmd = command(cfg, device, worker, port)
        swap = nvme_swap_root(json.loads(Path(a.ds_config).read_text()))  # offload_optimizer nvme
        # Before any rank starts and before anything is deleted: can the outputs be written, does
        # the host RAM suffice?
        # (checkpoints only when this run writes them; export/ is replaced or emptied either way)
        outs = {"run directory": Path(a.run), "export directory": Path(a.export)}
        if "--checkpoints" in worker:
            outs["checkpoint directory"] = Path(a.checkpoints)
        writable(outs, beside=("export directory",))
        for note in (host_memory(cfg, plan), gpu_memory(cfg, plan, device)):
            if note:
                print(f"train: {note}")
    except FileNotFoundError as e:
        print(f"longft train: {e.filename} is missing; run `dvc repro` (prepare and patch first)",
              file=sys.stderr)
        return 2
    except UserError as e:
        print(f"longft train: {e}", file=sys.stderr)
        return 2
    run_dir = Path(a.run)
    # other configurations' checkpoints kept, this one's resumed, the last run's measurements set
    # aside until this run completes (run/earlier.py)
    earlier = Earlier(Path(a.checkpoints) if "--checkpoints" in worker else None, run_dir,
                      fingerprint(cfg, Path(a.data)))
    earlier.arrange(trajectory(cfg, Path(a.data)), cfg.output.resume)
    print("\n".join(earlier.lines), flush=True)
    Path(a.checkpoints).mkdir(parents=True, exist_ok=True)
    Path(a.export).mkdir(parents=True, exist_ok=True)
    print("train:", " ".join(cmd), flush=True)
    env = environment(device, expandable_segments=cfg.hardware.expandable_segments)
    code = launch_ranks(cmd, env, run_dir, port if device == "cpu" else None,
                        auto_port=cfg.hardware.master_port == "auto",  # taken meanwhile: a fresh one
                        swap_root=Path(swap) if swap else None)
    if code == 0 and not cfg.output.export:
        # export/ persists across runs (dvc.yaml) so a refused or failed run keeps the last model;
        # a finished run without an export must not leave an older run's model there as its own
        shutil.rmtree(a.export, ignore_errors=True)
        Path(a.export).mkdir(parents=True, exist_ok=True)
    note = earlier.finish(code)
    if note:
        print(note, flush=True)
    if code and a.metrics and not earlier.undone:
        partial_metrics(run_dir, Path(a.plan), Path(a.metrics))
    return code


if __name__ == "__main__":
    sys.exit(main())
