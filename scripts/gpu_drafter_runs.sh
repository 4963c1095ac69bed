#!/usr/bin/env bash
# Issue 36's drafter runs in ONE call on a lent GPU (ddtree/train/RECIPE.md, "Equal-compute comparisons" and "The
# drafter and its head trained together"): side by side, from the shipped drafter WITH its Markov head (every run the
# same data, steps, seed and anchors; the loss CE + total variation):
#   ft-cetv   the head carried as it is (frozen)    ft-joint    the head trained with the drafter (--markov-weight 1)
#   ft-jlr    ft-joint, the head at lr 1e-3         ft-tv       total variation alone, the head carried
# and, beside them, a Markov head for the shipped drafter fitted on ITS OWN tables over as many training answers as
# the time allows (rank 64; the shipped head was fitted on the drafter before it). Then every result is rounded as
# shipped (`train quantize`), probed with its head on the same held-out answers, packed without the frozen LM heads
# and the tensors equal to the shipped drafter's (scripts/drafter_pack.py) and written to $OUT as xz parts.
#
# On the device: the embedded GGUF arrives in xz parts under .gguf/ (one per call; the earlier calls only copy
# theirs to /root/g) and the gguf wheel under .whl/. Here: SMOKE=1 runs the whole thing on a CPU on tiny settings.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
SMOKE=${SMOKE:-0}
OUT=${OUT:-/tmp/gpu36-out}
R=runs/gpu36
rm -rf "$R" && mkdir -p "$R/logs" "$OUT"
left() { local s=$((DEADLINE - $(date +%s) + T0 - $1)); echo $((s > 1 ? s : 1)); }  # to the deadline minus $1 (>= 1)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/logs/driver.txt"; }

if [ "$SMOKE" = 1 ]; then
    DEV=cpu; G=${GGUF:-}; TH=1; BF16=""
    FT_LIMIT="--max-steps 2 --seqs-per-step 2 --anchors 8"; TABLE_SECONDS=150; TABLE_MAX="--max-sequences 3"
    FIT_EPOCHS=0.02; PROBE_MAX=2; HELD_MAX=2; DEADLINE=100000
else
    DEV=cuda; G=/root/g/SmolLM2-135M-Instruct.Q4_1.gguf; TH=2; BF16="--bf16"
    FT_LIMIT="--seqs-per-step 16 --anchors 64 --max-minutes ${FT_MINUTES:-5}"; TABLE_SECONDS=${TABLE_SECONDS:-230}
    TABLE_MAX=""; FIT_EPOCHS=3; PROBE_MAX=40; HELD_MAX=30; DEADLINE=${DEADLINE:-540}  # seconds: all packed by then
    mkdir -p /root/g && cp .gguf/p* /root/g/ 2>/dev/null
    cat /root/g/p0 /root/g/p1 /root/g/p2 | xz -dc > "$G" || exit 1
    echo "${GGUF_SHA256:?}  $G" | sha256sum -c || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE=/root/ddtree-cache
    # seven processes share the GPU: the table processes' passes vary in size, and without expandable segments
    # their caching allocators keep the peaks, which leaves the fine-tunes short of memory (RECIPE.md)
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$R/logs/driver.txt"
fi
PY=python3; command -v python3 >/dev/null || PY=python
TGT=(--target "$G"); [ -z "$G" ] && TGT=()
train() { $PY -m ddtree train "$@"; }
say "setup done; converting the target once (every process then reads the cache)"
$PY -c "import sys; from ddtree.models.loading import resolve_target_dir; print(resolve_target_dir(sys.argv[1] or None))" "$G" \
    >>"$R/logs/driver.txt" 2>&1 || exit 1
SHIPPED=ddtree/assets/smollm2-135m-dflash

# the fine-tunes' data: v4 chunks the shipped drafter's own fine-tune did not read (0-63, 94-103: ~8,200 answers, an
# epoch in about the 5 minutes; its ancestors read them)
mkdir -p $R/ft-v4 && cp data/smollm2-v4/meta.json $R/ft-v4/
for i in $(seq 0 63) $(seq 94 103); do n=$(printf chunk_%05d.npz "$i"); ln -s "$PWD/data/smollm2-v4/$n" $R/ft-v4/$n; done
FT=(--device $DEV "${TGT[@]}" --data $R/ft-v4 --init-from $SHIPPED --distill 0.5
    --lr 1e-4 --epochs 1 --seed 10 --val-sequences 0 --eval-prompts 0 --checkpoint-every 100 --threads $TH
    --no-progress $BF16 $FT_LIMIT)
# every drafter probed on the same held-out greedy answers (fp32, SDPA attention: the CPU's arithmetic, near enough)
PROBE=(--device $DEV "${TGT[@]}" --data data/smollm2-v2 data/smollm2-v3 data/smollm2-v4 data/smollm2-v5
       data/smollm2-v6 --split heldout --max-sequences $PROBE_MAX --budgets 1,2,4,8,16,32 --no-progress --threads $TH)
