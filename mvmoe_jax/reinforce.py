"""REINFORCE with the POMO shared baseline, as the paper trains: sample, replay, loss, ``jax.grad``.

One training step of the paper (the reference ``Trainer._train_one_batch``):

1. ``sample_trajectories``: every POMO start of every instance decoded by sampling in training mode (MoE
   gating noise on), recording what the decoder saw at every step (mask, dynamic features; the current node
   is the previous action). ``lax.while_loop`` decodes, so this pass takes no gradient.
2. ``replay``: the decoder re-run on the recorded inputs (teacher forcing) with the same per-step keys (the
   same gating noise and MVMoE-L branch draws), so its log-likelihood equals the sampled one; differentiable.
3. ``reinforce_loss``: ``reward = -cost``; per instance the baseline is the mean reward over its valid POMO
   starts; ``loss = mean over valid (instance, start) of -(reward - baseline) * log_likelihood + w * aux``,
   ``aux`` the MoE load-balancing loss of the encoder and every decoding step (already weighted by the MoE
   layers' ``loss_coef`` = 1e-3, like the reference's ``model.aux_loss``). Padded POMO starts (mixed batches
   with backhaul variants) are excluded from both means.
4. ``reinforce_gradients``: ``jax.grad`` of that loss through the replay.

``training.train_step`` applies the optimiser; under the execution plan's ``backward=stepwise`` it takes the
same gradient one decoding step at a time (``engines.stepwise_backward``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mvmoe_jax.instances import Instance
from mvmoe_jax.nn.policy import Policy
from mvmoe_jax.rollout import RolloutOutput, decoding_keys, rollout, step_keys


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


def replay(policy: Policy, params, inst: Instance, traj: RolloutOutput, rng: jax.Array, *, num_steps: int,
           steps_at_once: int = 8, remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced decoding of the recorded trajectories over their first ``num_steps`` (static)
    steps: (log-likelihood (B, P), auxiliary loss ()), differentiable in ``params``.

    ``steps_at_once`` steps are decoded together (vmapped; more feeds an accelerator larger products, fewer
    suits a CPU's caches) and ``remat`` recomputes them in the backward pass instead of storing their
    activations: the plan's ``replay_steps_at_once`` and ``replay_remat``; the same gradient either way.

    ``num_steps`` must cover ``traj.num_steps``; steps past it contribute neither log-probability nor
    auxiliary loss. ``rng`` is the key the trajectories were sampled with.
    """
    cfg = policy.cfg
    k_enc, keys = decoding_keys(rng, num_steps)
    emb, aux_enc = policy.apply(params, inst, True, method=Policy.encode, rngs={"gating": k_enc})
    # No query fusion: see precompute.
    cache = policy.apply(params, emb, False, locs=inst.locs, method=Policy.precompute)
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
    ll, aux = jax.lax.map(one_step, xs, batch_size=min(steps_at_once, num_steps))
    return ll.sum(0), aux_enc + aux.sum()


def reinforce_loss(log_likelihood: jax.Array, cost: jax.Array, valid: jax.Array, aux_loss: jax.Array,
                   aux_loss_coef: float, *, cost_divisor: jax.Array | None = None,
                   leader_advantage: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(total loss, policy-gradient part) with the POMO shared baseline over the valid starts.

    log_likelihood, cost, valid: (B, P). The advantage is a constant (costs come from the sampling pass).
    cost_divisor: float (B,) or None: each instance's rewards are ``-cost / divisor`` (reward normalisation,
    ``training.variant_cost_scale``). leader_advantage: each instance's best valid start (the first of equal
    ones) has its advantage multiplied by this (the "leader reward" of Wang et al., 2024; 1: plain POMO).
    """
    reward = jnp.where(valid, -cost, 0.0)
    if cost_divisor is not None:
        reward = reward / cost_divisor[:, None]
    count = jnp.maximum(valid.sum(-1, keepdims=True), 1)
    advantage = jnp.where(valid, reward - reward.sum(-1, keepdims=True) / count, 0.0)
    if leader_advantage != 1.0:
        leader = jax.nn.one_hot(jnp.argmax(jnp.where(valid, reward, -jnp.inf), -1), reward.shape[-1], dtype=bool)
        advantage = jnp.where(leader & valid, leader_advantage * advantage, advantage)
    advantage = jax.lax.stop_gradient(advantage)
    pg = -jnp.sum(advantage * log_likelihood) / jnp.maximum(valid.sum(), 1)
    return pg + aux_loss_coef * aux_loss, pg


def reinforce_gradients(policy: Policy, params, inst: Instance, traj: RolloutOutput, rng: jax.Array, *,
                        num_steps: int, aux_loss_coef: float, steps_at_once: int = 8, remat: bool = False,
                        **loss_options):
    """((loss, (policy-gradient part, aux, log-likelihood (B, P))), gradient in ``params``) of the REINFORCE
    loss of the trajectories ``traj`` sampled from ``rng``, by ``jax.grad`` through ``replay`` over
    ``num_steps`` steps (``steps_at_once`` and ``remat``: see ``replay``; ``loss_options``: the keyword
    options of ``reinforce_loss``)."""

    def loss_fn(p):
        ll, aux = replay(policy, p, inst, traj, rng, num_steps=num_steps, steps_at_once=steps_at_once, remat=remat)
        loss, pg = reinforce_loss(ll, traj.cost, traj.valid, aux, aux_loss_coef, **loss_options)
        return loss, (pg, aux, ll)

    return jax.value_and_grad(loss_fn, has_aux=True)(params)
