"""The training run: config checks, resume from the workdir's checkpoints, fine-tuning, the epoch loop.

A run is described by one ml_collections config (``configs/*.py``). Its workdir holds::

    <workdir>/checkpoints/<epoch>/{params, config, opt_state, train_meta}   orbax CheckpointManager
    <workdir>/metrics.jsonl                                                one JSON record per epoch
    <workdir>/validation.png                                               validation curves

``checkpoints.restore_policy(workdir)`` / ``load_policy(workdir)`` read the latest parameters. Starting the
same command again resumes from the latest checkpoint and continues exactly as an uninterrupted run:
every optimiser step draws its data and sampling keys from ``fold_in(run key, step)``, and the parameters,
optimiser state (with its step counts, hence the learning-rate schedule), epoch and run key are restored.

A run may span several processes (``config.distributed``; ``mvmoe_jax.distributed``): the mesh then holds
every process's devices, each process generates its devices' rows of every batch and validates its share of
the batches, all save the checkpoints together (orbax coordinates them), and process 0 alone prints and
writes the metrics and plot.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from mvmoe_jax import checkpoints, distributed, execution, precision, problems, shipped, training
from mvmoe_jax.cli import policy_config
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import CAPACITY_BY_SIZE
from mvmoe_jax.nn import moe as moe_lib
from mvmoe_jax.nn.policy import PolicyConfig, distance_bias_of
from mvmoe_jax.training import NonFiniteError, StepFunctions, StepSettings, TrainState
from mvmoe_jax.training_validation import Validator, append_metrics, plot_validation, truncate_metrics

CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "validation.png"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a config means for the loop."""

    policy: PolicyConfig
    variants: tuple[str, ...]
    steps_per_epoch: int
    last_batch: int                     # size of an epoch's last batch (the remainder, as the reference)
    optimizer: training.OptimizerSettings
    # The size curriculum: (problem size, last epoch at that size) in order; the run's problem_size after them.
    curriculum: tuple[tuple[int, int], ...] = ()
    problem_size: int = 50
    normalises_rewards: bool = False
    backhaul_rules: tuple[str, ...] = ("paper",)    # each training instance under one, drawn uniformly
    # Training over several sizes (``train_sizes``): optimiser step s trains on sizes[s % len(sizes)]. () : none.
    sizes: tuple[int, ...] = ()

    def batch_size_of(self, index: int, batch_size: int) -> int:
        return self.last_batch if index == self.steps_per_epoch - 1 else batch_size

    def size_at(self, epoch: int) -> int:
        """The problem size of the instances trained on in ``epoch`` (1-based) under the size curriculum."""
        return next((size for size, last in self.curriculum if epoch <= last), self.problem_size)

    def size_of_step(self, epoch: int, step: int) -> int:
        """The problem size of optimiser step ``step`` (0-based, counted over the run) in ``epoch`` (1-based):
        the size cycle's where the run has one, else the curriculum's."""
        return self.sizes[step % len(self.sizes)] if self.sizes else self.size_at(epoch)

    def instances_at(self, batch_size: int, num_customers: int) -> int:
        """The instances of a batch of ``batch_size`` (counted at the run's problem size) at ``num_customers``:
        in a size cycle scaled by (problem_size / num_customers)^2, at least 1, for about the same work per step
        at every size (ICAM's scaling); else ``batch_size``."""
        if not self.sizes:
            return batch_size
        return max(1, round(batch_size * (self.problem_size / num_customers) ** 2))

    def num_cost_scales(self) -> int:
        """Length of the training state's ``cost_scale``: under reward normalisation one per training variant,
        and per size of a size cycle."""
        return len(self.variants) * max(1, len(self.sizes)) if self.normalises_rewards else 0


def parse_size_curriculum(text: str, problem_size: int) -> tuple[tuple[int, int], ...]:
    """``"SIZE:LAST_EPOCH,..."`` -> ((size, last epoch), ...): train on SIZE up to and including LAST_EPOCH,
    then on the next stage's size, and on ``problem_size`` after the last stage. "": none. A ValueError for
    sizes without a defined capacity, epochs not increasing, or a stage not of the form SIZE:LAST_EPOCH."""
    stages = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        size, sep, last = part.partition(":")
        _require(sep == ":" and size.strip().isdigit() and last.strip().isdigit(),
                 f"size_curriculum: stage {part!r} is not SIZE:LAST_EPOCH (e.g. '20:10,50:30')")
        stages.append((int(size), int(last)))
    for size, last in stages:
        _require(size in CAPACITY_BY_SIZE, f"size_curriculum: size {size} has no defined vehicle capacity "
                 f"(one of {sorted(CAPACITY_BY_SIZE)})")
    lasts = [last for _, last in stages]
    _require(all(a < b for a, b in zip([0] + lasts, lasts)),
             f"size_curriculum: the stages' last epochs must increase from 1, got {lasts}")
    return tuple(stages)


