"""A training step: the optimiser, its state, the batches, and the step's programs on a device mesh.

The algorithm is in ``mvmoe_jax.reinforce`` (sample, teacher-forced replay, REINFORCE loss with the POMO
baseline, ``jax.grad``). ``train_step`` applies optax to that gradient, or, under the execution plan's
``backward=stepwise``, to the same gradient taken one decoding step at a time
(``engines.stepwise_backward``); ``sample_and_train_step`` then runs sampling and update as one program whose
encoder pass serves both, decoding each device's instances a few at a time where the plan says so
(``chunked_sampling``) and taking the backward pass's products from the sampling pass's record where it says
so (``reuses_sampling_pass``). ``StepFunctions`` jits these over a one-axis data mesh. The replay is
differentiated for a static number of steps rounded up to a bucket, so only a handful of shapes compile; it
runs the plan's ``replay_steps_at_once`` steps at a time (vmapped), with ``replay_remat`` recomputing them in
the backward pass to bound memory.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mvmoe_jax import execution, problems
from mvmoe_jax.chunked_sampling import chunked_sampling, sampling_chunk_size
from mvmoe_jax.devices import DATA_AXIS, make_mesh, program_memory_bytes  # noqa: F401  (make_mesh: API)
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance, generate, generate_instance
from mvmoe_jax.engines.stepwise_backward import encoder_vjp, stepwise_gradients
from mvmoe_jax.nn.policy import DecoderRecord, Policy, PolicyConfig, decoder_record_floats
from mvmoe_jax.reinforce import (max_decoding_steps, reinforce_gradients, reinforce_loss, replay_bucket,
                                 sample_trajectories)
from mvmoe_jax.rollout import RolloutOutput, rollout, trajectory_shardings

# Largest decoder record (per device) that ``reuse_sampling='auto'`` keeps: see ``reuses_sampling_pass``.
DECODER_RECORD_BUDGET_BYTES = 1 << 30


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient."""


# ----------------------------------------------------------------------------------------------------
# Optimiser, state, step
# ----------------------------------------------------------------------------------------------------

