"""MVMoE/4E: 4 experts, input-choice top-2 node-level gating, MoE in every encoder FFN and the decoder."""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.model = model_config(model="mvmoe")
    return c