def parse_train_sizes(text: str) -> tuple[int, ...]:
    """``"50,100,200"`` -> (50, 100, 200): the sizes a run cycles through, each with a defined vehicle capacity,
    no size twice. "": none (one size)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    _require(all(p.isdigit() for p in parts), f"train_sizes must be comma-separated sizes (e.g. '50,100,200'), "
             f"got {text!r}")
    sizes = tuple(int(p) for p in parts)
    _require(all(n in CAPACITY_BY_SIZE for n in sizes), f"train_sizes: every size needs a defined vehicle capacity "
             f"(one of {sorted(CAPACITY_BY_SIZE)}), got {list(sizes)}")
    _require(len(set(sizes)) == len(sizes), f"train_sizes: a size given twice in {list(sizes)}")
    return sizes


def train_starts(config: ml_collections.ConfigDict, num_customers: int) -> int:
    """POMO starts sampled per training instance of ``num_customers``: ``train_pomo_size`` (0: ``pomo_size``),
    at most one per customer."""
    return min(int(config.get("train_pomo_size", 0)) or config.pomo_size, num_customers)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_config(config: ml_collections.ConfigDict) -> RunSettings:
    """Validate a run config (clear ValueErrors) and derive the run's settings."""
    n = config.problem_size
    _require(n in CAPACITY_BY_SIZE, f"problem_size must be one of {sorted(CAPACITY_BY_SIZE)} (the sizes "
             f"with a defined vehicle capacity), got {n}")
    _require(1 <= config.pomo_size <= n, f"pomo_size must be between 1 and problem_size ({n}), got "
             f"{config.pomo_size}")
    for name in ("batch_size", "epochs", "train_episodes", "checkpoint_every_epochs",
                 "validation_instances", "validation_batch_size", "keep_checkpoints"):
        _require(int(config[name]) >= 1, f"{name} must be a positive integer, got {config[name]}")
    _require(config.validate_every_epochs >= 0, "validate_every_epochs must be >= 0 (0: never)")
    _require(config.get("stop_after_epoch", 0) >= 0, "stop_after_epoch must be >= 0 (0: run every epoch)")
    _require(config.get("time_limit_seconds", 0) >= 0, "time_limit_seconds must be >= 0 (0: no limit)")
    _require(config.learning_rate > 0, f"learning_rate must be positive, got {config.learning_rate}")
    _require(config.weight_decay >= 0, f"weight_decay must be >= 0, got {config.weight_decay}")
    _require(config.aux_loss_coef >= 0, f"aux_loss_coef must be >= 0, got {config.aux_loss_coef}")
    _require(0 < config.lr_decay_epoch_fraction <= 1,
             f"lr_decay_epoch_fraction must be in (0, 1], got {config.lr_decay_epoch_fraction}")
    _require(config.get("grad_clip_norm", 0.0) >= 0, f"grad_clip_norm must be >= 0 (0: no clipping), got "
             f"{config.get('grad_clip_norm')}")
    _require(config.get("train_pomo_size", 0) >= 0, f"train_pomo_size must be >= 0 (0: pomo_size), got "
             f"{config.get('train_pomo_size')}")
    _require(config.get("leader_advantage", 1.0) > 0, f"leader_advantage must be positive (1: plain POMO), got "
             f"{config.get('leader_advantage')}")
    _require(0 <= config.get("reward_normalization_alpha", 0.0) <= 1, "reward_normalization_alpha must be in "
             f"[0, 1] (0: no reward normalisation), got {config.get('reward_normalization_alpha')}")
    _require(0 <= config.get("warmup_fraction", 0.0) < 1,
             f"warmup_fraction must be in [0, 1), got {config.get('warmup_fraction')}")
    _require(0 <= config.get("final_lr_fraction", 0.0) <= 1,
             f"final_lr_fraction must be in [0, 1], got {config.get('final_lr_fraction')}")
    curriculum = parse_size_curriculum(config.get("size_curriculum", ""), n)
    sizes = parse_train_sizes(config.get("train_sizes", ""))
    _require(not (sizes and curriculum), "give train_sizes (a size cycle) or size_curriculum (sizes in stages), "
             "not both")
    _require(not config.finetune_from or os.path.exists(config.finetune_from)
             or config.finetune_from in shipped.names(),
             f"finetune_from: no checkpoint at {config.finetune_from}, nor a shipped model of that name "
             f"({shipped.describe_available()})")
    variants = tuple(v.name for v in problems.parse_variants(config.train_problems))
    problems.parse_variants(config.validation_problems or config.train_problems)
    rules = tuple(dict.fromkeys(r.strip().lower() for r in str(config.get("train_backhaul_rules", "paper")).split(",")
                                if r.strip()))
    _require(rules and all(r in problems.BACKHAUL_RULES for r in rules),
             f"train_backhaul_rules must name one or more of {', '.join(problems.BACKHAUL_RULES)} (comma-separated), "
             f"got {config.get('train_backhaul_rules')!r}")
    policy = policy_config(config.model)
    _require(policy.model != "pomo" or len(variants) == 1,
             f"model 'pomo' is the single-task baseline: give one variant in train_problems (got "
             f"{','.join(variants)}), or use pomo_mtl / mvmoe / mvmoe_light for multi-task training")
    execution_settings(config)          # a bad preset or field value fails here, before JAX starts
    distributed.launch_from_config(config)
    for name in ("matmul_precision", "eval_matmul_precision"):
        precision.check(config.get(name, "default"), what=name)
    _require(config.replay_bucket >= 0, f"replay_bucket must be >= 0 (0: auto), got {config.replay_bucket}")
    steps = math.ceil(config.train_episodes / config.batch_size)
    last = config.train_episodes - (steps - 1) * config.batch_size
    # torch MultiStepLR(milestones=[int(f * epochs) + 1]) stepped once per epoch: the decayed rate applies
    # from 0-based epoch int(f * epochs) + 1 (the paper's 5000 epochs: epochs 4502..5000, 1-based).
    decay_epoch = int(config.lr_decay_epoch_fraction * config.epochs) + 1
    decay_step = decay_epoch * steps if decay_epoch < config.epochs else None
    optimizer = training.OptimizerSettings(
        float(config.learning_rate), float(config.weight_decay), decay_step, float(config.lr_decay_factor),
        clip_norm=float(config.get("grad_clip_norm", 0.0)), schedule=config.get("lr_schedule", "step"),
        warmup_steps=int(config.get("warmup_fraction", 0.0) * int(config.epochs) * steps),
        total_steps=int(config.epochs) * steps,
        final_fraction=float(config.get("final_lr_fraction", 0.0)))
    return RunSettings(policy=policy, variants=variants, steps_per_epoch=steps, last_batch=last, optimizer=optimizer,
                       curriculum=curriculum, problem_size=n,
                       normalises_rewards=config.get("reward_normalization_alpha", 0.0) > 0, backhaul_rules=rules,
                       sizes=sizes)


