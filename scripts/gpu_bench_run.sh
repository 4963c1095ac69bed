#!/usr/bin/env bash
# Issue 53's device call, one call of about 5 minutes (4 without the tests: TESTS=0) that needs no GGUF: the CUDA tests of the runtime and of the
# staged step (tests/test_gpu_runtime.py, tests/test_staged_ops.py: graph replays bit for bit, no implicit
# synchronization in a step), the Qwen3-8B-shaped target with CUDA graphs under three oracles (scripts/gpu_e2e.py:
# end-to-end and decode-only tok/s, tau, per-stage ms, waits and implicit syncs per step, the pass-cost table), and
# the published DDTree code beside this engine on the same weights and oracle draws (scripts/gpu_reference.py).
#
# Here, before the call: a snapshot of liranringel/ddtree in .ref/ddtree (`git clone
# https://github.com/liranringel/ddtree .ref/ddtree`, or an archive of a fetched mirror; .ref/ is ignored).
# The device call: carry .ref, timeout 600, command `bash scripts/gpu_bench_run.sh`. Everything comes back in $OUT:
# one log per part, gpu_e2e_qwen3-8b.json, gpu_reference.json.
# SMOKE=1 runs the same parts on this CPU on tiny settings (the Triton interpreter, no graphs).
set -uo pipefail
OUT=${OUT:-runs/gpu-bench}
mkdir -p "$OUT"
PY=python3; command -v python3 >/dev/null || PY=python
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} DDTREE_CACHE=${DDTREE_CACHE:-/tmp/ddtree-cache}

part() {  # part NAME SECONDS COMMAND...: its log in $OUT/NAME.txt, its tail here; a failed part does not stop the rest
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.txt"
    echo "== $name: exit $rc"
}

[ -f .ref/ddtree/ddtree.py ] || echo "no .ref/ddtree: the reference comparison will stop at once (see the header)"
if [ "${SMOKE:-}" = 1 ]; then
    part tests 900 $PY -m pytest -q tests/test_staged_ops.py tests/test_gpu_runtime.py -p no:cacheprovider
    part e2e-qwen3-8b 900 $PY scripts/gpu_e2e.py qwen3-8b --modes graphs --budgets 8 --prompts 1 \
        --oracles qwen3-8b-dflash
    part reference 900 $PY scripts/gpu_reference.py
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/device.txt" 2>&1
    cat "$OUT/device.txt"
    [ "${TESTS:-1}" = 0 ] || part tests 120 $PY -m pytest -q tests/test_staged_ops.py tests/test_gpu_runtime.py \
        -p no:cacheprovider
    part e2e-qwen3-8b 300 $PY scripts/gpu_e2e.py qwen3-8b --modes graphs --context 2048 --prompts 4 \
        --max-new-tokens 256 --budgets 8 16 32 64 128 --oracles qwen3-8b-dflash embedded optimistic
    part reference 150 $PY scripts/gpu_reference.py --budgets 32 64 128 --prompts 2 --context 2048
fi
ls -la "$OUT"
