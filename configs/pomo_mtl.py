"""POMO-MTL: the dense multi-task baseline (same encoder-decoder, no experts)."""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="pomo_mtl")
    return c