def execution_settings(config: ml_collections.ConfigDict) -> tuple[str, dict]:
    """(preset, field overrides) of ``config.execution``, checked against the plan's fields and values."""
    values = dict(config.get("execution", {}))
    preset = values.pop("preset", "auto")
    overrides = {k: v for k, v in values.items() if v is not None}
    execution.plan_for("cpu" if preset == "auto" else preset, **overrides)
    return preset, overrides


def execution_plan(config: ml_collections.ConfigDict) -> ExecutionPlan:
    """The run's execution plan on JAX's default backend (after ``prepare_process``)."""
    preset, overrides = execution_settings(config)
    return execution.default_plan(preset, **overrides)


def prepare_process(config: ml_collections.ConfigDict) -> int:
    """Before any JAX computation: the run plan's huge pages and CPU devices (``execution.prepare_process``;
    ``cpu_devices`` 0: one per usable core, reduced to the largest count that splits every process's share
    of every batch of the run evenly), then joining the other processes of a distributed run. Returns
    this process's CPU device count."""
    def batch_shares():
        processes = config.get("num_processes") or 1
        run = check_config(config)
        return tuple(run.instances_at(size, n) // processes for size in (config.batch_size, run.last_batch)
                     for n in run.sizes or (config.problem_size,))

    count = execution.prepare_process(*execution_settings(config), batch_shares)
    distributed.initialize(distributed.launch_from_config(config))
    return count


