"""Fields shared by every config: the run (training) and evaluation settings.

Each model config (mvmoe.py, mvmoe_light.py, pomo_mtl.py, pomo.py, demo.py) calls ``base_config`` and
sets ``config.model``; every field is overridable on the command line as ``--config.field=value``.
"""

import ml_collections

from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.problems import TRAIN_VARIANTS


def model_config(**overrides) -> ml_collections.ConfigDict:
    """The policy architecture as a ConfigDict (fields of mvmoe_jax.nn.policy.PolicyConfig)."""
    fields = PolicyConfig(**overrides).to_dict()
    fields["expert_loc"] = ",".join(fields["expert_loc"])
    fields["capacity_factor"] = 0.0 if fields["capacity_factor"] is None else fields["capacity_factor"]
    return ml_collections.ConfigDict(fields)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 1234
    c.workdir = "workdir"
    # Problem and POMO
    c.problem_size = 50
    c.pomo_size = 50
    c.train_problems = ",".join(TRAIN_VARIANTS)
    c.mixed_batches = False           # True: every batch mixes variants; False: one variant per batch
    # Training (paper: 5000 epochs x 20000 instances, batch 128, Adam 1e-4, wd 1e-6, lr x0.1 last 10%)
    c.epochs = 5000
    c.train_episodes = 20000
    c.batch_size = 128
    c.learning_rate = 1e-4
    c.weight_decay = 1e-6
    c.lr_decay_epoch_fraction = 0.9
    c.aux_loss_coef = 0.01
    c.checkpoint_every_epochs = 1
    c.validate_every_epochs = 10
    c.validation_instances = 1000
    c.data_dir = "../shared/data/mvmoe-paper"
    # Evaluation
    c.eval_batch_size = 64
    c.eval_aug = 8
    c.model = model_config()
    return c
