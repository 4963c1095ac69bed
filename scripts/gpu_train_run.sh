#!/usr/bin/env bash
# Issue 51: a lent GPU window spent on training the drafter on the data earlier windows brought back, with the
# comparison that says whether the data paid. Side by side, from the shipped drafter, the same steps, seed, learning
# rate and loss (CE + total variation, distillation 0.5), sized to the window by a calibration:
#   all   every data directory (v2-v7 and the GPU window's smollm2-gpu1: ~18M response tokens)
#   old   the directories the shipped drafter was trained on (v2-v6: 5.26M), the control at equal compute
# Each is rounded as shipped (`train quantize`), packed without the frozen LM head (scripts/drafter_pack.py) and
# returned as xz parts with its log. Probing and the main job run here afterwards, on the same answers for both.
#
#   bash scripts/gpu_data_run.sh prepare       here, once: .gpu/ (the GGUF in parts sized to what a call can carry)
#   device calls 1..n-1: carry [".gpu/p<i>"], command: bash scripts/gpu_train_run.sh stash  (each within the warm
#                        window of the call before)
#   device call n: carry [".gpu/p<n-1>", ".gpu/whl", ".gpu/sums", ".gpu/eval"], timeout_s 600, command:
#                  bash scripts/gpu_train_run.sh      (first the embedded pair's run for issue 53, ~100 s)
#   here: bash scripts/gpu_train_run.sh unpack <files_at>   -> runs/gpu-train/<arm>-q8, then probe them
#
# SMOKE=1 bash scripts/gpu_train_run.sh runs the whole of the last call on this CPU on tiny settings
# (tests/test_gpu_scripts.py runs it with RUN_DIR and OUT in a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
SMOKE=${SMOKE:-0}
OUT=${OUT:-/tmp/gpu-train-out}
R=${RUN_DIR:-runs/gpu-train}  # replaced on every run (the tests point it elsewhere)
source scripts/gpu_common.sh  # G, PY, gpu_stash, gpu_setup
SHIPPED=ddtree/assets/smollm2-135m-dflash
OLD=(data/smollm2-v2 data/smollm2-v3 data/smollm2-v4 data/smollm2-v5 data/smollm2-v6)
NEW=(data/smollm2-v7 data/smollm2-gpu1)
ARMS=(all old)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/logs/driver.txt"; }
left() { echo $(( DEADLINE - $(date +%s) + T0 )); }  # seconds to the deadline

case "${1:-run}" in
stash) gpu_stash; exit ;;
unpack)  # here: the parts that came back -> runs/gpu-train/<arm>-q8 (LM heads rebuilt and checked)
    from=${2:?usage: gpu_train_run.sh unpack <folder with results.tar.xz.part*>}
    rm -rf "$R/pack" && mkdir -p "$R"
    cat "$from"/results.tar.xz.part* | xz -dc | tar -C "$R" -xf - || exit 1
    for arm in "${ARMS[@]}"; do
        [ -d "$R/pack/$arm" ] && $PY scripts/drafter_pack.py unpack "$R/pack/$arm" "$R/$arm-q8" --reference $SHIPPED
    done
    echo "probe each: python -m ddtree train probe --draft $R/<arm>-q8 --data ${OLD[*]} ${NEW[*]} --split heldout" \
         "--max-sequences 40 --eval-sets humaneval,mt-bench,gsm --num-prompts 8 --json runs/probe-<arm>.json"
    echo "then choose by the main job's speed: python scripts/choose_drafter.py $R/all-q8 $R/old-q8"
    exit 0 ;;
run) ;;
*) echo "usage: gpu_train_run.sh [stash|unpack DIR]"; exit 2 ;;
esac

