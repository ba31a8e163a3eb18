"""Efficient active search (EAS; Hottung, Kwon & Tierney, ICLR 2022): the node embeddings of each instance adapted
by gradient steps while every weight of the model stays fixed (EAS-Emb).

Which EAS: EAS-Emb, the variant in which the encoder runs once and its output becomes per-instance parameters.
All of the node embeddings (B, 8, N, D) are adapted, one set per symmetric copy (``instances.augment_8``): the
decoder derives everything it reads per rollout from them (multi-head keys and values, the query's node part,
the single-head scoring keys, and the execution plan's fused tables, ``Policy.precompute``), so the adapted
decoder is the trained one given other embeddings, under every execution plan and without any change to the
policy. (The authors' POMO code adapts only the scoring keys, a copy of the embeddings; here that copy and the
embeddings the query and attention read are one array.) EAS-Lay would add two D x D products to every
decoding step of every trajectory, about as much work as a step of the fused decoder itself, where EAS-Emb's
extra work is the precompute once per iteration.

One iteration for one instance (``adapt_iteration``), following the paper's algorithm:

1. from each of the P POMO starts on each of the 8 copies, one rollout sampled by the decoder reading the
   current embeddings (``rollout.rollout``);
2. the incumbent (the best solution found so far; initially greedy x8's) becomes the best of those where it
   is shorter;
3. the loss (``eas_loss``): POMO's REINFORCE loss of the sampled rollouts (baseline: the mean reward over each
   copy's starts, ``reinforce.reinforce_loss``) plus ``imitation_weight`` x the incumbent's negative
   log-likelihood (mean over the copies), the log-likelihoods those of the decoder teacher-forced along the 8P
   sampled trajectories and the incumbent (``forced_log_likelihood``; on a copy whose mask forbids one of the
   incumbent's moves, float rounding at a time window or limit, its log-likelihood up to that move);
4. its gradient in the embeddings, one decoding step at a time (``eas_gradient``), and one Adam step (optax).

Defaults: learning rate 0.0041 and imitation weight 0.013, those of the authors' published search script
(the paper tunes both per problem; ``search.Settings`` takes others). Instances are independent: each has its
own embeddings, Adam state and random key (``fold_in(key, i)`` for the i-th instance of the batch), so results
do not depend on how many devices share them, nor on how many are adapted at once (``chunk``) but for float
rounding in the embeddings (about 1e-6), which may turn a later draw.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from mvmoe_jax import env, rollout
from mvmoe_jax.devices import DATA_AXIS, local_mesh
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance, augment_8
from mvmoe_jax.nn.policy import DecoderCache, Policy, PolicyConfig
from mvmoe_jax.reinforce import reinforce_loss

NUM_COPIES = 8                 # the symmetric copies of each instance (``instances.augment_8``), as the paper
LEARNING_RATE = 0.0041
IMITATION_WEIGHT = 0.013


@struct.dataclass
class AdaptState:
    """The search's state per instance (B): embeddings float32 (B, 8, N, D), the adapted node embeddings of each
    copy; opt_state, Adam's (optax) state for them (every leaf with the leading B); best_cost float32 (B,) and
    best_actions int32 (B, T + 1), the incumbent (start node, then T decoded nodes, as ``rollout.rollout``)."""

    embeddings: jax.Array
    opt_state: optax.OptState
    best_cost: jax.Array
    best_actions: jax.Array


def optimizer(learning_rate: float) -> optax.GradientTransformation:
    """Adam, as the paper."""
    return optax.adam(learning_rate)


@partial(jax.jit, static_argnames=("cfg", "plan"))
def encoded_copies(cfg: PolicyConfig, plan: ExecutionPlan, params, inst: Instance, key: jax.Array
                   ) -> tuple[Instance, jax.Array]:
    """The 8 copies of each instance of the batch (B, 8, ...) and the encoder's node embeddings of every copy
    (B, 8, N, D), from ``key``'s encoder key, as the greedy rollout ``key`` drives."""
    b = inst.locs.shape[0]
    emb, _ = rollout.encode_nodes(Policy(cfg, plan), params, rollout.augmented_batch(inst), key)   # (8B, N, D)
    emb = jnp.swapaxes(emb.reshape((NUM_COPIES, b) + emb.shape[1:]), 0, 1)                           # (B, 8, N, D)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), augment_8(inst)), emb


