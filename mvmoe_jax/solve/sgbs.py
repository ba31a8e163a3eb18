"""Simulation-guided beam search (SGBS; Choo, Kwon, Kim, Jae, Hottung, Tierney & Gwon, NeurIPS 2022): a beam search
over partial solutions, pruned by the cost of a greedy rollout of the policy from each candidate.

One pass for one instance, on each of its 8 symmetric copies (``instances.augment_8``) separately, with beam width
W and expansion factor G:

1. greedy rollouts from every POMO start (``first_rollouts``); the beam starts as the W start nodes whose rollouts
   are shortest (pass r: those ranked r W .. r W + W - 1, so that a later pass begins elsewhere), each node's value
   the cost of its rollout, which it keeps as its known completion (``initial_beam``);
2. at each depth (``depth_step``) every beam node has G children: the next move of its known completion (whose
   value is known: the node's own) and the G - 1 moves the policy ranks highest among the others that the mask
   allows (a node with fewer such moves has fewer children);
3. simulation: a greedy rollout from each new child to the end of the route set; its cost is the child's value,
   its routes the child's known completion;
4. pruning: the W children of lowest value form the next beam (ties in order, the known children first).

The incumbent (per instance, over its copies) is the best finished rollout seen: greedy x8's at first, then any
rollout of steps 1 or 3 that is shorter, so a search never returns worse than greedy. A pass ends when every beam
node of every instance has finished, after at most 2n depths. Known completions are kept whole, so a known
child's value is exactly that of the routes kept for it. Shapes are fixed: each depth simulates 8 W (G - 1)
rollouts per instance (a child the mask forbids is simulated as a copy of the known child and never chosen).

Instances are independent (vmapped, ``chunk`` at a time under ``lax.map``, the chunks dealt out over the devices),
each drawing its keys from its own index, so results do not depend on the batch solved with them. The decoder
reads the node embeddings given: the encoder's (``eas.encoded_copies``) or EAS's adapted ones, which SGBS + EAS
(``search.sgbs_eas_search``) alternates with EAS iterations over one incumbent, as the authors' published code
does. The beam search itself draws nothing; its keys drive only MVMoE-L's dense-or-MoE draws.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from mvmoe_jax import env, rollout
from mvmoe_jax.devices import DATA_AXIS, local_mesh
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance
from mvmoe_jax.nn.policy import Policy, PolicyConfig

BEAM_WIDTH = 4           # the authors' CVRP settings: beam width 4, expansion factor 4
EXPANSION = 4

# A State's fields that belong to one trajectory (the others, the instance and its distances, to the instance).
_TRAJECTORY_FIELDS = tuple(f for f in env.State.__dataclass_fields__ if f not in ("instance", "distances"))


@struct.dataclass
class FirstRollouts:
    """Greedy rollouts from every start of every copy (B, 8, P): cost float32 (+inf where unfinished or not a real
    start), actions int32 (B, 8, P, T + 1) (start node, then T = 2n decoded nodes); gate_probs float32 (B, 2),
    MVMoE-L's dense-or-MoE probabilities from each instance's first step (zeros for other models)."""

    cost: jax.Array
    actions: jax.Array
    gate_probs: jax.Array


@struct.dataclass
class Beam:
    """The beam of each copy of each instance (B, 8, W): states, env.State after the nodes' moves so far (the
    instance and distances (B, 8)); completion int32 (B, 8, W, T + 1), each node's known completion (its moves so
    far, then the rest of the best rollout from it); value float32 (B, 8, W), the completion's cost (+inf when it
    did not finish); gate_probs (B, 2) as ``FirstRollouts``."""

    states: env.State
    completion: jax.Array
    value: jax.Array
    gate_probs: jax.Array


def _take(states: env.State, index: jax.Array) -> env.State:
    """The trajectories ``index`` int (A, Q) of states (A, W) along their second axis: states (A, Q)."""
    def take(x):
        return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)
    return states.replace(**{f: take(getattr(states, f)) for f in _TRAJECTORY_FIELDS})


def _concat(a: env.State, b: env.State) -> env.State:
    """States (A, Q1) and (A, Q2) of the same copies as (A, Q1 + Q2)."""
    return a.replace(**{f: jnp.concatenate([getattr(a, f), getattr(b, f)], axis=1) for f in _TRAJECTORY_FIELDS})


def _gate_probs(policy: Policy, params, cache, states: env.State, key: jax.Array) -> jax.Array:
    """MVMoE-L's dense-or-MoE probabilities (2,) from a decoding step of ``states`` (A, Q), as a rollout computes
    them at its first step; zeros for a model without that gate."""
    if not policy.cfg.hierarchical:
        return jnp.zeros((2,), jnp.float32)
    return policy.apply(params, cache, states.current, rollout.dynamic_features(states), env.batch_action_mask(states),
                        None, False, False, method=Policy.decode, rngs={"gating": rollout.step_keys(key)[0]})[2]


def _first_one(policy: Policy, starts: int, params, key: jax.Array, copies: Instance, emb: jax.Array, index):
    """One instance's ``FirstRollouts`` (without the batch axis): copies (A, ...), emb (A, N, D)."""
    key = jax.random.fold_in(key, index)
    cache = policy.apply(params, emb, locs=copies.locs, method=Policy.precompute)
    states, _, _ = rollout.initial_states(copies, starts)
    gate_probs = _gate_probs(policy, params, cache, states, key)
    out = rollout.rollout(policy, params, copies, pomo_size=starts, decode_type="greedy", rng=key,
                          encoded=(cache, jnp.float32(0.0)), gate_probs=gate_probs, log_likelihood=False)
    return FirstRollouts(cost=jnp.where(out.finished, out.cost, jnp.inf), actions=out.actions, gate_probs=gate_probs)