LR_SCHEDULES = ("step", "warmup_cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """torch's ``Adam(lr, weight_decay)`` (L2 added to the gradient, not decoupled) under a learning-rate
    schedule, after an optional clipping of the gradient's global norm to ``clip_norm`` (0: none; the
    norm is taken before the L2 term, as torch clips before its optimiser step).

    Schedules: ``step`` (the paper's one-step ``MultiStepLR``: the rate is multiplied by ``decay_factor``
    from optimiser step ``decay_step`` on; None: constant) and ``warmup_cosine`` (linear from 0 to
    ``learning_rate`` over ``warmup_steps``, then a cosine down to ``final_fraction * learning_rate`` at
    step ``total_steps``, constant after it)."""

    learning_rate: float
    weight_decay: float = 0.0
    decay_step: int | None = None
    decay_factor: float = 0.1
    clip_norm: float = 0.0
    schedule: str = "step"
    warmup_steps: int = 0
    total_steps: int = 0
    final_fraction: float = 0.0

    def __post_init__(self):
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "warmup_cosine" and not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_cosine needs 0 <= warmup_steps < the run's steps ({self.total_steps}), "
                             f"got {self.warmup_steps}")

    def rate(self) -> optax.Schedule:
        if self.schedule == "warmup_cosine":
            return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, self.warmup_steps, self.total_steps,
                                                      end_value=self.learning_rate * self.final_fraction)
        if self.decay_step is None:
            return optax.constant_schedule(self.learning_rate)
        return optax.piecewise_constant_schedule(self.learning_rate, {int(self.decay_step): self.decay_factor})

    def build(self) -> optax.GradientTransformation:
        clip = [optax.clip_by_global_norm(self.clip_norm)] if self.clip_norm > 0 else []
        return optax.chain(*clip, optax.add_decayed_weights(self.weight_decay),
                           optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                           optax.scale_by_learning_rate(self.rate()))

    def learning_rate_at(self, step: int) -> float:
        if self.schedule == "step":     # exact in float64, as the paper's schedule is stated
            decayed = self.decay_step is not None and step >= self.decay_step
            return float(self.learning_rate) * (self.decay_factor if decayed else 1.0)
        return float(self.rate()(step))


@struct.dataclass
class TrainState:
    step: jax.Array          # int32 (): optimiser steps taken
    params: Any              # {'params': ...}
    opt_state: Any
    # float32 (V,): the running mean cost of each training variant that normalises its rewards
    # (``variant_cost_scale``); 0 until the variant is first drawn. (0,) without reward normalisation.
    cost_scale: Any = None


def create_train_state(params, tx: optax.GradientTransformation, num_variants: int = 0) -> TrainState:
    """Step 0 with a fresh optimiser state and ``num_variants`` unset cost scales (on the default device;
    see StepFunctions.init_state)."""
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                      cost_scale=jnp.zeros((num_variants,), jnp.float32))


def variant_cost_scale(scale: jax.Array, table: jax.Array, flags: jax.Array, cost: jax.Array, valid: jax.Array,
                       alpha: float) -> tuple[jax.Array, jax.Array]:
    """RouteFinder's exponential reward normalisation: (updated scale (V,), each instance's divisor (B,)).

    scale: float32 (V,) the running mean cost per training variant (0: not drawn yet); table: bool (V, 4)
    the variants' flags; flags: bool (B, 4) the batch's; cost, valid: (B, P). Each variant drawn in the
    batch moves its scale to ``(1 - alpha) * scale + alpha * m``, ``m`` its mean cost over the batch's
    valid starts (a variant drawn for the first time takes ``m``); every instance is then divided by its
    variant's updated scale (1 for an instance of no listed variant). RouteFinder sets every variant at its
    first step, an undrawn one to 0, from which its average then grows; here a variant starts when drawn.
    """
    member = (flags[:, None, :] == table[None, :, :]).all(-1)                       # (B, V)
    per_instance = jnp.where(valid, cost, 0.0).sum(-1) / jnp.maximum(valid.sum(-1), 1)
    drawn = member.sum(0)
    batch_mean = (member * per_instance[:, None]).sum(0) / jnp.maximum(drawn, 1)
    moved = jnp.where(scale > 0, (1 - alpha) * scale + alpha * batch_mean, batch_mean)
    scale = jnp.where(drawn > 0, moved, scale)
    divisor = (member * scale[None, :]).sum(-1)
    return scale, jnp.where(divisor > 0, divisor, 1.0)


def init_params(cfg: PolicyConfig, key: jax.Array, num_customers: int = 20) -> dict:
    """Fresh parameters of ``Policy(cfg)`` (the {'params': ...} collection); shapes do not depend on n."""
    inst = generate(jax.random.key(0), 1, num_customers, "CVRP")
    return _init_params(cfg, key, inst)


@partial(jax.jit, static_argnums=0)
def _init_params(cfg: PolicyConfig, key: jax.Array, inst: Instance) -> dict:
    k_params, k_gate = jax.random.split(key)
    # The parameters do not depend on the execution plan: initialised through the reference computation.
    return {"params": Policy(cfg, execution.reference()).init({"params": k_params, "gating": k_gate}, inst)["params"]}


# The stream of a batch key the backhaul rules are drawn from (the variants and instances use its splits).
RULE_STREAM = 3


def generate_training_batch(key: jax.Array, batch: int, num_customers: int,
                            variant_flags: tuple[tuple[bool, ...], ...], mixed: bool,
                            backhaul_rules: tuple[int, ...] = (problems.PAPER_RULE,)) -> Instance:
    """Fresh instances: one variant drawn uniformly for the whole batch (the reference), or per instance
    when ``mixed``; each instance under one of ``backhaul_rules`` (indices of ``problems.BACKHAUL_RULES``),
    drawn uniformly per instance when there are several. jit-compatible with everything but ``key`` static."""
    return generate_training_rows(key, batch, 0, batch, num_customers, variant_flags, mixed, backhaul_rules)


def generate_training_rows(key: jax.Array, batch: int, lo: int, hi: int, num_customers: int,
                           variant_flags: tuple[tuple[bool, ...], ...], mixed: bool,
                           backhaul_rules: tuple[int, ...] = (problems.PAPER_RULE,)) -> Instance:
    """Rows ``lo..hi-1`` of ``generate_training_batch(key, batch, ...)``, generated alone: each instance
    is drawn from its own key, so a process of a distributed run draws just its share of the batch. The
    instances do not depend on the backhaul rules (the rule is drawn from a key of its own).
    jit-compatible with everything but ``key`` static."""
    table = jnp.asarray(np.asarray(variant_flags, bool))
    flags = table[batch_variants(key, table.shape[0], batch, mixed)[lo:hi]]
    k_inst = jax.random.split(key)[1]
    rule_table = jnp.asarray(backhaul_rules, jnp.int8)
    rules = rule_table[jax.random.randint(jax.random.fold_in(key, RULE_STREAM), (batch,), 0, len(backhaul_rules))]
    return jax.vmap(generate_instance, in_axes=(0, 0, None, 0))(jax.random.split(k_inst, batch)[lo:hi], flags,
                                                                num_customers, rules[lo:hi])


def batch_variants(key: jax.Array, num_variants: int, batch: int, mixed: bool) -> jax.Array:
    """int (batch,): the index (into the training variants) of each instance ``generate_training_batch``
    draws from ``key``; one index for the whole batch unless ``mixed``."""
    idx = jax.random.randint(jax.random.split(key)[0], (batch,) if mixed else (), 0, num_variants)
    return jnp.broadcast_to(idx, (batch,))


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What a training step needs besides its inputs (static under jit).

    pomo_size: the starts sampled per instance; leader_advantage: the factor on each instance's best
    start's advantage (1: plain POMO; see ``reinforce.reinforce_loss``); cost_scale_alpha: the rate of
    the per-variant reward normalisation (0: none; ``variant_cost_scale``) over the training variants'
    ``variant_flags`` (O, B, L, TW). A run over several sizes (``train_sizes``) keeps one block of scales per
    size, ``size_slots`` of them, this step's the ``size_slot``-th: costs of different sizes do not share a
    running mean."""

    pomo_size: int
    aux_loss_coef: float
    leader_advantage: float = 1.0
    cost_scale_alpha: float = 0.0
    variant_flags: tuple[tuple[bool, ...], ...] = ()
    size_slot: int = 0
    size_slots: int = 1

    @property
    def normalises_rewards(self) -> bool:
        return self.cost_scale_alpha > 0

    def num_cost_scales(self) -> int:
        return len(self.variant_flags) * self.size_slots if self.normalises_rewards else 0

    def cost_scale_block(self) -> slice:
        """This step's scales within the state's ``cost_scale``."""
        return slice(self.size_slot * len(self.variant_flags), (self.size_slot + 1) * len(self.variant_flags))


