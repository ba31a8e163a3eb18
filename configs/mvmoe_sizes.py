"""MVMoE/4E that learns its distance bias, trained over n = 50, 100 and 200 from the shipped n = 50 weights.

The decoder adds ``-alpha * log2(n) * d(current, j)`` to its logits with alpha a parameter (``learned_distance_bias``;
nn/locality.py) that starts at 1, the value chosen for the shipped weights at inference (docs/results.md,
"Distance-aware decoding"), so training starts from the n = 50 model with its size default. Optimiser steps cycle
through the sizes, each batch scaled by (50 / n)^2 (256, 64 and 16 instances: about the same work per step), with
reward normalisation kept per size and variant. The rate is the paper's 1e-4 (the default recipe's 1e-3 moved the
shipped weights away from their optimum when training went on at n = 50), decayed by a cosine to a tenth.

    python train.py --config=configs/mvmoe_sizes.py --config.epochs=8
    scripts/train_on.sh RUNS_DIR mvmoe_4e_n50 with CONFIG=configs/mvmoe_sizes.py (at low priority, resumable)
"""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="mvmoe", distance_bias=1.0, learned_distance_bias=True)
    c.finetune_from = "mvmoe_4e_n50"
    c.train_sizes = "50,100,200"
    c.batch_size = 256
    c.mixed_batches = True
    c.learning_rate = 1e-4
    c.lr_schedule = "warmup_cosine"
    c.warmup_fraction = 0.0
    c.final_lr_fraction = 0.1
    c.reward_normalization_alpha = 0.25
    c.grad_clip_norm = 1.0
    c.epochs = 8
    return c
