#!/usr/bin/env bash
# Trains the shipped n = 50 models with the paper's recipe (configs/mvmoe.py and configs/pomo_mtl.py: the six
# training variants, batch 128, Adam 1e-4, 20,000 instances an epoch), MVMoE/4E first, then POMO-MTL to the
# same epoch. Every command resumes from its workdir, so after any interruption the same call continues.
#
#   scripts/train_shipped.sh RUNS_DIR [LAST_EPOCH [--config.FIELD=VALUE ...]]
#
# LAST_EPOCH defaults to 50 (1,000,000 instances each); further arguments go to both train.py calls (for
# example --config.data_dir=PATH when the paper's test sets, used for validation, are not in ../shared).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: scripts/train_shipped.sh RUNS_DIR [LAST_EPOCH]}
last=${2:-50}
shift $(( $# < 2 ? $# : 2 ))
for model in mvmoe pomo_mtl; do
  python train.py --config="configs/$model.py" --config.workdir="$runs/${model}_n50" \
    --config.problem_size=50 --config.pomo_size=50 --config.stop_after_epoch="$last" \
    --config.validate_every_epochs=5 --config.validation_problems=ALL --config.keep_checkpoints=2 \
    --config.progress_bar=False "$@"
done
