"""A small CPU demo that shows learning within minutes: MVMoE (4 experts, top-2) with a reduced
encoder (3 layers, D = 64) on n = 20, all six training variants, validated after every epoch on a fixed
generated set (there is no paper test set at n = 20).

    python train.py --config=configs/demo.py                 # 1-3 minutes on 2 CPU cores
    python train.py --config=configs/demo.py --config.epochs=20 --config.workdir=workdir_demo_long
"""

from configs.common import base_config, model_config


def get_config():
    c = base_config()
    c.workdir = "workdir_demo"
    c.problem_size = 20
    c.pomo_size = 20
    c.batch_size = 64
    c.epochs = 20
    c.train_episodes = 64 * 10          # 10 steps per epoch
    c.learning_rate = 1e-3              # the paper's 1e-4 is for 5000 epochs, too slow to see in minutes
    c.validate_every_epochs = 1
    c.validation_instances = 100
    c.validation_batch_size = 100
    c.replay_bucket = 40                # = 2n: one replay length, hence one compilation
    c.model = model_config(model="mvmoe", embedding_dim=64, num_heads=8, num_layers=3, ff_hidden_dim=128,
                           expert_loc=("Enc0", "Enc1", "Enc2", "Dec"))
    return c