def step_functions(config: ml_collections.ConfigDict, run: RunSettings, mesh,
                   num_customers: int | None = None) -> StepFunctions:
    """The (cached) jitted training step of a run on ``mesh`` for instances of ``num_customers`` (default:
    the run's problem size; a size curriculum trains on others)."""
    n = config.problem_size if num_customers is None else num_customers
    # The MoE layers already weigh their load-balancing loss by DEFAULT_LOSS_COEF (the reference's 1e-3);
    # aux_loss_coef is the paper's alpha on the unweighted loss.
    flags = tuple(tuple(bool(f) for f in problems.get_variant(v).flags) for v in run.variants)
    settings = StepSettings(pomo_size=train_starts(config, n),
                            aux_loss_coef=config.aux_loss_coef / moe_lib.DEFAULT_LOSS_COEF,
                            leader_advantage=float(config.get("leader_advantage", 1.0)),
                            cost_scale_alpha=float(config.get("reward_normalization_alpha", 0.0)),
                            variant_flags=flags if run.normalises_rewards else (),
                            size_slot=run.sizes.index(n) if n in run.sizes else 0, size_slots=max(1, len(run.sizes)))
    return StepFunctions.cached(run.policy, execution_plan(config), run.optimizer, settings,
                                num_customers=n,
                                variants=run.variants, mixed=config.mixed_batches, mesh=mesh,
                                replay_bucket_size=config.replay_bucket,
                                backhaul_rules=tuple(problems.backhaul_rule_index(r) for r in run.backhaul_rules))


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------

def checkpoint_manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(os.path.join(workdir, CHECKPOINT_DIR), options=options)


def save_checkpoint(mngr: ocp.CheckpointManager, epoch: int, state: TrainState, cfg: PolicyConfig,
                    meta: dict) -> None:
    """The state at the end of ``epoch``: parameters and optimiser state as arrays, the per-variant cost
    scales of reward normalisation (a few floats, exact in JSON) with the run's ``meta``."""
    meta = dict(meta, cost_scale=np.asarray(jax.device_get(state.cost_scale), np.float32).tolist())
    mngr.save(epoch, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params), config=ocp.args.JsonSave(cfg.to_dict()),
        opt_state=ocp.args.StandardSave(state.opt_state), train_meta=ocp.args.JsonSave(meta)))


class CheckpointWriteError(OSError):
    """A checkpoint (or the metrics beside it) could not be written: a full disk, a lost filesystem. The
    previous checkpoint stays usable."""


# What orbax's writes raise when the filesystem refuses them, directly or from its writer threads.
WRITE_FAILURES = (OSError, ValueError, RuntimeError)


def checkpoint_write_error(mngr: ocp.CheckpointManager, workdir: str, error: BaseException,
                           what: str = "a checkpoint") -> CheckpointWriteError:
    """A CheckpointWriteError naming what could not be written (``what``) and where, the cause (the first
    operating-system error in ``error``'s chain or the code in a tensorstore message, e.g. "No space left on
    device", else ``error`` itself) and the last complete checkpoint."""
    cause, seen = error, set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    # tensorstore (orbax's array writer) reports the operating system's error code inside its message.
    code = re.search(r"os_error_code='(\d+)'", str(error))
    if isinstance(cause, OSError):
        reason = cause.strerror or str(cause)
    elif code:
        reason = os.strerror(int(code.group(1)))
    else:
        reason = str(error).splitlines()[0][:300]
    last = mngr.latest_step()
    kept = f"the checkpoint of epoch {last} is complete" if last is not None else "no earlier checkpoint exists"
    return CheckpointWriteError(
        f"could not write {what} in {workdir}: {reason}; {kept} (the "
        "partial one is ignored when the run starts again); free space and run the same command to resume")


def _close_manager(mngr: ocp.CheckpointManager, workdir: str, failure_reported: bool) -> None:
    """Wait for the last save and close ``mngr``; a failed save raises CheckpointWriteError unless one was
    already reported."""
    error = None
    for finish in (mngr.wait_until_finished, mngr.close):   # close waits again, and raises the same failure
        try:
            finish()
        except WRITE_FAILURES as e:
            error = error or e
    if error is not None and not failure_reported:
        raise checkpoint_write_error(mngr, workdir, error) from error


