#!/usr/bin/env bash
# Runs on a GPU machine (CPython 3.12, torch 2.11, pytest; no Go needed), in a copy of this repo
# whose python/gograph/_core_cpu and _core_cuda were built by `make gpu-bundle` (on the GPU machine
# itself, or on a build machine and copied over with the tree).
# Usage: bash scripts/gpu-run.sh [verify] [tests|alltests] [demo] [summary] [bench] [profile] [pipeline] [companion]
#                                [hostmem] [capture] [footprint] [recv] [floor] [default] [steptime] [plan] [shared] [megatron] [multirank]
#        (default: tests demo; summary: the measurements of docs/BENCHMARKS.md's summary; verify:
#        every GPU check and benchmark in one run of at most nine minutes, scripts/gpu_verify.py)
# Logs and JSON results go to $OUT when set (default /tmp/gograph-gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gograph-gpu-out}"; mkdir -p "$out"
what=("$@"); [ ${#what[@]} -gt 0 ] || what=(tests demo)
python3 - <<'PY' 2>&1 | tee "$out/env.log"
import torch, gograph
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("gograph", gograph.__version__, "flavor", gograph.core_flavor(), "cuda_available", gograph.cuda_available(), gograph.cuda_unavailable_reason())
PY
rc=0
for w in "${what[@]}"; do
  case "$w" in
    verify) timeout 570 python3 scripts/gpu_verify.py --out "$out/verify" 2>&1 | tee "$out/verify.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    tests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rs -m cuda tests 2>&1 | tee "$out/pytest-cuda.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    alltests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rs tests 2>&1 | tee "$out/pytest-all.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    demo) python3 examples/demo.py 2>&1 | tee "$out/demo.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    bench) timeout 200 python3 bench/run.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    profile) timeout 120 python3 bench/profile_replay.py 2>&1 | tee "$out/profile.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    companion) timeout 150 python3 bench/companion_rss.py --cycles 200 2>&1 | tee "$out/companion.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    hostmem) timeout 200 python3 bench/host_memory.py --cycles 200 2>&1 | tee "$out/host_memory.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    capture) timeout 300 python3 bench/capture_time.py --rounds 21 --json "$out/capture.json" 2>&1 | tee "$out/capture.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    pipeline) timeout 200 python3 bench/pipeline.py --json "$out/pipeline.json" 2>&1 | tee "$out/pipeline.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    plan) timeout 300 python3 bench/plan_accuracy.py --jobs 5 --json "$out/plan.json" 2>&1 | tee "$out/plan.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    footprint) timeout 500 python3 bench/footprint.py --jobs 4 --arms eager,eager:copies=1,torch,gograph,gograph:chain_buffers=true,gograph:chain_buffers=true+shared_samples=true \
                 --json "$out/footprint.json" 2>&1 | tee "$out/footprint.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    recv) timeout 400 python3 bench/footprint.py --jobs 3 --workloads pipeline \
                 --arms eager:recv=1,eager:recv=1+copies=1,gograph:recv=1,gograph:_reuse_graph_input_output_buffers=true+recv=1,gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true+recv_into_static=1 \
                 --json "$out/footprint-recv.json" 2>&1 | tee "$out/footprint-recv.log"; rc=$(( rc | PIPESTATUS[0] ))
          timeout 400 python3 bench/footprint.py --jobs 4 --workloads chain,blocks \
                 --arms eager,eager:recv=1,gograph:chain_buffers=true+shared_samples=all+recv_into_static=1,gograph:chain_buffers=true+shared_samples=all+loss_in_graph=1+recv_into_static=1 \
                 --json "$out/footprint-recv-chain.json" 2>&1 | tee "$out/footprint-recv-chain.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    floor) timeout 280 python3 bench/footprint.py --jobs 6 --workloads chain,blocks \
                 --arms eager,eager:copies=1,eager:pools=1,eager:copies=1+pools=1,gograph:chain_buffers=true+shared_samples=all+recv_into_static=1 \
                 --json "$out/footprint-floor.json" 2>&1 | tee "$out/footprint-floor.log"; rc=$(( rc | PIPESTATUS[0] ))
           timeout 250 python3 bench/footprint.py --jobs 4 --workloads pipeline \
                 --arms eager,eager:copies=1,eager:copies=1+pools=1,gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true \
                 --json "$out/footprint-floor-pipeline.json" 2>&1 | tee "$out/footprint-floor-pipeline.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    default) timeout 300 python3 bench/footprint.py --jobs 4 --workloads chain,blocks --arms eager,torch,gograph \
                 --json "$out/footprint-default.json" 2>&1 | tee "$out/footprint-default.log"; rc=$(( rc | PIPESTATUS[0] ))
             timeout 250 python3 bench/footprint.py --jobs 4 --workloads pipeline \
                 --arms eager,gograph,gograph:_reuse_graph_input_output_buffers=true \
                 --json "$out/footprint-default-pipeline.json" 2>&1 | tee "$out/footprint-default-pipeline.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    steptime) for m in none zero; do timeout 120 python3 bench/steptime.py --workload stack --mode $m \
                 --arms torch,gograph,gograph:chain_buffers=true --json "$out/steptime-stack-$m.json"; done 2>&1 \
                 | tee "$out/steptime.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    summary) timeout 500 python3 bench/footprint.py --jobs 8 --workloads chain,blocks \
                 --arms eager,torch,gograph,gograph:lend_param_grads=true,gograph:chain_buffers=true+shared_samples=all+recv_into_static=1,gograph:chain_buffers=true+shared_samples=all+recv_into_static=1+loss_in_graph=1 \
                 --json "$out/summary-memory.json" 2>&1 | tee "$out/summary-memory.log"; rc=$(( rc | PIPESTATUS[0] ))
             timeout 400 python3 bench/footprint.py --jobs 4 --workloads pipeline \
                 --arms eager,eager:recv=1,gograph,gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true,gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true+recv_into_static=1 \
                 --json "$out/summary-memory-pipeline.json" 2>&1 | tee "$out/summary-memory-pipeline.log"; rc=$(( rc | PIPESTATUS[0] ))
             for m in none zero; do timeout 150 python3 bench/steptime.py --workload stack --mode $m --rounds 15 \
                 --arms torch,gograph,gograph:chain_buffers=true --json "$out/summary-steptime-stack-$m.json"; done 2>&1 \
                 | tee "$out/summary-steptime.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    shared) timeout 120 python3 bench/shared_samples.py --json "$out/shared_samples.json" 2>&1 | tee "$out/shared_samples.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    multirank) timeout 500 python3 bench/multirank.py --json "$out/multirank.json" 2>&1 | tee "$out/multirank.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    megatron) timeout 500 python3 bench/megatron.py --json "$out/megatron.json" 2>&1 | tee "$out/megatron.log"; rc=$(( rc | PIPESTATUS[0] )) ;;
    *) echo "unknown step $w (verify, tests, alltests, demo, summary, bench, profile, pipeline, companion, hostmem, capture, footprint, recv, floor, default, steptime, plan, shared, megatron, multirank)"; rc=2 ;;
  esac
done
echo "gpu-run exit status $rc"
exit $rc
