#!/usr/bin/env bash
# Distillation on one GPU within a wall-clock budget: the target writes its own data for
# DATA_S seconds (several `moaspec data` processes, each its own seed and directory), then
# a MoA drafter and an EAGLE drafter (or the DRAFTERS listed) train in one process on the same
# batches, the target's features computed once for all of them (`moaspec train --arm`), for about
# TRAIN_S seconds. The number of updates comes from a 30-update calibration (timed from its 10th
# update on), so the cosine schedule ends when the budget does.
#
# Usage: scripts/distill_on_gpu.sh OUT [extra `moaspec train` options...]
#   env: MODEL (default smollm2), PROCS (4), DATA_S (300), TRAIN_S (600), MOASPEC (python3 -m moaspec),
#        DRAFTERS ("moa eagle"; also: moa-final, MoA with --memory-final; moa-newest, MoA with
#        --newest-entry; moa-final-newest, MoA with both (the best MoA from scratch on the CPU,
#        docs/experiments/2026-11-24-reading-the-newest-state.md); moa-derot, MoA with --derotate-keys;
#        moa-wide, MoA whose LSA runs at the target's full K/V width as in the paper (--lsa-width full;
#        the default halves it); moa-seg1, segments of 1;
#        moa-cont, the MoA drafter shipped for the default target continued at a lower learning rate;
#        moa-cont-newest, the same with --newest-entry added; moa-cont-derot, with --derotate-keys
#        added (an approximate warm start); eagle-cont, the shipped EAGLE drafter
#        continued like moa-cont, so both baselines get the same extra updates),
#        SHARD_SIZE (512), EXTRA_DATA (data directories written earlier, trained on beside the new ones),
#        DATA_OPTIONS (more `moaspec data` options for every data process, e.g. "--passages DIR
#        --pasted-fraction 0.7 --max-passage-tokens 800": documents pasted for summaries,
#        docs/experiments/2026-11-26-human-passages-for-summaries.md;
#        with --prompts or --passages each process gets --part K/PROCS, so they share the files),
#        DATA_DTYPE (float32), MPS (0; 1 runs the processes under the CUDA Multi-Process Service, so
#        their small kernels share the GPU instead of taking turns: 1.3x on a launch-bound probe on one H100)
# Drafters land in OUT/NAME/drafter for each NAME of DRAFTERS. Training's target runs in fp32, so the
# features are those of the fp32 CPU target the drafters are deployed with; DATA_DTYPE=bfloat16 writes
# the data with a bf16 copy (faster on a GPU; its answers are then a bf16 target's).
# Data shards are atomic, so stopping a `moaspec data` process at its deadline loses only the
# shard it was writing.
set -uo pipefail
OUT=${1:?usage: $0 OUT [train options...]}; shift
MODEL=${MODEL:-smollm2}; PROCS=${PROCS:-4}; DATA_S=${DATA_S:-300}; TRAIN_S=${TRAIN_S:-600}
SHARD_SIZE=${SHARD_SIZE:-512}; DATA_DTYPE=${DATA_DTYPE:-float32}
SHIPPED=$(dirname "$0")/../moaspec/assets/drafters/smollm2-135m-instruct  # -moa, -eagle
CONTINUE="--lr 4e-4 --warmup 30 --no-staircase"  # continuing a shipped drafter
read -r -a DRAFTERS <<< "${DRAFTERS:-moa eagle}"
options() {  # the `moaspec train` options of a drafter name
    case $1 in
        moa) echo --kind moa ;;
        eagle) echo --kind eagle ;;
        moa-final) echo --kind moa --memory-final ;;
        moa-newest) echo --kind moa --newest-entry ;;
        moa-final-newest) echo --kind moa --memory-final --newest-entry ;;
        moa-derot) echo --kind moa --derotate-keys ;;
        moa-wide) echo --kind moa --lsa-width full ;;
        moa-seg1) echo --kind moa --segment-min 1 --segment-max 1 ;;
        moa-cont) echo --kind moa --init-from "$SHIPPED-moa" $CONTINUE ;;
        moa-cont-newest) echo "$(options moa-cont)" --newest-entry ;;
        moa-cont-derot) echo "$(options moa-cont)" --derotate-keys ;;
        eagle-cont) echo --kind eagle --init-from "$SHIPPED-eagle" $CONTINUE ;;
        *) return 1 ;;
    esac
}
for k in "${DRAFTERS[@]}"; do options "$k" > /dev/null || { echo "unknown drafter $k in DRAFTERS" >&2; exit 1; }; done
read -r -a MOASPEC <<< "${MOASPEC:-python3 -m moaspec}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$OUT"
if [ "${MPS:-0}" = 1 ]; then
    command -v nvidia-cuda-mps-control > /dev/null || { echo "MPS=1 but nvidia-cuda-mps-control is not installed" >&2; exit 1; }
    nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "data: $PROCS processes for $DATA_S s"
