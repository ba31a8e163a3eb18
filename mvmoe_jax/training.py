"""REINFORCE with the POMO shared baseline: sampling, the backward pass, the loss and the train step.

How gradients flow through a rollout. ``rollout.rollout`` decodes under ``lax.while_loop``, which JAX
cannot reverse-differentiate, and decoding 2n steps under a differentiable ``lax.scan`` would pay for the
longest possible tour every time. A training step therefore runs in two parts (two jitted calls, or with
the stepwise backward one program, ``sample_and_train_step``, whose encoder pass serves both):

1. ``sample_trajectories`` (no gradient): ``rollout.rollout(..., decode_type='sampling', train=True,
   record=True)``, the inference rollout, which also records what the decoder saw at every step (the
   feasibility mask and the dynamic features; the current node is the previous action) and returns the
   number of decoding steps the batch needed. Where the plan says so (``sampling_chunk_trajectories``)
   ``sample_and_train_step`` decodes each device's instances a few at a time instead (``chunked_sampling``;
   same trajectories and record, see ``sampling_chunk``).
2. ``train_step`` (gradient), in one of two ways (the execution plan's ``backward``); both re-run the decoder on
   the recorded inputs (teacher forcing) with the same per-step keys (``rollout.decoding_keys``: the same
   MoE gating noise and MVMoE-L branch draws), so the log-likelihood they differentiate equals the
   sampling pass's (tested) and the gradient is the REINFORCE gradient of the sampled trajectories:

   - ``stepwise_gradients`` (the default): the loss is linear in each step's log-probability, so its
     gradient is a sum of per-step vector-Jacobian products. A ``lax.while_loop`` over exactly the steps
     the batch needed runs each step under ``jax.vjp`` and accumulates the cotangents; one compilation
     serves every length, and there is no forward replay before the backward pass.
   - ``replay``: the decoder is replayed as a whole and differentiated with
     ``jax.grad``, for a static number of steps T rounded up from the steps actually needed to a bucket
     (so only a handful of shapes ever compile). Since every step's inputs are known up front, the steps
     are independent: they run as one vmapped batch per chunk of ``replay_chunk`` steps (``lax.map``),
     which gives the accelerator large matmuls instead of T tiny sequential ones; ``replay_remat``
     recomputes each chunk in the backward pass to bound memory. Slower than stepwise on a CPU and on a
     GPU, in several times the memory (see docs/performance.md, "Stepwise backward").

Loss (reference ``Trainer._train_one_batch``): ``reward = -cost``; per instance the baseline is the mean
reward over its valid POMO starts; ``loss = mean over valid (instance, start) of -(reward - baseline) *
log_likelihood + w * aux``, ``aux`` the MoE load-balancing loss of the encoder plus every decoding step as
the rollout returns it (already weighted by the MoE layers' ``loss_coef`` = 1e-3, like the reference's
``model.aux_loss``) and ``w = StepSettings.aux_loss_coef`` (the training loop sets it to the config's
alpha / 1e-3). Padded POMO starts (mixed batches with backhaul variants) are excluded from both means.
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
from mvmoe_jax.instances import Instance, generate, generate_instance
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.nn.policy import DecoderRecord, Policy, PolicyConfig, decoder_record_floats
from mvmoe_jax.rollout import RolloutOutput, decoding_keys, rollout, step_keys

# Largest decoder record (per device) that ``reuse_sampling='auto'`` keeps: see ``reuses_sampling_pass``.
DECODER_RECORD_BUDGET_BYTES = 1 << 30


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient."""


# ----------------------------------------------------------------------------------------------------
# Sampling with a record of the decoder's inputs
# ----------------------------------------------------------------------------------------------------

def trajectory_shardings(mesh: Mesh, decoder: bool = False) -> RolloutOutput:
    """Batch-sharded placement of a recorded rollout (the batch axis is 0, or 1 after a step axis), with
    or without the decoder record (``rollout(..., record_decoder=True)``)."""
    batch0, batch1, rep = (NamedSharding(mesh, P(DATA_AXIS)), NamedSharding(mesh, P(None, DATA_AXIS)),
                           NamedSharding(mesh, P()))
    return RolloutOutput(actions=batch0, log_likelihood=batch0, cost=batch0, valid=batch0, finished=batch0,
                         aux_loss=rep, num_steps=rep, masks=batch1, dynamic=batch1, active=batch1,
                         decoder=DecoderRecord(batch1, batch1, batch1) if decoder else None)


