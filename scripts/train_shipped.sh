#!/usr/bin/env bash
# Trains the shipped n = 50 models with the paper's recipe over a budget of EPOCHS epochs (configs/mvmoe_paper.py and
# configs/pomo_mtl.py: the six training variants, batch 128, Adam 1e-4 decayed x0.1 after 90 % of the epochs,
# 20,000 instances an epoch), MVMoE/4E first, then POMO-MTL to the same epoch. Every command resumes from its
# workdir, so after any interruption the same call continues.
#
#   scripts/train_shipped.sh RUNS_DIR [EPOCHS [LAST_EPOCH]] [--config.FIELD=VALUE ...]
#
# EPOCHS defaults to 100 (2,000,000 instances each); LAST_EPOCH (default EPOCHS) stops both runs there, to be
# continued by the same call with a larger value. Further arguments go to both train.py calls (for example
# --config.data_dir=PATH when the paper's test sets, used for validation, are not in ../shared).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/train_shipped.sh RUNS_DIR [EPOCHS [LAST_EPOCH]] [--config.FIELD=VALUE ...]"
runs=${1:?$usage}
shift
epochs=100
if [ $# -gt 0 ] && [[ $1 != --* ]]; then epochs=$1; shift; fi
last=$epochs
if [ $# -gt 0 ] && [[ $1 != --* ]]; then last=$1; shift; fi
for n in "$epochs" "$last"; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "EPOCHS and LAST_EPOCH must be whole numbers, got '$n'; $usage" >&2; exit 2; }
done
for model in mvmoe pomo_mtl; do
  config=configs/$model.py
  [ "$model" = mvmoe ] && config=configs/mvmoe_paper.py      # configs/mvmoe.py holds the default recipe
  python train.py --config="$config" --config.workdir="$runs/${model}_n50" \
    --config.problem_size=50 --config.pomo_size=50 --config.epochs="$epochs" --config.stop_after_epoch="$last" \
    --config.validate_every_epochs=5 --config.validation_problems=ALL --config.keep_checkpoints=2 \
    --config.progress_bar=False "$@"
done
