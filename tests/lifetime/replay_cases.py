"""Replays on the CPU, with the eager engine's pool model, the cases a GPU fuzzer run logged
(``GOGRAPH_FUZZ_LOG``: one JSON line per case, its ``Case(...)`` and its violations), and says
where the two verdicts differ.

    python tests/lifetime/replay_cases.py fuzz-cases.jsonl [--plain]

A case that failed on CUDA must fail here too (the model reproduces the pool), and one that passed
must pass; each difference is printed with both verdicts. ``--plain`` replays on the plain eager
engine instead (no pool), for comparison. Each case runs with output isolation as its GPU run did
(the log's ``isolate``; a log without it is from before ``CudaEngine(isolate_outputs=...)``, which
did not isolate). Exit status: the number of differing cases (0: agree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")]

import torch  # noqa: E402
from _fuzz_case import run_case  # noqa: E402
from _fuzz_config import Case, Layer, Pipeline  # noqa: E402


def verdicts(path: str, pool_model: bool) -> tuple[int, list[str]]:
    """(cases replayed, differences) for the log at ``path``; each case once (hypothesis reruns
    a failing one while it shrinks)."""
    seen: dict[str, tuple[bool, bool]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            # a log without "isolate" is from before CudaEngine(isolate_outputs=...)
            seen.setdefault(row["case"], (bool(row["violations"]), bool(row.get("isolate", False))))
    diffs = []
    for text, (failed_on_gpu, isolate) in seen.items():
        case = eval(text, {"Case": Case, "Layer": Layer, "Pipeline": Pipeline})  # the log's own repr
        got = run_case(case, torch.device("cpu"), pool_model=pool_model, isolate=isolate)
        if bool(got) != failed_on_gpu:
            diffs.append(f"{text}\n  GPU: {'failed' if failed_on_gpu else 'passed'}; CPU: {got or 'passed'}")
    return len(seen), diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--plain", action="store_true", help="the plain eager engine (no pool model)")
    args = ap.parse_args(argv)
    n, diffs = verdicts(args.log, pool_model=not args.plain)
    for d in diffs:
        print(d)
    print(f"{n} cases replayed on the CPU ({'plain eager' if args.plain else 'pool model'}): {len(diffs)} differ")
    return len(diffs)


if __name__ == "__main__":
    sys.exit(main())
