"""MVMoE/4E-L: MVMoE/4E with the hierarchical dense-or-sparse gate in the decoder."""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="mvmoe_light")
    return c
