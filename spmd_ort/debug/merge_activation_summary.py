"""``python -m spmd_ort.debug.merge_activation_summary --pt_dir A --ort_dir B --output_dir C``.

Writes, per step, one file per activation with both runs' statistics side by side
and their absolute difference (ORTModule's command and layout of the result).
"""

from __future__ import annotations

import argparse
import sys

from .summary import merge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd_ort.debug.merge_activation_summary",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--pt_dir", required=True, help="statistics of the baseline (eager) run")
    ap.add_argument("--ort_dir", required=True, help="statistics of the compiled run")
    ap.add_argument("--output_dir", required=True)
    args = ap.parse_args(argv)
    try:
        n = merge(args.pt_dir, args.ort_dir, args.output_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} side-by-side summaries to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
