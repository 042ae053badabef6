#!/usr/bin/env bash
# Multi-GPU checks of gograph: tensor-parallel and data-parallel graphed layers with NCCL
# collectives, under torchrun (tests/multigpu/run_multigpu.py says what each test checks).
#
#   bash scripts/multigpu-run.sh               # 2 GPUs, NCCL (one machine with 2 or more GPUs)
#   bash scripts/multigpu-run.sh --cpu-smoke   # 2 CPU processes, gloo, gograph's eager engine
#   bash scripts/multigpu-run.sh --nproc 4 --tests tp_mlp,ddp
#
# Options: --cpu-smoke, --nproc N (default 2), --timeout S (default 480; cpu 240; or
# MULTIGPU_TIMEOUT), anything else goes to run_multigpu.py (--tests, --steps, --timed-steps,
# --destroy-timeout). The GPU machine needs torch and the built extensions in python/gograph
# (_core_cpu, _core_cuda); no Go, no network.
# Prints one PASS/FAIL line per test (step time eager vs graphed, per-rank memory), writes
# multigpu-summary.json and the log into $OUT (or /tmp/gograph-multigpu), exits non-zero on any
# failure or when torchrun does not finish within the timeout.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off (the multi-GPU hosts are shared; see the machine notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Blocking waits synchronize the host, which a capture must not; a fixed cuBLAS workspace keeps
# the matmuls bitwise reproducible across streams (eager vs graphed comparisons).
export TORCH_NCCL_BLOCKING_WAIT="${TORCH_NCCL_BLOCKING_WAIT:-0}" CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"

cpu=0; nproc=2; limit="${MULTIGPU_TIMEOUT:-}"; pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) cpu=1; pass+=("$1") ;;
    --nproc) nproc="$2"; shift ;;
    --nproc=*) nproc="${1#*=}" ;;
    --timeout) limit="$2"; shift ;;
    --timeout=*) limit="${1#*=}" ;;
    *) pass+=("$1") ;;
  esac
  shift
done

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ] && [ "$cpu" = 1 ]; then py=.venv/bin/python; else py=python3; fi
fi
out="${OUT:-/tmp/gograph-multigpu}"; mkdir -p "$out"
rm -f "$out"/teardown-rank*.json "$out/multigpu-summary.json"
if [ "$cpu" = 1 ]; then
  mode=cpu; limit="${limit:-240}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
else
  mode=cuda; limit="${limit:-480}"
  ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "${ngpu:-0}" -lt "$nproc" ]; then
    echo "multigpu-run: $nproc processes need $nproc GPUs, torch sees ${ngpu:-0} (use --cpu-smoke without GPUs)"
    exit 2
  fi
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.log" || true
fi

log="$out/multigpu-$mode.log"
echo "multigpu-run: $mode, $nproc processes, limit ${limit}s, python $py, out $out"
# torchrun == python -m torch.distributed.run (works where the torchrun script is not on PATH)
timeout -k 15 "$limit" "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  tests/multigpu/run_multigpu.py --out-dir "$out" "${pass[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "FAIL multigpu-run: torchrun did not finish within ${limit}s (exit $rc)"
fi
if [ ! -s "$out/multigpu-summary.json" ]; then
  echo "FAIL multigpu-run: no summary was written ($out/multigpu-summary.json)"
  [ "$rc" = 0 ] && rc=1
fi
echo "multigpu-run exit status $rc"
exit "$rc"