@partial(jax.jit, static_argnames=("cfg", "plan", "learning_rate"))
def start(cfg: PolicyConfig, plan: ExecutionPlan, params, inst: Instance, key: jax.Array, best_cost: jax.Array,
          best_actions: jax.Array, *, learning_rate: float) -> tuple[Instance, AdaptState]:
    """The 8 copies of each instance of the batch (B, 8, ...) and the initial state: the encoder's embeddings of
    every copy (from ``key``'s encoder key, as the greedy rollout ``key`` drives), fresh Adam state, and the
    incumbent given (greedy x8's cost (B,) and actions (B, T + 1))."""
    copies, emb = encoded_copies(cfg, plan, params, inst, key)
    opt_state = jax.vmap(optimizer(learning_rate).init)(emb)
    return copies, AdaptState(emb, opt_state, best_cost.astype(jnp.float32), best_actions.astype(jnp.int32))


def _decode(policy: Policy, params, cache: DecoderCache, states: env.State, mask: jax.Array, gate_probs,
            key: jax.Array):
    """One evaluation-mode decoding step as ``rollout.rollout`` takes it from step key ``key``: (log-probabilities
    (B, Q, N), aux loss, gate_probs)."""
    return policy.apply(params, cache, states.current, rollout.dynamic_features(states), mask, gate_probs, False,
                        method=Policy.decode, rngs={"gating": rollout.step_keys(key)[0]})


def _forced_start(policy: Policy, params, cache: DecoderCache, inst: Instance, actions: jax.Array, key: jax.Array,
                  gate_trajectories: int, with_vjp: bool = False):
    """(states (B, Q) after the start moves ``actions[..., 0]``, MVMoE-L's dense-or-MoE probabilities (None for
    other models) and, ``with_vjp``, their vjp in the cache). The probabilities come from the first step of the
    first ``gate_trajectories`` trajectories of each instance: the rollout's own batch."""
    states = env.batch_step(env.batch_reset(inst, actions.shape[1]), actions[..., 0])
    if not policy.cfg.hierarchical:
        return states, None, None
    g = gate_trajectories
    first = jax.tree.map(lambda x: x[:, :g], (states.current, rollout.dynamic_features(states),
                                              env.batch_action_mask(states)))

    def gate_probs(c):
        return policy.apply(params, c, *first, None, False, method=Policy.decode,
                            rngs={"gating": rollout.step_keys(key)[0]})[2]
    if with_vjp:
        return (states,) + jax.vjp(gate_probs, cache)
    return states, gate_probs(cache), None


def _forced_step(states: env.State, ok: jax.Array, action: jax.Array):
    """The masks of a step along forced moves ``action`` (B, Q): (mask for the decoder, counted: the move's
    log-probability belongs to the log-likelihood, ok after the move). A trajectory with a move its mask forbids
    (an incumbent found on another copy, whose float32 distances may round the other way at a time window or
    route limit) stops counting there, and reads a depot-only mask from then on so that its scores stay finite."""
    mask = env.batch_action_mask(states)
    active = ok & ~states.finished
    allowed = jnp.take_along_axis(mask, action[..., None], axis=-1)[..., 0]
    depot_only = jnp.arange(mask.shape[-1]) == 0
    return jnp.where(ok[..., None], mask, depot_only), active & allowed, ok & (allowed | ~active)