DATA=()
read -r -a DATA_OPTS <<< "${DATA_OPTIONS:-}"
for s in $(seq 1 "$PROCS"); do
    DATA+=("$OUT/data$s")
    PART=()  # a user's prompt or passage file is shared between the processes, not answered by each
    case " ${DATA_OPTS[*]} " in *" --prompts "*|*" --prompts="*|*" --passages "*|*" --passages="*) PART=(--part "$s/$PROCS");; esac
    ARGS=(data --model "$MODEL" --dtype "$DATA_DTYPE" --output "$OUT/data$s" --seed "$s" --examples 100000000
          --shard-size "$SHARD_SIZE" --batch-size 256 --no-progress "${DATA_OPTS[@]}" "${PART[@]}")
    echo "moaspec ${ARGS[*]}" > "$OUT/data$s.log"
    timeout "$DATA_S" "${MOASPEC[@]}" "${ARGS[@]}" >> "$OUT/data$s.log" 2>&1 &
done
wait
for d in "${DATA[@]}"; do
    [ -f "$d/manifest.json" ] || { echo "$d has no finished shard: raise DATA_S (see $d.log)" >&2; exit 1; }
done

read -r -a EXTRA <<< "${EXTRA_DATA:-}"
COMMON=(--model "$MODEL" --dtype float32 --data "${DATA[@]}" "${EXTRA[@]}" --tokens-per-batch 16384 --lr 8e-4 --warmup 100
        --max-len 1024 --no-feature-cache --no-progress "$@")
ARMS=()
for k in "${DRAFTERS[@]}"; do ARMS+=(--arm "$k=$(options "$k")"); done
log "calibration: 30 updates of the drafters together (${DRAFTERS[*]})"
"${MOASPEC[@]}" train "${COMMON[@]}" "${ARMS[@]}" --output "$OUT/cal" --steps 30 --eval-every 1000 --save-every 1000 \
    > "$OUT/cal.log" 2>&1
# An update's cost is timed between the 10th and the 30th (train_log.csv logs every update's wall_s):
# the whole run's average counts start-up and overestimated it 1.9x on an H100 (2026-11-25).
STEPS=$(python3 -c "
import csv
wall = {int(r['step']): float(r['wall_s']) for r in csv.DictReader(open('$OUT/cal/${DRAFTERS[0]}/train_log.csv'))}
print(max(100, int(0.88 * $TRAIN_S / ((wall[30] - wall[10]) / 20))))") \
    || { echo "calibration failed: see $OUT/cal.log" >&2; exit 1; }
log "training: $STEPS updates each"
"${MOASPEC[@]}" train "${COMMON[@]}" "${ARMS[@]}" --output "$OUT" --steps "$STEPS" --eval-every 250 --save-every 100 \
    > "$OUT/train.log" 2>&1 || { echo "training failed: see $OUT/train.log" >&2; exit 1; }
tail -n "$(( 2 * ${#DRAFTERS[@]} ))" "$OUT/train.log"
log "done: $(printf "$OUT/%s/drafter " "${DRAFTERS[@]}")"