def train_step(policy: Policy, tx: optax.GradientTransformation, settings: StepSettings, state: TrainState,
               inst: Instance, traj: RolloutOutput, rng: jax.Array, *, num_steps: int, encoded=None,
               mesh: Mesh | None = None) -> tuple[TrainState, dict]:
    """One optimiser step on sampled trajectories. A non-finite loss or gradient leaves the state as it
    was (``metrics['finite']`` is False) so the caller can stop with the last good parameters.
    ``encoded``: the stepwise backward's encoder pass, when the caller already ran it. ``mesh``: the data
    mesh of the batch (see ``stepwise_gradients``)."""

    cost_scale, divisor = state.cost_scale, None
    if settings.normalises_rewards:
        block = settings.cost_scale_block()
        scales, divisor = variant_cost_scale(state.cost_scale[block], jnp.asarray(settings.variant_flags, bool),
                                             inst.flags, traj.cost, traj.valid, settings.cost_scale_alpha)
        cost_scale = state.cost_scale.at[block].set(scales)
    loss_options = dict(cost_divisor=divisor, leader_advantage=settings.leader_advantage)
    if policy.plan.backward == "stepwise":
        def loss_of(ll, aux):
            return reinforce_loss(ll, traj.cost, traj.valid, aux, settings.aux_loss_coef, **loss_options)

        # The loss is linear in (ll, aux): its partial derivatives weigh the per-step gradients.
        ll_weight, aux_weight = jax.grad(lambda ll, aux: loss_of(ll, aux)[0], argnums=(0, 1))(
            traj.log_likelihood, traj.aux_loss)
        grads, ll, aux = stepwise_gradients(policy, state.params, inst, traj, rng, ll_weight, aux_weight,
                                            encoded=encoded, mesh=mesh)
        loss, pg = loss_of(ll, aux)
    else:
        (loss, (pg, aux, ll)), grads = reinforce_gradients(
            policy, state.params, inst, traj, rng, num_steps=num_steps, aux_loss_coef=settings.aux_loss_coef,
            steps_at_once=policy.plan.replay_steps_at_once, remat=policy.plan.replay_remat, **loss_options)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state, cost_scale=cost_scale)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
    best = jnp.where(traj.valid, traj.cost, jnp.inf).min(-1)
    replay_error = jnp.max(jnp.abs(jnp.where(traj.valid, ll - traj.log_likelihood, 0.0)))
    metrics = {"loss": loss, "pg_loss": pg, "aux_loss": aux, "grad_norm": grad_norm, "score": best.mean(),
               "finite": finite, "replay_error": replay_error, "decode_steps": traj.num_steps}
    return new, metrics


