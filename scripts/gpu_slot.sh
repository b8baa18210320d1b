#!/usr/bin/env bash
# One fixed slot of GPU time, one command: continue the MoA and EAGLE drafters on the same batches of
# fresh data from the target, and leave their weights and logs in a few files of at most 16 MiB.
#
#   1. checks the GPU (and that torch sees it);
#   2. a throughput probe of at most PROBE_S seconds (benchmarks/train_throughput.py): answer tokens/s,
#      loss tokens/s per drafter, and the seconds an update takes, which size the training;
#   3. data: PROCS `moaspec data` processes for DATA_S seconds, each its own seed and directory;
#      with PROMPTS, they answer those prompt files (balanced by category, shared with --part K/PROCS);
#   4. training: one `moaspec train` process trains both drafters on the same batches, the target's
#      features computed once for both, with as many updates as the time left holds (the cosine schedule
#      ends with the slot) and --time-limit as a backstop;
#   5. results in RESULTS: moa.safetensors and eagle.safetensors (split into .partK-of-N files over 16 MiB;
#      `python -m moaspec.training.carry unpack RESULTS/moa DIR` rebuilds a drafter directory), logs.tar.gz
#      (every log, config and data manifest) and slot.log (this script's own log, written as it goes).
#
# The whole command ends within BUDGET_S seconds. The drafters continued are the shipped ones, or with
# FROM=DIR those an earlier slot brought back in DIR, so that slot after slot they train on.
#
# Usage: scripts/gpu_slot.sh RESULTS
#   env: MODEL (the target: default smollm2), DEVICE (cuda; cpu for a dry run), BUDGET_S (540), PROBE_S (30),
#        DATA_S (180), PROCS (4), DATA_BATCH (256), DATA_DTYPE (float32: the deployed target's answers;
#        bfloat16 is faster), PROMPTS (files or directories for `moaspec data --prompts`; default: the target
#        writes its own prompts), EXCLUDE (a SpecBench-format directory whose questions the data leaves out),
#        DATA_OPTIONS (more `moaspec data` options), EXTRA_DATA (data directories written earlier, trained on
#        beside the new ones), FROM (an earlier slot's RESULTS), TOKENS_PER_BATCH (32768),
#        LR (4e-4), TRAIN_OPTIONS (more `moaspec train` options), PROBE_OPTIONS (more probe options),
#        WORK (a scratch directory: /tmp/moaspec-slot), PYTHON (python3).
set -uo pipefail
RESULTS=${1:?usage: $0 RESULTS}
START=$(date +%s)
MODEL=${MODEL:-smollm2}; DEVICE=${DEVICE:-cuda}; BUDGET_S=${BUDGET_S:-540}; PROBE_S=${PROBE_S:-30}
DATA_S=${DATA_S:-180}; PROCS=${PROCS:-4}; DATA_BATCH=${DATA_BATCH:-256}; DATA_DTYPE=${DATA_DTYPE:-float32}
TOKENS_PER_BATCH=${TOKENS_PER_BATCH:-32768}; LR=${LR:-4e-4}; PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/moaspec-slot}
PACK_S=30  # kept at the end for packing the results
HERE=$(cd "$(dirname "$0")/.." && pwd)
SHIPPED=$HERE/moaspec/assets/drafters/smollm2-135m-instruct  # -moa, -eagle
read -r -a DATA_OPTS <<< "${DATA_OPTIONS:-}"
read -r -a TRAIN_OPTS <<< "${TRAIN_OPTIONS:-}"
read -r -a PROBE_OPTS <<< "${PROBE_OPTIONS:-}"
read -r -a PROMPT_PATHS <<< "${PROMPTS:-}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$RESULTS" "$WORK"
exec > >(tee -a "$RESULTS/slot.log") 2>&1
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( START + BUDGET_S - PACK_S - $(date +%s) )); }  # seconds before packing must begin

pack() {  # step 5, whatever happened before: the drafters as far as they got, and every log
    log "results: $RESULTS"
    for arm in moa eagle; do
        [ -f "$WORK/runs/$arm/drafter/config.json" ] &&
            "$PYTHON" -m moaspec.training.carry pack "$WORK/runs/$arm/drafter" "$RESULTS/$arm"
    done
    (cd "$WORK" && tar -czf "$RESULTS/logs.tar.gz" --exclude='state*' --exclude='*.safetensors' --exclude='features' \
        --exclude='shard-*' --exclude='start' . 2>/dev/null)
    ls -l "$RESULTS"
}
trap pack EXIT

