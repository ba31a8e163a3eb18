"""Fields shared by every config: the run (training) and evaluation settings.

Each model config (mvmoe.py, mvmoe_light.py, pomo_mtl.py, pomo.py, demo.py) calls ``base_config`` and
sets ``config.model``; every field is overridable on the command line as ``--config.field=value``.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.problems import TRAIN_VARIANTS


def model_config(**overrides) -> ml_collections.ConfigDict:
    """The policy architecture as a ConfigDict (fields of mvmoe_jax.nn.policy.PolicyConfig)."""
    fields = PolicyConfig(**overrides).to_dict()
    fields["expert_loc"] = ",".join(fields["expert_loc"])
    fields["capacity_factor"] = 0.0 if fields["capacity_factor"] is None else fields["capacity_factor"]
    return ml_collections.ConfigDict(fields)


def execution_config(preset: str = "auto") -> ml_collections.ConfigDict:
    """The execution plan's preset and one unset (None) override per ExecutionPlan field, typed so that
    ``--config.execution.FIELD=VALUE`` parses."""
    c = ml_collections.ConfigDict()
    c.preset = preset
    defaults = ExecutionPlan()
    for field in dataclasses.fields(ExecutionPlan):
        c[field.name] = config_dict.placeholder(type(getattr(defaults, field.name)))
    return c


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 1234
    c.workdir = "workdir"
    # Problem and POMO
    c.problem_size = 50
    c.pomo_size = 50
    c.train_problems = ",".join(TRAIN_VARIANTS)
    c.mixed_batches = False           # True: every batch mixes variants; False: one variant per batch
    # The backhaul rules of the training instances (docs/environment.md, "Backhaul rules"): comma-separated names
    # of paper, classic, mixed; each instance draws one uniformly. The paper's data and recipe: paper alone.
    c.train_backhaul_rules = "paper"
    # Training (paper: 5000 epochs x 20000 instances, batch 128, Adam 1e-4, wd 1e-6, lr x0.1 last 10%)
    c.epochs = 5000
    c.train_episodes = 20000
    c.batch_size = 128
    c.learning_rate = 1e-4
    c.weight_decay = 1e-6
    c.lr_decay_epoch_fraction = 0.9
    c.lr_decay_factor = 0.1           # torch MultiStepLR gamma, from epoch int(fraction * epochs) + 2 (1-based)
    # alpha: weight of the MoE load-balancing loss (cv^2 of importance + cv^2 of load, summed over the MoE
    # layers and decoding steps). 1e-3 is what the authors' code applies (its MoE layers' loss_coef), so what
    # produced the paper's numbers; its trainer's comment says 1e-2. Both learn alike at n = 20
    # (docs/results.md, "Training fidelity").
    c.aux_loss_coef = 0.001
    # The recipe beyond the paper's (each off by default; docs/results.md, "Training recipe per CPU-hour").
    c.grad_clip_norm = 0.0            # clip the gradient's global norm to this (0: none; RouteFinder: 1.0)
    c.lr_schedule = "step"            # "step": the decay above; "warmup_cosine": warm-up, then a cosine
    c.warmup_fraction = 0.0           # warmup_cosine: linear warm-up over this fraction of the run's steps
    c.final_lr_fraction = 0.01        # warmup_cosine: the rate at the last epoch, as a fraction of learning_rate
    c.train_pomo_size = 0             # POMO starts sampled per training instance (0: pomo_size)
    c.leader_advantage = 1.0          # each instance's best start's advantage x this (1: plain POMO)
    c.reward_normalization_alpha = 0.0  # rewards / a running mean cost per variant, this its rate (0: none)
    c.size_curriculum = ""            # "SIZE:LAST_EPOCH,...": smaller instances first, problem_size after
    # "50,100,200": optimiser step s trains on the (s mod 3)-th size, its batch scaled by (problem_size / n)^2
    # (at least 1 instance), reward normalisation kept per size; validation stays at problem_size. "": one size.
    c.train_sizes = ""
    # End the run after this epoch (its checkpoint written), as if stopped there; the same command with a
    # larger value continues it. 0: run every epoch. The schedule still follows `epochs`.
    c.stop_after_epoch = 0
    # A wall-clock budget for this invocation: the run ends (checkpoint written) after the epoch past which
    # another would overrun it. 0: none. Validation time counts.
    c.time_limit_seconds = 0.0
    c.checkpoint_every_epochs = 1
    c.keep_checkpoints = 3            # orbax max_to_keep in <workdir>/checkpoints
    c.validate_every_epochs = 10      # also after epoch 1 and the last; 0: never
    c.validation_instances = 1000
    c.validation_problems = ""        # "": the train problems
    c.validation_aug = False          # x8 augmentation in validation (slower)
    c.validation_batch_size = 250
    c.validation_seed = 2024          # generated validation sets (sizes without a paper test set)
    c.data_dir = "../shared/data/mvmoe-paper"
    # Fine-tuning: start from this policy (orbax checkpoint dir, training workdir or original .pt) with a
    # fresh optimiser (the paper's few-shot setting: one target variant, train_episodes=10000).
    c.finetune_from = ""
    # Execution: how the computations run, never what they compute (mvmoe_jax/execution.py). preset: auto (cpu
    # or gpu, by the platform), reference, cpu or gpu; any field of ExecutionPlan overrides the preset, e.g.
    # --config.execution.backward=replay, --config.execution.cpu_devices=1 (cores as devices: 0 one per core,
    # reduced to the largest count that splits every batch; accelerators are not affected).
    c.execution = execution_config()
    # The replay (execution.backward=replay) runs over a length rounded up to a multiple of replay_bucket
    # decoding steps (0: auto, ceil(n/4); each length compiles once).
    c.replay_bucket = 0
    # float32 matmuls on GPUs (mvmoe_jax/precision.py): training allows TF32 (docs/performance.md, "Matmul
    # precision on a GPU"); evaluation runs in full float32 (the original implementation's numbers).
    # float32 | tensorfloat32 | bfloat16 | default (JAX's). No effect on a CPU.
    c.matmul_precision = "tensorfloat32"
    # Several processes (jax.distributed; README, "Several processes"): distributed=True joins a run whose
    # coordinator_address (process 0's host:port), num_processes and process_id are given together, or
    # left unset to be detected (SLURM, Open MPI, cloud TPU). A process silent for heartbeat_timeout_seconds
    # counts as dead and the others stop.
    c.distributed = False
    c.coordinator_address = ""
    c.num_processes = config_dict.placeholder(int)
    c.process_id = config_dict.placeholder(int)
    c.heartbeat_timeout_seconds = 100
    c.progress_bar = True
    # Evaluation
    c.eval_batch_size = 64
    c.eval_aug = 8
    c.eval_matmul_precision = "float32"
    c.model = model_config()
    return c
