#!/usr/bin/env bash
# Trains on an accelerator machine for a fixed wall-clock budget, continuing a carried run when one is
# given, and leaves the run as a few flat files (python -m mvmoe_jax.portable_state) to bring back and
# continue anywhere with the same command.
#
#   bash scripts/gpu_train.sh CONFIG BUDGET_S OUT_DIR [STATE_DIR|-] [--config.FIELD=VALUE ...]
#
# CONFIG: a config file (configs/mvmoe.py). BUDGET_S: whole seconds for training and validation; the run ends
# after the epoch past which another would overrun it. STATE_DIR: an exported run to continue, "-" for a
# new one. OUT_DIR receives state/ (the exported run: meta.json and state_NN.npz files of at most 15 MiB),
# metrics.jsonl and train_log.txt. Training is killed HARD_LIMIT_S seconds after it starts (default BUDGET_S +
# 90), so that the export still runs when an epoch overruns the budget. Validation reads the paper's test
# sets from DATA_DIR when it holds them (default ../shared/data/mvmoe-paper; scripts/copy_validation_sets.py
# copies them into a folder to carry), else fixed generated sets.
# Python packages the machine lacks can travel as wheels in .whl/ (benchmarks/gpu_prepare.sh downloads
# ml_collections), installed first:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=$PWD:/tmp/site bash scripts/gpu_train.sh configs/mvmoe.py 480 $OUT -
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/gpu_train.sh CONFIG BUDGET_S OUT_DIR [STATE_DIR|-] [--config.FIELD=VALUE ...]}
budget=${2:?budget in seconds}
out=${3:?output folder}
state=${4:--}
shift $(( $# < 4 ? $# : 4 ))
work=$(mktemp -d)/run
mkdir -p "$out"
if [ "$state" != "-" ]; then
  python3 -m mvmoe_jax.portable_state import "$state" "$work"
fi
export PYTHONUNBUFFERED=1
# Compiled programs persist on the machine, so a second call on the same machine skips the 80-100 s that
# compiling takes on an H200 (docs/performance.md, "GPU: training the shipped n = 50 models").
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/mvmoe_jax_compilation_cache}
status=0
timeout -k 10 "${HARD_LIMIT_S:-$((budget + 90))}" \
  python3 train.py --config="$config" --config.workdir="$work" --config.time_limit_seconds="$budget" \
  --config.data_dir="${DATA_DIR:-../shared/data/mvmoe-paper}" --config.progress_bar=False "$@" \
  2>&1 | tee "$out/train_log.txt" || status=$?
cp "$work/metrics.jsonl" "$out/" 2>/dev/null || true
python3 -m mvmoe_jax.portable_state export "$work" "$out/state"
exit "$status"