rm -rf "$R" && mkdir -p "$R/logs" "$OUT"
trap 'tar -C "$R" -czf "$OUT/logs.tgz" logs 2>/dev/null' EXIT  # every log comes back, whatever happens (one file)
if [ "$SMOKE" = 1 ]; then
    # the embedded target on this CPU; a few chunks of the data so that the arms differ, tiny steps
    DEV=(--device cpu --threads 1); TGT=(); DEADLINE=${DEADLINE:-400}
    STEP=(--seqs-per-step 2 --anchors 8 --max-seq-len 96); CALIB_STEPS=4; MAX_STEPS=3
    mkdir -p $R/smoke-old $R/smoke-new
    for d in data/smollm2-v4 data/smollm2-gpu1; do
        sub=$R/smoke-old; [ $d = data/smollm2-gpu1 ] && sub=$R/smoke-new
        mkdir -p $sub/${d##*/}; cp $d/meta.json $sub/${d##*/}/
        for i in 0 1; do n=$(printf chunk_%05d.npz $i); ln -s "$PWD/$d/$n" $sub/${d##*/}/$n; done
    done
    OLD=($R/smoke-old/smollm2-v4); NEW=($R/smoke-new/smollm2-gpu1)
else
    DEV=(--device cuda --bf16 --threads 2); TGT=(--target "$G"); DEADLINE=${DEADLINE:-540}
    STEP=(--seqs-per-step 32 --anchors 64); CALIB_STEPS=14; MAX_STEPS=${MAX_STEPS:-100000}
    gpu_setup >>"$R/logs/driver.txt" 2>&1 || { cat "$R/logs/driver.txt"; exit 1; }  # not in a pipe: it exports
    tail -n 1 "$R/logs/driver.txt"
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # two runs share the GPU
fi
# issue 53 first, since only these windows carry the GGUF: the embedded pair with CUDA graphs on 3 prompts of each
# evaluation set (.gpu/eval, exported by `gpu_data_run.sh prepare`); the training below sizes itself to what is left
if [ "$SMOKE" = 1 ]; then
    E2E=(--modes eager --prompts 1 --max-new-tokens 4 --budgets 4 --datasets humaneval)
else
    E2E=(--target "$G" --modes graphs --prompts 3 --budgets 8 16 32 64 128 --datasets .gpu/eval/*.jsonl)
fi
OUT="$OUT" timeout 150 $PY scripts/gpu_e2e.py embedded "${E2E[@]}" >$R/logs/e2e-embedded.txt 2>&1
rc=$?
say "embedded pair (exit $rc): $($PY - "$OUT/gpu_e2e_embedded.json" 2>&1 <<'PY' | tail -n 1
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
best = max((r for r in rows if r["method"] != "ar"), key=lambda r: r["tok_s"])
print(f"best {best['method']}:{best['budget']} {best['speedup_vs_ar']:.2f}x ar end to end, "
      f"{best['decode_speedup_vs_ar']:.2f}x decode; verdicts {sorted({v for r in rows for v in r['verdicts']})}")
PY
)"

data_of() { if [ "$1" = all ]; then echo "${OLD[*]} ${NEW[*]}"; else echo "${OLD[*]}"; fi; }
FIT=(--init-from $SHIPPED "${TGT[@]}" "${DEV[@]}" "${STEP[@]}" --distill 0.5 --objective ce+tv --lr 2e-4
     --warmup 0.04 --seed 11 --val-sequences 0 --eval-prompts 0 --checkpoint-every 0 --no-progress)
say "setup done; converting the target once (every run then reads the cache)"
$PY -c "import sys; from ddtree.models.loading import resolve_target_dir; print(resolve_target_dir(sys.argv[1] or None))" \
    "${TGT[1]:-}" >>"$R/logs/driver.txt" 2>&1 || exit 1

# calibration: both arms side by side for a few steps, as they will share the GPU; the seconds a step takes after
# the first few, and the seconds a run spends outside its steps (loading the data, the target, the drafter)
for arm in "${ARMS[@]}"; do
    ( s=$(date +%s)
      $PY -m ddtree train fit "${FIT[@]}" --data $(data_of $arm) --out $R/calib-$arm --max-steps $CALIB_STEPS \
          >$R/logs/calib-$arm.txt 2>&1
      echo $(( $(date +%s) - s )) > $R/calib-$arm/wall ) &
done
wait
read -r STEP_S OVERHEAD_S <<<"$($PY - "$CALIB_STEPS" $R/calib-* <<'EOF'
import json, sys
steps, per, over = int(sys.argv[1]), [], []
for run in sys.argv[2:]:
    log = [json.loads(l) for l in open(f"{run}/log.jsonl") if '"train"' in l]
    skip = min(3, steps - 1)  # the first steps pay for allocation and kernel choice
    per.append((log[-1]["train_seconds"] - log[skip - 1]["train_seconds"]) / (len(log) - skip))
    over.append(float(open(f"{run}/wall").read()) - log[-1]["train_seconds"])
print(f"{max(per):.4f} {max(over):.1f}")
EOF
)"
[ -n "${STEP_S:-}" ] || { say "calibration failed: $(tail -n 3 $R/logs/calib-*.txt)"; exit 1; }
# what the runs may use: the time left, less their start, less ~60 s for exporting, rounding and packing
STEPS=$(awk -v l="$(left)" -v o="$OVERHEAD_S" -v s="$STEP_S" -v cap="$MAX_STEPS" \
    'BEGIN { n = int((l - o - 60) / s); print (n < 0 ? 0 : (n > cap ? cap : n)) }')
say "calibrated: $STEP_S s a step with both arms running, $OVERHEAD_S s outside the steps; $STEPS steps each"
[ "${STEPS:-0}" -ge 1 ] || { say "no time left to train"; exit 1; }
for arm in "${ARMS[@]}"; do
    ( $PY -m ddtree train fit "${FIT[@]}" --data $(data_of $arm) --out $R/$arm --total-steps "$STEPS" \
          --max-minutes "$(awk -v l="$(left)" 'BEGIN { print (l - 50) / 60 }')" >$R/logs/fit-$arm.txt 2>&1
      say "$arm: $(grep '^fit: ' $R/logs/fit-$arm.txt | tail -n 1 | cut -c1-110)"
      $PY -m ddtree train quantize --draft $R/$arm/drafter --out $R/$arm-q8 >>$R/logs/fit-$arm.txt 2>&1
      cp $R/$arm/log.jsonl $R/logs/$arm.log.jsonl ) &
done
wait
say "trained; packing"
mkdir -p $R/pack
for arm in "${ARMS[@]}"; do
    [ -d $R/$arm-q8 ] && $PY scripts/drafter_pack.py pack $R/$arm-q8 $R/pack/$arm --reference $SHIPPED
done
cp -r $R/logs $R/pack/
tar -C $R -cf - pack | xz -T0 -3 > $R/results.tar.xz
split -b 15M -d $R/results.tar.xz "$OUT/results.tar.xz.part"
say "packed: $(du -b $R/results.tar.xz | cut -f1) bytes in $(ls $OUT/results.tar.xz.part* | wc -l) parts"
for arm in "${ARMS[@]}"; do tail -n 2 $R/logs/fit-$arm.txt; done