def decoder_record_bytes(cfg: PolicyConfig, plan: ExecutionPlan, trajectories: int, num_nodes: int,
                         steps: int) -> int:
    """Memory of a rollout's decoder record: ``steps`` x ``trajectories`` (instances x starts) x
    ``decoder_record_floats`` float32 values."""
    return 4 * steps * trajectories * decoder_record_floats(cfg, plan, num_nodes)


def reuses_sampling_pass(policy: Policy, *, trajectories_per_device: int, num_nodes: int, max_steps: int) -> bool:
    """Whether ``sample_and_train_step`` records each decoding step's attention weights, attention output
    and readout scores while sampling (``rollout(..., record_decoder=True)``) so that the backward loop
    takes them instead of computing the attention and the readout product again (the plan's
    ``reuse_sampling``).

    ``always`` / ``never`` decide; ``auto`` records when the record fits in ``DECODER_RECORD_BUDGET_BYTES``
    per device, the record being a float per attention weight, 8 x N per trajectory and step: 0.5 GB per
    device for 32 instances of n = 50 over its 104 recorded steps, 3.5 GB at n = 100; and only for a decoder
    MoE's four readout maps without MVMoE-L's gate (MVMoE/4E). With one map to recompute (POMO-MTL; MVMoE-L,
    whose steps mostly draw the dense map) the record's memory traffic costs what it saves (see
    docs/performance.md, "Reuse of the sampling pass"). Needs the readout fusion; without it, never."""
    cfg, plan = policy.cfg, policy.plan
    if not policy.fuses_readout or plan.reuse_sampling == "never":
        return False
    if plan.reuse_sampling == "always":
        return True
    size = decoder_record_bytes(cfg, plan, trajectories_per_device, num_nodes, max_steps)
    # One group of several maps: a decoder MoE's experts, without MVMoE-L's dense-or-MoE gate.
    several_maps = len(cfg.readout_map_counts) == 1 and cfg.readout_map_counts[0] > 1
    return several_maps and size <= DECODER_RECORD_BUDGET_BYTES


