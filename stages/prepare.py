"""DVC stage `prepare`: data.* of params.yaml -> data/prepared/ (token ids, labels, position ids,
meta.json, stats.json).

Run from the repository root:
    python stages/prepare.py [--params params.yaml] [--out data/prepared]
Exit status 2 with a one-paragraph message (no traceback) on a config, data or tokenizer problem.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    ap.add_argument("--out", default="data/prepared", help="output directory (default: data/prepared)")
    args = ap.parse_args(argv)

    from longft.config.params import load
    from longft.data.prepare import prepare
    from longft.data.tracked import check_tracked
    from longft.errors import UserError

    start = time.perf_counter()
    try:
        cfg = load(args.params)
        # a local data file / model dir must be a DVC dep (params.yaml track.*): refused under DVC
        for note in check_tracked(cfg):
            print(f"prepare: note (not run by DVC, so not refused): {note}", flush=True)
        stats = prepare(cfg, Path(args.out))
    except UserError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    skipped = sum(stats["skipped"].values())
    print(f"prepare: {stats['rows']} rows x {stats['max_seq_length']} tokens from "
          f"{stats['samples']} samples ({stats['source']}/{stats['format']}, {skipped} skipped, "
          f"{stats['truncated_samples']} truncated), {stats['trainable_tokens']} trainable tokens, "
          f"packing efficiency {stats['packing_efficiency']:.1%} -> {args.out} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
