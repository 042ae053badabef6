"""Every GPU check and benchmark of the project in one run that fits ten minutes on one H100.

Parts, each under its own time limit (a slow part is stopped and reported; the others still run),
in this order: side by side, the cuda test suite, PyTorch's own make_graphed_callables tests (their
log shows the stream of every call), the CUDA lifetime fuzzer and the pipeline rank
at 32 and 64 microbatches (correctness, and memory figures that torch counts per process, so
sharing the GPU changes none of them; their schedule times are not comparisons), then one at a
time the pipeline rank at 8 and 16 microbatches in every buffer mode, Megatron-Core, data-parallel
ranks sharing the GPU, capture time, and the launch-bound step time. Each part writes its log (and
JSON where the bench has one) under the output folder; one summary JSON (``verify.json``) and one
line per part close the run.

  python scripts/gpu_verify.py                      # on a GPU machine, after `make gpu-bundle`
  python scripts/gpu_verify.py --only pipeline,megatron --out /tmp/v
  python scripts/gpu_verify.py --cpu-smoke          # the same parts at toy sizes on the CPU

The fuzzer's seed is fresh (the clock) unless ``GOGRAPH_FUZZ_SEED`` is set; every case it ran is
logged with its verdict (``fuzz-cases.jsonl``), so the same cases can be replayed on the CPU
(``python tests/lifetime/replay_cases.py fuzz-cases.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_verify")


@dataclass
class Part:
    """One part: its command (GPU and CPU smoke), its time limit, what to read from its output."""

    name: str
    gpu: list[str] | None
    cpu: list[str] | None
    limit_s: int
    figures: Callable[[str, Path], dict[str, Any]] = lambda out, folder: {}
    env: dict[str, str] = field(default_factory=dict)
    group: int = 0  # parts of one group > 0 run side by side


def _pytest_counts(out: str, folder: Path) -> dict[str, Any]:
    """The counts of pytest's last summary line (``3 passed, 1 failed, 2 skipped in 4.5s``)."""
    lines = [ln for ln in out.splitlines() if re.search(r"\b(passed|failed|error|skipped|deselected)\b", ln)]
    found: dict[str, Any] = {}
    if lines:
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", lines[-1]):
            found[what] = int(n)
    return found


def _json_file(name: str) -> Callable[[str, Path], dict[str, Any]]:
    def read(out: str, folder: Path) -> dict[str, Any]:
        path = folder / name
        if not path.exists():
            return {}
        return {"json": name}

    return read


def _fuzz_figures(out: str, folder: Path) -> dict[str, Any]:
    found = _pytest_counts(out, folder)
    cases = folder / "fuzz-cases.jsonl"
    if cases.exists():
        verdicts = [json.loads(line) for line in cases.read_text().splitlines() if line.strip()]
        found["cases"] = len(verdicts)
        found["failing_cases"] = sum(1 for v in verdicts if v["violations"])
    m = re.search(r"feature counts: (.*)", out)
    if m:
        found["features"] = m.group(1).strip()
    return found


def parts(out: Path, seed: int, cases: int) -> list[Part]:
    """The parts, in the order they run, with their time limits (seconds on an H100)."""
    py = sys.executable
    fuzz_env = {"GOGRAPH_FUZZ_SEED": str(seed), "GOGRAPH_FUZZ_LOG": str(out / "fuzz-cases.jsonl")}
    suite = [py, "-m", "pytest", "-q", "-rs", "-m", "cuda"]
    fuzz = [py, "-m", "pytest", "-q", "tests/lifetime/test_lifetime_fuzz.py", "-k"]
    pipe = [py, "bench/pipeline.py"]
    small = ["--microbatches", "8,16", "--modes", "no-reuse,reuse,reuse+chain,share,share+reuse"]
    large32 = ["--microbatches", "32", "--modes", "reuse,reuse+chain,share,share+reuse"]
    # without buffer reuse every pass keeps its own buffers: at 64 microbatches that row only
    # repeats the growth shown at 8 to 32, so 64 runs the modes that are meant to stay flat
    large64 = ["--microbatches", "64", "--modes", "reuse,reuse+chain,share+reuse"]
    # gloo moves every gradient through host memory: a model of 4 blocks keeps a round short
    ranks_model = ["--modes", "none", "--layers", "4", "--hidden", "2048", "--rows", "512"]
    ranks_model += ["--steps", "8", "--rounds", "3"]
    toy = ["--layers", "2", "--width", "16", "--hidden", "32", "--rows", "8", "--steps", "2", "--rounds", "2"]
    stack = [
        "--workload",
        "stack",
        "--mode",
        "none",
        "--rounds",
        "9",
        "--arms",
        "torch,gograph,gograph:chain_buffers=true",
    ]
    return [
        Part(
            "suite",
            [*suite, "tests", "-n", "6", "-k", "not fuzz_cuda", "--ignore", "tests/upstream"],
            [*suite, "tests/cuda/test_cuda.py"],
            180,
            _pytest_counts,
            group=1,
        ),
        Part(  # PyTorch's own tests, their log kept: the stream each call was made on
            "upstream",
            [*suite, "tests/upstream", "-s"],
            None,
            150,
            _pytest_counts,
            group=1,
        ),
        Part(
            "fuzzer",
            [*fuzz, "fuzz_cuda_engine"],
            [*fuzz, "fuzz_eager_engine"],
            150,
            _fuzz_figures,
            env={**fuzz_env, "GOGRAPH_FUZZ_CASES": str(cases)},
            group=1,
        ),
        Part(
            "pipeline32",
            [*pipe, "--iters", "2", *large32, "--json", str(out / "pipeline32.json")],
            None,
            180,
            _json_file("pipeline32.json"),
            group=1,
        ),
        Part(
            "pipeline64",
            [*pipe, "--iters", "2", *large64, "--json", str(out / "pipeline64.json")],
            None,
            180,
            _json_file("pipeline64.json"),
            group=1,
        ),
        Part(
            "pipeline",
            [*pipe, "--iters", "3", *small, "--json", str(out / "pipeline.json")],
            [*pipe, "--cpu-smoke", "--microbatches", "4,8", "--modes", small[-1], "--json", str(out / "pipeline.json")],
            85,
            _json_file("pipeline.json"),
        ),
        Part(
            "megatron",
            [py, "bench/megatron.py", "--rounds", "2", "--json", str(out / "megatron.json")],
            [py, "bench/megatron.py", "--cpu-smoke", "--json", str(out / "megatron.json")],
            160,  # three arms, each trained in a process of its own, then timed side by side
            _json_file("megatron.json"),
        ),
        Part(
            "multirank",
            [py, "bench/multirank.py", "--ranks", "2", *ranks_model, "--json", str(out / "multirank.json")],
            [py, "bench/multirank.py", "--cpu", "--ranks", "2", *toy, "--json", str(out / "multirank.json")],
            70,
            _json_file("multirank.json"),
        ),
        Part(
            "capture",
            [py, "bench/capture_time.py", "--rounds", "7", "--json", str(out / "capture.json")],
            None,
            30,
            _json_file("capture.json"),
        ),
        Part(
            "steptime",
            [py, "bench/steptime.py", *stack, "--json", str(out / "steptime.json")],
            None,
            15,
            _json_file("steptime.json"),
        ),
    ]


