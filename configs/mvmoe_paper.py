"""MVMoE/4E under the paper's training recipe: one variant per batch of 128, Adam 1e-4 with L2 weight decay 1e-6,
the rate x0.1 for the last 10 % of epochs, no clipping and no reward normalisation (configs/mvmoe.py holds the
default recipe; docs/results.md, "Training recipe per CPU-hour")."""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="mvmoe")
    return c