probe() {  # name, drafter dir, extra probe options
    DDTREE_ATTENTION=sdpa timeout $(left 30) $PY -m ddtree train probe "${PROBE[@]}" --draft "$2" "${@:3}" \
        --json $R/logs/probe-$1.json >"$R/logs/probe-$1.txt" 2>&1
}
RUNS=("cetv:--objective ce+tv" "joint:--objective ce+tv --markov-weight 1"
      "jlr:--objective ce+tv --markov-weight 1 --markov-lr 1e-3" "tv:--objective tv")
for run in "${RUNS[@]}"; do
    name=${run%%:*}
    ( train fit "${FT[@]}" ${run#*:} --out $R/ft-$name >"$R/logs/ft-$name.txt" 2>&1
      train quantize --draft $R/ft-$name/drafter --out $R/ft-$name-q8 >>"$R/logs/ft-$name.txt" 2>&1
      say "ft-$name: $(grep '^fit: [dp]' $R/logs/ft-$name.txt | cut -c1-90)"
      probe ft-$name $R/ft-$name-q8 --markov-head ) &
done
say "${#RUNS[@]} fine-tunes started"
probe shipped $SHIPPED --markov-head &

# the Markov head's tables on the shipped drafter: training answers in three processes, held-out greedy answers
TB=(--device $DEV "${TGT[@]}" --draft $SHIPPED --chunk 50 --no-progress --threads $TH)
tables() { DDTREE_ATTENTION=sdpa timeout $(left $((DEADLINE - TABLE_SECONDS))) $PY -m ddtree train markov-tables \
               "${TB[@]}" "$@"; }
tables --data data/smollm2-v4 $TABLE_MAX --out $R/mk-a >"$R/logs/mk-a.txt" 2>&1 &
tables --data data/smollm2-v3 data/smollm2-v2 $TABLE_MAX --out $R/mk-b >"$R/logs/mk-b.txt" 2>&1 &
( tables --data data/smollm2-v2 data/smollm2-v3 data/smollm2-v4 data/smollm2-v5 data/smollm2-v6 --split heldout \
      --greedy-only --max-sequences $HELD_MAX --out $R/mk-held >"$R/logs/mk-held.txt" 2>&1
  tables --data data/smollm2-v5 data/smollm2-v6 $TABLE_MAX --out $R/mk-c >"$R/logs/mk-c.txt" 2>&1
  say "tables done: $(ls $R/mk-a $R/mk-b $R/mk-c 2>/dev/null | grep -c tables_) chunks of 50 answers"
  for rank in 64; do
      ( timeout $(left 60) $PY -m ddtree train markov-fit --device $DEV "${TGT[@]}" --draft $SHIPPED \
            --tables $R/mk-a $R/mk-b $R/mk-c --heldout $R/mk-held --rank $rank --epochs $FIT_EPOCHS --batch 16384 \
            --weight-decay 1e-4 --out $R/head-r$rank --no-progress --threads $TH >"$R/logs/head-r$rank.txt" 2>&1
        say "head-r$rank fitted: $(grep -m1 NLL $R/logs/head-r$rank.txt)"
        [ -d $R/head-r$rank ] && probe head-r$rank $R/head-r$rank --markov-head ) &
  done
  wait ) &

# until everything is done or the deadline is near; then pack what there is
while [ -n "$(jobs -r)" ] && [ "$(left 25)" -gt 1 ]; do sleep 2; done
[ -n "$(jobs -r)" ] && say "deadline: stopping $(jobs -r | wc -l) jobs" && pkill -f "ddtree train"
sleep 1
say "all done"
mkdir -p $R/pack
for run in "${RUNS[@]}"; do
    name=${run%%:*}
    [ -d $R/ft-$name-q8 ] && $PY scripts/drafter_pack.py pack $R/ft-$name-q8 $R/pack/ft-$name --reference $SHIPPED
    cp $R/ft-$name/log.jsonl $R/logs/ft-$name.log.jsonl 2>/dev/null
done
for rank in 64; do
    [ -d $R/head-r$rank ] && $PY scripts/drafter_pack.py pack $R/head-r$rank $R/pack/head-r$rank --reference $SHIPPED
done
cp -r $R/logs $R/pack/
tar -C $R -cf - pack | xz -T0 -6 > $R/results.tar.xz
split -b 15M -d $R/results.tar.xz "$OUT/results.tar.xz.part"
cp $R/logs/driver.txt "$OUT/driver.txt"
say "packed: $(du -b $R/results.tar.xz | cut -f1) bytes"
for f in $R/logs/probe-*.txt; do echo "== $f"; tail -n 8 "$f"; done
for f in $R/logs/head-r*.txt; do echo "== $f"; grep -A1 "NLL\|top-1 by" "$f"; done