def restore_checkpoint(mngr: ocp.CheckpointManager, template: TrainState, cfg: PolicyConfig,
                       epoch: int | None = None) -> tuple[TrainState, dict]:
    """(state, train_meta) of ``epoch`` (default: the latest), restored onto the structure and shardings
    of ``template``; a ValueError if the stored model is not ``cfg``."""
    epoch = mngr.latest_step() if epoch is None else epoch
    stored = mngr.restore(epoch, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    _check_same_model(stored, cfg, os.path.dirname(os.fspath(mngr.directory)))
    got = mngr.restore(epoch, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(template.params), opt_state=ocp.args.StandardRestore(template.opt_state),
        train_meta=ocp.args.JsonRestore()))
    meta = got["train_meta"]
    scale = np.asarray(meta.get("cost_scale", []), np.float32)
    if scale.shape != np.shape(template.cost_scale):
        raise RunMismatchError(f"{os.path.dirname(os.fspath(mngr.directory))}: the checkpoint of epoch {epoch} "
                               f"holds {scale.size} reward-normalisation scales, the run needs "
                               f"{np.size(template.cost_scale)}; resume it with its stored settings")
    state = TrainState(step=jax.numpy.int32(meta["step"]), params=got["params"], opt_state=got["opt_state"],
                       cost_scale=jax.numpy.asarray(scale))
    return state, meta


# The config fields that decide what a run computes: resuming with another value would silently continue a
# different run. The others may change between calls: workdir, stop_after_epoch, time_limit_seconds, the
# validation and checkpoint cadence, devices, the progress bar, execution choices that give the same
# results, and epochs with lr_decay_epoch_fraction (a run may be extended; the learning-rate schedule follows
# the new values, so that an extension can keep the decay epoch it had or move it).
RUN_FIELDS = ("seed", "problem_size", "pomo_size", "train_problems", "mixed_batches", "train_episodes",
              "batch_size", "learning_rate", "weight_decay", "lr_decay_factor", "aux_loss_coef", "finetune_from",
              "grad_clip_norm", "lr_schedule", "warmup_fraction", "final_lr_fraction", "train_pomo_size",
              "leader_advantage", "reward_normalization_alpha", "size_curriculum", "train_backhaul_rules",
              "train_sizes")


class RunMismatchError(ValueError):
    """A workdir holds a run of another model or with other run-defining settings."""


def restore_latest_readable(mngr: ocp.CheckpointManager, template: TrainState, cfg: PolicyConfig, workdir: str
                            ) -> tuple[TrainState, dict]:
    """``restore_checkpoint`` of the newest checkpoint that reads back whole: a damaged one (a truncated or
    corrupted file, after a crash or a full disk) is reported by name and the one before it is tried."""
    epochs = sorted(mngr.all_steps(), reverse=True)
    for i, epoch in enumerate(epochs):
        try:
            return restore_checkpoint(mngr, template, cfg, epoch)
        except RunMismatchError:
            raise
        except Exception as e:     # orbax and tensorstore report damage with many exception types
            where = os.path.join(workdir, CHECKPOINT_DIR, str(epoch))
            later = f"falling back to epoch {epochs[i + 1]}" if i + 1 < len(epochs) else "no older checkpoint left"
            _say(f"warning: the checkpoint of epoch {epoch} ({where}) cannot be read ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:200] if str(e) else ''}); {later}")
    raise ValueError(f"no checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)} can be read (epochs "
                     f"{', '.join(map(str, epochs))}); move the workdir aside to start again")


def check_same_run(stored: dict, config: ml_collections.ConfigDict, workdir: str) -> None:
    """A ValueError naming every run-defining field (``RUN_FIELDS``) in which ``config`` differs from the
    config stored with the workdir's checkpoint."""
    diff = [f"{k}: stored {stored[k]!r}, command {config[k]!r}" for k in RUN_FIELDS
            if k in stored and k in config and stored[k] != config[k]]
    if diff:
        raise RunMismatchError(f"{workdir} holds a run made with other settings ({'; '.join(diff)}); resume it "
                               "with the stored settings, or give another workdir")


def _check_same_model(stored: dict, requested: PolicyConfig, workdir: str) -> None:
    want, default = requested.to_dict(), PolicyConfig().to_dict()    # fields newer than the run: their defaults
    diff = [f"{k}: stored {stored.get(k, default[k])!r}, requested {want[k]!r}" for k in want
            if stored.get(k, default[k]) != want[k]]
    if diff:
        raise RunMismatchError(f"{workdir} holds a training run of another model ({'; '.join(diff)}); use "
                               "another workdir, or the stored model settings to resume")


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------

