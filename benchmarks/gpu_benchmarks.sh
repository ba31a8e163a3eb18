#!/usr/bin/env bash
# The GPU measurements in one command, for any CUDA host.
#
#   bash benchmarks/gpu_benchmarks.sh OUT_DIR
#
# Runs, in order of importance, each step under its own time limit and all within DEADLINE_S seconds
# (a step that no longer fits is skipped, and says so):
#   1. ours: greedy x8 inference of B instances of n = N (default 1,000 CVRP instances of n = 100), MVMoE/4E,
#      in full float32 (evaluation's default), then in TF32 (--matmul_precision=tensorfloat32)
#   2. ours: training MVMoE/4E at n = N, batches TRAIN_BATCHES (full optimiser steps; training's defaults:
#      stepwise backward, TF32)
#   3. the authors' PyTorch code on the same GPU: the same inference (decoding under inference_mode: with
#      autograd on, as their Tester decodes, 1,000 instances of n = 100 ran out of an H200's 141 GB), and
#      training at the first batch
#   4. the per-instance parity tests against the original implementation's greedy results, on this GPU
#   5. POMO-MTL and MVMoE/4E-L, bfloat16, the MoE dispatch strategies, the replay backward, n = 50 batch 64
#      and one instance of n = 100
# ONLY=name,name,... runs just those steps (names as in the log, e.g. ONLY=infer_mvmoe_light,latency_n100).
# Each step's JSON and log go to OUT_DIR/results.tgz (refreshed after every step), a summary to OUT_DIR/log.txt.
# Needs: python3 with jax[cuda], flax, optax, orbax-checkpoint, chex, ml_collections, torch (for step 3); the
# authors' checkout in AUTHORS (default .gpu/Routing-MVMoE) and the reference fixtures in
# ../shared/fixtures/torch-reference (or FIXTURES, copied there) for trained weights: benchmarks/gpu_prepare.sh
# prepares both folders and the wheels.
set -u
OUT_DIR=${1:-/tmp/gpu_benchmarks}
N=${N:-100}
B=${B:-1000}
TRAIN_BATCHES=${TRAIN_BATCHES:-128,512,2048}
AUTHORS=${AUTHORS:-.gpu/Routing-MVMoE}
FIXTURES=${FIXTURES:-.gpu/torch-reference}
DEADLINE_S=${DEADLINE_S:-540}
ONLY=${ONLY:-}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
RES=$(mktemp -d)
LOG="$OUT_DIR/log.txt"
: > "$LOG"

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, time left), its output in RES/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  local left=$((DEADLINE_S - SECONDS))
  if [ "$left" -lt 25 ]; then say "=== $name: skipped (${left} s left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "=== $name (limit ${limit} s, at ${SECONDS} s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  say "--- $name: rc=$rc in $((SECONDS - t0)) s"
  grep -E "^\| (infer|train) |inst/s|instances_per_second|passed|failed|Error|error:" "$RES/$name.log" \
    | grep -v "^\s*$" | tail -n 12 | tee -a "$LOG"
  [ "$rc" -ne 0 ] && tail -n 25 "$RES/$name.log" | tee -a "$LOG"
  tar czf "$OUT_DIR/results.tgz" -C "$RES" .
}

if [ -d "$FIXTURES" ] && [ ! -d ../shared/fixtures/torch-reference ]; then
  mkdir -p ../shared/fixtures && cp -r "$FIXTURES" ../shared/fixtures/torch-reference
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
$PY -c "import jax, flax, optax, chex, orbax.checkpoint as o, ml_collections, numpy; \
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, \
'numpy', numpy.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tee -a "$LOG"

T="$PY benchmarks/throughput.py"
A="$PY benchmarks/authors_peer.py --code=$AUTHORS --device cuda --model mvmoe"
FIRST_BATCH="${TRAIN_BATCHES%%,*}"
step infer_mvmoe 150 $T --model=mvmoe --size=$N --batch=$B --mode=infer --output=$RES/infer_mvmoe.json
step infer_mvmoe_tf32 100 $T --model=mvmoe --size=$N --batch=$B --mode=infer --matmul_precision=tensorfloat32 \
  --output=$RES/infer_mvmoe_tf32.json
step train_mvmoe 200 $T --model=mvmoe --size=$N --batches=$TRAIN_BATCHES --mode=train --output=$RES/train_mvmoe.json
step authors_infer 90 $A --size $N --batch $B --mode infer --repeats 2 --no-grad-rollout \
  --output $RES/authors_infer.json
step authors_train 90 $A --size $N --batch "$FIRST_BATCH" --mode train --steps 3 --output $RES/authors_train.json
step parity 150 $PY -m pytest -p no:cacheprovider -n 0 -q tests/test_inference_parity.py -k per_instance
step infer_pomo_mtl 100 $T --model=pomo_mtl --size=$N --batch=$B --mode=infer --output=$RES/infer_pomo_mtl.json
step infer_mvmoe_light 100 $T --model=mvmoe_light --size=$N --batch=$B --mode=infer \
  --output=$RES/infer_mvmoe_light.json
step infer_mvmoe_bf16 100 $T --model=mvmoe --size=$N --batch=$B --mode=infer --compute_dtype=bfloat16 \
  --output=$RES/infer_mvmoe_bf16.json
for d in grouped sparse einsum; do
  step infer_mvmoe_$d 100 $T --model=mvmoe --size=$N --batch=$B --mode=infer --execution_overrides=moe_dispatch=$d \
    --output=$RES/infer_mvmoe_$d.json
done
step train_mvmoe_replay 150 $T --model=mvmoe --size=$N --batch="$FIRST_BATCH" --mode=train --execution_overrides=backward=replay \
  --output=$RES/train_mvmoe_replay.json
step infer_n50_b64 100 $T --model=mvmoe --size=50 --batch=64 --mode=infer --output=$RES/infer_n50_b64.json
step latency_n100 100 $T --model=mvmoe --size=100 --batch=1 --mode=infer --output=$RES/latency_n100.json
say "=== done at ${SECONDS} s"