def forced_log_likelihood(policy: Policy, params, cache: DecoderCache, inst: Instance, actions: jax.Array,
                          keys: jax.Array, gate_trajectories: int) -> tuple[jax.Array, jax.Array]:
    """The decoder teacher-forced along given trajectories: (log-likelihood (B, Q), ok bool (B, Q)); the
    reference form of ``eas_gradient`` (``jax.grad`` of ``trajectory_weights . log-likelihood``).

    actions int32 (B, Q, T + 1): each trajectory's start node, then its T decoded nodes (depot after finishing);
    keys (T,): the step keys of the rollout (``rollout.decoding_keys``), so that the gating draws are its own.
    The environment is stepped along the actions; the log-likelihood sums the log-probabilities of the decoded
    moves (the start excluded, as ``rollout.rollout``) up to the first move its mask forbids (``ok`` False
    then, see ``_forced_step``), differentiably in ``cache``. MVMoE-L: see ``_forced_start``.
    """
    states, gate_probs, _ = _forced_start(policy, params, cache, inst, actions, keys[0], gate_trajectories)

    def body(carry, xs):
        states, ok = carry
        key, action = xs
        mask, counted, ok = _forced_step(states, ok, action)
        logp = _decode(policy, params, cache, states, mask, gate_probs, key)[0]
        picked = jnp.take_along_axis(logp, action[..., None], axis=-1)[..., 0]
        return (env.batch_step(states, action), ok), jnp.where(counted, picked, 0.0)

    steps = actions.shape[-1] - 1
    ok = jnp.ones(actions.shape[:2], bool)
    (_, ok), ll = jax.lax.scan(body, (states, ok), (keys[:steps], jnp.moveaxis(actions[..., 1:], -1, 0)))
    return ll.sum(0), ok


def eas_loss(log_likelihood: jax.Array, cost: jax.Array, usable: jax.Array, imitation_weight: float) -> jax.Array:
    """One instance's EAS loss from the log-likelihoods (A, P + 1) of its A copies' P sampled trajectories and then
    the incumbent: POMO's REINFORCE loss of the sampled ones (``reinforce.reinforce_loss``; baseline the mean
    reward over each copy's usable starts) plus ``imitation_weight`` x the incumbent's negative log-likelihood,
    the mean over the copies. cost (A, P) and usable (A, P) (a real POMO start that finished) of the sampled."""
    _, policy_gradient = reinforce_loss(log_likelihood[:, :-1], cost, usable, jnp.float32(0.0), 0.0)
    return policy_gradient - imitation_weight * jnp.mean(log_likelihood[:, -1])


def trajectory_weights(cost: jax.Array, usable: jax.Array, imitation_weight: float) -> jax.Array:
    """float32 (A, P + 1): ``eas_loss`` as a weighted sum of the log-likelihoods, ``sum(weights * ll)``: the loss
    is linear in them (the advantages are constants of the sampling pass), so the weights are its gradient."""
    ll = jnp.zeros((cost.shape[0], cost.shape[1] + 1), jnp.float32)
    return jax.grad(eas_loss)(ll, cost, usable, imitation_weight)