PAPER_SIZES = (50, 100)           # the sizes of the paper's test sets


def next_steps(config, paper_data: str | None = None) -> list[str]:
    """Where a finished run's results are and the commands that use its checkpoint: evaluation on the paper's test
    sets of the size nearest the run's (``paper_data``: their folder; default ``../shared/data/mvmoe-paper`` beside
    the repository when it exists) and solving instances with it."""
    workdir = os.path.abspath(config.workdir)
    if paper_data is None:
        beside = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared",
                              "data", "mvmoe-paper")
        paper_data = os.path.normpath(beside) if os.path.isdir(beside) else "PAPER_DATA_DIR"
    size = min(PAPER_SIZES, key=lambda s: abs(s - int(config.problem_size)))
    example = os.path.join(paper_data, "CVRP-LIB", "X-n101-k25.vrp")
    instances = example if os.path.isfile(example) else "my_instances/"
    return [f"checkpoint: {os.path.join(workdir, CHECKPOINT_DIR)}",
            f"metrics:    {os.path.join(workdir, METRICS_FILE)}",
            f"plot:       {os.path.join(workdir, PLOT_FILE)}",
            "next:",
            f"  python evaluate.py --checkpoint={workdir} --problems=TRAIN --data_dir={paper_data} --size={size} "
            "--num_instances=100",
            f"  python -m mvmoe_jax.solve {instances} --checkpoint={workdir} --plot"]


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def _validation_sharding(config, fns: StepFunctions):
    """Shard validation batches over the mesh when they split evenly; with several processes each one
    evaluates its own batches (``Validator``) over its own devices."""
    if jax.process_count() == 1:
        mesh = fns.mesh
    else:
        mesh = training.make_mesh([d for d in fns.mesh.devices.flat if d.process_index == jax.process_index()])
    if config.validation_batch_size % mesh.devices.size == 0:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(training.DATA_AXIS))
    return None


def _format_val(val: dict) -> str:
    return "  ".join(f"{k} {v['obj']:.4f}" + (f" ({v['gap']:.2f}%)" if v["gap"] is not None else "")
                     for k, v in val.items())


def train_and_evaluate(config: ml_collections.ConfigDict, *, mesh_devices=None) -> dict:
    """Train (or resume, or fine-tune) as ``config`` says; returns the last epoch's metrics record.

    mesh_devices: the devices of the data-parallel mesh (default: all). ``config.stop_after_epoch`` ends the
    run after that epoch (its checkpoint written), as if it had been stopped there; running again with a
    larger value (or 0) continues it.
    Raises ValueError for a bad config, NonFiniteError when a step's loss or gradient is not finite (the
    last good checkpoint stays the latest), CheckpointWriteError when a checkpoint cannot be written (the
    previous one stays usable), distributed.ProcessFailure when a computation fails in a run of
    several processes (most often: another process stopped).
    """
    run = check_config(config)
    stop_after_epoch = int(config.get("stop_after_epoch", 0)) or None
    distributed.initialize(distributed.launch_from_config(config))   # a no-op after prepare_process
    mesh = training.make_mesh(mesh_devices)
    n_dev = mesh.devices.size
    for size in {config.batch_size, run.last_batch}:
        _require(size % n_dev == 0, f"batch of {size} instances cannot be split over {n_dev} devices: "
                 f"batch_size (and train_episodes mod batch_size, when not 0) must be divisible by {n_dev}")
    workdir = os.path.abspath(config.workdir)
    os.makedirs(workdir, exist_ok=True)
    metrics_path = os.path.join(workdir, METRICS_FILE)
    cfg = run.policy

    fns = step_functions(config, run, mesh)
    k_init, run_key = jax.random.split(jax.random.key(config.seed))
    template = fns.init_state(training.init_params(cfg, k_init))
    mngr = checkpoint_manager(workdir, config.keep_checkpoints)
    lost_processes = write_failed = False
    try:
        if mngr.latest_step() is not None:
            state, meta = restore_latest_readable(mngr, template, cfg, workdir)
            check_same_run(meta.get("config", {}), config, workdir)
            start_epoch = meta["epoch"]
            run_key = jax.random.wrap_key_data(np.asarray(meta["rng_key_data"], np.uint32))
            if distributed.is_main():
                truncate_metrics(metrics_path, start_epoch)
            _say(f"resuming {workdir} from epoch {start_epoch} (step {meta['step']})")
        else:
            params = template.params
            if config.finetune_from:
                params = checkpoints.starting_weights(config.finetune_from, cfg)
                _say(f"fine-tuning from {config.finetune_from} with a fresh optimiser")
            state = fns.init_state(params)
            start_epoch = 0
            if distributed.is_main():
                truncate_metrics(metrics_path, -1)
        state = fns.replicate(state)
        with precision.matmul_precision(config.get("matmul_precision", precision.TRAIN_DEFAULT)):
            return _run(config, run, fns, mngr, state, start_epoch, run_key, workdir, metrics_path,
                        stop_after_epoch)
    except CheckpointWriteError:
        write_failed = True
        raise
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        # orbax cannot finish a save without the other processes: the manager is left as it is (a save
        # not committed is ignored when the run starts again).
        lost_processes = True
        last = mngr.latest_step()
        raise distributed.describe_failure(e, f"epoch {last} in {os.path.join(workdir, CHECKPOINT_DIR)}"
                                           if last is not None else "none (no epoch had completed)") from e
    finally:
        if not lost_processes:
            _close_manager(mngr, workdir, write_failed)