def max_decoding_steps(num_customers: int, bucket: int) -> int:
    """Length of the recording: 2n steps (a depot visit per customer at most), rounded up to a bucket."""
    return -(-2 * num_customers // bucket) * bucket


def replay_bucket(num_customers: int, bucket: int = 0) -> int:
    """Granularity of the replay length: ``bucket`` if given, else ceil(n/4), so that a problem size sees a
    few distinct lengths (compilations) and pads at most n/4 steps."""
    return bucket if bucket > 0 else -(-num_customers // 4)


def sample_trajectories(policy: Policy, params, inst: Instance, rng: jax.Array, *, pomo_size: int,
                        max_steps: int, record_decoder: bool = False) -> RolloutOutput:
    """Sample every POMO start of every instance in training mode (MoE gating noise on), recording the
    decoder's inputs at each of ``max_steps`` steps for ``replay`` (with ``record_decoder`` also what
    ``stepwise_gradients`` can take instead of recomputing, see ``reuses_sampling_pass``). jit-compatible
    (``policy``, ``pomo_size``, ``max_steps``, ``record_decoder`` static)."""
    return rollout(policy, params, inst, pomo_size=pomo_size, decode_type="sampling", rng=rng, train=True,
                   max_steps=max_steps, record=True, record_decoder=record_decoder)


# ----------------------------------------------------------------------------------------------------
# Differentiable replay and the loss
# ----------------------------------------------------------------------------------------------------

def replay(policy: Policy, params, inst: Instance, traj: RolloutOutput, rng: jax.Array, *, num_steps: int,
           chunk: int = 8, remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced decoding of the recorded trajectories over their first ``num_steps`` (static)
    steps: (log-likelihood (B, P), auxiliary loss ()), differentiable in ``params``.

    ``num_steps`` must cover ``traj.num_steps``; steps past it contribute neither log-probability nor
    auxiliary loss. ``rng`` is the key the trajectories were sampled with.
    """
    cfg = policy.cfg
    k_enc, keys = decoding_keys(rng, num_steps)
    emb, aux_enc = policy.apply(params, inst, True, method=Policy.encode, rngs={"gating": k_enc})
    cache = policy.apply(params, emb, False, method=Policy.precompute)      # no query fusion: see precompute
    current = jnp.moveaxis(traj.actions[..., :num_steps], -1, 0)              # (T, B, P)
    chosen = jnp.moveaxis(traj.actions[..., 1:num_steps + 1], -1, 0)          # (T, B, P)

    def decode(key, cur, dyn, mask, gate_probs):
        return policy.apply(params, cache, cur, dyn, mask, gate_probs, True, method=Policy.decode,
                            rngs={"gating": step_keys(key)[0]})

    gate_probs = None
    if cfg.hierarchical:
        # MVMoE-L's dense-or-sparse probabilities come from the first step and serve every step (the
        # gradient reaches the gate through all of them, as in the sequential rollout).
        gate_probs = decode(keys[0], current[0], traj.dynamic[0], traj.masks[0], None)[2]

    def one_step(xs):
        t, key, cur, dyn, mask, act, active = xs
        logp, aux_t, _ = decode(key, cur, dyn, mask, gate_probs)
        picked = jnp.take_along_axis(logp, act[..., None], axis=-1)[..., 0]
        return jnp.where(active, picked, 0.0), jnp.where(t < traj.num_steps, aux_t, 0.0)

    if remat:
        one_step = jax.checkpoint(one_step)
    xs = (jnp.arange(num_steps), keys, current, traj.dynamic[:num_steps], traj.masks[:num_steps], chosen,
          traj.active[:num_steps])
    ll, aux = jax.lax.map(one_step, xs, batch_size=min(chunk, num_steps))
    return ll.sum(0), aux_enc + aux.sum()


def encoder_vjp(policy: Policy, params, inst: Instance, rng: jax.Array):
    """``((cache, aux), vjp)``: the training-mode encoder and the decoder's precomputation without the
    query fusion (see ``Policy.precompute``), as a function of ``params``, run under ``jax.vjp`` with the
    encoder key a rollout from ``rng`` uses."""
    k_enc, _ = decoding_keys(rng, 1)

    def encoder(p):
        emb, aux = policy.apply(p, inst, True, method=Policy.encode, rngs={"gating": k_enc})
        return policy.apply(p, emb, False, method=Policy.precompute), aux

    return jax.vjp(encoder, params)


def steps_run_per_device(cfg: PolicyConfig, mesh: Mesh | None) -> bool:
    """Whether ``stepwise_gradients`` runs its loop over decoding steps on each device's share of the batch
    by itself (``shard_map``; one all-reduce of the decoder's gradient after the loop) rather than as one
    loop over the sharded batch, which XLA synchronises at every step: an all-reduce of that step's
    decoder gradient, and with a decoder MoE one of its importance and load sums. Only for models whose
    decoding steps use no statistic of the whole batch (no MoE in the decoder, hence no MVMoE-L gate):
    their gradient is the same either way, up to the order of float sums. The MoE models' decoders would
    need those statistics passed in from the sampling pass to run per device exactly, which was no faster
    (see docs/performance.md, "Stepwise backward")."""
    return mesh is not None and mesh.devices.size > 1 and not cfg.moe_at("Dec")


def _step_objective(policy: Policy, traj: RolloutOutput, keys: jax.Array, ll_weight: jax.Array,
                    aux_weight: jax.Array, score_tables=None):
    """``f(t, params, cache, gate_probs) -> ((objective, gate_probs), (picked, aux_t))``: the weighted
    log-probability of step t's recorded action plus the weighted aux loss, for ``jax.vjp``.
    ``score_tables``: (node_scores, feature_scores) of the query fusion, without gradient, from which each
    step's attention scores are gathered instead of computed (see ``Policy.decoder_attention``). With a
    decoder record in ``traj`` each step takes its attention and readout products from it instead."""

    def step_objective(t, p, c, gate_probs):
        if score_tables is not None:
            c = c.replace(node_scores=score_tables[0], feature_scores=score_tables[1])
        given = None if traj.decoder is None else jax.tree.map(lambda x: x[t], traj.decoder)
        logp, aux_t, gate_probs = policy.apply(
            p, c, traj.actions[:, :, t], traj.dynamic[t], traj.masks[t], gate_probs, True, given=given,
            method=Policy.decode, rngs={"gating": step_keys(keys[t])[0]})
        picked = jnp.take_along_axis(logp, traj.actions[:, :, t + 1, None], axis=-1)[..., 0]
        picked = jnp.where(traj.active[t], picked, 0.0)
        objective = jnp.sum(ll_weight * picked) + aux_weight * aux_t
        return (objective, gate_probs), (picked, aux_t)

    return step_objective


def _accumulate_steps(step_objective, params, cache, gate_probs: jax.Array, first, num_steps, ll, aux):
    """Steps ``first`` .. ``num_steps - 1`` under ``jax.vjp``, one at a time (``lax.while_loop``): the summed
    cotangents of (params, cache, gate_probs), and ``ll``, ``aux`` plus each step's picked log-probabilities
    and aux loss."""

    def body(carry):
        t, g_params, g_cache, g_gate, ll, aux = carry
        (_, _), vjp_t, (picked, aux_t) = jax.vjp(
            lambda p, c, g: step_objective(t, p, c, g), params, cache, gate_probs, has_aux=True)
        dp, dc, dg = vjp_t((jnp.float32(1.0), jnp.zeros_like(gate_probs)))
        return (t + 1, jax.tree.map(jnp.add, g_params, dp), jax.tree.map(jnp.add, g_cache, dc), g_gate + dg,
                ll + picked, aux + aux_t)

    zeros = partial(jax.tree.map, jnp.zeros_like)
    carry = (jnp.int32(first), zeros(params), zeros(cache), jnp.zeros_like(gate_probs), ll, aux)
    _, g_params, g_cache, g_gate, ll, aux = jax.lax.while_loop(lambda c: c[0] < num_steps, body, carry)
    return g_params, g_cache, g_gate, ll, aux


def _steps_per_device(policy: Policy, params, cache, traj: RolloutOutput, keys: jax.Array, ll_weight: jax.Array,
                      aux_weight: jax.Array, mesh: Mesh, score_tables=None):
    """``_accumulate_steps`` over all steps on each device's share of the batch (see ``steps_run_per_device``):
    (params cotangent summed over devices, cache cotangent (sharded), log-likelihood (B, P), aux)."""
    batch0 = P(DATA_AXIS)
    traj_specs = jax.tree.map(lambda sharding: sharding.spec,
                              trajectory_shardings(mesh, decoder=traj.decoder is not None))
    cache_specs = jax.tree.map(lambda _: batch0, cache)

    def local(params, cache, traj, ll_weight, aux_weight, keys, score_tables):
        step_objective = _step_objective(policy, traj, keys, ll_weight, aux_weight, score_tables)
        no_gate = jnp.zeros((2,), jnp.float32)          # no MVMoE-L gate here (steps_run_per_device)
        ll = jnp.zeros(traj.actions.shape[:2], jnp.float32)
        g_params, g_cache, _, ll, aux = _accumulate_steps(step_objective, params, cache, no_gate, 0,
                                                          traj.num_steps, ll, jnp.float32(0.0))
        return jax.lax.psum(g_params, DATA_AXIS), g_cache, ll, jax.lax.psum(aux, DATA_AXIS)

    # check_vma off: the per-device params cotangents are summed explicitly above.
    table_specs = jax.tree.map(lambda _: batch0, score_tables)
    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), cache_specs, traj_specs, batch0, P(), P(), table_specs),
                        out_specs=(P(), cache_specs, batch0, P()), check_vma=False)
    return run(params, cache, traj, ll_weight, aux_weight, keys, score_tables)


def stepwise_gradients(policy: Policy, params, inst: Instance, traj: RolloutOutput, rng: jax.Array,
                       ll_weight: jax.Array, aux_weight: jax.Array, encoded=None, mesh: Mesh | None = None
                       ) -> tuple[Any, jax.Array, jax.Array]:
    """Gradient in ``params`` of ``sum(ll_weight * log_likelihood) + aux_weight * aux`` over the recorded
    trajectories, taken one decoding step at a time: (gradient, log-likelihood (B, P), aux ()).

    The REINFORCE loss is linear in the per-step log-probabilities, so its gradient is a sum over steps of
    one step's vector-Jacobian product. This runs the encoder once under ``jax.vjp``, then a
    ``lax.while_loop`` over exactly the ``traj.num_steps`` steps the batch needed (no padding to a bucket,
    no compile per length) that re-runs each step's decoder under ``jax.vjp`` and accumulates the cotangents
    of the parameters and of the decoder cache; the cache's cotangent then goes back through the encoder.
    Nothing is stored across steps, and unlike ``replay`` no separate forward pass precedes the backward
    one. MVMoE-L's dense-or-MoE probabilities come from step 0 and serve every step: their cotangents are
    summed over steps 1.. and passed back through step 0, which runs last.

    ll_weight: (B, P) d loss / d log-likelihood; aux_weight: () d loss / d aux. ``rng`` is the key the
    trajectories were sampled with. ``encoded``: ``encoder_vjp(policy, params, inst, rng)`` when the caller
    already ran it (``sample_and_train_step``). ``mesh``: the data mesh the batch is sharded over, where
    the loop may run per device (``steps_run_per_device``). jit-compatible (``policy``, ``mesh`` static).

    With the query fusion (the plan's ``fused_query``) each step gathers its attention scores from the fusion's
    tables, computed once here without gradient, instead of multiplying queries and keys again; the
    gradient flows through the hoisted query and the keys as before (``attention_with_given_scores``): a
    small gain on a CPU (see docs/performance.md, "Fused readout and query"). The tables are the query
    fusion's, B x H x N x N floats (10 MB per 32 instances at n = 100).
    """
    _, keys = decoding_keys(rng, traj.masks.shape[0])
    (cache, aux_enc), backward_encoder = encoder_vjp(policy, params, inst, rng) if encoded is None else encoded
    score_tables = None
    if policy.plan.fused_query and traj.decoder is None:
        tables = jax.lax.stop_gradient(policy.apply(params, cache, method=Policy.with_query_scores))
        score_tables = (tables.node_scores, tables.feature_scores)
    if steps_run_per_device(policy.cfg, mesh):
        g_params, g_cache, ll, aux_dec = _steps_per_device(policy, params, cache, traj, keys, ll_weight,
                                                           aux_weight, mesh, score_tables)
        (de,) = backward_encoder((g_cache, aux_weight))
        return jax.tree.map(jnp.add, g_params, de), ll, aux_enc + aux_dec

    step_objective = _step_objective(policy, traj, keys, ll_weight, aux_weight, score_tables)
    # Step 0 first, forward only: it yields MVMoE-L's gate probabilities for the others (zeros elsewhere).
    (_, gate_probs), step0_vjp, (ll, aux_dec) = jax.vjp(
        lambda p, c: step_objective(0, p, c, None), params, cache, has_aux=True)
    hierarchical = gate_probs is not None
    if not hierarchical:
        gate_probs = jnp.zeros((2,), jnp.float32)
    g_params, g_cache, g_gate, ll, aux_dec = _accumulate_steps(step_objective, params, cache, gate_probs, 1,
                                                               traj.num_steps, ll, aux_dec)
    dp, dc = step0_vjp((jnp.float32(1.0), g_gate if hierarchical else None))
    (de,) = backward_encoder((jax.tree.map(jnp.add, g_cache, dc), aux_weight))
    grads = jax.tree.map(lambda a, b, c: a + b + c, g_params, dp, de)
    return grads, ll, aux_enc + aux_dec


def reinforce_loss(log_likelihood: jax.Array, cost: jax.Array, valid: jax.Array, aux_loss: jax.Array,
                   aux_loss_coef: float) -> tuple[jax.Array, jax.Array]:
    """(total loss, policy-gradient part) with the POMO shared baseline over the valid starts.

    log_likelihood, cost, valid: (B, P). The advantage is a constant (costs come from the sampling pass).
    """
    reward = jnp.where(valid, -cost, 0.0)
    count = jnp.maximum(valid.sum(-1, keepdims=True), 1)
    advantage = jnp.where(valid, reward - reward.sum(-1, keepdims=True) / count, 0.0)
    advantage = jax.lax.stop_gradient(advantage)
    pg = -jnp.sum(advantage * log_likelihood) / jnp.maximum(valid.sum(), 1)
    return pg + aux_loss_coef * aux_loss, pg


# ----------------------------------------------------------------------------------------------------
# Optimiser, state, step
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """torch's ``Adam(lr, weight_decay)`` (L2 added to the gradient, not decoupled) with a one-step
    ``MultiStepLR``: the rate is multiplied by ``decay_factor`` from optimiser step ``decay_step`` on."""

    learning_rate: float
    weight_decay: float = 0.0
    decay_step: int | None = None
    decay_factor: float = 0.1

    def build(self) -> optax.GradientTransformation:
        schedule = (optax.constant_schedule(self.learning_rate) if self.decay_step is None else
                    optax.piecewise_constant_schedule(self.learning_rate, {int(self.decay_step): self.decay_factor}))
        return optax.chain(optax.add_decayed_weights(self.weight_decay),
                           optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                           optax.scale_by_learning_rate(schedule))

    def learning_rate_at(self, step: int) -> float:
        decayed = self.decay_step is not None and step >= self.decay_step
        return float(self.learning_rate) * (self.decay_factor if decayed else 1.0)


@struct.dataclass
class TrainState:
    step: jax.Array          # int32 (): optimiser steps taken
    params: Any              # {'params': ...}
    opt_state: Any


def create_train_state(params, tx: optax.GradientTransformation) -> TrainState:
    """Step 0 with a fresh optimiser state (on the default device; see StepFunctions.init_state)."""
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params))


def init_params(cfg: PolicyConfig, key: jax.Array, num_customers: int = 20) -> dict:
    """Fresh parameters of ``Policy(cfg)`` (the {'params': ...} collection); shapes do not depend on n."""
    inst = generate(jax.random.key(0), 1, num_customers, "CVRP")
    return _init_params(cfg, key, inst)


@partial(jax.jit, static_argnums=0)
def _init_params(cfg: PolicyConfig, key: jax.Array, inst: Instance) -> dict:
    k_params, k_gate = jax.random.split(key)
    # The parameters do not depend on the execution plan: initialised through the reference computation.
    return {"params": Policy(cfg, execution.reference()).init({"params": k_params, "gating": k_gate}, inst)["params"]}


def generate_training_batch(key: jax.Array, batch: int, num_customers: int,
                            variant_flags: tuple[tuple[bool, ...], ...], mixed: bool) -> Instance:
    """Fresh instances: one variant drawn uniformly for the whole batch (the reference), or per instance
    when ``mixed``. jit-compatible with everything but ``key`` static."""
    table = jnp.asarray(np.asarray(variant_flags, bool))
    flags = table[batch_variants(key, table.shape[0], batch, mixed)]
    k_inst = jax.random.split(key)[1]
    return jax.vmap(generate_instance, in_axes=(0, 0, None))(jax.random.split(k_inst, batch), flags,
                                                             num_customers)


def batch_variants(key: jax.Array, num_variants: int, batch: int, mixed: bool) -> jax.Array:
    """int (batch,): the index (into the training variants) of each instance ``generate_training_batch``
    draws from ``key``; one index for the whole batch unless ``mixed``."""
    idx = jax.random.randint(jax.random.split(key)[0], (batch,) if mixed else (), 0, num_variants)
    return jnp.broadcast_to(idx, (batch,))


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What a training step needs besides its inputs (static under jit)."""

    pomo_size: int
    aux_loss_coef: float
    replay_chunk: int = 8          # the replay's steps vmapped at a time (plan backward "replay")
    replay_remat: bool = False     # the replay recomputes each chunk in the backward pass


def train_step(policy: Policy, tx: optax.GradientTransformation, settings: StepSettings, state: TrainState,
               inst: Instance, traj: RolloutOutput, rng: jax.Array, *, num_steps: int, encoded=None,
               mesh: Mesh | None = None) -> tuple[TrainState, dict]:
    """One optimiser step on sampled trajectories. A non-finite loss or gradient leaves the state as it
    was (``metrics['finite']`` is False) so the caller can stop with the last good parameters.
    ``encoded``: the stepwise backward's encoder pass, when the caller already ran it. ``mesh``: the data
    mesh of the batch (see ``stepwise_gradients``)."""

    def loss_of(ll, aux):
        return reinforce_loss(ll, traj.cost, traj.valid, aux, settings.aux_loss_coef)

    if policy.plan.backward == "stepwise":
        # The loss is linear in (ll, aux): its partial derivatives weigh the per-step gradients.
        ll_weight, aux_weight = jax.grad(lambda ll, aux: loss_of(ll, aux)[0], argnums=(0, 1))(
            traj.log_likelihood, traj.aux_loss)
        grads, ll, aux = stepwise_gradients(policy, state.params, inst, traj, rng, ll_weight, aux_weight,
                                            encoded=encoded, mesh=mesh)
        loss, pg = loss_of(ll, aux)
    else:
        def loss_fn(params):
            ll, aux = replay(policy, params, inst, traj, rng, num_steps=num_steps, chunk=settings.replay_chunk,
                             remat=settings.replay_remat)
            loss, pg = loss_of(ll, aux)
            return loss, (pg, aux, ll)

        (loss, (pg, aux, ll)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state)
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
        # Without node_queries the sampling pass takes the query fusion's forward-only attention.
        sampling_cache = policy.apply(state.params, cache, method=Policy.with_query_scores).replace(node_queries=None)
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
                 mixed: bool, mesh: Mesh, replay_bucket_size: int = 0):
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
        self._batch = jax.jit(partial(generate_training_batch, num_customers=num_customers,
                                      variant_flags=flags, mixed=mixed),
                              static_argnums=1, out_shardings=self.batch_sharding)
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
               num_customers: int, variants: tuple[str, ...], mixed: bool, mesh: Mesh, replay_bucket_size: int = 0
               ) -> "StepFunctions":
        """The same functions for the same arguments, so that runs in one process (a resumed run, the
        tests) reuse what was compiled."""
        return cls(cfg, plan, opt, settings, num_customers=num_customers, variants=variants, mixed=mixed,
                   mesh=mesh, replay_bucket_size=replay_bucket_size)

    def init_state(self, params) -> TrainState:
        """A fresh optimiser around ``params``, replicated over the mesh."""
        return self.replicate(create_train_state(params, self.tx))

    def check_batch_size(self, size: int) -> None:
        if size % self.num_devices:
            raise ValueError(f"a batch of {size} instances cannot be split over {self.num_devices} devices; "
                             f"use a batch size divisible by {self.num_devices}")

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)

    def batch(self, key: jax.Array, size: int) -> Instance:
        self.check_batch_size(size)
        return self._batch(key, size)

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


def step_key(base_key: jax.Array, step: int) -> jax.Array:
    """The PRNG key of optimiser step ``step``: a pure function of the run's key and the step, so a
    resumed run draws exactly what an uninterrupted one would."""
    return jax.random.fold_in(base_key, step)
