"""The REINFORCE gradient one decoding step at a time (plan field ``backward=stepwise``; reference:
``reinforce.reinforce_gradients``, ``jax.grad`` through the teacher-forced ``reinforce.replay``).

The loss is linear in each step's log-probability, so its gradient is a sum over steps of one step's
vector-Jacobian product. ``stepwise_gradients`` runs the encoder once under ``jax.vjp``, then a
``lax.while_loop`` over exactly the steps the batch needed that re-runs each step's decoder under ``jax.vjp``
and accumulates the cotangents of the parameters and of the decoder cache; the cache's cotangent then goes
back through the encoder. Nothing is stored across steps, there is no forward replay before the backward
pass, no padding of the length to a bucket and one compilation for every length: faster than the replay on
a CPU and on a GPU, in a fraction of its memory (docs/performance.md, "Stepwise backward").
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mvmoe_jax.devices import DATA_AXIS
from mvmoe_jax.instances import Instance
from mvmoe_jax.nn.policy import Policy, PolicyConfig
from mvmoe_jax.rollout import RolloutOutput, decoding_keys, step_keys, trajectory_shardings


def encoder_vjp(policy: Policy, params, inst: Instance, rng: jax.Array):
    """``((cache, aux), vjp)``: the training-mode encoder and the decoder's precomputation without the
    query fusion (see ``Policy.precompute``), as a function of ``params``, run under ``jax.vjp`` with the
    encoder key a rollout from ``rng`` uses."""
    k_enc, _ = decoding_keys(rng, 1)

    def encoder(p):
        emb, aux = policy.apply(p, inst, True, method=Policy.encode, rngs={"gating": k_enc})
        return policy.apply(p, emb, False, locs=inst.locs, method=Policy.precompute), aux

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
    ``score_tables``: (node_scores, feature_scores) of the query fusion, without gradient, from which each step's
    attention scores are gathered instead of computed (the ``"given_scores"`` path of
    ``engines.decoder_attention``). With a decoder record in ``traj`` each step takes its attention and readout
    products from it instead."""

    def step_objective(t, p, c, gate_probs):
        if score_tables is not None:
            c = c.with_given_scores(*score_tables)
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