log "1. device ($DEVICE)"
"$PYTHON" - "$DEVICE" <<'EOF' || exit 1
import sys, torch
device = sys.argv[1]
print(f"torch {torch.__version__}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this is a GPU command (DEVICE=cpu for a dry run on the CPU)")
    free, total = torch.cuda.mem_get_info()
    print(f"{torch.cuda.get_device_name()}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
EOF
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv

log "2. probe (at most ${PROBE_S}s)"
timeout "$PROBE_S" "$PYTHON" "$HERE/benchmarks/train_throughput.py" --model "$MODEL" --device "$DEVICE" \
    --tokens-per-batch "$TOKENS_PER_BATCH" --data-batch-size "$DATA_BATCH" --train-seconds $(( PROBE_S / 3 )) \
    "${PROBE_OPTS[@]}" > "$WORK/probe.json"
tail -n 1 "$WORK/probe.json"
S_PER_UPDATE=$("$PYTHON" -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['s_per_update'])" \
    "$WORK/probe.json" 2> /dev/null) || { S_PER_UPDATE=""; log "the probe gave no figure: training stops by its time limit alone"; }

log "3. data: $PROCS processes for ${DATA_S}s"
DATA=(); PIDS=()
for s in $(seq 1 "$PROCS"); do
    DATA+=("$WORK/data$s")
    ARGS=(data --model "$MODEL" --device "$DEVICE" --dtype "$DATA_DTYPE" --output "$WORK/data$s" --seed "$s"
          --examples 100000000 --shard-size "$DATA_BATCH" --batch-size "$DATA_BATCH" --no-progress)
    if [ ${#PROMPT_PATHS[@]} -gt 0 ]; then
        ARGS+=(--prompts "${PROMPT_PATHS[@]}" --pasted-fraction 0 --part "$s/$PROCS")
    fi
    [ -n "${EXCLUDE:-}" ] && ARGS+=(--exclude-questions "$EXCLUDE")
    echo "moaspec ${ARGS[*]} ${DATA_OPTS[*]}" > "$WORK/data$s.log"
    timeout "$DATA_S" "$PYTHON" -m moaspec "${ARGS[@]}" "${DATA_OPTS[@]}" >> "$WORK/data$s.log" 2>&1 &
    PIDS+=($!)
done
wait "${PIDS[@]}"  # not a bare wait: that would wait for the log's tee too
READY=()
for d in "${DATA[@]}"; do
    if [ -f "$d/manifest.json" ]; then READY+=("$d"); else log "$d has no finished shard (see $d.log)"; fi
done
read -r -a EXTRA <<< "${EXTRA_DATA:-}"
READY+=("${EXTRA[@]}")
[ ${#READY[@]} -gt 0 ] || { log "no data was written: nothing to train on"; exit 1; }
"$PYTHON" -c "
import json, sys
n = sum(s['answer_tokens'] for d in sys.argv[1:] for s in json.load(open(d + '/manifest.json'))['shards'])
print(f'{n:,} answer tokens')" "${READY[@]}"

log "4. training MoA and EAGLE together"
mkdir -p "$WORK/start"
for arm in moa eagle; do
    if [ -n "${FROM:-}" ]; then
        "$PYTHON" -m moaspec.training.carry unpack "$FROM/$arm" "$WORK/start/$arm" || exit 1
    else
        cp -r "$SHIPPED-$arm" "$WORK/start/$arm"
    fi
done
TRAIN_S=$(( $(left) - 30 ))  # 30 s for the target to load, the drafters to start and the last save
[ "$TRAIN_S" -gt 0 ] || { log "no time left to train"; exit 1; }
STEPS=$("$PYTHON" -c "import sys; s = sys.argv[1]; print(max(1, int(0.9 * int(sys.argv[2]) / float(s))) if s else 10**6)" \
    "$S_PER_UPDATE" "$TRAIN_S")
log "$STEPS updates each (${S_PER_UPDATE:-?} s each in the probe), at most ${TRAIN_S}s"
CONTINUE="--lr $LR --warmup $(( STEPS < 300 ? STEPS / 10 : 30 )) --no-staircase --steps $STEPS"
timeout $(( $(left) > 1 ? $(left) : 1 )) "$PYTHON" -m moaspec train --model "$MODEL" --device "$DEVICE" --dtype float32 \
    --data "${READY[@]}" --output "$WORK/runs" --tokens-per-batch "$TOKENS_PER_BATCH" --no-feature-cache --no-progress \
    --eval-every 1000000 --save-every 200 --log-every 20 --time-limit "$TRAIN_S" \
    --arm "moa=--kind moa --init-from $WORK/start/moa $CONTINUE" \
    --arm "eagle=--kind eagle --init-from $WORK/start/eagle $CONTINUE" "${TRAIN_OPTS[@]}" \
    > "$WORK/train.log" 2>&1
RC=$?  # 124: stopped by the slot's end, past --time-limit; what was saved last is packed
log "training ended ($RC): $(tail -n 4 "$WORK/train.log" | tr '\n' ' ')"
exit $RC
