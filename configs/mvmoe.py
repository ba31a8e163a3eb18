"""MVMoE/4E: 4 experts, input-choice top-2 node-level gating, MoE in every encoder FFN and the decoder.

Trained under the default recipe, chosen by the recipe study (benchmarks/recipe_study.py; docs/results.md,
"Training recipe per CPU-hour"): RouteFinder's (batch 256, every batch mixing the variants, rewards divided by
a running mean cost per variant, the gradient's norm clipped at 1) with a rate of 1e-3 warmed up over the
first tenth of the run and decayed by a cosine to 1 % at its end. configs/mvmoe_paper.py trains under the
paper's recipe.
"""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="mvmoe")
    c.batch_size = 256
    c.mixed_batches = True
    c.learning_rate = 1e-3
    c.lr_schedule = "warmup_cosine"
    c.warmup_fraction = 0.1
    c.final_lr_fraction = 0.01
    c.reward_normalization_alpha = 0.25
    c.grad_clip_norm = 1.0
    return c