def _depth_one(policy: Policy, expansion: int, params, key: jax.Array, depth: jax.Array, copies: Instance,
               emb: jax.Array, beam: Beam, best_cost: jax.Array, best_actions: jax.Array, index):
    """One instance's depth (without the batch axis): (beam, best_cost (), best_actions (T + 1,), done ())."""
    key = jax.random.fold_in(jax.random.fold_in(key, index), depth)
    k_expand, k_simulate = jax.random.split(key)
    cache = policy.apply(params, emb, locs=copies.locs, method=Policy.precompute)
    states, completion = beam.states, beam.completion
    a, w, t1 = completion.shape
    g = expansion - 1
    mask = env.batch_action_mask(states)                                                  # (A, W, N)
    logits = policy.apply(params, cache, states.current, rollout.dynamic_features(states), mask, beam.gate_probs,
                          False, False, method=Policy.decode, rngs={"gating": rollout.step_keys(k_expand)[0]})[0]
    known = jax.lax.dynamic_index_in_dim(completion, depth + 1, axis=-1, keepdims=False)    # (A, W)
    nodes = jnp.arange(mask.shape[-1])
    others = jnp.where(mask & (nodes != known[..., None]), logits, -jnp.inf)
    top, moves = jax.lax.top_k(others, g)                                                # (A, W, G)
    valid = (top > -jnp.inf) & ~states.finished[..., None]
    moves = jnp.where(valid, moves, known[..., None]).reshape(a, w * g)
    valid = valid.reshape(a, w * g)

    parent = jnp.broadcast_to(jnp.repeat(jnp.arange(w), g), (a, w * g))
    children = env.batch_step(_take(states, parent), moves)                                # (A, W G)
    position = jnp.arange(t1)
    prefix = jnp.take_along_axis(completion, parent[..., None], axis=1)
    trajectories = jnp.where(position == depth + 1, moves[..., None], jnp.where(position > depth + 1, 0, prefix))

    def unfinished(carry):
        t, s, _ = carry
        return (t < t1 - 1) & ~jnp.all(s.finished)

    def simulate(carry):
        t, s, traj = carry
        s, action = rollout.decode_one_step(policy, params, cache, s, beam.gate_probs, jax.random.fold_in(k_simulate, t),
                                            decode_type="greedy", train=False, log_likelihood=False,
                                            record_decoder=False)[:2]
        return t + 1, s, jnp.where(position == t + 1, action[..., None], traj)

    _, end, trajectories = jax.lax.while_loop(unfinished, simulate, (depth + 1, children, trajectories))
    value = jnp.where(valid & end.finished, end.cost, jnp.inf)                             # (A, W G)

    found = jnp.argmin(value.reshape(-1))
    better = value.reshape(-1)[found] < best_cost
    best_cost = jnp.where(better, value.reshape(-1)[found], best_cost)
    best_actions = jnp.where(better, trajectories.reshape(-1, t1)[found], best_actions)

    candidates = _concat(env.batch_step(states, known), children)                          # (A, W + W G)
    values = jnp.concatenate([beam.value, value], axis=1)
    keep = jnp.argsort(values, axis=1, stable=True)[:, :w]                                 # (A, W)
    beam = Beam(states=_take(candidates, keep), value=jnp.take_along_axis(values, keep, axis=1),
                completion=jnp.take_along_axis(jnp.concatenate([completion, trajectories], axis=1), keep[..., None],
                                               axis=1),
                gate_probs=beam.gate_probs)
    return beam, best_cost, best_actions, jnp.all(beam.states.finished)


