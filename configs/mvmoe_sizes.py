"""MVMoE/4E that learns its distance bias, trained over n = 50, 100 and 200 from the shipped n = 50 weights.

The decoder adds ``-alpha * log2(n) * d(current, j)`` to its logits with alpha a parameter (``learned_distance_bias``;
nn/locality.py) that starts at 1, the value chosen for the shipped weights at inference (docs/results.md,
"Distance-aware decoding"), so training starts from the n = 50 model with its size default. Optimiser steps cycle
through the sizes, each batch scaled by (50 / n)^2 (256, 64 and 16 instances: about the same work per step), with
reward normalisation kept per size and variant; otherwise the default recipe (configs/mvmoe.py) at the paper's
rate of 1e-4, a tenth of the default's, decayed by a cosine to a tenth of it over 8 epochs. Measured against the
n = 50 model at equal CPU-hours in docs/results.md, "Learning the bias over sizes".

    python train.py --config=configs/mvmoe_sizes.py --config.workdir=runs/sizes
    scripts/train_on.sh RUNS_DIR mvmoe_4e_sizes        (at low priority; the same command resumes)
"""

from configs import mvmoe


def get_config():
    c = mvmoe.get_config()            # the default recipe: batches of 256 mixing the variants, rewards normalised,
    c.model.distance_bias = 1.0       # gradients clipped at 1, warm-up and cosine
    c.model.learned_distance_bias = True
    c.finetune_from = "mvmoe_4e_n50"
    c.train_sizes = "50,100,200"
    c.learning_rate = 1e-4
    c.warmup_fraction = 0.0
    c.final_lr_fraction = 0.1
    c.epochs = 8
    return c
