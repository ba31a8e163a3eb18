#!/usr/bin/env bash
# Trains both shipped n = 50 models (MVMoE/4E and POMO-MTL, with scripts/train_shipped.sh's settings) side by
# side on one accelerator for BUDGET_S seconds, continuing the runs in STATE_DIR when given, and packs the two
# exported runs (scripts/gpu_train.sh) with their logs into OUT_DIR as runs.tar.00, runs.tar.01, ... of at
# most 15 MiB each, for a machine that returns few, small files. Unpack and continue anywhere:
#
#   cat OUT_DIR/runs.tar.* | tar -x -C RUNS            # RUNS/mvmoe_n50/state, RUNS/pomo_mtl_n50/state, logs
#   python -m mvmoe_jax.portable_state import RUNS/mvmoe_n50/state WORKDIR
#
#   bash scripts/gpu_train_shipped.sh BUDGET_S OUT_DIR [STATE_DIR|-] [--config.FIELD=VALUE ...]
#
# STATE_DIR is such an unpacked folder. The two processes share the accelerator (each may take
# XLA_PYTHON_CLIENT_MEM_FRACTION of its memory, default 0.45): at n = 50 and batch 128 one alone leaves it
# partly idle.
set -euo pipefail
cd "$(dirname "$0")/.."
budget=${1:?usage: scripts/gpu_train_shipped.sh BUDGET_S OUT_DIR [STATE_DIR|-] [--config.FIELD=VALUE ...]}
out=${2:?output folder}
state=${3:--}
shift $(( $# < 3 ? $# : 3 ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
runs=$(mktemp -d)
pids=()
for model in mvmoe pomo_mtl; do
  from=-
  if [ "$state" != "-" ]; then from="$state/${model}_n50/state"; fi
  bash scripts/gpu_train.sh "configs/$model.py" "$budget" "$runs/${model}_n50" "$from" \
    --config.problem_size=50 --config.pomo_size=50 --config.epochs=100 --config.validate_every_epochs=5 \
    --config.validation_problems=ALL --config.keep_checkpoints=2 "$@" > "$runs/${model}_n50.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
for model in mvmoe pomo_mtl; do echo "== $model"; tail -n 4 "$runs/${model}_n50.log"; done
mkdir -p "$out"
tar -C "$runs" -cf - . | split -b 15M -d - "$out/runs.tar."
ls -l "$out"
exit "$status"
