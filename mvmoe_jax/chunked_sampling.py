"""Training's sampling pass decoded a few instances at a time on each device (CPU).

``rollout.rollout(..., decode_type='sampling', train=True, record=True)`` decodes a device's whole share of the
batch at every step (1,600 trajectories for 32 instances of n = 50). On a CPU a decoding step over about 100
trajectories keeps its scores, masks and softmax in the core's cache (see ``rollout.chunk_instances``), and a device
that decodes its own instances needs no collective at any step. ``chunked_sampling`` decodes each device's instances
in chunks of that size, one after another, and returns what the whole-batch rollout returns: the same sampled
actions, log-likelihoods, costs, step count and record of the decoder's inputs (``RolloutOutput``), so that the
backward pass (``engines.stepwise_backward.stepwise_gradients``) is unchanged. "The same" up to the float rounding
of products over fewer rows (1e-6 relative in the tests, bitwise on a two-device mesh there), which can flip a
sampled choice whose uniform lies within that rounding of a node's cumulative probability.

What makes the chunks equal to the whole batch:

- Every random draw is the whole batch's. Step t's gating noise of the decoder MoE and the uniforms of the
  sampled choice are drawn for the whole batch from step t's key before decoding (``Policy.decoder_gating_noise``,
  ``sampling_uniforms``; (T, B x P, E) and (T, B, P) floats) and each chunk takes its rows.
- A chunk stops when its own trajectories have finished, after one more step over the finished states: the
  whole batch keeps decoding finished trajectories until every trajectory has finished, and the backward pass
  reads their inputs (the decoder MoE's load-balancing loss counts every token). A finished trajectory's
  inputs no longer change (at the depot, load, time and length reset, only the depot feasible), so that extra
  step's record is copied into the steps up to the batch's last.
- MVMoE-L is left to the whole-batch rollout: its dense-or-MoE probabilities come from the first step's
  attention over the whole batch.

The one output that differs is ``aux_loss``: the encoder's only. The decoder MoE's loss at a step is a
function of the whole batch's gate statistics, which no chunk sees; training takes its value and gradient
from the backward pass, which recomputes every step over the whole batch (``train_step``'s loss weights do
not depend on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mvmoe_jax.devices import DATA_AXIS, largest_divisor_at_most
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance
from mvmoe_jax.nn.policy import DecoderCache, DecoderRecord, Policy, PolicyConfig
from mvmoe_jax.rollout import (RolloutOutput, choice_uniforms, chunk_instances, decode_one_step, decoder_storage,
                               decoding_keys, initial_states, start_nodes, step_keys)


def sampling_chunk_size(cfg: PolicyConfig, plan: ExecutionPlan, pomo_size: int, per_device_batch: int) -> int | None:
    """Instances per chunk of ``chunked_sampling`` for a device's share of ``per_device_batch`` instances: the
    largest divisor of that share within ``rollout.chunk_instances`` of the plan's
    ``sampling_chunk_trajectories``; None (decode the whole share at once) where the plan has no chunks, for
    MVMoE-L (see the module docstring) and where one chunk would be the whole share. See docs/performance.md,
    "Chunked sampling"."""
    most = chunk_instances(pomo_size, plan.sampling_chunk_trajectories)
    if most is None or cfg.hierarchical or per_device_batch < 1:
        return None
    chunk = largest_divisor_at_most(most, per_device_batch)
    return None if chunk == per_device_batch else chunk


def sampling_uniforms(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """(T,) + shape: the uniforms that ``rollout.sample_actions`` draws at each step from its choice key
    (``rollout.step_keys``)."""
    return jax.vmap(lambda key: choice_uniforms(step_keys(key)[1], shape))(keys)


def decoder_gating_noise(policy: Policy, params, keys: jax.Array, num_units: int) -> jax.Array | None:
    """(T, num_units, E): the decoder MoE's gating noise at each step, from its gating key
    (``rollout.step_keys``); None for a decoder without an MoE."""
    if not policy.cfg.moe_at("Dec"):
        return None
    return jax.vmap(lambda key: policy.apply(params, num_units, method=Policy.decoder_gating_noise,
                                             rngs={"gating": step_keys(key)[0]}))(keys)


def chunked_sampling(policy: Policy, params, inst: Instance, rng: jax.Array, *, pomo_size: int, max_steps: int,
                     encoded: tuple[DecoderCache, jax.Array], chunk: int, mesh: Mesh | None = None,
                     record_decoder: bool = False, decoder_buffers: DecoderRecord | None = None) -> RolloutOutput:
    """``rollout.rollout(policy, params, inst, pomo_size=pomo_size, decode_type='sampling', rng=rng,
    train=True, max_steps=max_steps, record=True, encoded=encoded, record_decoder=record_decoder,
    decoder_buffers=decoder_buffers)`` decoded ``chunk`` instances at a time on each device of ``mesh`` (its
    one ``'data'`` axis splits the batch; None: one device), with the same result except ``aux_loss`` (see the
    module docstring) and the record's dynamic features at step ``num_steps``, which no step reads (the whole
    batch leaves zeros there, a chunk may leave its last step's). ``chunk`` must divide each device's share of
    the batch. jit-compatible (``policy``, ``pomo_size``, ``max_steps``, ``chunk``, ``mesh``, ``record_decoder``
    static)."""
    if policy.cfg.hierarchical:
        raise ValueError("MVMoE-L's gate needs the whole batch's first step: use rollout.rollout")
    if decoder_buffers is not None and not record_decoder:
        raise ValueError("decoder_buffers are storage for the decoder record: pass record_decoder=True")
    cache, aux = encoded
    b = inst.locs.shape[0]
    num_devices = 1 if mesh is None else mesh.devices.size
    if b % num_devices or (b // num_devices) % chunk:
        raise ValueError(f"chunks of {chunk} instances do not divide a batch of {b} over {num_devices} devices")
    p = min(pomo_size, inst.locs.shape[-2] - 1)                   # starts per instance (start_nodes)
    _, keys = decoding_keys(rng, max_steps)
    uniforms = sampling_uniforms(keys, (b, p))                      # (T, B, P)
    noise = decoder_gating_noise(policy, params, keys, b * p)       # (T, B x P, E) or None
    if noise is not None:
        noise = noise.reshape((max_steps, b, p, -1))

    def local(params, inst, cache, uniforms, noise, decoder_buffers):
        out, chunk_steps = _sample_in_chunks(policy, params, inst, cache, keys, uniforms, noise, decoder_buffers,
                                             pomo_size=pomo_size, chunk=chunk, record_decoder=record_decoder)
        num_steps = jnp.max(chunk_steps)
        if mesh is not None:
            num_steps = jax.lax.pmax(num_steps, DATA_AXIS)
        return _repeat_last_steps(out.replace(num_steps=num_steps), chunk_steps, chunk)

    if mesh is None:
        out = local(params, inst, cache, uniforms, noise, decoder_buffers)
    else:
        batch, stepped = P(DATA_AXIS), P(None, DATA_AXIS)
        out_specs = RolloutOutput(actions=batch, log_likelihood=batch, cost=batch, valid=batch, finished=batch,
                                  aux_loss=P(), num_steps=P(), masks=stepped, dynamic=stepped, active=stepped,
                                  decoder=stepped if record_decoder else None)
        # check_vma off: num_steps is made equal on every device by the pmax above.
        out = jax.shard_map(local, mesh=mesh, in_specs=(P(), batch, batch, stepped, stepped, stepped),
                            out_specs=out_specs, check_vma=False)(params, inst, cache, uniforms, noise,
                                                                  decoder_buffers)
    return out.replace(aux_loss=aux)


def _sample_in_chunks(policy: Policy, params, inst: Instance, cache: DecoderCache, keys: jax.Array,
                      uniforms: jax.Array, noise: jax.Array | None, decoder_buffers: DecoderRecord | None, *,
                      pomo_size: int, chunk: int, record_decoder: bool) -> tuple[RolloutOutput, jax.Array]:
    """One device's part of ``chunked_sampling``: its B' instances (B' / chunk chunks, one after another) with
    their rows of the step draws, uniforms (T, B', P) and noise (T, B', P, E) or None: (the output, its
    ``aux_loss`` zero and ``num_steps`` this device's, and the steps each chunk needed (B' / chunk,))."""
    b = inst.locs.shape[0]
    steps = keys.shape[0]
    starts, valid = start_nodes(inst, pomo_size)
    p = starts.shape[1]
    take = lambda x, off: jax.lax.dynamic_slice_in_dim(x, off, chunk, axis=0)

    def step(c_cache, states, t, off):
        """Step t of the chunk at offset ``off``, with its rows of step t's draws."""
        row = lambda x: jax.lax.dynamic_slice_in_dim(x[t], off, chunk, axis=0)
        given = {} if noise is None else {"gating_noise": row(noise).reshape(chunk * p, -1)}
        return decode_one_step(policy, params, c_cache, states, None, keys[t], decode_type="sampling", train=True,
                               log_likelihood=True, record_decoder=record_decoder, uniform=row(uniforms), **given)

    # The record's shapes: one step of the first chunk, traced only.
    c_inst0 = jax.tree.map(lambda x: take(x, 0), inst)
    c_cache0 = jax.tree.map(lambda x: take(x, 0), cache)
    first = jax.eval_shape(lambda: step(c_cache0, initial_states(c_inst0, pomo_size)[0], 0, 0)[-1])
    stepped = lambda s: jnp.zeros((steps, b) + s.shape[1:], s.dtype)
    buffers = {
        "actions": jnp.zeros((b, p, steps + 1), jnp.int32).at[:, :, 0].set(starts),
        # Unrun steps look like finished trajectories: only the depot feasible.
        "masks": stepped(first[0]).at[..., 0].set(True), "dynamic": stepped(first[1]), "active": stepped(first[2]),
        "log_likelihood": jnp.zeros((b, p), jnp.float32), "cost": jnp.zeros((b, p), jnp.float32),
        "finished": jnp.zeros((b, p), bool), "steps": jnp.zeros((b // chunk,), jnp.int32)}
    if record_decoder:
        device_step = jax.tree.map(lambda s: jax.ShapeDtypeStruct((b,) + s.shape[1:], s.dtype), first[3])
        buffers["decoder"] = decoder_storage(device_step, steps, decoder_buffers)

    def write_step(bufs, t, off, action, record_t):
        at = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[None], (t, off) + (0,) * (x.ndim - 1))
        bufs = dict(bufs)
        bufs["actions"] = jax.lax.dynamic_update_slice(bufs["actions"], action[..., None], (off, 0, t + 1))
        for name, x in zip(("masks", "dynamic", "active"), record_t[:3]):
            bufs[name] = at(bufs[name], x)
        if record_decoder:
            bufs["decoder"] = jax.tree.map(at, bufs["decoder"], record_t[3])
        return bufs

    def run_chunk(i, bufs):
        off = i * chunk
        c_cache = jax.tree.map(lambda x: take(x, off), cache)
        states = initial_states(jax.tree.map(lambda x: take(x, off), inst), pomo_size)[0]

        def cond(carry):
            t, _, _, _, stop = carry
            return (t < steps) & ~stop

        def body(carry):
            t, states, ll, bufs, _ = carry
            # A step over states that have all finished is the chunk's last: its record serves the steps after.
            all_done = jnp.all(states.finished)
            states, action, chosen, _, _, record_t = step(c_cache, states, t, off)
            return t + 1, states, ll + chosen, write_step(bufs, t, off, action, record_t), all_done

        ll = jnp.zeros((chunk, p), jnp.float32)
        t, states, ll, bufs, stop = jax.lax.while_loop(cond, body, (jnp.int32(0), states, ll, bufs,
                                                                    jnp.asarray(False)))
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, off, axis=0)
        bufs = dict(bufs, log_likelihood=put(bufs["log_likelihood"], ll), cost=put(bufs["cost"], states.cost),
                    finished=put(bufs["finished"], states.finished))
        bufs["steps"] = bufs["steps"].at[i].set(t - stop.astype(jnp.int32))
        return bufs

    bufs = jax.lax.fori_loop(0, b // chunk, run_chunk, buffers)
    out = RolloutOutput(actions=bufs["actions"], log_likelihood=bufs["log_likelihood"],
                        cost=jnp.where(valid, bufs["cost"], jnp.inf), valid=valid, finished=bufs["finished"],
                        aux_loss=jnp.zeros((), jnp.float32), num_steps=jnp.max(bufs["steps"]), masks=bufs["masks"],
                        dynamic=bufs["dynamic"], active=bufs["active"], decoder=bufs.get("decoder"))
    return out, bufs["steps"]


def _repeat_last_steps(out: RolloutOutput, chunk_steps: jax.Array, chunk: int) -> RolloutOutput:
    """``out`` with each chunk's record of its last step (over its finished states, step s = its steps run)
    copied into steps s + 1 .. ``out.num_steps`` - 1, which the whole batch decodes over those unchanged
    inputs: the dynamic features and the decoder record (the masks and the active flags already hold what a
    finished trajectory shows). chunk_steps (C,): the steps each chunk needed."""

    def fill_chunk(i, stepped):
        last, off = chunk_steps[i], i * chunk

        def copy(t, stepped):
            def one(buf):
                start = (0,) * (buf.ndim - 2)
                row = jax.lax.dynamic_slice(buf, (last, off) + start, (1, chunk) + buf.shape[2:])
                return jax.lax.dynamic_update_slice(buf, row, (t, off) + start)
            return jax.tree.map(one, stepped)

        return jax.lax.fori_loop(last + 1, out.num_steps, copy, stepped)

    dynamic, decoder = jax.lax.fori_loop(0, chunk_steps.shape[0], fill_chunk, (out.dynamic, out.decoder))
    return out.replace(dynamic=dynamic, decoder=decoder)