def run_part(part: Part, out: Path, cpu: bool) -> dict[str, Any]:
    """Runs one part under its limit; returns its status, time, exit code and figures."""
    cmd = part.cpu if cpu else part.gpu
    if cmd is None:
        return {"status": "skipped", "seconds": 0.0, "why": "needs a GPU"}
    limit = part.limit_s * (3 if cpu else 1)  # the limits are an H100's; a CPU smoke run is slower
    env = {**os.environ, **part.env, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    logf = out / f"{part.name}.log"
    with open(logf, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            status = "timeout"
    text = logf.read_text(encoding="utf-8", errors="replace")
    result: dict[str, Any] = {"status": status, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    result.update(part.figures(text, out))
    result["tail"] = text.splitlines()[-6:]
    return result


def run(selected: Sequence[Part], out: Path, cpu: bool) -> dict[str, dict[str, Any]]:
    """Runs the parts: each group's side by side, the rest one at a time, in order."""
    results: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(selected):
        group = selected[i].group
        batch = [selected[i]]
        while group and i + len(batch) < len(selected) and selected[i + len(batch)].group == group:
            batch.append(selected[i + len(batch)])
        with ThreadPoolExecutor(max_workers=len(batch)) as ex:
            for part, res in zip(batch, ex.map(lambda p: run_part(p, out, cpu), batch)):
                results[part.name] = res
                print(line(part.name, res), flush=True)
        i += len(batch)
    return results


def line(name: str, res: dict[str, Any]) -> str:
    figures = {k: v for k, v in res.items() if k not in ("status", "rc", "seconds", "tail", "why")}
    extra = " ".join(f"{k}={v}" for k, v in figures.items())
    why = f" ({res['why']})" if "why" in res else ""
    return f"verify {name}: {res['status']}{why} in {res['seconds']} s {extra}".rstrip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gograph-verify"))
    ap.add_argument("--only", default="", help="comma-separated part names")
    ap.add_argument("--cpu-smoke", action="store_true", help="the parts' CPU variants at toy sizes")
    ap.add_argument("--cases", type=int, default=600, help="CUDA fuzzer cases (the CPU smoke runs 5)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seed = int(os.environ.get("GOGRAPH_FUZZ_SEED", str(int(time.time()))))
    selected = parts(out, seed, 5 if args.cpu_smoke else args.cases)
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {p.name for p in selected}
        if unknown:
            ap.error(f"unknown parts {sorted(unknown)}; parts: {', '.join(p.name for p in selected)}")
        selected = [p for p in selected if p.name in names]
    t0 = time.perf_counter()
    results = run(selected, out, args.cpu_smoke)
    seconds = round(time.perf_counter() - t0, 1)
    summary = {"seed": seed, "cpu_smoke": args.cpu_smoke, "seconds": seconds, "parts": results}
    (out / "verify.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    bad = [n for n, r in results.items() if r["status"] not in ("ok", "skipped")]
    print(f"verify: {len(results) - len(bad)} of {len(results)} parts ok in {summary['seconds']} s; fuzzer seed {seed}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
