#!/usr/bin/env bash
# The checks that need a GPU, for one short lease of a GPU machine: most valuable first, each
# bounded by its own timeout, every result written under $OUT as it comes.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh        (from the repository's root)
#
# Python packages the machine lacks can travel as wheels in .whl/ (installed into /tmp/site).
# The tiny-preset CPU blocks at the end run with CUDA hidden: two ranks on one GPU is not a
# layout NCCL accepts (benchmarks/nccl_ranks_per_gpu.py records why).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
BUDGET=${BUDGET:-520}  # seconds for all of it; a step that would start past it is skipped
ONLY=${ONLY:-}  # names of the steps to run (all when empty), e.g. ONLY="gpu_snapshot pytest_gpu"
step() {  # step NAME TIMEOUT CMD...: run CMD under TIMEOUT (cut to what the budget has left)
    local name=$1 limit=$2
    shift 2
    [[ -z $ONLY || " $ONLY " == *" $name "* ]] || return 0
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        echo "== $name: skipped (budget spent at ${SECONDS}s)" | tee -a "$OUT/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s, at ${SECONDS}s)"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -n 40 "$OUT/$name.log"
}

{
    nvidia-smi -L
    nproc
    free -g | head -2
    df -h /dev/shm /tmp | cat
    $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0), torch.cuda.nccl.version())'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

step gpu_snapshot 150 $PY benchmarks/gpu_snapshot.py --device cuda --preset small \
    --train-steps 120 --json "$OUT/gpu_snapshot.json"
step pytest_gpu 150 $PY -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider --tb=native
step nccl_two_ranks 60 $PY benchmarks/nccl_ranks_per_gpu.py --ranks 2 --timeout 45 \
    --json "$OUT/nccl_two_ranks.json"
step throughput_small 120 $PY benchmarks/trainer_throughput.py --preset small --device cuda \
    --layouts 1x1x1 --peak-tflops 989 --steps 30 --json "$OUT/throughput_small.json"
step tiny_blocks_cpu 200 env CUDA_VISIBLE_DEVICES= $PY benchmarks/memory_tier.py --skip-bench \
    --trainer-blocks 2 --block-commit-every 1,0 --block-two-nodes --block-floors \
    --json "$OUT/tiny_blocks_cpu.json"
echo "done in ${SECONDS}s"