def eas_gradient(policy: Policy, params, emb: jax.Array, inst: Instance, actions: jax.Array, weights: jax.Array,
                 keys: jax.Array, gate_trajectories: int) -> jax.Array:
    """The gradient in the embeddings emb (B, N, D) of ``sum(weights * forced_log_likelihood(...)[0])``, one decoding
    step at a time: the loss is linear in each step's log-probabilities, so its gradient is the sum over steps
    of one step's vector-Jacobian product in the decoder cache; a ``lax.while_loop`` runs exactly the steps
    until every trajectory has finished and stores nothing across them (as training's
    ``engines.stepwise_backward``, where the backward of a replayed scan was several times slower), then the
    cache's cotangent goes back through ``Policy.precompute``. actions, keys, gate_trajectories: as
    ``forced_log_likelihood``; weights (B, Q)."""
    cache, cache_vjp = jax.vjp(lambda e: policy.apply(params, e, False, locs=inst.locs, method=Policy.precompute), emb)
    states, gate_probs, gate_vjp = _forced_start(policy, params, cache, inst, actions, keys[0], gate_trajectories,
                                                 with_vjp=True)
    steps = actions.shape[-1] - 1

    def body(carry):
        t, states, ok, g_cache, g_gate = carry
        action = jax.lax.dynamic_index_in_dim(actions, t + 1, axis=-1, keepdims=False)
        mask, counted, next_ok = _forced_step(states, ok, action)

        def objective(c, gp):
            logp = _decode(policy, params, c, states, mask, gp, keys[t])[0]
            picked = jnp.take_along_axis(logp, action[..., None], axis=-1)[..., 0]
            return jnp.sum(jnp.where(counted, weights * picked, 0.0))

        _, step_vjp = jax.vjp(objective, cache, gate_probs)
        d_cache, d_gate = step_vjp(jnp.float32(1.0))
        g_gate = None if g_gate is None else g_gate + d_gate
        return t + 1, env.batch_step(states, action), next_ok, jax.tree.map(jnp.add, g_cache, d_cache), g_gate

    def cond(carry):
        t, states, ok = carry[:3]
        return (t < steps) & ~jnp.all(states.finished | ~ok)

    zeros = partial(jax.tree.map, jnp.zeros_like)
    carry = (jnp.int32(0), states, jnp.ones(actions.shape[:2], bool), zeros(cache),
             None if gate_probs is None else zeros(gate_probs))
    _, _, _, g_cache, g_gate = jax.lax.while_loop(cond, body, carry)
    if gate_vjp is not None:
        g_cache = jax.tree.map(jnp.add, g_cache, gate_vjp(g_gate)[0])
    return cache_vjp(g_cache)[0]


def _sample(policy: Policy, params, copies: Instance, emb: jax.Array, key: jax.Array, *, starts: int):
    """One instance's sampled rollouts, decoder reading ``emb`` (A, N, D): actions (A, P, T + 1), cost (A, P),
    usable (A, P)."""
    cache = policy.apply(params, emb, locs=copies.locs, method=Policy.precompute)
    out = rollout.rollout(policy, params, copies, pomo_size=starts, decode_type="sampling", rng=key,
                          encoded=(cache, jnp.float32(0.0)))
    return out.actions, out.cost, out.valid & out.finished


def _adapt(policy: Policy, params, tx: optax.GradientTransformation, imitation_weight: float, copies: Instance,
           emb: jax.Array, opt_state, trajectories: jax.Array, cost: jax.Array, usable: jax.Array, key: jax.Array):
    """One instance's Adam step on its embeddings (A, N, D) from the loss of ``trajectories`` (A, P + 1, T + 1):
    the sampled ones, then the incumbent. Returns (embeddings, opt_state)."""
    _, keys = rollout.decoding_keys(key, trajectories.shape[-1] - 1)
    weights = trajectory_weights(cost, usable, imitation_weight)
    grads = eas_gradient(policy, params, emb, copies, trajectories, weights, keys, cost.shape[-1])
    updates, opt_state = tx.update(grads, opt_state, emb)
    return optax.apply_updates(emb, updates), opt_state


