"""``python -m spmd_ort.debug.compare A B [--rtol R]``: where two runs' activation statistics first diverge.

Prints ``first divergence: step S, <module FQN or name>, <statistic>: a vs b`` (in step
order, then run A's execution order) and exits 1, or ``no divergence (N steps, M
activations)`` and exits 0.  A statistic diverges when it differs by more than
``rtol`` times the activation's magnitude (max |min|, |max|; the norm by its own
size); NaN/inf counts must be equal.  The default separates fp32 rounding from a
real change (e.g. exact vs tanh GELU).
"""

from __future__ import annotations

import argparse
import sys

from .summary import DEFAULT_RTOL, count, first_divergence, load_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd_ort.debug.compare", description=__doc__.splitlines()[0])
    ap.add_argument("a", help="statistics directory of the first run (e.g. eager)")
    ap.add_argument("b", help="statistics directory of the second run (e.g. compiled)")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
    args = ap.parse_args(argv)
    try:
        a, b = load_run(args.a), load_run(args.b)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    found = first_divergence(a, b, args.rtol)
    if found is not None:
        print(found)
        return 1
    steps, acts = count(a)
    print(f"no divergence ({steps} steps, {acts} activations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
