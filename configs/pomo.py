"""Single-task POMO: the dense model trained on one variant (CVRP by default)."""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="pomo")
    c.train_problems = "CVRP"
    return c
