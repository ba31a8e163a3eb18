#!/usr/bin/env bash
# Trains a shipped n = 50 model on, from its shipped weights, with the recipe of its config file (the default
# recipe, chosen by benchmarks/recipe_study.py), at low priority. Resumable at any moment: the same command
# continues from the workdir's last checkpoint; the shipped weights stay as they are (scripts/ship_model.py
# ships a better state).
#
#   scripts/train_on.sh RUNS_DIR [MODEL] [--config.FIELD=VALUE ...]
#
# MODEL: mvmoe_4e_n50 (default; configs/mvmoe.py), pomo_mtl_n50 (configs/pomo_mtl.py) or mvmoe_4e_sizes (the
# n = 50 weights learning their distance bias over n = 50, 100 and 200: configs/mvmoe_sizes.py, 8 epochs); CONFIG=FILE
# names another recipe (configs/mvmoe_paper.py: the paper's). The workdir is RUNS_DIR/MODEL. Every epoch of 20,000
# instances is validated on the paper's n = 50 sets of all 16 variants (DATA_DIR, default
# ../shared/data/mvmoe-paper; greedy, no augmentation) and checkpointed (the last two kept). EPOCHS (default
# 100; 8 for mvmoe_4e_sizes) places the end of the learning-rate schedule. CPU_CORE=K pins the run to core K
# with one XLA thread.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/train_on.sh RUNS_DIR [mvmoe_4e_n50|pomo_mtl_n50|mvmoe_4e_sizes] [--config.FIELD=VALUE ...]"
runs=${1:?$usage}
shift
model=mvmoe_4e_n50
if [ $# -gt 0 ] && [[ $1 != --* ]]; then model=$1; shift; fi
source=$model epochs=${EPOCHS:-100}
case $model in
  mvmoe_4e_n50) config=${CONFIG:-configs/mvmoe.py} ;;
  pomo_mtl_n50) config=${CONFIG:-configs/pomo_mtl.py} ;;
  mvmoe_4e_sizes) config=${CONFIG:-configs/mvmoe_sizes.py} source=mvmoe_4e_n50 epochs=${EPOCHS:-8} ;;
  *) echo "MODEL must be mvmoe_4e_n50, pomo_mtl_n50 or mvmoe_4e_sizes, got '$model'; $usage" >&2; exit 2 ;;
esac
pin=()
if [ -n "${CPU_CORE:-}" ]; then
  pin=(taskset -c "$CPU_CORE")
  export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
  set -- --config.execution.cpu_devices=1 "$@"
fi
exec "${pin[@]}" nice -n "${NICE:-19}" python train.py --config="$config" --config.workdir="$runs/$model" \
  --config.finetune_from="$source" --config.problem_size=50 --config.pomo_size=50 --config.train_episodes=20000 \
  --config.epochs="$epochs" --config.validate_every_epochs=1 --config.validation_problems=ALL \
  --config.data_dir="${DATA_DIR:-../shared/data/mvmoe-paper}" --config.keep_checkpoints=2 \
  --config.progress_bar=False "$@"