def _run(config, run: RunSettings, fns: StepFunctions, mngr, state: TrainState, start_epoch: int, run_key,
         workdir: str, metrics_path: str, stop_after_epoch: int | None) -> dict:
    cfg = run.policy
    validator = None
    if config.validate_every_epochs:
        validator = Validator(cfg, variants=config.validation_problems or config.train_problems,
                              num_customers=config.problem_size, pomo_size=config.pomo_size,
                              num_instances=config.validation_instances,
                              batch_size=config.validation_batch_size, data_dir=config.data_dir,
                              augment=config.validation_aug, seed=config.validation_seed,
                              sharding=_validation_sharding(config, fns), plan=fns.plan)
        _say(f"validation sets: {validator.describe()}")
    rules = "" if run.backhaul_rules == ("paper",) else f", backhaul rules {','.join(run.backhaul_rules)}"
    _say(f"training {cfg.model} on {','.join(run.variants)}{rules} (n={config.problem_size}, pomo={config.pomo_size}) "
         f"with {fns.num_devices} device(s): {config.epochs} epochs x {run.steps_per_epoch} steps of "
         f"{config.batch_size}; workdir {workdir}")
    opt = run.optimizer
    if opt.schedule == "warmup_cosine":
        _say(f"learning rate {opt.learning_rate:g} after {opt.warmup_steps} warm-up steps, cosine to "
             f"{opt.learning_rate * opt.final_fraction:g} at step {opt.total_steps}")
    else:
        _say(f"learning rate {opt.learning_rate:g}" + ("" if opt.decay_step is None else
             f", x{opt.decay_factor:g} from epoch {opt.decay_step // run.steps_per_epoch + 1}"))
    if run.sizes:
        _say("sizes: each step the next of " + ", ".join(f"n = {n} ({run.instances_at(config.batch_size, n)} "
                                                          "instances)" for n in run.sizes))
    if run.curriculum:
        _say("size curriculum: " + ", ".join(f"n = {size} to epoch {last}" for size, last in run.curriculum)
             + f", then n = {run.problem_size}")

    def fns_of(num_customers: int) -> StepFunctions:
        return fns if num_customers == config.problem_size else step_functions(config, run, fns.mesh, num_customers)
    meta_base = {"seed": config.seed, "rng_key_data": np.asarray(jax.random.key_data(run_key)).tolist(),
                 "steps_per_epoch": run.steps_per_epoch, "config": config.to_dict()}
    is_main = distributed.is_main()
    record: dict = {}
    time_limit = float(config.get("time_limit_seconds", 0))
    wall0 = time.perf_counter()

    def validate(record):
        fns.release_buffers()       # the training step's decoder record: not needed while validating
        t0 = time.perf_counter()
        # Validation is evaluation: at its precision (full float32 by default), not training's.
        with precision.matmul_precision(config.get("eval_matmul_precision", precision.EVAL_DEFAULT)):
            record["val"] = validator(state.params)
        record["time"]["validation_seconds"] = time.perf_counter() - t0
        _say(f"  validation: {_format_val(record['val'])}")

    if start_epoch == 0 and validator is not None:
        record = {"epoch": 0, "step": 0, "time": {}}
        validate(record)
        if is_main:
            append_metrics(metrics_path, record)
            plot_validation(metrics_path, os.path.join(workdir, PLOT_FILE))

    if stop_after_epoch is not None and start_epoch >= stop_after_epoch:
        _say(f"epoch {start_epoch} reached: nothing to do before stop_after_epoch={stop_after_epoch}")
        return record
    for epoch in range(start_epoch + 1, config.epochs + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        sums = {k: 0.0 for k in ("loss", "pg_loss", "aux_loss", "score", "grad_norm")}
        count = 0
        bar = tqdm(range(run.steps_per_epoch), desc=f"epoch {epoch}/{config.epochs}", leave=False,
                   disable=not (config.progress_bar and is_main))
        step_fns = None
        for i in bar:
            step = (epoch - 1) * run.steps_per_epoch + i
            num_customers = run.size_of_step(epoch, step)
            previous, step_fns = step_fns, fns_of(num_customers)
            if previous is not None and previous is not step_fns:
                previous.release_buffers()        # one size's decoder record kept at a time
            size = run.instances_at(run.batch_size_of(i, config.batch_size), num_customers)
            state, m = step_fns.step(state, training.step_key(run_key, step), size)
            m = jax.device_get(m)
            if not m["finite"]:
                last = mngr.latest_step()
                raise NonFiniteError(
                    f"non-finite loss or gradient at step {step} (epoch {epoch}, batch {i + 1}/"
                    f"{run.steps_per_epoch}): loss={float(m['loss'])}, grad_norm={float(m['grad_norm'])}. "
                    "Stopped without saving this state; the last good checkpoint is "
                    + (f"epoch {last} in {os.path.join(workdir, CHECKPOINT_DIR)}" if last is not None
                       else "none (no epoch had completed)"))
            for k in sums:
                sums[k] += float(m[k]) * size
            count += size
            bar.set_postfix(score=f"{sums['score'] / count:.4f}", loss=f"{sums['loss'] / count:.4f}")
        bar.close()
        if step_fns is not fns:
            step_fns.release_buffers()    # validation runs beside the main size's buffers only
        train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        step = epoch * run.steps_per_epoch
        record = {"epoch": epoch, "step": step, "lr": run.optimizer.learning_rate_at(step - 1),
                  "train": {k: v / count for k, v in sums.items()},
                  "time": {"train_seconds": train_s, "instances_per_second": count / train_s,
                           "train_cpu_seconds": train_cpu_s}}
        if cfg.learned_distance_bias:
            record["distance_bias_alpha"] = distance_bias_of(cfg, state.params)     # the scalar alone to the host
        _say(f"epoch {epoch}/{config.epochs}: score {record['train']['score']:.4f}  loss "
             f"{record['train']['loss']:.4f}  aux {record['train']['aux_loss']:.5f}  "
             f"{count / train_s:.1f} inst/s  ({train_s:.1f}s)"
             + (f"  distance bias {record['distance_bias_alpha']:.4f}" if cfg.learned_distance_bias else ""))
        if validator is not None and (epoch == 1 or epoch % config.validate_every_epochs == 0
                                      or epoch == config.epochs):
            validate(record)
        record["time"]["wall_seconds"] = time.perf_counter() - wall0
        if is_main:
            try:
                append_metrics(metrics_path, record)
                if "val" in record:
                    plot_validation(metrics_path, os.path.join(workdir, PLOT_FILE))
            except OSError as e:
                raise checkpoint_write_error(mngr, workdir, e, "the metrics") from e
        # With a wall-clock budget the run ends when another epoch like this one would overrun it.
        now = time.perf_counter()
        # Process 0's clock and limit decide for all: the processes save and stop together. Every process
        # takes part in the decision, whatever limit it was given.
        out_of_time = distributed.same_on_all(bool(time_limit) and (now - wall0) + (now - t0) > time_limit)
        last = epoch == config.epochs or epoch == stop_after_epoch or out_of_time
        if epoch % config.checkpoint_every_epochs == 0 or last:
            try:      # a save waits for the one before; either may find the filesystem refusing writes
                save_checkpoint(mngr, epoch, state, cfg, dict(meta_base, epoch=epoch, step=step))
            except WRITE_FAILURES as e:
                raise checkpoint_write_error(mngr, workdir, e) from e
        if out_of_time:
            _say(f"stopping after epoch {epoch}: time_limit_seconds={time_limit:g} would be overrun by another")
        if (stop_after_epoch is not None and epoch >= stop_after_epoch) or out_of_time:
            break
    fns.release_buffers()
    return record