def records_decoder(policy: Policy, settings: StepSettings, inst: Instance, max_steps: int,
                    mesh: Mesh | None) -> bool:
    """``reuses_sampling_pass`` for a batch of ``inst`` split over ``mesh`` (None: the default device), with
    the stepwise backward (the replay recomputes everything)."""
    if policy.plan.backward != "stepwise":
        return False
    num_devices = _num_devices(mesh)
    return reuses_sampling_pass(policy, num_nodes=inst.locs.shape[-2], max_steps=max_steps,
                                trajectories_per_device=inst.locs.shape[0] * settings.pomo_size // num_devices)


def sampling_chunk(policy: Policy, settings: StepSettings, inst: Instance, mesh: Mesh | None) -> int | None:
    """Instances per chunk in which ``sample_and_train_step``'s sampling pass decodes each device's share of
    ``inst`` (``chunked_sampling.sampling_chunk_size``; None: the whole share at once, ``rollout.rollout``).
    Same trajectories and record either way. See docs/performance.md, "Chunked sampling"."""
    return sampling_chunk_size(policy.cfg, policy.plan, settings.pomo_size, inst.locs.shape[0] // _num_devices(mesh))


def _num_devices(mesh: Mesh | None) -> int:
    """Devices of ``mesh``; None: the default device."""
    return 1 if mesh is None else mesh.devices.size


def sample_and_train_step(policy: Policy, tx: optax.GradientTransformation, settings: StepSettings,
                          state: TrainState, inst: Instance, rng: jax.Array, *, max_steps: int,
                          mesh: Mesh | None = None) -> tuple[TrainState, dict]:
    """Sampling and the stepwise update in one program, with one encoder pass for both: the encoder runs
    once under ``jax.vjp`` (``encoder_vjp``), the rollout samples from its cache (plus the query fusion,
    computed from it without gradient), and the backward pass reuses the same vjp. Saves the encoder
    forward that ``sample_trajectories`` followed by ``train_step`` pay twice. Same trajectories and
    update as those two calls (the same keys), up to float rounding."""
    state, metrics, _ = _sample_and_train(policy, tx, settings, state, inst, rng, max_steps=max_steps, mesh=mesh)
    return state, metrics


def sample_and_train_step_in_place(policy: Policy, tx: optax.GradientTransformation, settings: StepSettings,
                                   state: TrainState, inst: Instance, rng: jax.Array,
                                   decoder_buffers: DecoderRecord, *, max_steps: int, mesh: Mesh | None = None
                                   ) -> tuple[TrainState, dict, DecoderRecord]:
    """``sample_and_train_step`` for a batch that keeps the decoder record (``records_decoder``), writing
    the record into ``decoder_buffers`` (their contents ignored; donate them) instead of into zeroed
    memory: (state, metrics, the record, whose buffers serve the next call). On a CPU zeroing the record
    would cost a pass over all of it at every step (see docs/performance.md, "Reuse of the sampling pass")."""
    state, metrics, traj = _sample_and_train(policy, tx, settings, state, inst, rng, max_steps=max_steps,
                                             mesh=mesh, decoder_buffers=decoder_buffers)
    return state, metrics, traj.decoder


def _sample_and_train(policy: Policy, tx: optax.GradientTransformation, settings: StepSettings,
                      state: TrainState, inst: Instance, rng: jax.Array, *, max_steps: int,
                      mesh: Mesh | None = None, decoder_buffers: DecoderRecord | None = None
                      ) -> tuple[TrainState, dict, RolloutOutput]:
    if policy.plan.backward != "stepwise":
        raise ValueError("sample_and_train_step needs the stepwise backward; the replay compiles per length")
    (cache, aux_enc), backward_encoder = encoder_vjp(policy, state.params, inst, rng)
    sampling_cache = cache
    if policy.plan.fused_query:
        # The sampling pass takes the query fusion's forward-only attention ("score_tables").
        sampling_cache = policy.apply(state.params, cache, method=Policy.with_query_scores)
    sampling_cache, sampling_aux = jax.lax.stop_gradient((sampling_cache, aux_enc))
    record_decoder = records_decoder(policy, settings, inst, max_steps, mesh)
    chunk = sampling_chunk(policy, settings, inst, mesh)
    # Both refuse decoder_buffers for a batch that keeps no record.
    if chunk is None:
        traj = rollout(policy, state.params, inst, pomo_size=settings.pomo_size, decode_type="sampling", rng=rng,
                       train=True, max_steps=max_steps, record=True, encoded=(sampling_cache, sampling_aux),
                       record_decoder=record_decoder, decoder_buffers=decoder_buffers)
    else:
        traj = chunked_sampling(policy, state.params, inst, rng, pomo_size=settings.pomo_size, max_steps=max_steps,
                                encoded=(sampling_cache, sampling_aux), chunk=chunk,
                                mesh=mesh if mesh is not None and mesh.devices.size > 1 else None,
                                record_decoder=record_decoder, decoder_buffers=decoder_buffers)
    state, metrics = train_step(policy, tx, settings, state, inst, traj, rng, num_steps=0,
                                encoded=((cache, aux_enc), backward_encoder), mesh=mesh)
    return state, metrics, traj


class StepFunctions:
    """The jitted pieces of a training step on a device mesh (batch sharded over ``'data'``, parameters
    and optimiser state replicated). With a one-device mesh this is the plain single-device step.

    ``batch(key, size)`` -> Instance; ``sample(params, inst, rng)`` -> RolloutOutput (recorded);
    ``update(state, inst, traj, rng, num_steps)`` -> (state, metrics); ``sample_and_update(state, inst,
    rng)`` (stepwise backward) the last two as one program; ``step(state, key, size)`` runs a whole step for
    one batch drawn from ``key``.
    """

    def __init__(self, cfg: PolicyConfig, plan: ExecutionPlan, tx: optax.GradientTransformation | OptimizerSettings,
                 settings: StepSettings, *, num_customers: int, variants: Sequence[str | problems.Variant],
                 mixed: bool, mesh: Mesh, replay_bucket_size: int = 0,
                 backhaul_rules: tuple[int, ...] = (problems.PAPER_RULE,)):
        if isinstance(tx, OptimizerSettings):
            tx = tx.build()
        self.tx = tx
        self.mesh = mesh
        self.num_devices = mesh.devices.size
        self.plan = plan
        # The grouped MoE execution sorts within each device's share of the batch: a sort over the whole
        # batch would gather every device's units onto each.
        self.policy = Policy(cfg, plan.replace(moe_sort_groups=plan.moe_sort_groups * self.num_devices))
        # The replay compiles the update once per replay length; the stepwise backward compiles it once.
        self.replays = plan.backward == "replay"
        self.bucket = replay_bucket(num_customers, replay_bucket_size)
        self.max_steps = max_decoding_steps(num_customers, self.bucket)
        flags = tuple(tuple(bool(f) for f in problems.get_variant(v).flags) for v in variants)
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(DATA_AXIS))
        # This process's rows of a batch, generated on its own devices (see ``batch``).
        self._rows_position, self._rows_devices = process_row_devices(mesh)
        self._rows = jax.jit(partial(generate_training_rows, num_customers=num_customers, variant_flags=flags,
                                     mixed=mixed, backhaul_rules=tuple(backhaul_rules)),
                             static_argnums=(1, 2, 3),
                             out_shardings=NamedSharding(Mesh(np.asarray(self._rows_devices), (DATA_AXIS,)),
                                                         P(DATA_AXIS)))
        self.settings = settings
        # With and without the decoder record (records_decoder: the batch's size decides).
        self._samples = {record: jax.jit(partial(sample_trajectories, self.policy, pomo_size=settings.pomo_size,
                                                 max_steps=self.max_steps, record_decoder=record),
                                         out_shardings=trajectory_shardings(mesh, decoder=record))
                         for record in (False, True)}
        self._update = jax.jit(partial(train_step, self.policy, tx, settings, mesh=mesh),
                               static_argnames="num_steps", out_shardings=(self.replicated, self.replicated))
        self._sample_and_update = jax.jit(
            partial(sample_and_train_step, self.policy, tx, settings, max_steps=self.max_steps, mesh=mesh),
            out_shardings=(self.replicated, self.replicated))
        # Batches that keep the decoder record write it into the previous step's record, donated.
        self._record_sharding = trajectory_shardings(mesh, decoder=True).decoder
        self._sample_and_update_in_place = jax.jit(
            partial(sample_and_train_step_in_place, self.policy, tx, settings, max_steps=self.max_steps, mesh=mesh),
            donate_argnums=3, out_shardings=(self.replicated, self.replicated, self._record_sharding))
        self._record_buffers: DecoderRecord | None = None
        self._record_spec_cache: dict = {}

    @classmethod
    @functools.lru_cache(maxsize=8)
    def cached(cls, cfg: PolicyConfig, plan: ExecutionPlan, opt: OptimizerSettings, settings: StepSettings, *,
               num_customers: int, variants: tuple[str, ...], mixed: bool, mesh: Mesh, replay_bucket_size: int = 0,
               backhaul_rules: tuple[int, ...] = (problems.PAPER_RULE,)) -> "StepFunctions":
        """The same functions for the same arguments, so that runs in one process (a resumed run, the
        tests) reuse what was compiled."""
        return cls(cfg, plan, opt, settings, num_customers=num_customers, variants=variants, mixed=mixed,
                   mesh=mesh, replay_bucket_size=replay_bucket_size, backhaul_rules=backhaul_rules)

    def init_state(self, params) -> TrainState:
        """A fresh optimiser around ``params``, replicated over the mesh."""
        return self.replicate(create_train_state(params, self.tx, self.settings.num_cost_scales()))

    def check_batch_size(self, size: int) -> None:
        if size % self.num_devices:
            raise ValueError(f"a batch of {size} instances cannot be split over {self.num_devices} devices; "
                             f"use a batch size divisible by {self.num_devices}")

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)

    def batch(self, key: jax.Array, size: int) -> Instance:
        """``generate_training_batch(key, size)`` sharded over the mesh. Each process generates only the
        rows its devices hold (with one process: all of them), and the global batch is assembled from
        them without moving any data."""
        self.check_batch_size(size)
        share = size // self.num_devices
        start = self._rows_position * share
        rows = self._rows(key, size, start, start + share * len(self._rows_devices))
        if len(self._rows_devices) == self.num_devices:
            return rows
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            (size,) + x.shape[1:], self.batch_sharding, [s.data for s in x.addressable_shards]), rows)

    def _sample(self, params, inst: Instance, rng: jax.Array) -> RolloutOutput:
        """The jitted sampler, with the decoder record when the one-program step would keep it (so that
        ``sample`` then ``update`` computes what ``sample_and_update`` does)."""
        record = records_decoder(self.policy, self.settings, inst, self.max_steps, self.mesh)
        return self._samples[record](params, inst, rng)

    def sample(self, params, inst: Instance, rng: jax.Array) -> RolloutOutput:
        self.check_batch_size(inst.locs.shape[0])
        return self._sample(params, jax.device_put(inst, self.batch_sharding), rng)

    def replay_length(self, needed: int) -> int:
        return min(self.max_steps, -(-max(1, needed) // self.bucket) * self.bucket)

    def update(self, state: TrainState, inst: Instance, traj: RolloutOutput, rng: jax.Array,
               num_steps: int | None = None) -> tuple[TrainState, dict]:
        """``num_steps`` (replay only) defaults to the bucket above the steps the trajectories needed (a
        host sync)."""
        if not self.replays:
            num_steps = 0           # unused: the stepwise backward reads the step count on the device
        elif num_steps is None:
            num_steps = self.replay_length(int(traj.num_steps))
        return self._update(state, jax.device_put(inst, self.batch_sharding), traj, rng, num_steps=num_steps)

    def sample_and_update(self, state: TrainState, inst: Instance, rng: jax.Array) -> tuple[TrainState, dict]:
        """``sample`` then ``update`` as one program sharing the encoder pass (stepwise backward only; see
        ``sample_and_train_step``, which refuses the replay). A batch that keeps the decoder record writes
        it into the buffers of the previous such step (``sample_and_train_step_in_place``); they stay
        allocated between steps (``release_buffers`` frees them)."""
        self.check_batch_size(inst.locs.shape[0])
        inst = jax.device_put(inst, self.batch_sharding)
        # records_decoder is False for the replay, which _sample_and_update then refuses.
        if not records_decoder(self.policy, self.settings, inst, self.max_steps, self.mesh):
            return self._sample_and_update(state, inst, rng)
        wanted = self._record_spec(state.params, inst, rng)
        buffers, self._record_buffers = self._record_buffers, None      # donated below
        if buffers is None or jax.tree.map(lambda x: (x.shape, x.dtype), buffers) != jax.tree.map(
                lambda s: (s.shape, s.dtype), wanted):
            buffers = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), wanted)
        state, metrics, self._record_buffers = self._sample_and_update_in_place(state, inst, rng, buffers)
        return state, metrics

    def release_buffers(self) -> None:
        """Free the decoder record kept between steps (``sample_and_update``)."""
        self._record_buffers = None

    def _record_spec(self, params, inst: Instance, rng: jax.Array) -> DecoderRecord:
        """Shapes, dtypes and shardings of the decoder record of a batch like ``inst`` (traced once per batch
        shape)."""
        key = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(inst))
        if key not in self._record_spec_cache:
            shapes = jax.eval_shape(self._samples[True], params, inst, rng).decoder
            self._record_spec_cache[key] = jax.tree.map(
                lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                shapes, self._record_sharding)
        return self._record_spec_cache[key]

    def memory_bytes(self, state: TrainState, inst: Instance, rng: jax.Array, num_steps: int | None = None) -> int:
        """Device memory (per device) of this batch shape's training step, from XLA's memory analysis of
        the compiled programs (compiled here unless already, as a call would): the one-program step, or for
        the replay the larger of the sampling program and the update at ``num_steps`` (default: the
        longest replay)."""
        self.check_batch_size(inst.locs.shape[0])
        inst = jax.device_put(inst, self.batch_sharding)
        if not self.replays:
            if records_decoder(self.policy, self.settings, inst, self.max_steps, self.mesh):
                record = self._record_spec(state.params, inst, rng)
                return program_memory_bytes(self._sample_and_update_in_place.lower(state, inst, rng, record).compile())
            return program_memory_bytes(self._sample_and_update.lower(state, inst, rng).compile())
        sampler = self._samples[False]          # the replay recomputes everything: no decoder record
        traj = jax.eval_shape(sampler, state.params, inst, rng)
        sample = program_memory_bytes(sampler.lower(state.params, inst, rng).compile())
        update = self._update.lower(state, inst, traj, rng, num_steps=num_steps or self.max_steps).compile()
        return max(sample, program_memory_bytes(update))

    def step(self, state: TrainState, key: jax.Array, size: int) -> tuple[TrainState, dict]:
        """A whole training step on a fresh batch drawn from ``key`` (deterministic in ``key``)."""
        k_data, k_roll = jax.random.split(key)
        inst = self.batch(k_data, size)
        if not self.replays:
            return self.sample_and_update(state, inst, k_roll)
        traj = self.sample(state.params, inst, k_roll)
        return self.update(state, inst, traj, k_roll)


def process_row_devices(mesh: Mesh) -> tuple[int, list]:
    """(position of the first, list) of this process's devices on the one-axis ``mesh``, in mesh order:
    they hold one contiguous block of a batch sharded over it, which the process generates itself. A
    ValueError for a mesh that interleaves the processes' devices."""
    order = list(mesh.devices.flat)
    positions = [i for i, d in enumerate(order) if d.process_index == jax.process_index()]
    if not positions:
        raise ValueError(f"the mesh has none of process {jax.process_index()}'s devices")
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ValueError("each process's devices must be consecutive on the data mesh (as in jax.devices()), got "
                         f"process {jax.process_index()} at positions {positions}")
    return positions[0], [order[i] for i in positions]


def step_key(base_key: jax.Array, step: int) -> jax.Array:
    """The PRNG key of optimiser step ``step``: a pure function of the run's key and the step, so a
    resumed run draws exactly what an uninterrupted one would."""
    return jax.random.fold_in(base_key, step)