def _by_instance(one, shared: tuple, batched: tuple, *, chunk: int, num_devices: int):
    """``one(*shared, *instance's args, index)`` for every instance of the batched args (leading B): vmapped over
    ``chunk`` instances at a time (``lax.map``), the chunks dealt out over ``num_devices`` devices (the batch padded
    with copies of its first instance); the outputs replicated over the devices, with the leading B."""
    b = jax.tree.leaves(batched)[0].shape[0]
    per_device = -(-b // (chunk * num_devices)) * chunk
    idx = jnp.concatenate([jnp.arange(b), jnp.zeros(per_device * num_devices - b, jnp.int32)])
    xs = jax.tree.map(lambda x: x[idx], batched + (jnp.arange(b),))

    def by_chunks(shared, xs):
        chunked = jax.tree.map(lambda x: x.reshape((-1, chunk) + x.shape[1:]), xs)
        out = jax.lax.map(lambda c: jax.vmap(partial(one, *shared))(*c), chunked)
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)

    if num_devices == 1:
        out = by_chunks(shared, xs)
    else:
        mesh = local_mesh(num_devices)
        # check_vma=False: as eas.adapt_iteration; each device's instances are its own.
        out = jax.shard_map(by_chunks, mesh=mesh, in_specs=(P(), P(DATA_AXIS)), out_specs=P(DATA_AXIS),
                            check_vma=False)(shared, xs)
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P()))
    return jax.tree.map(lambda x: x[:b], out)


@partial(jax.jit, static_argnames=("cfg", "plan", "starts", "chunk", "num_devices"))
def first_rollouts(cfg: PolicyConfig, plan: ExecutionPlan, params, copies: Instance, emb: jax.Array, key: jax.Array,
                   *, starts: int, chunk: int, num_devices: int) -> FirstRollouts:
    """Greedy rollouts from ``starts`` POMO starts of every copy, the decoder reading ``emb`` (B, 8, N, D);
    copies (B, 8, ...)."""
    one = partial(_first_one, Policy(cfg, plan), starts)
    return _by_instance(one, (params, key), (copies, emb), chunk=chunk, num_devices=num_devices)


@partial(jax.jit, static_argnames=("width",))
def initial_beam(copies: Instance, first: FirstRollouts, offset: jax.Array, best_cost: jax.Array,
                 best_actions: jax.Array, *, width: int) -> tuple[Beam, jax.Array, jax.Array]:
    """(Beam of ``width`` nodes per copy, best_cost (B,), best_actions (B, T + 1)): the start nodes ranked
    ``offset`` .. ``offset + width - 1`` by their rollouts' cost in each copy (stable; ranks past the starts repeat
    the last, at value +inf), and the incumbent given updated with the best of ``first``."""
    b, a, p, t1 = first.actions.shape
    ranks = offset + jnp.arange(width)
    order = jnp.argsort(first.cost, axis=-1, stable=True)                                  # (B, A, P)
    picked = order[..., jnp.clip(ranks, 0, p - 1)]                                         # (B, A, W)
    value = jnp.where(ranks < p, jnp.take_along_axis(first.cost, picked, axis=-1), jnp.inf)
    completion = jnp.take_along_axis(first.actions, picked[..., None], axis=2)
    states = jax.vmap(lambda c, s: env.batch_step(env.batch_reset(c, width), s))(copies, completion[..., 0])

    flat_cost, flat_actions = first.cost.reshape(b, -1), first.actions.reshape(b, -1, t1)
    found = jnp.argmin(flat_cost, axis=-1)
    cost = jnp.take_along_axis(flat_cost, found[:, None], axis=1)[:, 0]
    better = cost < best_cost
    best_cost = jnp.where(better, cost, best_cost)
    best_actions = jnp.where(better[:, None], jnp.take_along_axis(flat_actions, found[:, None, None], axis=1)[:, 0],
                             best_actions)
    return Beam(states, completion, value, first.gate_probs), best_cost, best_actions


@partial(jax.jit, static_argnames=("cfg", "plan", "expansion", "chunk", "num_devices"))
def depth_step(cfg: PolicyConfig, plan: ExecutionPlan, params, copies: Instance, emb: jax.Array, beam: Beam,
               best_cost: jax.Array, best_actions: jax.Array, depth: jax.Array, key: jax.Array, *, expansion: int,
               chunk: int, num_devices: int) -> tuple[Beam, jax.Array, jax.Array, jax.Array]:
    """One depth of the beam search for a batch (B): each beam node at ``depth`` moves after its start expanded
    into ``expansion`` children, the new ones simulated, the best kept. Returns (beam, best_cost (B,),
    best_actions (B, T + 1), done bool (B,): every beam node of the instance has finished)."""
    one = partial(_depth_one, Policy(cfg, plan), expansion)
    return _by_instance(one, (params, key, depth), (copies, emb, beam, best_cost, best_actions), chunk=chunk,
                        num_devices=num_devices)


def default_chunk(num_instances: int, num_devices: int, plan: ExecutionPlan, width: int, expansion: int) -> int:
    """Instances searched at once before any memory limit: as many as make about the plan's chunk of trajectories
    in a depth's simulation (8 W (G - 1) each; at least one), or a device's whole share on a plan that decodes
    everything at once (an accelerator)."""
    share = -(-num_instances // num_devices)
    if not plan.eval_chunk_trajectories:
        return share
    return max(1, min(share, plan.eval_chunk_trajectories // (8 * width * (expansion - 1))))