def _adapt_chunk(policy: Policy, tx: optax.GradientTransformation, imitation_weight: float, starts: int, params,
                 key: jax.Array, copies: Instance, state: AdaptState, index: jax.Array) -> AdaptState:
    """An iteration for a chunk of C instances (every argument but params and key with the leading C), each
    instance drawing from ``fold_in(key, index)``."""
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(index)
    actions, cost, usable = jax.vmap(partial(_sample, policy, params, starts=starts))(
        copies, state.embeddings, keys)                                                   # (C, A, P, ...)
    c, a, p, t1 = actions.shape
    sampled = jnp.where(usable, cost, jnp.inf).reshape(c, a * p)
    best = jnp.argmin(sampled, axis=-1)
    found = jnp.take_along_axis(actions.reshape(c, a * p, t1), best[:, None, None], axis=1)[:, 0]
    better = sampled.min(-1) < state.best_cost
    best_cost = jnp.where(better, sampled.min(-1), state.best_cost)
    best_actions = jnp.where(better[:, None], found, state.best_actions)
    incumbent = jnp.broadcast_to(best_actions[:, None, None, :], (c, a, 1, t1))
    trajectories = jnp.concatenate([actions, incumbent], axis=2)                          # (C, A, P + 1, T + 1)
    adapt = partial(_adapt, policy, params, tx, imitation_weight)
    emb, opt_state = jax.vmap(adapt)(copies, state.embeddings, state.opt_state, trajectories, cost, usable, keys)
    return AdaptState(emb, opt_state, best_cost, best_actions)


@partial(jax.jit, static_argnames=("cfg", "plan", "starts", "chunk", "num_devices", "learning_rate",
                                   "imitation_weight"))
def adapt_iteration(cfg: PolicyConfig, plan: ExecutionPlan, params, copies: Instance, state: AdaptState,
                    key: jax.Array, *, starts: int, chunk: int, num_devices: int, learning_rate: float,
                    imitation_weight: float) -> AdaptState:
    """One EAS iteration for a batch (B): ``copies`` (B, 8, ...) and ``state`` from ``start``; instance i draws
    from ``fold_in(key, i)``. ``chunk`` instances are adapted at once (``lax.map`` over chunks), the chunks dealt
    out over ``num_devices`` devices (see the module docstring for what results depend on)."""
    policy, tx = Policy(cfg, plan), optimizer(learning_rate)
    b = copies.locs.shape[0]
    per_device = -(-b // (chunk * num_devices)) * chunk
    idx = jnp.concatenate([jnp.arange(b), jnp.zeros(per_device * num_devices - b, jnp.int32)])
    xs = jax.tree.map(lambda x: x[idx], (copies, state, jnp.arange(b)))

    def by_chunks(params, key, copies, state, index):
        def one(args):
            return _adapt_chunk(policy, tx, imitation_weight, starts, params, key, *args)
        chunked = jax.tree.map(lambda x: x.reshape((-1, chunk) + x.shape[1:]), (copies, state, index))
        out = jax.lax.map(one, chunked)
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)

    if num_devices == 1:
        out = by_chunks(params, key, *xs)
    else:
        # check_vma=False: the rollout's loop starts its log-likelihood sum from zeros that do not vary over the
        # devices and adds sampled choices that do; each device's instances are its own.
        out = jax.shard_map(by_chunks, mesh=local_mesh(num_devices),
                            in_specs=(P(), P(), P(DATA_AXIS), P(DATA_AXIS), P(DATA_AXIS)), out_specs=P(DATA_AXIS),
                            check_vma=False)(params, key, *xs)
        # Replicated, as the state came in, so that the next iteration takes it as it is.
        out = jax.lax.with_sharding_constraint(out, NamedSharding(local_mesh(num_devices), P()))
    return jax.tree.map(lambda x: x[:b], out)


def default_chunk(num_instances: int, num_devices: int, plan: ExecutionPlan) -> int:
    """Instances adapted at once before any memory limit: one on a plan that decodes in cache-sized chunks (a CPU:
    an instance's 8 copies already make hundreds of trajectories), else a device's whole share."""
    share = -(-num_instances // num_devices)
    return 1 if plan.eval_chunk_trajectories else share


def adapted_arrays(state: AdaptState, real: int) -> np.ndarray:
    """The first ``real`` instances' adapted embeddings on the host: float32 (real, 8, N, D)."""
    return np.asarray(jax.device_get(state.embeddings[:real]), np.float32)
